"""Does the loop make the policy better by a measure it was not trained on? A gold-judge experiment.

In the style of Gao et al. 2022 ("Scaling Laws for Reward Model Overoptimization"): a fixed gold
judge stands in for people. It is the `embedding` judge of pipeline/oracle.py, on the offline
all-MiniLM-L6-v2 model: cos(response, "helpful, friendly, detailed ...") - cos(response, "rude,
evasive, unhelpful ...") + 0.5 cos(response, prompt). The pipeline never trains on it: simulated
annotators rank each prompt's K responses by gold score with Bradley-Terry noise (through the
store, like people in the app), a proxy reward model is trained on those rankings, and the policy
is optimised against the proxy (or, with DPO, on the pairs). The question is what happens to the
gold score.

    python bench/gold/loop.py              # SmolLM2-135M, every part (CPU: see docs/results/gold_loop.md)
    python bench/gold/loop.py --parallel   # the parts side by side (each its own job queue)
    python bench/gold/loop.py --quick      # tiny random models, every part end to end (a few minutes)
    python bench/gold/loop.py --reuse-round1 OLD_RESULTS_DIR ...   # round 1 as an earlier run left it

Phases
  0. held-out split: a fixed, seeded set of evaluation prompts is kept out of the store; the rest
     of the bundled prompt pool (store/data/prompts.jsonl) is imported through the store (store.io.import_prompts)
  1. round 1, shared by all settings: generate K responses per prompt with the base policy (a job),
     simulated annotators rank them, reward model 1 is trained (a job); the base policy is evaluated
  2. the parts, each from round 1's pairs (--variants, --bon, --curve-sizes, --hh-sizes choose them):
     - PPO settings (adaptive KL, fixed beta, beta = 0): the store is copied, PPO round 1 runs
       against reward model 1, then rounds 2..R run through the real loop (pipeline/orchestrate/loop.py:
       generate with the new policy, rank, retrain the reward model warm-started on all pairs so far, PPO)
     - dpo and control (bench/gold/arms.py): DPO on reward model 1's pairs; PPO at the adaptive
       setting's KL budget against a reward model trained on those pairs with shuffled labels
     - best-of-n with reward model 1 from the start policy (bench/gold/bon.py)
     - the proxy's learning curve on simulated pairs and on the HH dev pairs (bench/gold/curve.py)
  3. each new policy is evaluated on the held-out prompts as soon as it exists (bench/gold/eval.py),
     and the gold judge scores PPO's per-step sample tables; results.json is rewritten after each
     part, so a stopped run keeps what it has; every part's wall and CPU time is recorded
  4. report.md, its plots and results.json in the results directory (bench/gold/report.py); a
     full run also publishes report and plots to docs/results/

Sharing round 1 (its responses, rankings and reward model) makes every method start from the same
pairs and the same policy. One training run per method says nothing about the next one:
bench/gold/seeds.py runs the arms over several seeds, with an early-stopped proxy and every arm
evaluated at checkpoints along its training. The last lines are `RESULT gold ...` (the verdict) and
`RESULT gold_loop ...` (bench/run_all.py's row).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipeline.config import GenerateConfig, LoopConfig, ModelConfig, PPOConfig, RewardConfig  # noqa: E402
from pipeline.orchestrate.loop import LoopSettings  # noqa: E402

from bench.gold.bon import DEFAULT_NS  # noqa: E402
from bench.gold.curve import CurveConfig  # noqa: E402
from bench.gold.eval import EvalConfig  # noqa: E402
from bench.gold.rounds import VARIANTS, reuse_shared_round, run_variant, shared_round  # noqa: E402
from bench.gold.prompt_sets import split_prompts  # noqa: E402
from bench.gold.steps import Context, RecordingOracle  # noqa: E402

PROMPTS = ROOT / "store" / "data" / "prompts.jsonl"  # the app's bundled pool (license: store/data/LICENSE.md)
OUT_ROOT = ROOT / "bench" / "out" / "gold_loop"
PUBLISH = ROOT / "docs" / "results"

@dataclass
class Experiment:
    loop: LoopSettings
    eval: EvalConfig
    eval_prompts: int = 32
    """Held-out prompts, never imported into the store."""
    noise: float = 0.05
    """Bradley-Terry temperature of the simulated annotators (in gold-score units)."""
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    bon: list[int] = field(default_factory=lambda: list(DEFAULT_NS))
    """Best-of-n sizes ([] = no best-of-n)."""
    dpo: dict = field(default_factory=dict)
    """train-dpo's options (key = option name), e.g. {"loss": "sigmoid", "beta": 0.1}."""
    curve: CurveConfig = field(default_factory=CurveConfig)
    threads: int = 2
    seed: int = 0


