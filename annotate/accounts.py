"""Signing in: the password check behind Gradio's login, login throttling and session expiry (a
user's own password change is a handler: annotate/handlers.py `change_password`).

Gradio's login (`POST /login`) calls `password_check(ctx)` with the name and password, and on
success puts a random token in a cookie and `token -> name` in `App.tokens`; every later request
is resolved through `App.tokens.get(token)` (gradio/routes.py, get_current_user). Two hooks here:

- **Throttling** (`Throttle`): failures are counted per account name and per client address.
  After FREE_FAILURES failures for a name (FREE_FAILURES_PER_ADDRESS for an address, higher
  because many people may share one address behind a NAT) every further attempt waits an
  exponentially growing time (1 s, 2 s, 4 s, ... capped at LOCK_CAP_S) during which the login is
  refused with HTTP 429 and a message saying how long, without even checking the password.
  A success clears the name's count; the admin's Users table shows locked names and unlocks them.
  Once the app runs (`persist_in`), the counts are kept in the store too (store/sessions.py): a
  restart keeps every lock. The client address is the TCP peer (behind a reverse proxy that is
  the proxy: forwarded headers are not trusted).
- **Session expiry** (`Sessions`): `App.tokens` is replaced by a table that records when each
  token was issued and forgets it `max_age_s` later, so the cookie of a session older than
  `--session-hours` counts as signed out everywhere (pages show the login form again, API calls
  get 401), each session on its own clock. Deactivating an account or resetting its password
  ends its sessions at once (`Sessions.end`), and so does "Sign out" (`SessionsMiddleware`).
  With a store, each session is also kept there (the SHA-256 of its token), so a restart of the
  app, planned or after a crash, signs no one out: a token this process has not seen is looked
  up in the store. Ages are measured on the wall clock, the one clock a restart keeps.

Role and deactivation checks on every request stay in annotate/context.py (`user`, `admin`),
which builds on this module (it holds a `Throttle` and the `Sessions`); nothing here asks who
a request belongs to.
"""

from __future__ import annotations

import contextvars
import math
import secrets
import threading
import time

import anyio
from fastapi import HTTPException


FREE_FAILURES = 5
FREE_FAILURES_PER_ADDRESS = 30
LOCK_BASE_S = 1.0
LOCK_CAP_S = 15 * 60.0

# The address of the client whose request is being served, set by ClientAddress (an ASGI
# middleware) so that the password check, which Gradio calls with only a name and a password,
# can count failures per address.
CLIENT_ADDRESS: contextvars.ContextVar[str | None] = contextvars.ContextVar("client_address", default=None)


