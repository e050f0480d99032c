"""Helpers of the gold-loop experiment (bench/gold/loop.py); its round steps are pipeline/orchestrate/loop.py's own
(start_round, train_round_reward, train_round_policy, finish_round), with the same jobs and records.

- RecordingOracle, gold_agreement: the gold judge, and how often the simulated annotators agree with it
- Context: what every part of the experiment shares (settings, results, the held-out evaluation,
  the wall and CPU time of each part)
- copy_store, run_job: a consistent copy of a store (one per setting after round 1); one job run
  to its end through a store's job queue
- ppo_step_trace: per PPO step, proxy score and KL (metrics.jsonl) and the gold score of the step's
  sample table
"""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
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


def gold_agreement(store, judge: RecordingOracle) -> dict:
    """Share of stored pairs whose chosen response has the higher gold score (1.0 = no noise).
    Responses the judge has not scored in this process (a reused round 1) are scored now."""
    rows = []
    for pair in store.list_pairs():
        prompt = store.get_prompt(pair.prompt_id).text
        rows.append((prompt, store.get_response(pair.chosen_id).text, store.get_response(pair.rejected_id).text))
    missing = list({(p, t) for p, a, b in rows for t in (a, b)} - judge.scores.keys())
    if missing:
        judge.score([p for p, _ in missing], [t for _, t in missing])
    scored = [(judge.scores[(p, a)], judge.scores[(p, b)]) for p, a, b in rows]
    scored = [(a, b) for a, b in scored if a != b]
    agree = sum(a > b for a, b in scored)
    return {"pairs": len(scored), "agreement": agree / len(scored) if scored else float("nan")}


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
    """bench/gold/loop.py's Experiment."""
    out: Path
    heldout: list
    judge: RecordingOracle
    results: dict
    lock: object
    log: object

    def env(self) -> dict:
        n = str(self.exp.threads)
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}

    @contextlib.contextmanager
    def part(self, name: str):
        """Record the wall and CPU seconds of one part of the experiment in results["parts"]. The
        CPU time counts this process and its ended jobs: exact when the parts run one after the
        other, shared between the parts that overlap under --parallel."""
        wall, cpu = time.perf_counter(), cpu_seconds()
        try:
            yield
        finally:
            with self.lock:
                self.results.setdefault("parts", {})[name] = {
                    "wall_s": time.perf_counter() - wall, "cpu_s": cpu_seconds() - cpu}

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


# --------------------------------------------------------------------------- store copies, jobs and PPO traces


def copy_store(store, src: Path, dst: Path) -> None:
    """A consistent copy of the DuckDB file: close it first (DuckDB folds its WAL in on close)."""
    store.close()
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def run_job(store, runner, kind: str, args: list[str], **submit):
    """Queue `python -m pipeline KIND ARGS` on the store's job queue, wait for it; the ended Run.
    A job that did not succeed is a RuntimeError naming it, its run directory and its error."""
    run = runner.wait(runner.submit(kind, args, **submit).id)
    if run.status != "done":
        raise RuntimeError(f"{kind} job {run.id} {run.status} ({run.run_dir}): {run.error}")
    return run


def ppo_step_trace(run_dir: Path, judge, round_no: int) -> list[dict]:
    """Per PPO step: proxy score and KL of the rollout (metrics.jsonl), and the gold score of the
    step's sample table (samples/step_N.jsonl: the first responses of the rollout)."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        m = json.loads(line)
        row = {"round": round_no, "step": m["step"], "proxy": m["objective/score"], "kl": m["objective/kl"],
               "beta": m["kl/beta"], "length": m["gen/length_mean"], "eos_rate": m["gen/eos_rate"]}
        samples = run_dir / "samples" / f"step_{m['step']}.jsonl"
        if samples.is_file():
            table = [json.loads(s) for s in samples.read_text(encoding="utf-8").splitlines() if s.strip()]
            prompts = [t["prompt"] if isinstance(t["prompt"], str) else t["prompt"][-1]["content"] for t in table]
            gold = judge.score(prompts, [t["response"] for t in table])
            row.update(gold=sum(gold) / len(gold), gold_n=len(gold))
        rows.append(row)
    return rows
