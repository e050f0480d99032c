"""Launch, watch and cancel pipeline jobs as subprocesses, and ingest what they write.

DESIGN.md, Process model: a job is `python -m pipeline <stage> ... --out RUN_DIR` (or the same
under `accelerate launch`); it reads files, writes only its run directory and never opens the
DuckDB file. The process that owns the store (the app, or a CLI) runs a `JobRunner`, which

  1. records the run in the store (status 'queued'),
  2. starts the job when its device is free (one job at a time per device: a FIFO queue),
  3. tails status.json and metrics.jsonl while it runs, copying metrics into the store,
  4. when it ends, marks the run done / failed (with the error and the log tail) / cancelled, and
     on success ingests its results (responses, new model versions) in one store transaction.

A job that crashes or is killed (even with SIGKILL) leaves its run marked failed and the store as
it was: nothing from a run is written to the store before the run has finished successfully.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pipeline.rundir import MetricsTail, read_status

DEFAULT_LAUNCHER = (sys.executable, "-m", "pipeline")


def launcher_from_env() -> tuple[str, ...]:
    """$RLHF_LOOP_LAUNCHER (e.g. "accelerate launch --num_processes 4 -m pipeline") or python -m pipeline."""
    env = os.environ.get("RLHF_LOOP_LAUNCHER")
    return tuple(shlex.split(env)) if env else DEFAULT_LAUNCHER


@dataclass
class Job:
    run_id: int
    kind: str
    args: list[str]
    run_dir: Path
    device: str
    on_done: Callable | None = None
    process: subprocess.Popen | None = None
    cancel_requested: bool = False
    finished: threading.Event = field(default_factory=threading.Event)


class JobRunner:
    """Owns the job queue of one store. Thread-safe; one worker thread per device."""

    def __init__(self, store, runs_root: str | Path, launcher=None, poll_s: float = 0.5,
                 grace_s: float = 10.0, env: dict | None = None):
        self.store = store
        self.runs_root = Path(runs_root)
        self.launcher = tuple(launcher or launcher_from_env())
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        self._lock = threading.Lock()
        self._queues: dict[str, collections.deque[Job]] = {}
        self._workers: dict[str, threading.Thread] = {}
        self._jobs: dict[int, Job] = {}
        self._closed = False

    # ------------------------------------------------------------------ public API

    def submit(self, kind: str, args: list[str], *, inputs: dict | None = None, config: dict | None = None,
               device: str = "auto", on_done: Callable | None = None):
        """Queue `python -m pipeline KIND ARGS --out RUN_DIR`; returns the store's Run.

        `inputs` is recorded with the run and tells the finisher what to register (for example
        the model version that generates, or the snapshot a reward model trains on).
        `on_done(run)` is called in the worker thread after the run has ended and been ingested.
        """
        if self._closed:
            raise RuntimeError("the job runner is shut down")
        run = self.store.create_run(kind, config={"args": list(args), **(config or {})}, inputs=inputs or {})
        run_dir = self.runs_root / f"{run.id:05d}-{kind}"
        run_dir.mkdir(parents=True, exist_ok=True)
        run = self.store.update_run(run.id, run_dir=str(run_dir))
        job = Job(run.id, kind, list(args), run_dir, device, on_done)
        with self._lock:
            self._jobs[run.id] = job
            self._queues.setdefault(device, collections.deque()).append(job)
            worker = self._workers.get(device)
            if worker is None or not worker.is_alive():
                worker = threading.Thread(target=self._work, args=(device,), daemon=True,
                                          name=f"jobs-{device}")
                self._workers[device] = worker
                worker.start()
        return run

    def cancel(self, run_id: int) -> None:
        """Ask a job to stop: a queued job never starts; a running one gets SIGTERM (it saves a
        checkpoint and exits), then SIGKILL after `grace_s` seconds."""
        job = self._jobs.get(run_id)
        if job is None:
            raise KeyError(f"run {run_id} is not a job of this runner")
        job.cancel_requested = True
        proc = job.process
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            threading.Thread(target=self._kill_after_grace, args=(proc,), daemon=True).start()

    def wait(self, run_id: int, timeout: float | None = None):
        """Block until the run has ended and been ingested; returns its Run."""
        job = self._jobs[run_id]
        if not job.finished.wait(timeout):
            raise TimeoutError(f"run {run_id} ({job.kind}) still running after {timeout} s")
        return self.store.get_run(run_id)

    def progress(self, run_id: int) -> dict:
        """The job's status.json (state, step, total, progress), or {} before it writes one."""
        job = self._jobs.get(run_id)
        run_dir = job.run_dir if job else Path(self.store.get_run(run_id).run_dir or ".")
        return read_status(run_dir)

    def log_tail(self, run_id: int, lines: int = 40) -> str:
        job = self._jobs.get(run_id)
        run_dir = job.run_dir if job else Path(self.store.get_run(run_id).run_dir or ".")
        return _tail(run_dir / "log.txt", lines)

    def busy(self) -> bool:
        return any(not job.finished.is_set() for job in self._jobs.values())

    def shutdown(self, cancel_running: bool = True) -> None:
        self._closed = True
        if cancel_running:
            for job in list(self._jobs.values()):
                if not job.finished.is_set():
                    self.cancel(job.run_id)

    # ------------------------------------------------------------------ worker

    def _work(self, device: str) -> None:
        while True:
            with self._lock:
                queue = self._queues.get(device)
                if not queue:
                    self._workers.pop(device, None)
                    return
                job = queue.popleft()
            try:
                self._run(job)
            except Exception as exc:  # the runner must survive anything a job does
                self._end(job, "failed", f"job runner error: {type(exc).__name__}: {exc}")
            finally:
                job.finished.set()

    def _run(self, job: Job) -> None:
        if job.cancel_requested:
            self._end(job, "cancelled", "cancelled before it started")
            return
        # 1. start the subprocess in its own process group (so cancel reaches its children too)
        cmd = [*self.launcher, job.kind, *job.args, "--out", str(job.run_dir)]
        (job.run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
        with open(job.run_dir / "log.txt", "ab") as log:
            job.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=self.env, start_new_session=True)
        self.store.update_run(job.run_id, status="running")
        # 2. tail metrics while it runs
        tail = MetricsTail(job.run_dir)
        while job.process.poll() is None:
            self._ingest_metrics(job, tail)
            time.sleep(self.poll_s)
        self._ingest_metrics(job, tail)
        # 3. decide how it ended
        rc = job.process.returncode
        status = read_status(job.run_dir)
        if job.cancel_requested:
            self._end(job, "cancelled", status.get("error") or "cancelled by the user")
        elif rc == 0 and status.get("state", "done") == "done":
            # 4. ingest its results; a failure here fails the run and stores nothing of it
            outputs = FINISHERS[job.kind](self.store, self.store.get_run(job.run_id), job.run_dir) \
                if job.kind in FINISHERS else {}
            self._end(job, "done", None, outputs)
        else:
            why = status.get("error") or (f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}")
            self._end(job, "failed", f"{why}\n--- log tail ---\n{_tail(job.run_dir / 'log.txt', 30)}")

    def _ingest_metrics(self, job: Job, tail: MetricsTail) -> None:
        rows = tail.read()
        if rows:
            self.store.add_metrics(job.run_id, rows)

    def _end(self, job: Job, status: str, error: str | None, outputs: dict | None = None) -> None:
        run = self.store.update_run(job.run_id, status=status, error=error, outputs=outputs or {})
        if job.on_done is not None:
            job.on_done(run)

    def _kill_after_grace(self, proc: subprocess.Popen) -> None:
        try:
            proc.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    # tqdm redraws with carriage returns: keep the last state of each line
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n")[-lines:])