def full_experiment(threads: int = 2) -> Experiment:
    """SmolLM2-135M on CPU in fp32. The PPO settings are sized for about 50 minutes on 2 idle cores
    with --parallel --threads 1 (round 1 ~20 min; then per setting 2 x 24 PPO steps of 8 episodes,
    ~30 min side by side): enough PPO for beta = 0 to over-optimise the proxy. The learning curves
    are the longest parts (a reward model per size); the report gives each part's wall and CPU time."""
    tokens = 24
    return Experiment(
        loop=LoopSettings(
            # no reward gate: the experiment measures PPO against whatever proxy a round trains
            loop=LoopConfig(rounds=2, prompts_per_round=16, rankings_per_round=0, seed=0, reward_gate=False),
            model=ModelConfig(model="default", device="cpu", dtype="fp32"),
            generate=GenerateConfig(k=4, max_new_tokens=tokens, temperature=0.9, batch_size=32),
            # normalisation: 64 samples of PPO's 24 tokens (16 had given stds 0.64 and 1.02 for the
            # proxies of two consecutive epochs)
            reward=RewardConfig(epochs=1, lr=3e-4, batch_size=8, max_steps=6, max_length=128, norm_samples=64),
            ppo=PPOConfig(steps=24, batch_size=8, mini_batch_size=4, micro_batch_size=4, ppo_epochs=1,
                          lr=5e-4, critic_lr=3e-4, max_new_tokens=tokens, temperature=0.7,
                          missing_eos_penalty=0.0, sample_every=1, max_prompt_tokens=96, forward_batch_size=8),
            ppo_prompts=256),
        eval=EvalConfig(samples=4, max_new_tokens=tokens, temperature=0.7, batch_size=16),
        eval_prompts=24, threads=threads,
        dpo={"loss": "sigmoid", "beta": 0.1, "epochs": 2, "lr": 5e-4, "batch_size": 8, "max_length": 128},
        curve=CurveConfig(
            sizes=[100, 300, 1000, 3000], heldout_pairs=600,
            reward=RewardConfig(epochs=1, lr=3e-4, batch_size=8, max_length=128),
            # HH: the reference run's recipe (pipeline/train_reward.py's docstring); at most 2,048
            # tokens a forward pass (the same gradients in chunks), so it fits beside the other parts
            hh_sizes=[100, 300, 1000], hh_heldout_pairs=400,
            hh_reward=RewardConfig(epochs=1, lr=1e-4, batch_size=8, max_length=512, max_tokens=2048)))


def quick_experiment(model_dir: str, threads: int = 2) -> Experiment:
    """Tiny random models: every step of the full run, in a few minutes (the slow test runs it)."""
    tokens = 8
    tiny_reward = RewardConfig(batch_size=4, max_length=64, norm_samples=0, lr=1e-3)
    return Experiment(
        loop=LoopSettings(
            # no reward gate: the experiment measures PPO against whatever proxy a round trains
            loop=LoopConfig(rounds=2, prompts_per_round=6, rankings_per_round=0, seed=0, reward_gate=False),
            model=ModelConfig(model=model_dir, device="cpu", dtype="fp32", lora_r=4, lora_alpha=8),
            generate=GenerateConfig(k=3, max_new_tokens=tokens, temperature=1.0, batch_size=18),
            reward=dataclasses.replace(tiny_reward, eval_fraction=0.25),
            ppo=PPOConfig(steps=2, batch_size=4, mini_batch_size=4, micro_batch_size=4, ppo_epochs=1,
                          lr=1e-3, max_new_tokens=tokens, missing_eos_penalty=0.0, sample_every=1),
            ppo_prompts=8),
        eval=EvalConfig(samples=2, max_new_tokens=tokens, temperature=1.0, batch_size=8),
        eval_prompts=4, threads=threads,
        dpo={"loss": "sigmoid", "beta": 0.1, "epochs": 1, "lr": 1e-3, "batch_size": 4, "max_length": 64},
        curve=CurveConfig(sizes=[6, 18], heldout_pairs=12, reward=tiny_reward,
                          hh_sizes=[8, 24], hh_heldout_pairs=16, hh_reward=tiny_reward))


# --------------------------------------------------------------------------- the experiment


