"""1 process against N: the same train-reward and ppo jobs launched plainly and under torchrun.

    python bench/scale_bench.py                       # tiny model, CPU, 1 vs 2 processes
    python bench/scale_bench.py --model default --device cuda --procs 4 --reps 2

Each job is the job runner's command (`python -m pipeline <stage> ...` for 1 process,
`python -m torch.distributed.run --nproc_per_node N -m pipeline <stage> ...` for N), with the same
options, so both sides do the same work (sizes are global: pipeline/distributed.py). Timed: the
whole job (launch, imports, loading, training) and the steady-state throughput read from its
metrics.jsonl (median over steps after the first). The order of the sides alternates over the
repetitions; medians and ranges are printed, then the N/1 ratios, and the commit.

On a CPU machine the processes share the cores and the tiny model's steps are dominated by
communication and Python overhead: the table there shows what the launch and the all-reduces cost,
not what N GPUs gain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def command(procs: int, port: int) -> list[str]:
    if procs == 1:
        return [sys.executable, "-m", "pipeline"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
            "--master_port", str(port), "-m", "pipeline"]


def run_job(stage_args: list[str], procs: int, out: Path, port: int) -> tuple[float, list[dict]]:
    # one thread per process on both sides (torchrun's default for its workers): the 1-process side
    # with every core's threads would measure OpenMP contention on a shared machine, not scaling
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    done = subprocess.run([*command(procs, port), *stage_args, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(stage_args[:1])} on {procs} process(es) failed:\n{done.stdout[-3000:]}"
                         f"\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return wall, lines


def throughput(lines: list[dict], key: str) -> float:
    values = [m[key] for m in lines if key in m][1:]  # the first step pays warm-up
    return statistics.median(values) if values else float("nan")


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model folder or 'default' ('' = a tiny random model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--procs", type=int, default=2, help="N, compared with 1")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each side (order alternates)")
    parser.add_argument("--reward-steps", type=int, default=12)
    parser.add_argument("--ppo-steps", type=int, default=6)
    args = parser.parse_args()

    from tests.test_train_ppo import PROMPTS
    from tests.test_train_reward import marker_pairs
    from tests.tiny import save_tiny_model_dir

    work = Path(tempfile.mkdtemp(prefix="scale_bench-"))
    model = args.model or str(save_tiny_model_dir(work / "tiny"))
    pairs = work / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in marker_pairs(16 * args.reward_steps + 40)))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    common = ["--model", model, "--device", args.device]
    jobs = {
        "train-reward": (["train-reward", "--data", str(pairs), "--batch-size", "16", "--max-steps",
                          str(args.reward_steps), "--norm-samples", "0", "--eval-fraction", "0.1", *common],
                         "train/pairs_per_s", "pairs/s"),
        "ppo": (["ppo", "--policy", model, "--reward", "script:count:e", "--prompts", str(prompts),
                 "--steps", str(args.ppo_steps), "--batch-size", "16", "--mini-batch-size", "8",
                 "--micro-batch-size", "4", "--max-new-tokens", "16", "--sample-every", "0", *common],
                "time/episodes_per_s", "episodes/s"),
    }
    results: dict = {}
    port = 29650
    for stage, (stage_args, key, _) in jobs.items():
        for rep in range(args.reps):
            order = (1, args.procs) if rep % 2 == 0 else (args.procs, 1)
            for procs in order:
                port += 1
                out = work / f"{stage}-{procs}-{rep}"
                wall, lines = run_job(stage_args, procs, out, port)
                row = results.setdefault((stage, procs), {"wall": [], "rate": []})
                row["wall"].append(wall)
                row["rate"].append(throughput(lines, key))
                print(f"  {stage} x{procs} rep {rep}: {wall:.1f} s, {row['rate'][-1]:.2f} {jobs[stage][2]}",
                      flush=True)

    print(f"\nscale_bench  model={args.model or 'tiny (random, ~30k parameters)'}  device={args.device}  "
          f"commit={commit()}  reps={args.reps}")
    print(f"{'stage':<13}{'procs':>6}  {'job wall s, median (range)':<30}{'steady throughput, median (range)':<36}")
    for (stage, procs), row in sorted(results.items()):
        print(f"{stage:<13}{procs:>6}  {summary(row['wall']):<30}{summary(row['rate'])} {jobs[stage][2]}")
    for stage in jobs:
        one, many = results[(stage, 1)], results[(stage, args.procs)]
        print(f"{stage}: {args.procs} processes / 1: wall x{statistics.median(many['wall']) / statistics.median(one['wall']):.2f}, "
              f"throughput x{statistics.median(many['rate']) / statistics.median(one['rate']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
