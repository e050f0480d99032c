"""Helpers of the closed-loop experiment (bench/gold/closed_loop.py), whose rounds are
pipeline/orchestrate/loop.py's own:

- RecordingOracle: the gold judge, remembering every score it gave
- Context: what every part of a seed's run shares (settings, results, the held-out evaluation)
- cpu_seconds, write_rows: CPU time of this process and its ended jobs; JSON Lines out
"""

from __future__ import annotations

import json
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


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and of its jobs that have ended."""
    own, jobs = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + jobs.ru_utime + jobs.ru_stime


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
