"""What a job's start costs: cold (a new `python -m pipeline` process, importing torch,
transformers and peft itself) against warm (forked from the JobRunner's warm process,
pipeline/orchestrate/warm.py), the same jobs side by side.

    python bench/job_start_bench.py                  # tiny model, 6 jobs of each (about a minute)
    python bench/job_start_bench.py --quick          # 1 job of each (seconds; the suite's smoke test)
    python bench/job_start_bench.py --model default  # SmolLM2-135M-Instruct

A job is a short `train-reward` (16 pairs, one epoch, no normalisation samples): a job the app runs
often and whose compute is small beside its start. Each side has its own store and JobRunner; the
jobs alternate between the sides (cold, warm, cold, ...), each timed from submit until its run is
settled (its model registered in the store). The warm side's first job also starts the warm process
and is reported apart (`warm_first_s`), not in the median.

Prints a table and `RESULT job_start cold_s= warm_s= ratio= warm_first_s= jobs= threads=` (medians;
ratio = cold / warm).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.orchestrate.jobs import JobRunner  # noqa: E402
from store import Store  # noqa: E402


def job_args(work: Path, model: str) -> list[str]:
    data = work / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Question {i}?", "chosen": "Yes, gladly.", "rejected": "No."})
                            + "\n" for i in range(16)))
    return ["--data", str(data), "--model", model, "--device", "cpu", "--epochs", "1", "--batch-size", "8",
            "--norm-samples", "0"]


def timed(runner: JobRunner, args: list[str]) -> float:
    t0 = time.perf_counter()
    run = runner.wait(runner.submit("train-reward", args).id, timeout=900)
    if run.status != "done":
        raise SystemExit(f"run {run.id} {run.status}: {run.error}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a model folder or 'default' (default: a tiny random model)")
    parser.add_argument("--jobs", type=int, default=6, help="jobs on each side")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every job (OMP_NUM_THREADS)")
    parser.add_argument("--quick", action="store_true", help="one job on each side")
    args = parser.parse_args(argv)
    jobs = 1 if args.quick else args.jobs
    work = Path(tempfile.mkdtemp(prefix="job_start_"))
    model = args.model
    if not model:
        from tests.fixtures_models import save_tiny_model_dir

        model = str(save_tiny_model_dir(work / "tiny_model"))
    command = job_args(work, model)
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    sides = {}
    for name, warm in (("cold", False), ("warm", True)):
        store = Store(work / f"{name}.duckdb")
        sides[name] = (store, JobRunner(store, work / f"runs-{name}", poll_s=0.05, env=env, warm_starts=warm))
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    try:
        first = timed(sides["warm"][1], command)  # starts the warm process
        for _ in range(jobs):
            for name in ("cold", "warm"):
                times[name].append(timed(sides[name][1], command))
    finally:
        for store, runner in sides.values():
            runner.shutdown()
            store.close()
    cold, warm = statistics.median(times["cold"]), statistics.median(times["warm"])
    print(f"job start, {jobs} short train-reward job(s) a side, {args.threads} thread(s), model {args.model or 'tiny'}")
    print("| side | median s/job | min | max |")
    print("|---|---|---|---|")
    for name in ("cold", "warm"):
        print(f"| {name} | {statistics.median(times[name]):.2f} | {min(times[name]):.2f} | {max(times[name]):.2f} |")
    print(f"| warm, first job (starts the warm process) | {first:.2f} | | |")
    print(f"RESULT job_start cold_s={cold:.3f} warm_s={warm:.3f} ratio={cold / warm:.2f} warm_first_s={first:.3f} "
          f"jobs={jobs} threads={args.threads}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
