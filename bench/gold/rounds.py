"""Round 1 and the PPO settings of the gold-loop experiment (bench/gold/loop.py), through the real loop.

- shared_round: import the pool, round 1 with the base policy (generate, simulated ranking),
  reward model 1, the start policy's evaluation; reuse_shared_round takes them from an earlier run
- run_variant: one setting in its own copy of the store after round 1: PPO round 1 against reward
  model 1 (the control: against its shuffled-label reward model, bench/gold/arms.py), then rounds
  2..R with pipeline/orchestrate/loop.py's own steps (start_round, finish_round); or DPO on
  round 1's pairs. Every new policy is evaluated on the held-out prompts as soon as it exists.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

from pipeline.orchestrate.loop import LoopSettings

from bench.gold.steps import Context, copy_store, gold_agreement, ppo_step_trace

# The PPO settings differ only in the KL control of PPO (pipeline/kl.py); the control has the
# adaptive setting's KL control (the same budget) and a reward model that learned nothing.
# The Ziegler et al. horizon (10,000 episodes) assumes runs of many thousand episodes; ours see a
# hundred, so the horizon is one rollout: beta may move by up to 20% a step toward the target.
# Run in this order: the two ends of the comparison first.
ADAPTIVE = {"kl_control": "adaptive", "init_kl_coef": 0.1, "kl_target": 2.0, "kl_horizon": 8}
VARIANTS = {
    "adaptive": ADAPTIVE,
    "beta0": {"kl_control": "fixed", "init_kl_coef": 0.0},
    "fixed": {"kl_control": "fixed", "init_kl_coef": 0.1},
    "control": ADAPTIVE,
    "dpo": {},  # no PPO: bench/gold/arms.py
}
LABELS = {"adaptive": "adaptive KL (target 2 nats)", "fixed": "fixed beta = 0.1", "beta0": "beta = 0"}
ONE_ROUND = ("control", "dpo")
"""Settings that run on round 1's pairs only (later rounds would train an ordinary reward model)."""


def with_variant(settings: LoopSettings, variant: str) -> LoopSettings:
    return dataclasses.replace(settings, ppo=dataclasses.replace(settings.ppo, **VARIANTS[variant]))


def shared_round(ctx: Context, pool: Path):
    """Phase 1: import the pool, round 1 with the base policy, reward model 1, the base's evaluation.
    Returns (reward model 1, round 1, the start policy's folder or None for the base model)."""
    from pipeline.orchestrate.loop import make_runner, start_round, train_round_reward
    from pipeline.orchestrate.simulate import simulate_annotations
    from store import Store
    from store.io import import_prompts

    exp, out, results, settings = ctx.exp, ctx.out, ctx.results, ctx.exp.loop
    shared_db = out / "shared" / "rlhf.duckdb"
    store = Store(shared_db)
    runner = make_runner(store, out / "shared" / "runs", poll_s=0.5, env=ctx.env())
    try:
        results["import"] = import_prompts(store, pool)
        t = time.perf_counter()
        rnd1 = start_round(store, runner, settings, 0)
        simulate_annotations(store, ctx.judge, noise=exp.noise, seed=exp.seed)
        results["annotators"] = {"round1": gold_agreement(store, ctx.judge)}
        # round step 4 only: each setting runs its own PPO (step 5) against this reward model, so
        # it is recorded on round 1 now, for the settings' store copies (and a later --reuse-round1)
        reward1 = train_round_reward(store, runner, rnd1, settings)
        store.update_round(rnd1.id, reward_version_id=reward1.id, snapshot_id=reward1.snapshot_id)
        results["reward_models"] = {"rm1": {"path": reward1.path, **reward1.meta.get("eval", {})}}
        results["timings"]["round1_shared_s"] = time.perf_counter() - t
        base = store.get_model_version(rnd1.policy_version_id)
        rnd1 = store.get_round(rnd1.id)
    finally:
        runner.shutdown()
    copy_store(store, shared_db, out / "shared" / "after_round1.duckdb")
    results["base"], _ = ctx.evaluate(base.path, {"rm1": reward1.path}, "base")
    return reward1, rnd1, base.path


