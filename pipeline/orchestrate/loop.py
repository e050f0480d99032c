"""The closed loop, one round at a time.

    round n:  1. pick N prompts from the pool        (random, or those the reward model separates least)
              2. generate K responses with the active policy            (a `generate` job)
              3. annotators rank them                      (people in the app, or a simulated judge)
              4. export a snapshot of all pairs, train the reward model  (a `train-reward` job,
                 warm-started from the previous reward model)
              5. PPO from the active policy against it                   (a `ppo` job)
              6. register the new policy, make it active, and start round n+1's generation

Every model-touching step is a subprocess job (pipeline/orchestrate/jobs.py); this module only decides what
runs next and records it in the store, so the same code drives the app's "Run a full round"
button and the headless `python -m pipeline loop --rounds R`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import (GenerateConfig, LoopConfig, ModelConfig, PPOConfig, RewardConfig, add_arguments,
                             from_args, to_cli_args, to_dict)


@dataclass
class LoopSettings:
    """Everything a round needs, one dataclass per stage (pipeline/config.py)."""

    loop: LoopConfig = field(default_factory=LoopConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    ppo_prompts: int = 256
    """Prompts from the pool that PPO trains on each round."""


class RoundFailed(RuntimeError):
    pass


# ---------------------------------------------------------------------- model versions


def ensure_base_policy(store, model_cfg: ModelConfig):
    """The active policy; on a fresh store, register the base model as policy 'base' and activate it."""
    active = store.active_policy()
    if active is not None:
        return active
    base = store.find_model_version("base") or store.register_model_version(
        "policy", name="base", base_model=model_cfg.model, meta={"note": "the starting policy, no training"})
    return store.set_active_policy(base.id)


def policy_args(version) -> list[str]:
    """Command-line options that load a policy version: its base model, plus its adapter if trained."""
    args = ["--model", version.base_model or "default"]
    return args + (["--adapter", version.path] if version.path else [])


def latest_reward(store):
    versions = store.list_model_versions("reward")
    return versions[-1] if versions else None


# ---------------------------------------------------------------------- steps


def select_prompts(store, n: int, strategy: str, seed: int = 0) -> list:
    """N prompts that have no responses yet. 'uncertain' is handled by the generate job (it scores
    candidates with the reward model), so here it means: a random candidate pool of 2N."""
    if strategy not in ("random", "uncertain"):
        raise ValueError(f"strategy must be 'random' or 'uncertain', not {strategy!r}")
    pool = store.prompts_without_responses()
    if not pool:
        raise RoundFailed("the prompt pool is empty: import more prompts (Data tab or python -m store import-prompts)")
    rng = random.Random(seed)
    take = min(len(pool), n * (2 if strategy == "uncertain" else 1))
    return rng.sample(pool, take)


def write_prompts(prompts, path: Path) -> Path:
    """The prompts a job reads: {"id", "prompt"} per line (chat messages when the prompt has them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps({"id": p.id, "prompt": p.messages or p.text}) + "\n")
    return path


def _wait_done(runner, run, what: str):
    run = runner.wait(run.id)
    if run.status != "done":
        raise RoundFailed(f"{what} (run {run.id}) ended {run.status}: {(run.error or '').strip()[:2000]}")
    return run


def start_round(store, runner, settings: LoopSettings, round_no: int = 0):
    """Steps 1-2: create the round, pick its prompts, generate with the active policy."""
    policy = ensure_base_policy(store, settings.model)
    rnd = store.create_round(policy_version_id=policy.id, config={"loop": to_dict(settings.loop)})
    prompts = select_prompts(store, settings.loop.prompts_per_round, settings.loop.strategy,
                             settings.loop.seed + round_no)
    prompts_file = write_prompts(prompts, runner.runs_root / "inputs" / f"round-{rnd.id}-prompts.jsonl")
    args = ["--prompts", str(prompts_file), *policy_args(policy), *to_cli_args(settings.generate),
            *_model_args(settings.model)]
    reward = latest_reward(store)
    if settings.loop.strategy == "uncertain" and reward is not None:
        args += ["--select-uncertain", str(settings.loop.prompts_per_round), "--reward", reward.path]
    run = runner.submit("generate", args, inputs={"model_version_id": policy.id, "round_id": rnd.id})
    _wait_done(runner, run, "generation")
    return store.update_round(rnd.id, status="annotating")


def finish_round(store, runner, rnd, settings: LoopSettings):
    """Steps 4-6: snapshot -> reward model -> PPO -> new active policy. Returns the finished round."""
    reward = train_round_reward(store, runner, rnd, settings)
    return train_round_policy(store, runner, rnd, reward, settings)


def train_round_reward(store, runner, rnd, settings: LoopSettings):
    """Step 4: a snapshot of every pair so far -> a train-reward job, warm-started from the latest
    reward model -> the registered reward version (its snapshot_id names the snapshot).

    The round is marked 'training'; the reward model is recorded on it only by train_round_policy,
    so a round whose PPO fails keeps no half-finished outcome (the app reopens it for another try).
    """
    from store.export import export_pairs

    store.update_round(rnd.id, status="training")
    policy = store.get_model_version(rnd.policy_version_id)
    # 4. a snapshot of every pair so far (rankings of all rounds, and imported pairs)
    out = runner.runs_root / "snapshots" / f"round-{rnd.id}-{int(time.time())}.parquet"
    snapshot = export_pairs(store, out, "parquet")
    if not snapshot.counts.get("pairs"):
        raise RoundFailed("no preference pairs to train on yet: rank some items first")
    previous = latest_reward(store)
    args = ["--data", snapshot.path, *to_cli_args(settings.reward), *_model_args(settings.model),
            "--model", policy.base_model or settings.model.model]
    if previous is not None and previous.path:
        args += ["--init-from", previous.path]
    run = runner.submit("train-reward", args, inputs={
        "snapshot_id": snapshot.id, "round_id": rnd.id,
        "parent_version_id": previous.id if previous else None})
    reward_id = _wait_done(runner, run, "reward training").outputs["model_version_id"]
    return store.get_model_version(reward_id)


