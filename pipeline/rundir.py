"""The run directory: the only thing a job writes, and what the store's owner process reads.

Every stage (generate, train-reward, ppo) writes the same three files, so one job runner can
watch any of them (DESIGN.md, Process model):

    config.json     the configuration the run started with
    status.json     {"state", "step", "total", "progress", "updated_at", "error", ...},
                    rewritten whole (tmp + rename) so a reader never sees half a file
    metrics.jsonl   one JSON object per step: {"step": n, "namespace/key": value, ...}

Writers use `write_json`, `write_status` and `append_metrics` (and `truncate_metrics` when a run
resumes from a checkpoint); the job runner reads with `read_status` and `MetricsTail`, and
`saved_state` tells it whether a stopped trainer left a state that `--resume` continues (STATE_FILE,
in the run folder or, for PPO, in its checkpoint folder). A trainer
installs a `StopFlag`: SIGTERM (the job runner's cancel) or Ctrl-C only set a flag that the loop
checks between phases, so a cancel never interrupts a write. A job learns which process owns it
from $`OWNER_ENV`, and stops when that process dies.

In a job of N processes (pipeline/distributed.py) only rank 0 writes: `set_writer(False)` on the
other ranks makes write_json, write_status, append_metrics and truncate_metrics do nothing.

Experiment tracking: a trainer's CLI calls `open_tracker(out, args.report_to)` once before it
trains; append_metrics then also writes each line as TensorBoard scalars in RUN_DIR/tensorboard/,
and truncate_metrics marks a resume there (pipeline/tracking.py).

This module imports neither torch nor tensorboard: the app process reads run directories through it.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from pipeline.tracking import EVENTS_DIR, REPORT_TO, TensorBoardWriter

OWNER_ENV = "RLHF_LOOP_OWNER_PID"
"""Set in every job's environment (pipeline/orchestrate/jobs.py): the pid of the process that owns
the store. A job whose owner has died stops itself (pipeline/__main__.py `watch_owner`), so a
killed app leaves no job running unseen. Here, the module both sides import, so the CLI reads it
without importing the job runner."""

STATE_FILE = "trainer_state.pt"
"""A trainer's optimiser, scheduler and step (pipeline/lifecycle.py `save_state`), for --resume."""


def saved_state(run_dir: str | Path) -> bool:
    """Whether a trainer's run folder holds a state to continue from with --resume."""
    return any((Path(run_dir) / sub / STATE_FILE).is_file() for sub in ("", "checkpoint"))

STATES = ("running", "done", "failed", "cancelled")

_WRITER = True  # False on ranks other than 0 of a multi-process job
_TRACKERS: dict[Path, TensorBoardWriter] = {}  # run directory -> its event writer (open_tracker)


def set_writer(enabled: bool) -> None:
    """Whether this process writes the run directory (pipeline.distributed.setup sets it)."""
    global _WRITER
    _WRITER = bool(enabled)


def is_writer() -> bool:
    return _WRITER


def write_json(path: Path, data: dict) -> None:
    """Write whole or not at all: a tailing reader never sees half a file."""
    if not _WRITER:
        return
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str), encoding="utf-8")
    os.replace(tmp, path)


def write_status(out: Path, state: str, step: int, total: int, error: str | None = None, **extra) -> None:
    """status.json: `progress` is step / total in [0, 1]."""
    if state not in STATES:
        raise ValueError(f"status state must be one of {STATES}, not {state!r}")
    if not _WRITER:
        return
    write_json(Path(out) / "status.json", {
        "state": state, "step": int(step), "total": int(total),
        "progress": round(step / total, 4) if total else 0.0,
        "updated_at": time.time(), "error": error, **extra})


def open_tracker(out: Path, report_to: str = "tensorboard") -> None:
    """Track the run in `out`: from now on append_metrics also writes TensorBoard events there
    ('none': only metrics.jsonl). Nothing is written (or imported) before the first metrics line,
    so a trainer calls this before setting up its processes; ranks other than 0 never write."""
    if report_to not in REPORT_TO:
        raise ValueError(f"--report-to {report_to!r}: use one of {', '.join(REPORT_TO)}")
    key = Path(out).resolve()
    previous = _TRACKERS.pop(key, None)
    if previous is not None:
        previous.close()
    if report_to == "tensorboard":
        _TRACKERS[key] = TensorBoardWriter(key / EVENTS_DIR)


def close_trackers() -> None:
    """Close every event file (at exit; each step is flushed as it is written anyway)."""
    while _TRACKERS:
        _TRACKERS.popitem()[1].close()


atexit.register(close_trackers)


