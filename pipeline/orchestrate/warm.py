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

import atexit
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
import traceback
from pathlib import Path

from pipeline.rundir import read_status

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


VOLATILE = ("PYTEST_CURRENT_TEST",)
"""Environment variables that may differ between the jobs of one warm process (nothing reads them
at import): a job gets its own value of these, and must match the warm process's environment in
every other."""


def _same_environment(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in VOLATILE} == {k: v for k, v in b.items() if k not in VOLATILE}


def _become_job(request: dict) -> int | str:
    """In the forked child, after setsid: become `python -m pipeline ARGV` (module docstring).
    Returns its exit status, or "SIGINT" for an uncaught KeyboardInterrupt (which a new
    interpreter turns into a death by SIGINT)."""
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
    for key in VOLATILE:  # the rest of the environment is the warm process's own (start checks)
        if key in request["env"]:
            os.environ[key] = request["env"][key]
        else:
            os.environ.pop(key, None)
    if "numpy" in sys.modules:  # fresh entropy, as a new interpreter's (the fork reseeds Python's `random`)
        sys.modules["numpy"].random.seed()
    import pipeline.__main__ as cli

    sys.argv = [cli.__file__, *request["argv"]]
    try:
        return int(cli.run() or 0)
    except SystemExit as exc:  # as the interpreter turns it into an exit status
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return "SIGINT"
    except BaseException:  # noqa: BLE001  (printed as an uncaught exception is)
        traceback.print_exc()
        return 1


def _run_job(request: dict, ready: int) -> None:
    """The forked child's whole life: a session of its own (then tell the warm process, through
    `ready`, that a cancel can reach it), the job, and the end an interpreter has: non-daemon
    threads joined, exit functions run, streams flushed. Never returns."""
    code: int | str = 1
    try:
        os.setsid()
        os.write(ready, b"1")
        os.close(ready)
        code = _become_job(request)
    finally:
        try:
            threading._shutdown()  # what the interpreter does at exit: join non-daemon threads
            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            if code == "SIGINT":
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
        finally:
            os._exit(130 if code == "SIGINT" else code)


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


def _fork(request: dict) -> dict:
    """Fork the request's job; the answer once the child has its own session."""
    ready_r, ready_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(ready_r)
        os.close(ready_w)
        return {"id": request["id"], "error": f"fork failed: {exc}"}
    if pid == 0:
        os.close(ready_r)
        _run_job(request, ready_w)
    os.close(ready_w)
    os.read(ready_r, 1)  # the child's setsid is done (or it died: end of file)
    os.close(ready_r)
    return {"id": request["id"], "pid": pid}


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
        _reply(_fork(json.loads(line)))


# ---------------------------------------------------------------------- the runner's side


class WarmProcess:
    """A job forked by a warm process, seen as subprocess.Popen shows a child: pid, poll(),
    wait(timeout), returncode (negative: the signal that ended it)."""

    def __init__(self, pid: int, warm: "Warm", forker: subprocess.Popen, run_dir: Path):
        self.pid, self.returncode = pid, None
        self._warm, self._forker, self._run_dir = warm, forker, run_dir

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._warm.returncode(self.pid, self._forker, self._run_dir)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"job {self.pid}", timeout)
            self._warm.wait_for_exit(0.1)
        return self.returncode


_SHARED: "Warm | None" = None
_SHARED_LOCK = threading.Lock()


def shared_warm(env: dict, log: Path) -> "Warm":
    """The warm process of this owner process: one for every JobRunner of the process whose jobs
    get the same environment (a test session makes dozens of runners), started at the first job of
    any of them and ended when the owner process exits. A runner with another environment replaces
    it (at most one is kept). log: where it writes what it prints (the first runner's)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or not _same_environment(_SHARED.env, env):
            if _SHARED is not None:
                _SHARED.close()
            _SHARED = Warm(env, log)
        return _SHARED


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
        self._requests = 0
        self.refused: str | None = None
        """Why this machine starts every job cold (a GPU build of torch), once the warm process said so."""

    def start(self, argv: list[str], cwd: str, log: str, env: dict) -> WarmProcess | None:
        """Fork `python -m pipeline ARGV` from the warm process. None when nothing was started and
        the job may start cold: a GPU build of torch, another environment than the warm process
        imported under, no warm process, a failed fork. Raises RuntimeError when the warm process
        did not answer: a job may have started, so it must not start a second time."""
        if self.refused or not _same_environment(env, self.env):
            return None
        with self._lock:
            if not self._alive() and not self._spawn():
                return None
            self._requests += 1
            request = {"id": self._requests, "argv": list(argv), "cwd": cwd, "env": env, "log": log}
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
            except (OSError, ValueError):  # it died between the check and the write: nothing forked
                return None
            answer, forker = self._next_answer(self._requests, 30.0), self._proc
            if answer is None:
                self._kill()
                raise RuntimeError("the warm process did not answer a job's start (it was stopped); the job "
                                   "was not started again, to never run twice")
        if "pid" not in answer:
            return None  # the fork failed: nothing started
        return WarmProcess(int(answer["pid"]), self, forker, Path(log).parent)

    def returncode(self, pid: int, forker: subprocess.Popen, run_dir: Path) -> int | None:
        """The job's exit status once its warm process reported it. A job whose warm process died
        before reporting is judged, once it is gone, by its status file: 0 for 'done', 130 for
        'cancelled', else -9 (as killed)."""
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
        if forker.poll() is None or alive(pid):
            return None
        state = read_status(run_dir).get("state")
        return {"done": 0, "cancelled": 130}.get(state, -signal.SIGKILL)

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

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _spawn(self) -> bool:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self._changed:
            self._answers.clear()
        with open(self.log, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "pipeline.orchestrate.warm"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, env=self.env, text=True, bufsize=1,
                                    start_new_session=True)
        self._proc = proc
        threading.Thread(target=self._read, args=(proc,), name="warm-reader", daemon=True).start()
        first = self._next_answer(None, READY_TIMEOUT_S)
        if not first or not first.get("ready"):
            self.refused = (first or {}).get("why")
            self.close()
            self._proc = None
            return False
        return True

    def _next_answer(self, request_id: int | None, timeout: float) -> dict | None:
        """The answer to request `request_id` (None: the ready line); answers to earlier requests,
        late, are dropped."""
        deadline = time.monotonic() + timeout
        proc = self._proc
        with self._changed:
            while True:
                while self._answers:
                    answer = self._answers.pop(0)
                    if answer.get("id") == request_id:
                        return answer
                left = deadline - time.monotonic()
                if left <= 0 or proc.poll() is not None:
                    return None
                self._changed.wait(min(left, 0.5))

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue  # something a library printed while importing
            if not isinstance(message, dict):
                continue
            with self._changed:
                if "exit" in message:
                    self._exits[int(message["exit"])] = int(message["returncode"])
                else:
                    if "pid" in message and "id" in message:  # a new job: an old one's pid may be reused
                        self._exits.pop(int(message["pid"]), None)
                    self._answers.append(message)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie counts; another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    sys.exit(serve())