class ClientAddress:
    """ASGI middleware: puts the TCP peer's address in CLIENT_ADDRESS for the request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        token = CLIENT_ADDRESS.set((scope.get("client") or (None,))[0])
        try:
            await self.app(scope, receive, send)
        finally:
            CLIENT_ADDRESS.reset(token)


class Throttle:
    """Failed sign-ins per key ('name:<n>' or 'address:<a>'), and the lock they earn."""

    def __init__(self, *, free: int = FREE_FAILURES, free_per_address: int = FREE_FAILURES_PER_ADDRESS,
                 base_s: float = LOCK_BASE_S, cap_s: float = LOCK_CAP_S, clock=time.time):
        self.free, self.free_per_address, self.base_s, self.cap_s = free, free_per_address, base_s, cap_s
        self.clock = clock
        self._failures: dict[str, tuple[int, float]] = {}  # key -> (count, time of the last one)
        self._lock = threading.Lock()
        self.store = None

    def persist_in(self, store) -> None:
        """Keep the counts in `store` from now on, starting from those it kept (a restart's)."""
        with self._lock:
            self.store = store
            self._failures = {**store.login_failures(), **self._failures}

    def _wait(self, key: str, free: int, now: float) -> float:
        count, last = self._failures.get(key, (0, 0.0))
        if count < free:
            return 0.0
        return max(0.0, last + min(self.cap_s, self.base_s * 2 ** (count - free)) - now)

    def wait_s(self, name: str, address: str | None) -> tuple[float, str]:
        """(seconds until `name` from `address` may try again, what is locked); 0 = now."""
        now = self.clock()
        with self._lock:
            by_name = self._wait(f"name:{name}", self.free, now)
            by_address = self._wait(f"address:{address}", self.free_per_address, now) if address else 0.0
        if by_name >= by_address:
            return by_name, f"the account {name!r}"
        return by_address, f"your address ({address})"

    def failed(self, name: str, address: str | None) -> None:
        now = self.clock()
        with self._lock:
            self._forget_old(now)
            for key in (f"name:{name}",) + ((f"address:{address}",) if address else ()):
                count, _ = self._failures.get(key, (0, now))
                self._failures[key] = (count + 1, now)
                if self.store is not None:
                    self.store.set_login_failures(key, count + 1, now)

    def succeeded(self, name: str) -> None:
        self.unlock(name)

    def unlock(self, name: str) -> bool:
        """Clear `name`'s failures; True if it had any."""
        with self._lock:
            had = self._failures.pop(f"name:{name}", None) is not None
            if had and self.store is not None:
                self.store.clear_login_failures([f"name:{name}"])
            return had

    def locked_names(self) -> dict[str, float]:
        """name -> seconds its lock still lasts, for every name locked now."""
        now = self.clock()
        with self._lock:
            keys = [k for k in self._failures if k.startswith("name:")]
            waits = {k[5:]: self._wait(k, self.free, now) for k in keys}
        return {name: s for name, s in waits.items() if s > 0}

    def _forget_old(self, now: float) -> None:
        # Guessing random names must not grow the table for ever: a record whose lock (if any)
        # ended a cap ago is dropped.
        if len(self._failures) < 10_000:
            return
        old = [k for k, v in self._failures.items() if now - v[1] >= 2 * self.cap_s]
        for k in old:
            del self._failures[k]
        if self.store is not None:
            self.store.clear_login_failures(old)


class Sessions(dict):
    """Gradio's token -> name table (App.tokens) with an age limit per token, kept in `store` too
    (when given) so that a restart signs no one out.

    Gradio reads it with .get(token), `in`, [token], and iterates it on logout; an expired token
    disappears on its next read, whichever way it is read. The dict holds the sessions this
    process has seen; a token it has not seen is looked up in the store (a session from before a
    restart) and kept from then on."""

    def __init__(self, max_age_s: float, store=None, clock=time.time):
        super().__init__()
        self.max_age_s = max_age_s
        self.store = store
        self.clock = clock
        self._issued: dict[str, float] = {}
        self._lock = threading.Lock()
        if store is not None:
            store.expire_sessions(clock() - max_age_s)

    def __setitem__(self, token, name) -> None:
        issued = self.clock()
        with self._lock:
            self._issued[token] = issued
            super().__setitem__(token, name)
        if self.store is not None:
            self.store.add_session(token, name, issued)

    def _refresh(self, token) -> None:
        """Drop the token if it is too old; fetch it from the store if this process has not seen it."""
        if not isinstance(token, str):
            return
        issued = self._issued.get(token)
        if issued is None and self.store is not None:
            found = self.store.find_session(token)
            if found is not None:
                with self._lock:
                    super().__setitem__(token, found[0])
                    self._issued[token] = issued = found[1]
        if issued is not None and self.clock() - issued >= self.max_age_s:
            self._forget(token)

    def _forget(self, token) -> None:
        with self._lock:
            super().pop(token, None)
            self._issued.pop(token, None)
        if self.store is not None:
            self.store.end_session(token)

    def get(self, token, default=None):
        self._refresh(token)
        return super().get(token, default)

    def __getitem__(self, token):
        self._refresh(token)
        return super().__getitem__(token)

    def __contains__(self, token) -> bool:
        self._refresh(token)
        return super().__contains__(token)

    def __delitem__(self, token) -> None:
        self._forget(token)

    def end(self, name: str) -> int:
        """Sign `name` out everywhere now (also the sessions only the store knows, from before a
        restart); the number of sessions ended."""
        with self._lock:
            tokens = [t for t, n in self.items() if n == name]
            for t in tokens:
                super().pop(t, None)
                self._issued.pop(t, None)
        if self.store is None:
            return len(tokens)
        return self.store.end_sessions(name)


def cookie_id(store) -> str:
    """The id in the session cookie's name (Gradio's App.cookie_id, `access-token-<id>`), drawn
    once per store and kept in its settings, so that it outlives the process."""
    found = store.get_setting(COOKIE_ID_SETTING)
    if found:
        return found
    store.set_setting(COOKIE_ID_SETTING, secrets.token_urlsafe(16))
    return store.get_setting(COOKIE_ID_SETTING)


COOKIE_ID_SETTING = "session_cookie_id"


class SessionsMiddleware:
    """ASGI middleware that puts `ctx.sessions` in charge of Gradio's sign-ins, before any request
    is served:

    - on the first request, Gradio's App gets the store's session table as its token table
      (App.tokens) and the store's cookie id (App.cookie_id, `cookie_id`): Gradio makes both only
      when it starts serving, so installing them afterwards would leave a window in which a cookie
      from before a restart is not read (a client retrying at once would be signed out);
    - "Sign out" (Gradio's GET /logout, on every device) ends the user's sessions with
      `Sessions.end` before Gradio's route runs: Gradio's route walks App.tokens, which holds only
      the sessions this process has seen, and sessions from before a restart live in the store."""

    def __init__(self, app, ctx):
        self.app, self.ctx = app, ctx

    async def __call__(self, scope, receive, send):
        sessions = self.ctx.sessions
        served = scope.get("app")
        if scope["type"] in ("http", "websocket") and sessions is not None and served is not None:
            if served.tokens is not sessions:
                for token, name in list(served.tokens.items()):  # a sign-in before this (none, normally)
                    sessions[token] = name
                served.tokens = sessions
                served.cookie_id = self.ctx.cookie_id or served.cookie_id
            if scope["type"] == "http" and scope["path"].rstrip("/").endswith("/logout"):
                user = sessions.get(_cookies(scope).get(f"access-token-{served.cookie_id}")
                                    or _cookies(scope).get(f"access-token-unsecure-{served.cookie_id}"))
                if user is not None:
                    await anyio.to_thread.run_sync(sessions.end, user)
        await self.app(scope, receive, send)


def _cookies(scope) -> dict[str, str]:
    cookies = {}
    for key, value in scope.get("headers", []):
        if key == b"cookie":
            for part in value.decode("latin-1").split(";"):
                k, _, v = part.strip().partition("=")
                cookies[k] = v
    return cookies


def password_check(ctx):
    """The `auth` function given to Gradio's launch: throttled, and run in a worker thread (a
    scrypt check takes most of a second on purpose and must not stall the event loop)."""

    async def check(name: str, password: str) -> bool:
        address = CLIENT_ADDRESS.get()
        wait, what = ctx.throttle.wait_s(name, address)
        if wait > 0:
            # Gradio's login route lets this through as the response: 429 with the message.
            raise HTTPException(status_code=429, detail=(
                f"Too many failed sign-ins for {what}: try again in {math.ceil(wait)} s."))
        account = await anyio.to_thread.run_sync(ctx.store.authenticate, name, password)
        if account is None:
            ctx.throttle.failed(name, address)
            return False
        ctx.throttle.succeeded(name)
        return True

    return check
