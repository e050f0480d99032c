"""The job queue: launch, watch and cancel pipeline jobs as subprocesses, one at a time.

A job is `python -m pipeline <stage> ... --out RUN_DIR` (or, with several processes, the same
under `torchrun` or `accelerate launch`): it reads files, writes only its run directory and never opens the DuckDB file
(docs/DESIGN.md, Process model). The process that owns the store (the app, or a CLI) runs one
`JobRunner`, which

  1. records each job as a run in the store, status 'queued': the queue *is* the `runs` table, so
     it survives a restart of the owner;
  2. starts the oldest queued run when the device set is free (one job at a time: the job may use
     every device of the machine, so the whole set is one busy unit); a job of one process is
     forked from a warm process that has imported torch and transformers already (warm.py: a
     job's start without seconds of imports), any other started as a new process;
  3. while it runs, tails status.json and metrics.jsonl, copying metrics into the store, and
     ingests partial results as they appear (generated responses, chunk by chunk: ingest.py);
  4. when it ends, marks the run done / failed (with its error and log tail) / cancelled, ingests
     its results (new model versions ...) in the store, then calls `on_end(runner, run)`, which
     the round state machine (loop.py) uses to start the next step.

On start the runner recovers what a previous owner left: a run still 'running' is over (its job
stops by itself when its owner dies, see pipeline/rundir.py `OWNER_ENV`; a survivor is terminated
here). A trainer (RESUMABLE) saves its state when it is stopped, and every `save_every` steps: a
run that left one goes back to the queue and continues from it (`--resume`), so a restart of the
app during a long training loses at most the steps since its last save; any other is marked failed
"interrupted".
Queued runs stay queued and start in order.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from pipeline.orchestrate import ingest
from pipeline.orchestrate.warm import WarmProcess, alive, shared_warm
from pipeline.rundir import OWNER_ENV, MetricsTail, read_status, saved_state

DEFAULT_LAUNCHER = (sys.executable, "-m", "pipeline")
INTERRUPTED = "interrupted: the process that owned the job stopped before it finished"
RESUMABLE = ("train-reward", "train-dpo", "sft", "ppo", "rloo")
"""Job kinds whose trainer continues a stopped run of its own with --resume (pipeline/lifecycle.py)."""


def launcher_from_env() -> tuple[str, ...] | None:
    """$RLHF_LOOP_LAUNCHER (e.g. "accelerate launch --config_file my.yaml -m pipeline"), if set:
    it then launches every job, whatever its number of processes."""
    env = os.environ.get("RLHF_LOOP_LAUNCHER")
    return tuple(shlex.split(env)) if env else None


def launch_command(nproc: int = 1, accelerate_config: str = "") -> tuple[str, ...]:
    """How a job with `nproc` processes starts: one process is `python -m pipeline`; several are
    data-parallel ranks under torchrun (`python -m torch.distributed.run`), or under
    `accelerate launch` with a config file (FSDP, DeepSpeed: configs/accelerate/)."""
    if nproc < 1:
        raise ValueError(f"processes must be >= 1, not {nproc}")
    if accelerate_config:
        return (sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_config,
                "--num_processes", str(nproc), "-m", "pipeline")
    if nproc == 1:
        return DEFAULT_LAUNCHER
    return (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "pipeline")


class JobRunner:
    """Owns the job queue of one store (see the module docstring). Thread-safe."""

    def __init__(self, store, runs_root: str | Path, launcher=None, poll_s: float = 0.5,
                 grace_s: float = 10.0, env: dict | None = None,
                 on_end: Callable[["JobRunner", object], None] | None = None, warm_starts: bool = True):
        """on_end(runner, run): called in the worker thread after a run has ended and its results
        are in the store (also for runs found interrupted at start). warm_starts=False starts every
        job as a new process (bench/job_start_bench.py measures the difference)."""
        self.store = store
        self.runs_root = Path(runs_root)
        self.launcher = tuple(launcher) if launcher else launcher_from_env()
        """A fixed launcher for every job (tests, $RLHF_LOOP_LAUNCHER); None = each job's own."""
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "PYTHONUNBUFFERED": "1", **(env or {}), OWNER_ENV: str(os.getpid())}
        self.on_end = on_end
        self._wake = threading.Condition()
        self._settled: set[int] = set()  # runs of this runner that ended and were ingested
        self._cancel: set[int] = set()
        self._warm = shared_warm(self.env, self.runs_root / "warm.log") if warm_starts else None
        """Forks one-process jobs from a process that has imported torch already (warm.py; one for
        every runner of this process with the same job environment)."""
        self._process: subprocess.Popen | WarmProcess | None = None
        self._current: int | None = None
        self._closed = False
        self.recover()
        self._worker = threading.Thread(target=self._work, name="jobs", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ public API

    def submit(self, kind: str, args: list[str], *, inputs: dict | None = None, config: dict | None = None,
               nproc: int = 1, accelerate_config: str = ""):
        """Queue `python -m pipeline KIND ARGS --out RUN_DIR` (as `nproc` data-parallel processes,
        see `launch_command`); returns the store's Run.

        `inputs` is recorded with the run and tells ingest.py what to register when it ends (the
        model version that generates, the snapshot a reward model trains on, the round step ...)."""
        if self._closed:
            raise RuntimeError("the job runner is shut down")
        launch = {"nproc": int(nproc), "accelerate_config": accelerate_config}
        launch_command(**launch)  # a bad setting is refused now, not when the job comes up
        run = self.store.create_run(kind, config={"args": list(args), "launch": launch, **(config or {})},
                                    inputs=inputs or {})
        run = self._with_run_dir(run)
        with self._wake:
            self._wake.notify_all()
        return run

    def _with_run_dir(self, run):
        """The run with its folder made and recorded. The folder's name follows from the run alone,
        so the worker, which can pick up a run between its creation and this call, records the same."""
        if run.run_dir:
            return run
        run_dir = self.runs_root / f"{run.id:05d}-{run.kind}"
        run_dir.mkdir(parents=True, exist_ok=True)
        return self.store.update_run(run.id, run_dir=str(run_dir))

    def cancel(self, run_id: int) -> None:
        """Stop a run: a queued one never starts; a running one gets SIGTERM (it saves a
        checkpoint and exits), then SIGKILL after `grace_s` seconds."""
        run = self.store.get_run(run_id)
        with self._wake:
            if run.status not in ("queued", "running"):
                raise ValueError(f"run {run_id} is {run.status}: nothing to cancel")
            if run.status == "running" and self._current != run_id:
                raise ValueError(f"run {run_id} is not running in this job runner, so it cannot be cancelled here")
            self._cancel.add(run_id)
            proc = self._process if self._current == run_id else None
            self._wake.notify_all()
        if proc is not None and proc.poll() is None:
            _terminate(proc.pid, self.grace_s, wait=False, proc=proc)

    def wait(self, run_id: int, timeout: float | None = None):
        """Block until the run has ended and its results (and `on_end`) are through; returns it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            while run_id not in self._settled:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"run {run_id} still in flight after {timeout} s")
                self._wake.wait(min(1.0, left) if left is not None else 1.0)
        return self.store.get_run(run_id)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until no run is queued or running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.busy():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"jobs still in flight after {timeout} s")
            with self._wake:
                self._wake.wait(0.2)

    def progress(self, run_id: int) -> dict:
        """The job's status.json (state, step, total, progress), or {} before it writes one."""
        run = self.store.get_run(run_id)
        return read_status(Path(run.run_dir)) if run.run_dir else {}

    def busy(self) -> bool:
        with self._wake:
            if self._current is not None:
                return True
        return bool(self.store.list_runs(status="queued", limit=1))

    def in_flight(self, kinds: tuple[str, ...] | None = None) -> list:
        """Runs queued or running (of these kinds), oldest first."""
        # queued first: a run that starts between the two reads is in the second
        runs = self.store.list_runs(status="queued") + self.store.list_runs(status="running")
        latest = {r.id: r for r in runs}  # one that started between the reads is in both: keep the newer row
        return sorted((r for r in latest.values() if kinds is None or r.kind in kinds), key=lambda r: r.id)

    def shutdown(self, cancel_running: bool = True) -> None:
        """Stop taking jobs. The running job is cancelled (and waited for) unless `cancel_running`
        is False; queued runs stay queued for the next owner."""
        with self._wake:
            self._closed = True
            current, proc = self._current, self._process
            self._wake.notify_all()
        if cancel_running and current is not None and proc is not None and proc.poll() is None:
            self.cancel(current)
        self._worker.join(self.grace_s + 5 if cancel_running else 0.1)

    # ------------------------------------------------------------------ recovery

    def recover(self) -> int:
        """Runs a previous owner left 'running' are over: stop a job still alive; a trainer's run
        with a saved state is queued again to continue from it (`_run` adds --resume), any other is
        marked failed "interrupted" and `on_end` told. Returns how many."""
        stale = self.store.list_runs(status="running")
        for run in stale:
            pid = (run.outputs or {}).get("pid")
            if pid and alive(int(pid)):
                _terminate(int(pid), self.grace_s, wait=True)
            if run.kind in RESUMABLE and run.run_dir and saved_state(run.run_dir):
                with open(Path(run.run_dir) / "log.txt", "a", encoding="utf-8") as log:
                    log.write("\n--- the owner stopped; queued again to continue from the saved state ---\n")
                self.store.update_run(run.id, status="queued", outputs={"resume": True})
            else:
                self._finish(run.id, "failed", INTERRUPTED)
        return len(stale)

    # ------------------------------------------------------------------ worker

    def _next_queued(self):
        queued = self.store.list_runs(status="queued")
        return min(queued, key=lambda r: r.id) if queued else None

    def _work(self) -> None:
        while True:
            with self._wake:
                if self._closed:
                    return
            run = self._next_queued()
            if run is None:
                with self._wake:
                    if not self._closed:
                        self._wake.wait(self.poll_s * 4)
                continue
            try:
                self._run(run)
            except Exception as exc:  # the runner must survive anything a job does
                self._finish(run.id, "failed", f"job runner error: {type(exc).__name__}: {exc}")

    def _run(self, run) -> None:
        if run.id in self._cancel:
            self._finish(run.id, "cancelled", "cancelled before it started")
            return
        run = self._with_run_dir(run)
        run_dir = Path(run.run_dir)
        # 1. start the subprocess in its own process group (so cancel reaches its children too)
        launcher = self.launcher or launch_command(**run.config.get("launch", {}))
        cmd = [*launcher, run.kind, *run.config.get("args", []), "--out", str(run_dir)]
        cmd += ["--resume"] if (run.outputs or {}).get("resume") else []  # queued again by `recover`
        (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
        warm = self._warm is not None and tuple(launcher) == DEFAULT_LAUNCHER  # one process, python -m pipeline
        proc = self._start(cmd, run_dir / "log.txt", warm)
        with self._wake:
            self._process, self._current = proc, run.id
            cancelled_meanwhile = run.id in self._cancel
        start = "warm" if isinstance(proc, WarmProcess) else "cold"
        self.store.update_run(run.id, status="running", outputs={"pid": proc.pid, "start": start})
        if cancelled_meanwhile:  # cancelled between leaving the queue and starting
            _terminate(proc.pid, self.grace_s, wait=False, proc=proc)
        try:
            # 2. tail metrics and partial results while it runs
            tail, partial = MetricsTail(run_dir), ingest.Partial(self.store, run)
            while proc.poll() is None:
                self._tail(run, tail, partial)
                time.sleep(self.poll_s)
            self._tail(run, tail, partial)
            # 3. decide how it ended, 4. ingest its results
            rc, status = proc.returncode, read_status(run_dir)
            if run.id in self._cancel:
                self._finish(run.id, "cancelled", status.get("error") or "cancelled by the user")
            elif rc == 0 and status.get("state", "done") == "done":
                try:  # a failure here fails the run; each ingest step is one store transaction
                    outputs = ingest.finish(self.store, self.store.get_run(run.id), run_dir, partial)
                except Exception as exc:
                    self._finish(run.id, "failed", f"ingesting the results failed: {type(exc).__name__}: {exc}")
                else:
                    self._finish(run.id, "done", None, outputs)
            else:
                why = status.get("error") or (f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}")
                self._finish(run.id, "failed", f"{why}\n--- log tail ---\n{tail_text(run_dir / 'log.txt', 30)}")
        finally:
            with self._wake:
                self._process, self._current = None, None

    def _start(self, cmd: list[str], log_path: Path, warm: bool) -> subprocess.Popen | WarmProcess:
        """The job's process, in its own process group, writing into its log: forked from the warm
        process when `warm` (one process, `python -m pipeline`: warm.py) and it can, else started cold."""
        if warm:
            proc = self._warm.start(cmd[len(DEFAULT_LAUNCHER):], os.getcwd(), str(log_path), self.env)
            if proc is not None:
                return proc
        with open(log_path, "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.env, start_new_session=True)

    def _tail(self, run, tail: MetricsTail, partial) -> None:
        rows = tail.read()
        if rows:
            self.store.add_metrics(run.id, rows)
        partial.poll()

    def _finish(self, run_id: int, status: str, error: str | None, outputs: dict | None = None) -> None:
        run = self.store.update_run(run_id, status=status, error=error, outputs=outputs or {})
        try:
            if self.on_end is not None:
                self.on_end(self, run)
        except Exception:  # what comes next failed; the run itself is recorded as it ended
            traceback.print_exc()
        finally:
            with self._wake:
                self._settled.add(run_id)
                self._cancel.discard(run_id)
                self._wake.notify_all()


# ---------------------------------------------------------------------- processes


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _terminate(pid: int, grace_s: float, wait: bool, proc: subprocess.Popen | WarmProcess | None = None) -> None:
    """SIGTERM to the job's process group (it checkpoints and exits), SIGKILL after `grace_s`.
    `proc`: our own child (waited for through Popen, which reaps it); without it, a job of an
    earlier owner, watched until it is gone."""
    _signal_group(pid, signal.SIGTERM)

    def kill_later():
        if proc is not None:
            try:
                proc.wait(grace_s)
                return
            except subprocess.TimeoutExpired:
                pass
        else:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and alive(pid):
                time.sleep(0.1)
        _signal_group(pid, signal.SIGKILL)

    if wait:
        kill_later()
    else:
        threading.Thread(target=kill_later, daemon=True).start()


def tail_text(path: Path, lines: int) -> str:
    """The last `lines` lines of a log. tqdm redraws its line with carriage returns: each line
    shows its last state."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    rows = [line.rsplit("\r", 1)[-1] for line in text.rstrip("\n").split("\n")]
    return "\n".join(rows[-lines:])