def train_round_policy(store, runner, rnd, reward, settings: LoopSettings):
    """Steps 5-6: PPO (settings.ppo) from the round's policy against `reward` -> the new policy,
    which becomes active (it writes the next round's responses). Returns the round, now done, with
    its reward model, snapshot and new policy recorded.

    Separate from train_round_reward so that several PPO settings can share one reward model
    (bench/gold_loop.py runs its KL settings from round 1's)."""
    policy = store.get_model_version(rnd.policy_version_id)
    # 5. PPO on the first prompts of the pool
    pool = store.list_prompts(limit=settings.ppo_prompts)
    prompts_file = write_prompts(pool, runner.runs_root / "inputs" / f"round-{rnd.id}-ppo-prompts.jsonl")
    args = ["--prompts", str(prompts_file), "--reward", reward.path, *to_cli_args(settings.ppo),
            *_model_args(settings.model), "--model", policy.base_model or settings.model.model]
    if policy.path:
        args += ["--policy", policy.path]
    run = runner.submit("ppo", args, inputs={"policy_version_id": policy.id, "reward_version_id": reward.id,
                                             "round_id": rnd.id})
    new_policy_id = _wait_done(runner, run, "PPO").outputs["model_version_id"]
    # 6. the new policy writes the next round's responses
    store.set_active_policy(new_policy_id)
    return store.update_round(rnd.id, status="done", reward_version_id=reward.id,
                              new_policy_version_id=new_policy_id, snapshot_id=reward.snapshot_id)


def _model_args(model_cfg: ModelConfig) -> list[str]:
    """ModelConfig options except --model (each step names its own model)."""
    args = to_cli_args(model_cfg)
    if "--model" in args:
        i = args.index("--model")
        del args[i:i + 2]
    return args


def current_round(store):
    """The round waiting for annotations, if any."""
    rounds = [r for r in store.list_rounds() if r.status == "annotating"]
    return rounds[-1] if rounds else None


def run_loop(store, runner, settings: LoopSettings, judge=None, noise: float = 0.0, log=print) -> list:
    """R rounds headless. Rankings come from `judge` (simulated annotator) or, without one, from
    people: the loop waits until `rankings_per_round` rankings of the round have arrived."""
    from pipeline.orchestrate.simulate import simulate_annotations

    done = []
    rnd = current_round(store) or start_round(store, runner, settings, 0)
    for n in range(settings.loop.rounds):
        log(f"round {rnd.id}: annotating")
        if judge is not None:
            simulate_annotations(store, judge, noise=noise, seed=settings.loop.seed + n)
        else:
            while store.round_counts(rnd.id).get("rankings", 0) < settings.loop.rankings_per_round:
                time.sleep(5)
        log(f"round {rnd.id}: training")
        try:
            done.append(finish_round(store, runner, rnd, settings))
        except Exception as exc:
            store.update_round(rnd.id, status="failed", meta={"error": str(exc)[:2000]})
            raise
        log(f"round {rnd.id}: done, new policy {done[-1].new_policy_version_id}")
        rnd = start_round(store, runner, settings, n + 1)
    return done


def main(argv: list[str] | None = None) -> int:
    from pipeline.orchestrate.jobs import JobRunner
    from pipeline.orchestrate.judge import make_judge
    from store import Store, default_db_path

    parser = argparse.ArgumentParser(prog="python -m pipeline loop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", default=str(default_db_path()), help="the DuckDB file (default: %(default)s)")
    parser.add_argument("--runs", default="", help="where run directories go (default: runs/ beside --db)")
    parser.add_argument("--judge", default="", help="simulated annotator's judge (see simulate-annotators); "
                                                    "'' = wait for people to rank in the app")
    parser.add_argument("--noise", type=float, default=0.0, help="simulated annotator's Bradley-Terry noise")
    parser.add_argument("--ppo-prompts", type=int, default=256, help="pool prompts PPO trains on per round")
    for cls, prefix in ((LoopConfig, ""), (ModelConfig, ""), (GenerateConfig, "gen_"), (RewardConfig, "rm_"),
                        (PPOConfig, "ppo_")):
        add_arguments(parser, cls, prefix)
    args = parser.parse_args(argv)
    settings = LoopSettings(loop=from_args(LoopConfig, args), model=from_args(ModelConfig, args),
                            generate=from_args(GenerateConfig, args, "gen_"),
                            reward=from_args(RewardConfig, args, "rm_"), ppo=from_args(PPOConfig, args, "ppo_"),
                            ppo_prompts=args.ppo_prompts)
    store = Store(args.db)
    runner = JobRunner(store, args.runs or Path(args.db).resolve().parent / "runs")
    try:
        run_loop(store, runner, settings, judge=make_judge(args.judge) if args.judge else None, noise=args.noise)
    finally:
        runner.shutdown()
        store.close()
    return 0