def append_metrics(out: Path, step: int, metrics: dict) -> None:
    """One line per step; non-finite numbers are written as null (JSON has no NaN). With a
    tracker open for `out`, the same values as TensorBoard scalars at the same step."""
    if not _WRITER:
        return
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    with open(Path(out) / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": int(step), **clean}) + "\n")
    tracker = _TRACKERS.get(Path(out).resolve())
    if tracker is not None:
        tracker.scalars(step, clean)


def truncate_metrics(out: Path, step: int) -> None:
    """Keep the metric lines up to `step`: a run resumed from the checkpoint of `step` logs the
    steps after it again. A line cut short by a kill is dropped. With a tracker open, its new event
    file starts at step + 1, which hides the earlier files' events from there on (tracking.py)."""
    path = Path(out) / "metrics.jsonl"
    if not _WRITER:
        return
    tracker = _TRACKERS.get(Path(out).resolve())
    if tracker is not None:
        tracker.begin(step + 1)
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            continue
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    os.replace(tmp, path)


def read_status(out: Path) -> dict:
    """The run's status.json, or {} when it does not exist yet (or is being replaced)."""
    try:
        return json.loads((Path(out) / "status.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


class MetricsTail:
    """Reads metrics.jsonl incrementally: each `read()` returns the (step, key, value) rows of the
    complete lines appended since the last call (a half-written last line waits for the next)."""

    def __init__(self, out: Path):
        self.path = Path(out) / "metrics.jsonl"
        self.offset = 0

    def read(self) -> list[tuple[int, str, float | None]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        rows = []
        for line in chunk[:end].splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            step = int(record.pop("step", 0))
            for key, value in record.items():
                if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                    rows.append((step, key, None if value is None else float(value)))
        return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write whole or not at all (tmp name, then rename): a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: Path, check: Callable[[object], None] | None = None) -> list[dict]:
    """Every row of a JSON Lines file (blank lines skipped). A line that is not JSON, or whose row
    check(row) refuses with a ValueError, is a ValueError naming the file and the line number."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {n}: not valid JSON ({exc.msg})") from None
            if check is not None:
                try:
                    check(row)
                except ValueError as exc:
                    raise ValueError(f"{path}, line {n}: {exc}") from None
            rows.append(row)
    return rows


class Cancelled(Exception):
    """SIGTERM or Ctrl-C arrived; the run stops at its next safe point."""


class StopFlag:
    """SIGTERM/SIGINT set `signal` (the signal's name); the loop calls `check()` (raises Cancelled)
    or reads `signal` between phases. A second Ctrl-C (SIGINT) stops at once (KeyboardInterrupt);
    a repeated SIGTERM is the same cancel: a launcher (torchrun, accelerate launch) forwards the
    SIGTERM its process group received to its workers, which then get it twice.

        with StopFlag() as stop:
            ...
            stop.check()
    """

    def __init__(self):
        self.signal: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopFlag":
        if threading.current_thread() is threading.main_thread():  # handlers only in the main thread
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> bool:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        return False

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            if signum == signal.SIGTERM:
                return
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def check(self) -> None:
        if self.signal is not None:
            raise Cancelled(f"cancelled by {self.signal}")


def run_job(out: Path, body: Callable[[Callable[[int, int, str], None]], None]) -> int:
    """The life of a one-process job that is not a trainer (compare, sample-versions) in run
    directory `out`: status.json 'running', then `body(on_progress)`, whose
    on_progress(done, total, detail) records progress and is where SIGTERM or Ctrl-C cancels it.
    Returns the exit status: 0 'done'; 1 'failed' with the error for what bad input raises
    (ValueError, RuntimeError, FileNotFoundError), printed; 130 'cancelled'. Anything else is
    recorded as failed, then raised."""
    out.mkdir(parents=True, exist_ok=True)
    write_status(out, "running", 0, 0, phase="loading")
    progress = {"step": 0, "total": 0}
    try:
        with StopFlag() as stop:
            def on_progress(done: int, total: int, detail: str) -> None:
                progress.update(step=done, total=total)
                write_status(out, "running", done, total, phase=detail)
                stop.check()

            body(on_progress)
    except (Cancelled, KeyboardInterrupt) as exc:
        write_status(out, "cancelled", **progress, error=str(exc) or "interrupted")
        print(f"cancelled: {exc}", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        write_status(out, "failed", **progress, error=f"{type(exc).__name__}: {exc}")
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:
        write_status(out, "failed", **progress, error=f"{type(exc).__name__}: {exc}")
        raise
    write_status(out, "done", progress["total"], progress["total"])
    return 0