def run_experiment(exp: Experiment, out: Path, prompts_file: Path = PROMPTS, log=print,
                   reuse_round1: Path | None = None, parallel: bool = False) -> dict:
    """Phases 0-3 of the module docstring; returns (and writes) results.json's content.

    reuse_round1: a results directory of an earlier run with the same settings whose phases 0-1
    (round 1 and the start policy's evaluation) are taken as they are. parallel: the parts run
    side by side, each with its own store and job queue (one process per job on a shared machine
    gets a fairer share of the CPU; the results are the same as one after the other).
    """
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from bench.gold.arms import dpo_unavailable
    from bench.gold.bon import run_bon
    from bench.gold.curve import run_hh_curve, run_simulated_curve
    from pipeline.oracle import make_oracle

    torch.set_num_threads(exp.threads)
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval").mkdir(exist_ok=True)
    results: dict = {"settings": _describe(exp), "variants": {}, "timings": {}, "parts": {}, "skipped": {}}
    lock = threading.Lock()

    def save():
        with lock:
            results["timings"]["total_s"] = time.perf_counter() - t0
            (out / "results.json").write_text(json.dumps(results, indent=2, default=str))

    # 0. held-out split (seeded: a reused round 1 had the same) and the gold judge
    heldout, pool = split_prompts(prompts_file, exp.eval_prompts, exp.seed, out / "prompts")
    judge = RecordingOracle(make_oracle("embedding"))
    ctx = Context(exp, out, heldout, judge, results, lock, log)
    with ctx.part("round1"):
        if reuse_round1 is not None:
            reward1, rnd1, base_path = reuse_shared_round(ctx, Path(reuse_round1))
        else:
            reward1, rnd1, base_path = shared_round(ctx, pool)
    save()
    if "dpo" in exp.variants and (why := dpo_unavailable()):
        log(f"DPO skipped: {why}")
        results["skipped"]["dpo"] = why
    variants = [v for v in exp.variants if v not in results["skipped"]]

    # 2-3. the parts, each from round 1; a part that fails is recorded (results["failed"]) and
    #      the others go on: a long run keeps every part that worked, and the report says which did not
    def timed(name, fn):
        def task():
            try:
                with ctx.part(name):
                    fn()
            except Exception as exc:  # noqa: BLE001 - any failure of one part
                log(f"{name} failed:\n{traceback.format_exc()}")
                with lock:
                    results.setdefault("failed", {})[name] = f"{type(exc).__name__}: {exc}"
            save()
        return task

    def put(key, fn):
        return lambda: results.__setitem__(key, fn())

    tasks = [timed("bon", lambda: run_bon(ctx, base_path, reward1.path, exp.bon))] if exp.bon else []
    tasks += [timed(name, lambda name=name: run_variant(ctx, name, rnd1, reward1, save)) for name in variants]
    if exp.curve.sizes:
        tasks.append(timed("curve", put("curve_simulated", lambda: run_simulated_curve(ctx, pool, exp.curve))))
    if exp.curve.hh_sizes:
        tasks.append(timed("hh_curve", put("curve_hh", lambda: run_hh_curve(ctx, exp.curve))))
    if parallel:
        with ThreadPoolExecutor(len(tasks)) as pool_:
            for future in [pool_.submit(task) for task in tasks]:
                future.result()
        results["variants"] = {n: results["variants"][n] for n in variants if n in results["variants"]}
    else:
        for task in tasks:
            task()
    save()
    return results


def _describe(exp: Experiment) -> dict:
    s = exp.loop
    return {"model": s.model.model, "rounds": s.loop.rounds, "prompts_per_round": s.loop.prompts_per_round,
            "k": s.generate.k, "max_new_tokens": s.generate.max_new_tokens,
            "generate_temperature": s.generate.temperature, "reward": dataclasses.asdict(s.reward),
            "ppo": dataclasses.asdict(s.ppo), "ppo_prompts": s.ppo_prompts, "lora_r": s.model.lora_r,
            "eval_prompts": exp.eval_prompts, "eval": dataclasses.asdict(exp.eval), "noise": exp.noise,
            "variants": {v: VARIANTS[v] for v in exp.variants}, "threads": exp.threads, "bon": exp.bon,
            "dpo": exp.dpo, "curve": dataclasses.asdict(exp.curve),
            "judge": "embedding (all-MiniLM-L6-v2, pipeline/oracle.py defaults)"}


# --------------------------------------------------------------------------- CLI


