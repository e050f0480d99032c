"""The proxy's learning curve: how well a reward model ranks pairs of prompts it never saw, against
the number of annotated pairs it learned from.

Two curves, each a fresh reward model per size (a train-reward job, no warm start), trained on
nested subsets (the 300 pairs hold the 100) and scored on one fixed set of held-out pairs whose
prompts no subset contains:

- **simulated**: the gold-loop's own kind of data. A store of its own imports the prompt pool
  (the held-out evaluation prompts of bench/gold/loop.py stay out), the start policy answers
  enough prompts with K responses each (one generate job, as in a round), and the simulated
  annotators rank them with the same judge and noise (pairs with an empty response are left out:
  train-reward refuses them). The ceiling beside it: how often the gold
  judge itself prefers the held-out pairs' chosen response (the annotators' noise caps every
  reward model's accuracy there).
- **HH**: the bundled Anthropic HH-RLHF dev pairs (tests/data/hh_dev_pairs.jsonl), with the
  "longer response wins" baseline of the same held-out pairs (reward_eval's length_baseline).

Pairs are grouped by prompt: the held-out set takes whole prompts (seeded) until it has its
number of pairs; the training order is the remaining prompts, shuffled, their pairs in a row.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import RewardConfig

from bench.gold.steps import run_job, write_rows
from bench.reward_bench import wilson

ROOT = Path(__file__).resolve().parents[2]
HH_PAIRS = ROOT / "tests" / "data" / "hh_dev_pairs.jsonl"  # license: tests/data/README.md


@dataclass
class CurveConfig:
    sizes: list[int] = field(default_factory=lambda: [100, 300, 1000, 3000])
    """Simulated annotated pairs each reward model trains on ([] = no simulated curve)."""
    heldout_pairs: int = 600
    """Simulated pairs (whole prompts) that measure accuracy, never trained on."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward models' recipe on the simulated pairs (eval_data is set here)."""
    hh_sizes: list[int] = field(default_factory=lambda: [100, 300, 1000, 1600])
    """HH dev pairs each reward model trains on ([] = no HH curve)."""
    hh_heldout_pairs: int = 400
    hh_reward: RewardConfig = field(default_factory=RewardConfig)
    hh_data: str = str(HH_PAIRS)


def split_for_curve(rows: list[dict], key, heldout_pairs: int, sizes: list[int], seed: int):
    """(held-out rows, {size: training rows}) as the module docstring says; key(row) names its prompt."""
    import random

    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    heldout, rest = [], []
    for k in keys:
        (heldout if len(heldout) < heldout_pairs else rest).extend(groups[k])
    if len(rest) < max(sizes, default=0):
        raise ValueError(f"the learning curve needs {max(sizes)} training pairs beside {len(heldout)} held out; "
                         f"there are {len(rest)}: lower its sizes")
    return heldout, {n: rest[:n] for n in sizes}


def train_points(store, runner, ctx, subsets: dict[int, list[dict]], heldout: Path, reward: RewardConfig,
                 folder: Path, key) -> list[dict]:
    """One fresh reward model per subset, scored on the held-out file: one point each."""
    from pipeline.config import to_cli_args
    from pipeline.orchestrate.steps import model_args

    cfg = dataclasses.replace(reward, eval_data=str(heldout), norm_samples=0)
    points = []
    for n, rows in subsets.items():
        data = write_rows(folder / f"train_{n}.jsonl", rows)
        started = time.perf_counter()
        run = run_job(store, runner, "train-reward",
                      ["--data", str(data), *to_cli_args(cfg), *model_args(ctx.exp.loop.model, None)],
                      config={"label": f"learning curve: {n} pairs"})
        report = json.loads((Path(run.run_dir) / "eval_report.json").read_text(encoding="utf-8"))
        m = report["eval/pairs"]
        lo, hi = wilson(round(report["eval/accuracy"] * m), m)
        points.append({"pairs": n, "prompts": len({key(r) for r in rows}), "eval/accuracy": report["eval/accuracy"],
                       "eval/pairs": m, "acc_lo": lo, "acc_hi": hi,
                       "length_baseline": report["eval/length_baseline_accuracy"],
                       "train_s": time.perf_counter() - started, "reward": str(Path(run.run_dir) / "checkpoint")})
        ctx.log(f"learning curve ({folder.name}): {n} pairs -> held-out accuracy {report['eval/accuracy']:.3f} "
                f"[{lo:.3f}, {hi:.3f}] on {m} pairs")
    return points


