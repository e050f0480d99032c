"""Does the loop make the policy better by a measure it was not trained on? A gold-judge experiment.

In the style of Gao et al. 2022 ("Scaling Laws for Reward Model Overoptimization"): a fixed gold
judge stands in for people. It is the `embedding` judge of pipeline/orchestrate/judge.py, on the offline
all-MiniLM-L6-v2 model: cos(response, "helpful, friendly, detailed ...") - cos(response, "rude,
evasive, unhelpful ...") + 0.5 cos(response, prompt). The pipeline never trains on it: simulated
annotators rank each prompt's K responses by gold score with Bradley-Terry noise (through the
store, like people in the app), a proxy reward model is trained on those rankings, and PPO
optimises the proxy. The question is what happens to the gold score.

    python bench/gold_loop.py              # SmolLM2-135M, 2 rounds, three KL settings (CPU: see docs/results/gold_loop.md)
    python bench/gold_loop.py --parallel   # the settings side by side (one job each at a time)
    python bench/gold_loop.py --quick      # tiny random models, the same steps end to end (a minute or two)
    python bench/gold_loop.py --reuse-round1 OLD_RESULTS_DIR ...   # round 1 as an earlier run left it

Phases
  0. held-out split: a fixed, seeded set of evaluation prompts is kept out of the store; the rest
     of the bundled prompt pool (store/data/prompts.jsonl) is imported through the store (store.io.import_prompts)
  1. round 1, shared by all settings: generate K responses per prompt with the base policy (a job),
     simulated annotators rank them, reward model 1 is trained (a job); the base policy is evaluated
  2. per setting (adaptive KL, fixed beta, beta = 0): the store is copied, PPO round 1 runs against
     reward model 1, then rounds 2..R run through the real loop (pipeline/orchestrate/loop.py: generate with the
     new policy, rank, retrain the reward model warm-started on all pairs so far, PPO)
  3. each new policy version is evaluated on the held-out prompts as soon as it exists
     (bench/gold_eval.py), and the gold judge scores PPO's per-step sample tables (gold along the
     PPO steps); results.json is rewritten after each evaluation, so a stopped run keeps them
  4. report.md, gold_vs_sqrt_kl.png, proxy_vs_gold.png, results.json in the results directory
     (bench/gold_report.py); a full run also publishes report and plots to docs/results/

Sharing round 1 (its responses, rankings and reward model) between the settings saves three
generations and two reward trainings, and makes the settings differ only in their KL control.
The last line is `RESULT gold_loop ...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import GenerateConfig, LoopConfig, ModelConfig, PPOConfig, RewardConfig  # noqa: E402
from pipeline.orchestrate.loop import LoopSettings  # noqa: E402

from bench.gold_eval import EvalConfig  # noqa: E402
from bench.gold_steps import (RecordingJudge, copy_store, gold_agreement, ppo_step_trace,  # noqa: E402
                              split_prompts)

PROMPTS = ROOT / "store" / "data" / "prompts.jsonl"  # the app's bundled pool (license: store/data/LICENSE.md)
OUT_ROOT = ROOT / "bench" / "out" / "gold_loop"
PUBLISH = ROOT / "docs" / "results"

# The three settings differ only in the KL control of PPO (pipeline/kl.py).
# The Ziegler et al. horizon (10,000 episodes) assumes runs of many thousand episodes; ours see a
# hundred, so the horizon is one rollout: beta may move by up to 20% a step toward the target.
# Run in this order: the two ends of the comparison first.
VARIANTS = {
    "adaptive": {"kl_control": "adaptive", "init_kl_coef": 0.1, "kl_target": 2.0, "kl_horizon": 8},
    "beta0": {"kl_control": "fixed", "init_kl_coef": 0.0},
    "fixed": {"kl_control": "fixed", "init_kl_coef": 0.1},
}
LABELS = {"adaptive": "adaptive KL (target 2 nats)", "fixed": "fixed beta = 0.1", "beta0": "beta = 0"}


@dataclass
class Experiment:
    loop: LoopSettings
    eval: EvalConfig
    eval_prompts: int = 32
    """Held-out prompts, never imported into the store."""
    noise: float = 0.05
    """Bradley-Terry temperature of the simulated annotators (in gold-score units)."""
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    threads: int = 2
    seed: int = 0


def full_experiment(threads: int = 2) -> Experiment:
    """SmolLM2-135M on CPU in fp32, sized for about 50 minutes on 2 idle cores with --parallel
    --threads 1 (round 1 ~20 min; then per setting 2 x 24 PPO steps of 8 episodes, ~30 min side by
    side): enough PPO for beta = 0 to over-optimise the proxy."""
    tokens = 24
    return Experiment(
        loop=LoopSettings(
            loop=LoopConfig(rounds=2, prompts_per_round=16, rankings_per_round=0, seed=0),
            model=ModelConfig(model="default", device="cpu", dtype="fp32"),
            generate=GenerateConfig(k=4, max_new_tokens=tokens, temperature=0.9, batch_size=32),
            reward=RewardConfig(epochs=1, lr=3e-4, batch_size=8, max_steps=6, max_length=128, norm_samples=16),
            ppo=PPOConfig(steps=24, batch_size=8, mini_batch_size=4, micro_batch_size=4, ppo_epochs=1,
                          lr=5e-4, critic_lr=3e-4, max_new_tokens=tokens, temperature=0.7,
                          missing_eos_penalty=0.0, sample_every=1, max_prompt_tokens=96, forward_batch_size=8),
            ppo_prompts=256),
        eval=EvalConfig(samples=4, max_new_tokens=tokens, temperature=0.7, batch_size=16),
        eval_prompts=24, threads=threads)


def quick_experiment(model_dir: str, threads: int = 2) -> Experiment:
    """Tiny random models: every step of the full run, in a minute or two (the slow test runs it)."""
    tokens = 8
    return Experiment(
        loop=LoopSettings(
            loop=LoopConfig(rounds=2, prompts_per_round=6, rankings_per_round=0, seed=0),
            model=ModelConfig(model=model_dir, device="cpu", dtype="fp32", lora_r=4, lora_alpha=8),
            generate=GenerateConfig(k=3, max_new_tokens=tokens, temperature=1.0, batch_size=18),
            reward=RewardConfig(batch_size=4, max_length=64, norm_samples=0, eval_fraction=0.25, lr=1e-3),
            ppo=PPOConfig(steps=2, batch_size=4, mini_batch_size=4, micro_batch_size=4, ppo_epochs=1,
                          lr=1e-3, max_new_tokens=tokens, missing_eos_penalty=0.0, sample_every=1),
            ppo_prompts=8),
        eval=EvalConfig(samples=2, max_new_tokens=tokens, temperature=1.0, batch_size=8),
        eval_prompts=4, threads=threads)


def with_variant(settings: LoopSettings, variant: str) -> LoopSettings:
    return dataclasses.replace(settings, ppo=dataclasses.replace(settings.ppo, **VARIANTS[variant]))


# --------------------------------------------------------------------------- the experiment


def run_experiment(exp: Experiment, out: Path, prompts_file: Path = PROMPTS, log=print,
                   reuse_round1: Path | None = None, parallel: bool = False) -> dict:
    """Phases 0-3 of the module docstring; returns (and writes) results.json's content.

    reuse_round1: a results directory of an earlier run with the same settings whose phases 0-1
    (round 1 and the start policy's evaluation) are taken as they are. parallel: the settings run
    side by side, each with its own store and job queue (one process per job on a shared machine
    gets a fairer share of the CPU; the results are the same as one after the other).
    """
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from pipeline.orchestrate.judge import make_judge

    torch.set_num_threads(exp.threads)
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval").mkdir(exist_ok=True)
    results: dict = {"settings": _describe(exp), "variants": {}, "timings": {}}
    lock = threading.Lock()

    def save():
        with lock:
            results["timings"]["total_s"] = time.perf_counter() - t0
            (out / "results.json").write_text(json.dumps(results, indent=2, default=str))

    # 0. held-out split (seeded: a reused round 1 had the same) and the gold judge
    heldout, pool = split_prompts(prompts_file, exp.eval_prompts, exp.seed, out / "prompts")
    judge = RecordingJudge(make_judge("embedding"))
    ctx = Context(exp, out, heldout, judge, results, lock, log)
    if reuse_round1 is not None:
        reward1, rnd1 = reuse_shared_round(ctx, Path(reuse_round1))
    else:
        reward1, rnd1 = shared_round(ctx, pool)
    save()

    # 2-3. each setting from the same start: PPO round 1 on reward model 1, then rounds 2..R
    def one(name):
        run_variant(ctx, name, rnd1, reward1, save)

    if parallel:
        with ThreadPoolExecutor(len(exp.variants)) as pool_:
            list(pool_.map(one, exp.variants))  # re-raises the first failure
        results["variants"] = {n: results["variants"][n] for n in exp.variants}
    else:
        for name in exp.variants:
            one(name)
    save()
    return results


EVAL_LOCK = threading.Lock()


@dataclass
class Context:
    exp: Experiment
    out: Path
    heldout: list
    judge: RecordingJudge
    results: dict
    lock: object
    log: object

    def env(self) -> dict:
        n = str(self.exp.threads)
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}

    def evaluate(self, version_path, rewards: dict, tag: str) -> dict:
        from bench.gold_eval import evaluate_policy

        t = time.perf_counter()
        with EVAL_LOCK:  # one at a time: loading models from several threads at once is not safe
            metrics, rows = evaluate_policy(version_path, self.exp.loop.model, self.heldout, self.judge, rewards,
                                            self.exp.eval)
        with open(self.out / "eval" / f"{tag}.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        self.log(f"eval {tag}: " + ", ".join(f"{k.split('/')[1]}={v:.3f}" for k, v in metrics.items()))
        with self.lock:
            self.results["timings"][f"eval_{tag}_s"] = time.perf_counter() - t
        return metrics


def shared_round(ctx: Context, pool: Path):
    """Phase 1: import the pool, round 1 with the base policy, reward model 1, the base's evaluation."""
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
    results["base"] = ctx.evaluate(base.path, {"rm1": reward1.path}, "base")
    return reward1, rnd1


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
        ctx.results["base"] = ctx.evaluate(base.path, {"rm1": reward1.path}, "base")
    return reward1, rnd1


def run_variant(ctx: Context, name: str, rnd1, reward1, save=lambda: None) -> dict:
    """One setting: a copy of the store after round 1, PPO round 1, rounds 2..R; each new policy
    is evaluated as soon as it exists, and the partial results saved (a stopped run keeps them)."""
    from pipeline.orchestrate.loop import finish_round, make_runner, start_round, train_round_policy
    from pipeline.orchestrate.simulate import simulate_annotations
    from store import Store

    exp, out = ctx.exp, ctx.out
    t = time.perf_counter()
    s = with_variant(exp.loop, name)
    db = out / name / "rlhf.duckdb"
    db.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(out / "shared" / "after_round1.duckdb", db)
    entry = {"label": LABELS[name], "ppo": VARIANTS[name], "rounds": [], "steps": []}
    with ctx.lock:
        ctx.results["variants"][name] = entry
    store = Store(db)
    runner = make_runner(store, out / name / "runs", poll_s=0.5, env=ctx.env())

    def record(n: int, rnd) -> None:
        policy, reward = store.get_model_version(rnd.new_policy_version_id), store.get_model_version(rnd.reward_version_id)
        metrics = ctx.evaluate(policy.path, {"rm1": reward1.path, "own": reward.path}, f"{name}_round{n}")
        steps = ppo_step_trace(Path(store.get_run(policy.run_id).run_dir), ctx.judge, n)
        with ctx.lock:
            entry["rounds"].append({"round": n, "policy": policy.path, "reward": reward.path,
                                    "reward_eval": reward.meta.get("eval", {}), **metrics})
            entry["steps"] += steps
            ctx.results["timings"][f"{name}_s"] = time.perf_counter() - t
        ctx.log(f"{name}: round {n} done")
        save()

    try:
        record(1, train_round_policy(store, runner, rnd1, reward1, s))  # round 1's steps 5-6
        for n in range(1, exp.loop.loop.rounds):
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


def _describe(exp: Experiment) -> dict:
    s = exp.loop
    return {"model": s.model.model, "rounds": s.loop.rounds, "prompts_per_round": s.loop.prompts_per_round,
            "k": s.generate.k, "max_new_tokens": s.generate.max_new_tokens,
            "generate_temperature": s.generate.temperature, "reward": dataclasses.asdict(s.reward),
            "ppo": dataclasses.asdict(s.ppo), "ppo_prompts": s.ppo_prompts, "lora_r": s.model.lora_r,
            "eval_prompts": exp.eval_prompts, "eval": dataclasses.asdict(exp.eval), "noise": exp.noise,
            "variants": {v: VARIANTS[v] for v in exp.variants}, "threads": exp.threads,
            "judge": "embedding (all-MiniLM-L6-v2, pipeline/orchestrate/judge.py defaults)"}


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    from bench.gold_report import publish, result_line, write_report

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random models, a minute or two")
    parser.add_argument("--out", default="", help="results directory (default: bench/out/gold_loop/<time>)")
    parser.add_argument("--prompts", default=str(PROMPTS), help="prompt pool (JSONL with 'prompt')")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=0, help="override the number of rounds")
    parser.add_argument("--ppo-steps", type=int, default=0, help="override PPO steps per round")
    parser.add_argument("--prompts-per-round", type=int, default=0, help="override new prompts per round")
    parser.add_argument("--eval-samples", type=int, default=0, help="override responses per held-out prompt")
    parser.add_argument("--reward-steps", type=int, default=-1,
                        help="override the reward model's optimiser steps per round (0 = every pair, each epoch)")
    parser.add_argument("--reward-epochs", type=int, default=0, help="override the reward model's epochs per round")
    parser.add_argument("--threads", type=int, default=2, help="torch threads here and in every job")
    parser.add_argument("--parallel", action="store_true", help="run the settings side by side")
    parser.add_argument("--reuse-round1", default="",
                        help="take round 1 and the start policy's evaluation from this earlier results directory")
    parser.add_argument("--publish", default=None,
                        help="also copy report and plots here (default: docs/results for a full run, none for --quick)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else OUT_ROOT / time.strftime("%Y%m%d-%H%M%S")
    if not Path(args.prompts).is_file():
        raise SystemExit(f"{args.prompts}: no such file (the default is the bundled pool, store/data/prompts.jsonl)")
    if args.quick:
        from tests.tiny import save_tiny_model_dir

        exp = quick_experiment(str(save_tiny_model_dir(out / "tiny_model")), args.threads)
    else:
        exp = full_experiment(args.threads)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    exp.variants = args.variants.split(",")
    if args.rounds:
        exp.loop.loop.rounds = args.rounds
    if args.ppo_steps:
        exp.loop.ppo.steps = args.ppo_steps
    if args.prompts_per_round:
        exp.loop.loop.prompts_per_round = args.prompts_per_round
    if args.eval_samples:
        exp.eval.samples = args.eval_samples
    if args.reward_steps >= 0:
        exp.loop.reward.max_steps = args.reward_steps
    if args.reward_epochs:
        exp.loop.reward.epochs = args.reward_epochs
    started = time.time()
    results = run_experiment(exp, out, Path(args.prompts), reuse_round1=Path(args.reuse_round1) if args.reuse_round1
                             else None, parallel=args.parallel)
    results["wall_s"] = time.time() - started
    results["command"] = "python bench/gold_loop.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    results["mode"] = "quick" if args.quick else "full"
    results["parallel"] = args.parallel
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    report = write_report(results, out)
    print(f"report: {report}")
    target = args.publish if args.publish is not None else ("" if args.quick else str(PUBLISH))
    if target:
        for path in publish(out, Path(target)):
            print(f"published: {path}")
    print(result_line(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