# ---------------------------------------------------------------------- finishers
# Run in the owner process after a job succeeded: read the run directory, write the store.


def finish_generate(store, run, run_dir: Path) -> dict:
    """responses.jsonl -> one item per prompt, all in one transaction, tagged with the version."""
    version_id = run.inputs["model_version_id"]
    by_prompt: dict[int, list[dict]] = collections.defaultdict(list)
    with open(run_dir / "responses.jsonl", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if row.get("prompt_id") is None:
                raise ValueError("responses.jsonl row has no prompt_id: generate from a store export")
            by_prompt[int(row["prompt_id"])].append({
                "text": row["text"], "token_count": row["token_count"],
                "finish_reason": row["finish_reason"], "sampling": row.get("sampling", {})})
    item_ids = store.add_responses_bulk(version_id, list(by_prompt.items()), round_id=run.inputs.get("round_id"))
    return {"items": len(item_ids), "responses": sum(len(v) for v in by_prompt.values())}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def finish_train_reward(store, run, run_dir: Path) -> dict:
    ckpt = run_dir / "checkpoint"
    meta = _read_json(ckpt / "model_meta.json")
    report = _read_json(run_dir / "eval_report.json")
    version = store.register_model_version(
        "reward", parent_id=run.inputs.get("parent_version_id"), path=str(ckpt),
        base_model=meta.get("base_model"), run_id=run.id, snapshot_id=run.inputs.get("snapshot_id"),
        meta={"eval": {k: v for k, v in report.items() if not isinstance(v, (list, dict))},
              "reward_mean": meta.get("reward_mean"), "reward_std": meta.get("reward_std")})
    return {"model_version_id": version.id}


def finish_ppo(store, run, run_dir: Path) -> dict:
    policy_dir = run_dir / "policy"
    meta = _read_json(policy_dir / "model_meta.json")
    last = {}
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.is_file():
        lines = metrics_file.read_text(encoding="utf-8").strip().splitlines()
        last = json.loads(lines[-1]) if lines else {}
    version = store.register_model_version(
        "policy", parent_id=run.inputs.get("policy_version_id"), path=str(policy_dir),
        base_model=meta.get("base_model"), run_id=run.id,
        reward_version_id=run.inputs.get("reward_version_id"),
        meta={"final": {k: v for k, v in last.items() if isinstance(v, (int, float))}})
    return {"model_version_id": version.id}


FINISHERS = {"generate": finish_generate, "train-reward": finish_train_reward, "ppo": finish_ppo}