def judge_agreement(rows: list[dict], judge) -> dict:
    """How often the gold judge scores a pair's chosen response above its rejected one (ties left out)."""
    prompts = [_text(r["prompt"]) for r in rows]
    chosen = judge.score(prompts, [_text(r["chosen"]) for r in rows])
    rejected = judge.score(prompts, [_text(r["rejected"]) for r in rows])
    decided = [(a, b) for a, b in zip(chosen, rejected) if a != b]
    return {"pairs": len(decided), "agreement": sum(a > b for a, b in decided) / len(decided) if decided else float("nan")}


def _text(message) -> str:
    """A prompt's or response's text, exported as text or as conversational messages (the last one's)."""
    return message if isinstance(message, str) else message[-1]["content"]


def _open(folder: Path, ctx):
    from pipeline.orchestrate.loop import make_runner
    from store import Store

    folder.mkdir(parents=True, exist_ok=True)
    store = Store(folder / "rlhf.duckdb")
    return store, make_runner(store, folder / "runs", poll_s=0.5, env=ctx.env())


def run_simulated_curve(ctx, pool: Path, cfg: CurveConfig) -> dict:
    """Generate and rank enough pairs through a store of its own, then one point per size."""
    from pipeline.orchestrate.loop import start_round
    from pipeline.orchestrate.simulate import simulate_annotations
    from store.export import export_pairs
    from store.io import import_prompts

    exp, folder = ctx.exp, ctx.out / "curve"
    per_prompt = math.comb(exp.loop.generate.k, 2)
    n_prompts = math.ceil((max(cfg.sizes) + cfg.heldout_pairs) / per_prompt) + 2  # + 2: a duplicate-tie spare
    settings = dataclasses.replace(exp.loop, loop=dataclasses.replace(exp.loop.loop, prompts_per_round=n_prompts))
    store, runner = _open(folder, ctx)
    try:
        import_prompts(store, pool)
        started = time.perf_counter()
        start_round(store, runner, settings, 1000)  # round number 1000: other prompts than the loop's round 1
        simulate_annotations(store, ctx.judge, noise=exp.noise, seed=exp.seed + 1000)
        snapshot = export_pairs(store, folder / "pairs.jsonl", "jsonl")
        generated_s = time.perf_counter() - started
        exported = [json.loads(line) for line in Path(snapshot.path).read_text(encoding="utf-8").splitlines() if line]
        rows = [r for r in exported if _text(r["chosen"]).strip() and _text(r["rejected"]).strip()]
        heldout, subsets = split_for_curve(rows, lambda r: r["prompt_id"], cfg.heldout_pairs, cfg.sizes, exp.seed)
        held_file = write_rows(folder / "heldout.jsonl", heldout)
        ceiling = judge_agreement(heldout, ctx.judge)
        points = train_points(store, runner, ctx, subsets, held_file, cfg.reward, folder, lambda r: r["prompt_id"])
    finally:
        runner.shutdown()
        store.close()
    return {"points": points, "heldout_pairs": len(heldout), "pairs_available": len(rows), "prompts": n_prompts,
            "dropped_empty": len(exported) - len(rows),
            "ceiling": ceiling, "generate_and_rank_s": generated_s, "reward": dataclasses.asdict(cfg.reward)}


def run_hh_curve(ctx, cfg: CurveConfig) -> dict:
    """One point per size on the HH dev pairs, beside the length baseline of the held-out pairs."""
    from pipeline.pairs_data import prompt_key

    folder = ctx.out / "hh_curve"
    rows = [json.loads(line) for line in Path(cfg.hh_data).read_text(encoding="utf-8").splitlines() if line.strip()]
    key = lambda r: prompt_key(r["prompt"])  # noqa: E731
    heldout, subsets = split_for_curve(rows, key, cfg.hh_heldout_pairs, cfg.hh_sizes, ctx.exp.seed)
    store, runner = _open(folder, ctx)
    try:
        held_file = write_rows(folder / "heldout.jsonl", heldout)
        points = train_points(store, runner, ctx, subsets, held_file, cfg.hh_reward, folder, key)
    finally:
        runner.shutdown()
        store.close()
    return {"points": points, "heldout_pairs": len(heldout), "pairs_available": len(rows),
            "data": Path(cfg.hh_data).name, "reward": dataclasses.asdict(cfg.hh_reward)}