def _sizes(text: str) -> list[int]:
    """'100,300' -> [100, 300]; 'none' -> []."""
    if text.strip().lower() == "none":
        return []
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes as 100,300,1000 (or none)") from None
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be at least 1")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--quick", action="store_true", help="tiny random models, a few minutes")
    add("--out", default="", help="results directory (default: bench/out/gold_loop/<time>)")
    add("--prompts", default=str(PROMPTS), help="prompt pool (JSONL with 'prompt')")
    add("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)} (none: only the other parts)")
    add("--bon", type=_sizes, default=None, help="best-of-n sizes, e.g. 1,2,4,8,16 (none: skip)")
    add("--curve-sizes", type=_sizes, default=None,
        help="simulated pairs per learning-curve point, e.g. 100,300,1000,3000 (none: skip)")
    add("--hh-sizes", type=_sizes, default=None, help="HH dev pairs per learning-curve point (none: skip)")
    for name, kind in (("rounds", int), ("ppo-steps", int), ("prompts-per-round", int), ("eval-samples", int),
                       ("reward-epochs", int), ("dpo-epochs", int), ("dpo-beta", float), ("dpo-lr", float)):
        add(f"--{name}", type=kind, default=0, help=f"override the {name.replace('-', ' ')}")
    add("--dpo-loss", default="", choices=["", "sigmoid", "ipo"], help="override the DPO loss")
    add("--reward-steps", type=int, default=-1,
        help="override the reward model's optimiser steps per round (0 = every pair, each epoch)")
    add("--threads", type=int, default=2, help="torch threads here and in every job")
    add("--parallel", action="store_true", help="run the parts side by side")
    add("--reuse-round1", default="", help="take round 1 and the start policy's evaluation from this earlier results directory")
    add("--publish", default=None,
        help="also copy report and plots here ('none': nowhere; default: docs/results for a full run, "
             "nowhere for --quick)")
    return parser


def apply_overrides(exp: Experiment, args) -> Experiment:
    exp.variants = [] if args.variants == "none" else args.variants.split(",")
    unknown = [v for v in exp.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)} (or none)")
    overrides = [(args.rounds, exp.loop.loop, "rounds"), (args.ppo_steps, exp.loop.ppo, "steps"),
                 (args.prompts_per_round, exp.loop.loop, "prompts_per_round"), (args.eval_samples, exp.eval, "samples"),
                 (args.reward_epochs, exp.loop.reward, "epochs")]
    for value, target, attr in overrides:
        if value:
            setattr(target, attr, value)
    if args.reward_steps >= 0:
        exp.loop.reward.max_steps = args.reward_steps
    for key, value in (("epochs", args.dpo_epochs), ("beta", args.dpo_beta), ("lr", args.dpo_lr), ("loss", args.dpo_loss)):
        if value:
            exp.dpo[key] = value
    if args.bon is not None:
        exp.bon = args.bon
    if args.curve_sizes is not None:
        exp.curve.sizes = args.curve_sizes
    if args.hh_sizes is not None:
        exp.curve.hh_sizes = args.hh_sizes
    return exp


def main(argv: list[str] | None = None) -> int:
    from bench.gold.report import publish, result_line, write_report
    from bench.gold.verdict import gold_result_line

    args = build_parser().parse_args(argv)
    out = Path(args.out) if args.out else OUT_ROOT / time.strftime("%Y%m%d-%H%M%S")
    if not Path(args.prompts).is_file():
        raise SystemExit(f"{args.prompts}: no such file (the default is the bundled pool, store/data/prompts.jsonl)")
    if args.quick:
        from tests.tiny import save_tiny_model_dir

        exp = quick_experiment(str(save_tiny_model_dir(out / "tiny_model")), args.threads)
    else:
        exp = full_experiment(args.threads)
    exp = apply_overrides(exp, args)
    started = time.time()
    results = run_experiment(exp, out, Path(args.prompts), reuse_round1=Path(args.reuse_round1) if args.reuse_round1
                             else None, parallel=args.parallel)
    results["wall_s"] = time.time() - started
    results["command"] = "python bench/gold/loop.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    results["mode"] = "quick" if args.quick else "full"
    results["parallel"] = args.parallel
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    report = write_report(results, out)
    print(f"report: {report}")
    target = args.publish if args.publish is not None else ("" if args.quick else str(PUBLISH))
    if target and target != "none":
        for path in publish(out, Path(target)):
            print(f"published: {path}")
    print(gold_result_line(results, out))
    print(result_line(results))  # last: bench/run_all.py reads the last RESULT line
    for name, why in results.get("failed", {}).items():
        print(f"failed: {name}: {why}", file=sys.stderr)
    return 1 if results.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
