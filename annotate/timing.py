"""Where an action's time goes on the server: the per-phase breakdown bench/ui_bench.py prints.

Off unless the app is started with `--timings FILE` (then `AppContext.timings` is a `Timings`, and
the app writes every sample to FILE as JSON when it stops). Off, each hook below is one attribute
test. An action of a browser tab or of gradio_client (Submit, Skip, ...) goes through these phases,
each recorded per action with the wall-clock time it ended:

    join      POST /queue/join inside the server: the request read, the event queued, its id sent
    queued    from the join's response to our handler starting: Gradio's queue, its worker thread,
              preprocessing the inputs
    handler   our function (annotate/bind.py), of which
      account   the account look-up (annotate/context.py `user`)
      store     the store call that writes (a submit's transaction with the next lease)
    deliver   from our handler returning to the result's SSE message leaving the server:
              postprocessing the outputs and the send
    server    join's start to deliver's end: all of the above

`prefetch` (the next item fetched in the background after an action; not on any action's path,
but competing for the same CPU) is recorded too. The client's share of a round trip is what it
measures minus `server`. Actions are matched to their requests by Gradio's session hash (one per
open tab or client, with at most one action in flight at a time, as in the app's own pages).
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qs

import gradio as gr

MAX_SAMPLES = 500_000
"""Samples kept (about 40 MB of JSON at most); later ones are counted but dropped."""

class Timings:
    """Samples (phase, seconds, wall-clock end) from the request path, thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.samples: list[tuple[str, float, float]] = []
        self.dropped = 0
        self._joined: dict[str, tuple[float, float]] = {}  # session -> (join start, join end), perf_counter
        self._handled: dict[str, float] = {}  # session -> our handler's end (perf_counter)

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            if len(self.samples) < MAX_SAMPLES:
                self.samples.append((phase, seconds, time.time()))
            else:
                self.dropped += 1

    # -- the hooks (each called from one place)

    def joined(self, session: str, start: float, end: float) -> None:
        """POST /queue/join of `session` took start..end (TimingMiddleware)."""
        self.add("join", end - start)
        with self._lock:
            self._joined[session] = (start, end)

    @contextmanager
    def handler(self, session: str | None):
        """Around our handler (annotate/bind.py)."""
        start = time.perf_counter()
        with self._lock:
            joined = self._joined.get(session) if session else None
        if joined is not None:
            self.add("queued", start - joined[1])
        try:
            yield
        finally:
            end = time.perf_counter()
            self.add("handler", end - start)
            if joined is not None:
                with self._lock:
                    self._handled[session] = end

    def delivered(self, session: str) -> None:
        """The result of `session`'s action left the server (TimingMiddleware)."""
        now = time.perf_counter()
        with self._lock:
            handled = self._handled.pop(session, None)
            joined = self._joined.pop(session, None)
        if handled is not None and joined is not None:
            self.add("deliver", now - handled)
            self.add("server", now - joined[0])

    # -- the file

    def write(self, path: str | Path) -> None:
        with self._lock:
            data = {"samples": self.samples, "dropped": self.dropped}
            Path(path).write_text(json.dumps(data))


@contextmanager
def span(ctx, phase: str):
    """Time a part of the work (a no-op when the app's timings are off)."""
    timings = getattr(ctx, "timings", None)
    if timings is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        timings.add(phase, time.perf_counter() - start)


def session_of(args, kwargs) -> str | None:
    """The Gradio session hash of a handler call (from its gr.Request argument), if any."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, gr.Request) and value.session_hash:
            return value.session_hash
    return None


class TimingMiddleware:
    """ASGI middleware that reports the join and delivery of each queued action to a Timings."""

    JOIN, DATA = "/queue/join", "/queue/data"

    def __init__(self, app, timings: Timings):
        self.app, self.timings = app, timings

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope.get("type") == "http" else ""
        if path.endswith(self.JOIN):
            return await self._join(scope, receive, send)
        if path.endswith(self.DATA):
            session = parse_qs(scope.get("query_string", b"").decode()).get("session_hash", [None])[0]
            if session:
                return await self._data(session, scope, receive, send)
        return await self.app(scope, receive, send)

    async def _join(self, scope, receive, send):
        start = time.perf_counter()
        body = bytearray()

        async def reading():
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
            return message

        try:
            await self.app(scope, reading, send)
        finally:
            try:
                session = json.loads(bytes(body)).get("session_hash")
            except (ValueError, AttributeError):
                session = None
            if session:
                self.timings.joined(session, start, time.perf_counter())

    async def _data(self, session, scope, receive, send):
        async def sending(message):
            await send(message)
            if message["type"] == "http.response.body" and b'"process_completed"' in message.get("body", b""):
                self.timings.delivered(session)

        await self.app(scope, receive, sending)
