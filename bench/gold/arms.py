"""The arms of the gold-loop experiment beside PPO on reward model 1, from round 1's very pairs.

- **DPO** (Rafailov et al. 2023, "Direct Preference Optimization"): `python -m pipeline train-dpo`
  on the snapshot reward model 1 was trained on, from the start policy, as one job of the store's
  queue; no reward model. Its policy is evaluated like every other one (bench/gold/eval.py).
- **The drift control**: a reward model trained exactly like reward model 1 on the same pairs with
  their labels shuffled (each pair's chosen and rejected swapped with probability 1/2, seeded), so
  it has nothing to learn; PPO optimises it with the adaptive setting's KL control, i.e. at the
  same KL budget. What the control loses in gold is what moving that far from the start costs by
  itself (the judge rewards relevance to the prompt, which any drift can lose). bench/gold/verdict.py
  claims reward hacking only where beta = 0 loses clearly more gold than the control at the same KL.

Both run in their own copy of the store after round 1, like the PPO settings (bench/gold/loop.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench.gold.steps import run_job, write_rows

CONTROL_LABEL = "control: PPO on shuffled labels (adaptive KL)"


def shuffle_labels(rows: list[dict], seed: int) -> tuple[list[dict], int]:
    """(rows with chosen and rejected swapped in a seeded half of them on average, swaps made)."""
    rng = random.Random(seed)
    out, swapped = [], 0
    for row in rows:
        if rng.random() < 0.5:
            row = {**row, "chosen": row["rejected"], "rejected": row["chosen"]}
            swapped += 1
        out.append(dict(row))
    return out, swapped


def snapshot_file(store, reward) -> str:
    """The pairs file a reward model version was trained on."""
    if reward.snapshot_id is None:
        raise ValueError(f"reward model {reward.name} records no snapshot: its pairs are unknown")
    return store.get_snapshot(reward.snapshot_id).path


def train_shuffled_reward(ctx, store, runner, reward1, settings) -> tuple[object, dict]:
    """Reward model 1's recipe on its pairs with shuffled labels: (the new reward version, a summary)."""
    from pipeline.config import to_cli_args
    from pipeline.orchestrate.steps import ensure_base_policy, model_args, normalised_as_ppo, round_ppo
    from store.export import load_pairs_snapshot

    rows = load_pairs_snapshot(snapshot_file(store, reward1))
    shuffled, swapped = shuffle_labels(rows, ctx.exp.seed)
    data = write_rows(ctx.out / "control" / "shuffled_pairs.jsonl", [_plain(r) for r in shuffled])
    base = ensure_base_policy(store, settings.model)
    args = ["--data", str(data), *to_cli_args(normalised_as_ppo(settings.reward, round_ppo(settings))),
            *model_args(settings.model, base.base_model)]
    run = run_job(store, runner, "train-reward", args, config={"label": "control reward model (shuffled labels)"},
                  inputs={"snapshot_id": None, "parent_version_id": None})
    version = store.get_model_version(run.outputs["model_version_id"])
    return version, {"pairs": len(rows), "swapped": swapped, "seed": ctx.exp.seed, "reward": version.path,
                     "reward_eval": version.meta.get("eval", {})}


def _plain(row: dict) -> dict:
    """A snapshot row as JSON can hold it (timestamps and the like as text)."""
    return json.loads(json.dumps(row, default=str))


# --------------------------------------------------------------------------- DPO


def dpo_unavailable() -> str | None:
    """Why the DPO arm cannot run in this checkout, or None when it can."""
    from pipeline.__main__ import STAGES

    if "train-dpo" not in STAGES:
        return "this checkout has no `python -m pipeline train-dpo` stage"
    return None


def dpo_label(dpo: dict) -> str:
    return f"DPO ({dpo.get('loss', 'sigmoid')}, beta {dpo.get('beta', 0.1)})"


def dpo_args(snapshot: str, dpo: dict, model_cfg, base) -> list[str]:
    """train-dpo's command line: the pairs, the DPO options (dict keys are option names), the
    model options as the loop's jobs take them, and --policy when the start is a trained policy."""
    from pipeline.orchestrate.steps import model_args

    args = ["--data", snapshot]
    for key, value in dpo.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    args += model_args(model_cfg, base.base_model)
    if base.path:
        args += ["--policy", base.path]
    return args


def run_dpo(ctx, store, runner, rnd1, reward1) -> dict:
    """DPO on reward model 1's pairs from round 1's policy, evaluated on the held-out prompts;
    returns the setting's entry (one round, no PPO steps)."""
    base = store.get_model_version(rnd1.policy_version_id)
    args = dpo_args(snapshot_file(store, reward1), ctx.exp.dpo, ctx.exp.loop.model, base)
    run = run_job(store, runner, "train-dpo", args, config={"label": "dpo on round 1's pairs"},
                  inputs={"policy_version_id": base.id, "snapshot_id": reward1.snapshot_id, "activate": False})
    policy = Path(run.run_dir) / "policy"
    if not policy.is_dir():
        raise RuntimeError(f"train-dpo job {run.id} ended without a policy folder in {run.run_dir}")
    metrics, _ = ctx.evaluate(str(policy), {"rm1": reward1.path}, "dpo_round1")
    report_path = Path(run.run_dir) / "eval_report.json"
    report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.is_file() else {}
    return {"round": 1, "policy": str(policy), "reward": None,
            "dpo_report": {k: v for k, v in report.items() if isinstance(v, (int, float))}, **metrics}