def reuse_shared_round(ctx: Context, src: Path):
    """Phase 1 taken from an earlier run's results directory: its store copy, reward model 1 and
    the start policy's evaluation."""
    from store import Store

    previous = json.loads((src / "results.json").read_text(encoding="utf-8"))
    if "base" not in previous:
        raise ValueError(f"{src}: round 1 did not finish there (no base evaluation in results.json)")
    for key in ("import", "annotators", "reward_models", "base"):
        ctx.results[key] = previous[key]
    ctx.results["timings"].update({k: v for k, v in previous["timings"].items()
                                   if k in ("round1_shared_s", "eval_base_s")})
    ctx.results["reused_round1"] = {"from": src.name, "seconds_there": previous["timings"].get("total_s"),
                                    # the command that ran round 1 (further back when src reused it too)
                                    "command": previous.get("reused_round1", {}).get("command") or previous.get("command")}
    (ctx.out / "shared").mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "shared" / "after_round1.duckdb", ctx.out / "shared" / "after_round1.duckdb")
    shutil.copy2(src / "eval" / "base.jsonl", ctx.out / "eval" / "base.jsonl")
    store = Store(ctx.out / "shared" / "after_round1.duckdb")
    try:
        rnd1 = store.list_rounds()[0]
        reward1 = store.get_model_version(rnd1.reward_version_id)
        base = store.get_model_version(rnd1.policy_version_id)
    finally:
        store.close()
    if previous["settings"].get("eval") != dataclasses.asdict(ctx.exp.eval):
        # another evaluation (e.g. more samples per prompt): the start policy is measured again the
        # same way as the settings' policies, so that every row of the table is comparable
        ctx.results["base"], _ = ctx.evaluate(base.path, {"rm1": reward1.path}, "base")
    return reward1, rnd1, base.path


def run_variant(ctx: Context, name: str, rnd1, reward1, save=lambda: None) -> dict:
    """One setting in a copy of the store after round 1: PPO round 1 (against reward model 1, or
    for the control against its shuffled-label reward model), rounds 2..R; or DPO on round 1's
    pairs. Each new policy is evaluated as soon as it exists, and the partial results saved."""
    from bench.gold.arms import CONTROL_LABEL, dpo_label, run_dpo, train_shuffled_reward
    from pipeline.orchestrate.loop import finish_round, make_runner, start_round, train_round_policy
    from pipeline.orchestrate.simulate import simulate_annotations
    from store import Store

    exp, out = ctx.exp, ctx.out
    t = time.perf_counter()
    s = with_variant(exp.loop, name)
    db = out / name / "rlhf.duckdb"
    db.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(out / "shared" / "after_round1.duckdb", db)
    label = {**LABELS, "control": CONTROL_LABEL, "dpo": dpo_label(exp.dpo)}[name]
    entry = {"label": label, "ppo": VARIANTS[name], "rounds": [], "steps": []}
    with ctx.lock:
        ctx.results["variants"][name] = entry
    store = Store(db)
    runner = make_runner(store, out / name / "runs", poll_s=0.5, env=ctx.env())

    def add(round_entry: dict, steps: list) -> None:
        with ctx.lock:
            entry["rounds"].append(round_entry)
            entry["steps"] += steps
            ctx.results["timings"][f"{name}_s"] = time.perf_counter() - t
        ctx.log(f"{name}: round {round_entry['round']} done")
        save()

    def record(n: int, rnd) -> None:
        policy, reward = store.get_model_version(rnd.new_policy_version_id), store.get_model_version(rnd.reward_version_id)
        metrics, _ = ctx.evaluate(policy.path, {"rm1": reward1.path, "own": reward.path}, f"{name}_round{n}")
        steps = ppo_step_trace(Path(store.get_run(policy.run_id).run_dir), ctx.judge, n)
        add({"round": n, "policy": policy.path, "reward": reward.path, "reward_eval": reward.meta.get("eval", {}),
             **metrics}, steps)

    try:
        if name == "dpo":
            entry["dpo"] = exp.dpo
            add(run_dpo(ctx, store, runner, rnd1, reward1), [])
            return entry
        reward = reward1
        if name == "control":
            reward, entry["shuffled"] = train_shuffled_reward(ctx, store, runner, reward1, s)
        record(1, train_round_policy(store, runner, rnd1, reward, s))  # round 1's steps 5-6
        for n in range(1, 1 if name in ONE_ROUND else exp.loop.loop.rounds):
            rnd = start_round(store, runner, s, n)
            simulate_annotations(store, ctx.judge, noise=exp.noise, seed=exp.seed + n)
            record(n + 1, finish_round(store, runner, rnd, s))
        agreement = gold_agreement(store, ctx.judge)
        with ctx.lock:
            entry["annotators"] = agreement
    finally:
        runner.shutdown()
        store.close()
    save()
    return entry
