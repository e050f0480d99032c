"""Named background tasks of the Train and Models tabs: a full loop round, a policy comparison.

A task is one daemon thread running a function; the UI polls `status()` with a gr.Timer. The
function reports progress through `task.update(done=, total=, detail=)`; its return value (or its
error) is kept for the page to show. At most one task of a name runs at a time, per app.

The tasks live on the app's context (`ctx.tasks`, a dict), never in module globals, so two apps in
one process (tests) do not share them.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable


@dataclass(frozen=True)
class TaskStatus:
    name: str
    label: str
    status: str
    """running | done | failed"""
    done: int = 0
    total: int = 0
    detail: str = ""
    error: str | None = None
    result: object = None
    started: float = field(default_factory=time.time)

    @property
    def running(self) -> bool:
        return self.status == "running"


class Task:
    def __init__(self, name: str, label: str, fn: Callable[["Task"], object]):
        self._lock = threading.Lock()
        self._status = TaskStatus(name, label, "running")
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"task-{name}", daemon=True)

    def start(self) -> "Task":
        self._thread.start()
        return self

    def status(self) -> TaskStatus:
        with self._lock:
            return self._status

    def update(self, **changes) -> None:
        with self._lock:
            self._status = replace(self._status, **changes)

    def wait(self, timeout: float | None = None) -> TaskStatus:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"task {self._status.name} still running after {timeout} s")
        return self.status()

    def _run(self, fn) -> None:
        try:
            result = fn(self)
            self.update(status="done", result=result)
        except Exception as exc:  # the task fails, the app stays up
            traceback.print_exc()
            self.update(status="failed", error=f"{type(exc).__name__}: {exc}", detail=str(exc)[:500])


def tasks_of(ctx) -> dict[str, Task]:
    """The app's task table (AppContext.tasks)."""
    return ctx.tasks


_START_LOCK = threading.Lock()


def start_task(ctx, name: str, label: str, fn: Callable[[Task], object]) -> Task:
    """Run `fn(task)` in the background as task `name`; RuntimeError while one of that name runs."""
    table = tasks_of(ctx)
    with _START_LOCK:
        current = table.get(name)
        if current is not None and current.status().running:
            raise RuntimeError(f"{current.status().label} is still running: wait for it to finish")
        table[name] = task = Task(name, label, fn).start()
    return task


def task_status(ctx, name: str) -> TaskStatus | None:
    task = tasks_of(ctx).get(name)
    return None if task is None else task.status()
