"""Warm starts: a job's process forked from one that has already imported torch and transformers.

A cold job (`python -m pipeline STAGE ...`) spends its first seconds importing torch, transformers,
peft and accelerate, and building transformers' lazy modules at its first model load: about 3 s of
CPU on a fast 2-core machine, 7 s on a slow one, more than many of the app's jobs compute (a chunk
of responses, a short evaluation). So the JobRunner keeps one *warm* process beside it
(`python -m pipeline.orchestrate.warm`, started with the first job): it imports all of that once
and computes nothing (no thread pool, no CUDA), and for each job forks a child that becomes the
job just as `python -m pipeline STAGE ARGS` would be: its own session (process group, so a cancel
reaches it and its children), working directory, environment, stdout and stderr into the job's
log, stdin from /dev/null, default signal handlers, argv, and exit status. This is how PyTorch's
DataLoader starts its workers: a fork of a process that has imported torch.

The warm process reaps its children and reports their exit statuses; the runner sees a job
through `WarmProcess`, which answers as subprocess.Popen does (pid, poll, wait, returncode).
Requests and answers are JSON lines on the warm process's stdin and stdout:

    -> {"argv": [...], "cwd": ..., "env": {...}, "log": path}    <- {"pid": N} or {"error": ...}
                                                                  <- {"exit": N, "returncode": rc}

What starts cold instead (a fresh `python -m pipeline`): a job of several processes (torchrun,
accelerate launch), a runner given its own launcher, a CUDA build of torch (CUDA does not survive
a fork), and any job while the warm process cannot start or has died (the next job tries again).
A warm job runs the code the warm process imported: after updating the code, restart the app (as
the app's own code needs anyway).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

READY_TIMEOUT_S = 120.0
"""How long the runner waits for a new warm process to import everything (seconds)."""


# ---------------------------------------------------------------------- the warm process


PRELOAD = ("accelerate", "peft", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.elastic",
           "torch.distributed.fsdp", "transformers.generation.utils", "transformers.modeling_utils",
           "transformers.models.auto.configuration_auto", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.models.llama.modeling_llama")
"""What transformers, peft and torch import lazily at a job's first model load (about 1,600 modules)."""


def preload() -> None:
    """Import what a job imports before it computes: PRELOAD and every stage's module."""
    import pipeline.__main__ as cli

    for name in (*PRELOAD, *(target.partition(":")[0] for target in cli.STAGES.values())):
        importlib.import_module(name)


def _become_job(request: dict) -> int:
    """In the forked child: become `python -m pipeline ARGV` (module docstring); returns its exit status."""
    os.setsid()
    _name_process(f"job {request['argv'][0] if request['argv'] else ''}")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a new interpreter
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(request["cwd"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(stdin)
    os.close(log)
    # new file objects on the new descriptors, unbuffered as the runner's PYTHONUNBUFFERED asks
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # fresh entropy, as a new interpreter's (the fork reseeds Python's `random`)
        sys.modules["numpy"].random.seed()
    import pipeline.__main__ as cli

    sys.argv = [cli.__file__, *request["argv"]]
    try:
        code = cli.run()
    except SystemExit as exc:  # as the interpreter turns it into an exit status
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001  (printed as an uncaught exception would be)
        import traceback

        traceback.print_exc()
        code = 1
    return int(code or 0)


def _name_process(name: str) -> None:
    """The name `top` and `ps -o comm` show (15 bytes; Linux): a forked job keeps the warm
    process's command line, so its name says which stage it runs."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _reap() -> None:
    """Report every child that has ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply({"exit": pid, "returncode": os.waitstatus_to_exitcode(status)})


def serve() -> int:
    """The warm process: import everything, say so, then fork a job per request until stdin closes
    (the runner has gone; its jobs carry on, each watching the store's owner itself)."""
    import torch

    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        _reply({"ready": False, "why": "a GPU build of torch: jobs start cold (CUDA does not survive a fork)"})
        return 0
    preload()
    _reply({"ready": True, "pid": os.getpid()})
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the owner's terminal is the owner's
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.2)
        _reap()
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return 0
        request = json.loads(line)
        try:
            pid = os.fork()
        except OSError as exc:
            _reply({"error": f"fork failed: {exc}"})
            continue
        if pid == 0:  # the child: never returns into this loop
            code = 1
            try:
                code = _become_job(request)
            finally:
                _exit(code)
        _reply({"pid": pid})


def _exit(code: int) -> None:
    """The end of a forked job, as the interpreter ends: other threads joined, exit functions run,
    streams flushed; then the process exits without unwinding into the warm process's loop."""
    import atexit

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


# ---------------------------------------------------------------------- the runner's side


class WarmProcess:
    """A job forked by the warm process, seen as subprocess.Popen shows a child: pid, poll(),
    wait(timeout), returncode (negative: the signal that ended it)."""

    def __init__(self, pid: int, warm: "Warm"):
        self.pid, self._warm, self.returncode = pid, warm, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._warm.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"job {self.pid}", timeout)
            self._warm.wait_for_exit(0.1)
        return self.returncode


