"""Helpers of the closed-loop experiment (bench/gold/closed_loop.py), whose rounds are
pipeline/orchestrate/loop.py's own:

- RecordingOracle: the gold judge, remembering every score it gave
- Context: what every part of a seed's run shares (settings, results, the held-out evaluation)
- cpu_seconds, JobCPU, write_rows: CPU time of this process and its jobs, each job's own; JSON Lines out
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path

class RecordingOracle:
    """The gold judge, remembering every score it gave (to measure the annotators' agreement).
    One call at a time: a fast tokenizer shared by threads fails with 'Already borrowed'."""

    def __init__(self, judge):
        import threading

        self.judge, self.name, self.scores = judge, judge.name, {}
        self._lock = threading.Lock()

    def score(self, prompts, responses):
        with self._lock:
            out = self.judge.score(prompts, responses)
            self.scores.update({(p, r): s for p, r, s in zip(prompts, responses, out)})
        return out


# --------------------------------------------------------------------------- the shared context

EVAL_LOCK = threading.Lock()
"""One model load at a time in this process: loading from several threads at once is not safe."""


def own_cpu_seconds() -> float:
    """CPU time (user + system) of this process alone: the evaluations, the simulated annotators."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def ended_cpu_seconds(live: list | None = None) -> float:
    """CPU time of every process started from this one that has ended: the children this process
    reaped (cold-started jobs, a warm process that ended) and those its live children reaped (the
    jobs a warm process forked, pipeline/orchestrate/warm.py). It grows by a job's whole CPU time
    when the job ends, before the runner hears of it. live: `_live_children()`, if read already."""
    jobs = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = _live_children() if live is None else live
    return jobs.ru_utime + jobs.ru_stime + sum(stat[2] + stat[3] for stat in live)


def cpu_seconds() -> float:
    """CPU time of this process and everything it started, ended or alive (/proc read once)."""
    live = _live_children()
    return own_cpu_seconds() + ended_cpu_seconds(live) + sum(stat[0] + stat[1] for stat in live)


def _live_children() -> list[tuple[float, float, float, float]]:
    """(utime, stime, cutime, cstime) in seconds of each live child of this process, from
    /proc/PID/stat (none where there is no /proc)."""
    me, tick, out = os.getpid(), os.sysconf("SC_CLK_TCK"), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended while being read
        if int(fields[1]) == me:  # fields from the state on: ppid is the second, utime the 12th
            out.append(tuple(int(x) / tick for x in fields[11:15]))
    return out


class JobCPU:
    """CPU seconds of each job of a runner, measured as it ends (`ended_cpu_seconds` since the
    last job ended: jobs run one at a time), kept in a JSON file {run id: {kind, round_id, cpu_s}}
    so a resumed run keeps the earlier ones. Hooked in front of the runner's on_end."""

    def __init__(self, runner, path: Path):
        self.path, self.last = path, ended_cpu_seconds()
        self.jobs: dict[str, dict] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        after = runner.on_end

        def on_end(r, run) -> None:
            self.ended(run)
            if after is not None:
                after(r, run)

        runner.on_end = on_end

    def ended(self, run) -> None:
        now = ended_cpu_seconds()
        self.jobs[str(run.id)] = {"kind": run.kind, "round_id": run.inputs.get("round_id"), "cpu_s": now - self.last}
        self.last = now
        self.path.write_text(json.dumps(self.jobs, indent=1), encoding="utf-8")

    def of_round(self, round_id: int) -> dict[str, float]:
        """{job kind: CPU seconds} of the round's jobs."""
        parts: dict[str, float] = {}
        for job in self.jobs.values():
            if job["round_id"] == round_id:
                parts[job["kind"]] = parts.get(job["kind"], 0.0) + job["cpu_s"]
        return parts


@dataclass
class Context:
    exp: object
    """The run's settings: .loop (LoopSettings), .eval (EvalConfig), .threads."""
    out: Path
    heldout: list
    judge: RecordingOracle
    results: dict
    lock: object
    log: object

    def env(self) -> dict:
        n = str(self.exp.threads)
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}

    def evaluate(self, version_path, rewards: dict, tag: str, eval_cfg=None) -> tuple[dict, list[dict]]:
        """bench/gold/eval.py on the held-out prompts; its rows go to eval/TAG.jsonl."""
        from bench.gold.eval import evaluate_policy

        t = time.perf_counter()
        with EVAL_LOCK:
            metrics, rows = evaluate_policy(version_path, self.exp.loop.model, self.heldout, self.judge, rewards,
                                            eval_cfg or self.exp.eval)
        write_rows(self.out / "eval" / f"{tag}.jsonl", rows)
        self.log(f"eval {tag}: " + ", ".join(f"{k.split('/')[1]}={v:.3f}" for k, v in metrics.items()))
        with self.lock:
            self.results["timings"][f"eval_{tag}_s"] = time.perf_counter() - t
        return metrics, rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    """JSON Lines, one row a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return path