_SHARED: dict[tuple, "Warm"] = {}
_SHARED_LOCK = threading.Lock()


def shared_warm(env: dict, log: Path) -> "Warm":
    """The warm process of this owner process for jobs with environment `env`: one for every
    JobRunner of the process that gives its jobs that environment (a test session makes many
    runners), started at the first job of any of them, ended when the owner process exits.
    log: where it writes what it prints (the first runner's)."""
    key = tuple(sorted(env.items()))
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = Warm(env, log)
        return _SHARED[key]


class Warm:
    """A runner's handle on a warm process: started at the first job, asked to fork each
    one-process job, restarted after it died. Thread-safe."""

    def __init__(self, env: dict, log: Path):
        self.env, self.log = dict(env), log
        """The environment every job gets (the warm process imports under it), and the warm
        process's own log (what it printed while importing)."""
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._exits: dict[int, int] = {}
        self._answers: list[dict] = []
        self.refused: str | None = None
        """Why this machine starts every job cold (a GPU build of torch), once the warm process said so."""

    def start(self, argv: list[str], cwd: str, log: str, env: dict) -> WarmProcess | None:
        """Fork `python -m pipeline ARGV` from the warm process; None when it cannot (the job then
        starts cold): no warm process, another environment than the one it imported under."""
        if self.refused or env != self.env:
            return None
        with self._lock:
            if not self._alive() and not self._spawn():
                return None
            answer = self._ask({"argv": list(argv), "cwd": cwd, "env": env, "log": log})
        if not answer or "pid" not in answer:
            return None
        return WarmProcess(int(answer["pid"]), self)

    def returncode(self, pid: int) -> int | None:
        """The job's exit status once the warm process reported it; a job whose warm process died
        before reporting counts as killed (-9) once it is gone."""
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
            dead = self._proc is None or self._proc.poll() is not None
        if dead and not _alive(pid):
            return -signal.SIGKILL
        return None

    def wait_for_exit(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait(timeout)

    def close(self) -> None:
        """Stop the warm process (its running jobs carry on)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()
                proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()

    # -- inside

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _spawn(self) -> bool:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "pipeline.orchestrate.warm"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, env=self.env, text=True, bufsize=1,
                                    start_new_session=True)
        self._proc = proc
        threading.Thread(target=self._read, args=(proc,), name="warm-reader", daemon=True).start()
        first = self._next_answer(READY_TIMEOUT_S)
        if not first or not first.get("ready"):
            self.refused = (first or {}).get("why")
            self.close()
            self._proc = None
            return False
        return True

    def _ask(self, request: dict) -> dict | None:
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):
            return None
        return self._next_answer(30.0)

    def _next_answer(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self._answers:
                left = deadline - time.monotonic()
                if left <= 0 or self._proc is None or (self._proc.poll() is not None and not self._answers):
                    return None
                self._changed.wait(min(left, 0.5))
            return self._answers.pop(0)

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue  # something a library printed while importing
            with self._changed:
                if "exit" in message:
                    self._exits[int(message["exit"])] = int(message["returncode"])
                else:
                    self._answers.append(message)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    sys.exit(serve())
