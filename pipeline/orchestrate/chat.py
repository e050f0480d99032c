"""Replies while an annotator waits: the app's side of the chat sampler.

`ChatService.replies(user_id, messages, n)` returns an `Answer`: n `Reply`s to a conversation (its
last message the user's) and who gave them, read once for the request; or it raises a `ChatError`
whose message can be shown to the annotator as it is. It asks an OpenAI-compatible
chat-completions endpoint (POST /v1/chat/completions with `n`):

- with no `url`, the local sampler (`python -m pipeline chat-server`, pipeline/chat_server.py),
  which this module starts at the first request like a job (its own process and session, its
  run folder `RUNS_DIR/chat/NNNN-chat-server/` with log.txt, command.txt and status.json, the
  owner's pid in RLHF_LOOP_OWNER_PID so it stops when the app dies) and which serves the store's
  active policy: a change of the active policy reloads it (POST /admin/reload) before the next
  request. Its token is drawn here (secrets) and passed in its environment, never on its command
  line. A sampler found dead is started again and the request answered `ChatUnavailable` with
  `restarted` set ("... restarted: send the message again"): the annotator, not this module,
  decides to ask again, so no one waits a model load without being told why;
- when the store names an outside server (Store.chat_server: the base URL of vLLM, llama.cpp's
  server, TGI ..., e.g. http://host:8000/v1, and a model name, set in the Team tab or by app.py
  --chat-url), that server, with `api_key`. This module starts nothing then (and stops a local
  sampler it had started); clearing the setting goes back to the local sampler.

One request per annotator at a time: a second one while theirs is in flight raises `ChatBusy` at
once. The local sampler answers one request at a time (429 to another): the request is tried again
until it runs or `timeout_s` is over (`ChatBusy`). A request not answered within `timeout_s`
raises `ChatTimeout` and returns nothing (its sampling may run on in the sampler; the next request
waits for it as for any other). The first request also waits for the model to load, up to
`start_timeout_s`. Replies repeated in one answer are asked again, as generation re-samples
duplicates (the local sampler has done so already).

Nothing here writes to the store: what becomes of the replies is the caller's. This module
imports neither torch nor the store; the app process uses it and loads no model.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from formats.chat import conversation_problem, server_url_problem
from pipeline.config import ChatConfig, GenerateConfig, ModelConfig, to_cli_args
from pipeline.orchestrate.jobs import DEFAULT_LAUNCHER, tail_text
from pipeline.rundir import OWNER_ENV, read_status

TOKEN_ENV = "RLHF_LOOP_CHAT_TOKEN"
"""Where the chat-server reads its token (pipeline/chat_server.py TOKEN_ENV)."""
API_KEY_ENV = "RLHF_LOOP_CHAT_API_KEY"
"""Where the app reads an outside server's API key (app.py --chat-url): not on a command line,
which every user of the machine can read, nor in the store, whose backups and exports travel."""
RETRY_S = 0.25
"""The wait before a request the sampler refused as busy (429) is tried again."""
CHECK_S = 5.0
"""How long an admin waits, on saving an outside server, to hear whether it answers."""
DYING_S = 5.0
"""How long a sampler whose connection broke may take to be seen ended: a killed process closes
its sockets before its parent can reap it, so the client learns of the death first."""


class ChatError(Exception):
    """Why no replies came, in words for the annotator."""


class ChatBusy(ChatError):
    """A request is in flight already (the annotator's own, or the sampler stayed busy with others')."""


class ChatTimeout(ChatError):
    """No answer within the timeout: nothing came back, nothing is to be stored."""


class ChatUnavailable(ChatError):
    """The sampler cannot answer now. `restarted`: it had stopped and was started again."""

    def __init__(self, message: str, restarted: bool = False):
        super().__init__(message)
        self.restarted = restarted


class _Refused(Exception):
    """The endpoint answered 429: busy, try again."""


@dataclass(frozen=True)
class Reply:
    text: str
    finish_reason: str
    """'stop' (the model ended it) or 'length' (cut at max_tokens), as OpenAI names them."""


@dataclass(frozen=True)
class Answer:
    """One request's replies and who gave them, as read when the request was sent: `outside`, the
    outside server the store named, or (None) the local sampler serving `policy`, the store's
    active policy then (None as well on a store without one: the configured base model)."""

    replies: list[Reply]
    outside: "Endpoint | None" = None
    policy: object = None
    """store.ModelVersion | None (this module does not import the store)"""


# --------------------------------------------------------------------------- one endpoint


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: its root URL (the part before /v1), key and model name."""

    root: str
    api_key: str
    model: str

    @classmethod
    def from_url(cls, url: str, api_key: str, model: str) -> "Endpoint":
        """`url` as OpenAI clients take a base URL (http://host:8000/v1); '/v1' may be left off."""
        problem = server_url_problem(url)
        if problem:
            raise ChatUnavailable(problem)
        parts = urllib.parse.urlsplit(url.strip())
        path = parts.path.rstrip("/")
        return cls(f"{parts.scheme}://{parts.netloc}{path[:-3] if path.endswith('/v1') else path}", api_key, model)

    def ask(self, path: str, body: dict | None, deadline: float) -> dict:
        """The JSON answer to POST root + path (GET when body is None), by `deadline`
        (time.monotonic) or ChatTimeout; 429 -> _Refused; another error status -> ChatError with
        the server's message."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChatTimeout("no answer in time")
        request = urllib.request.Request(self.root + path, data=None if body is None else json.dumps(body).encode(),
                                         method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {self.api_key}"})
        host = urllib.parse.urlsplit(self.root).hostname
        opener = _DIRECT if host in ("127.0.0.1", "localhost", "::1") else _DEFAULT  # no proxy for loopback
        try:
            with opener.open(request, timeout=left) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 429:
                raise _Refused() from None
            raise ChatError(f"the chat server refused the request ({exc.code}): {_error_text(exc)}") from None
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:  # URLError is an OSError
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise ChatTimeout("no answer in time") from None
            raise ChatUnavailable(f"cannot reach the chat server at {self.root}: {reason}") from None


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_DEFAULT = urllib.request.build_opener()


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read())
        return str(body["error"]["message"] if isinstance(body.get("error"), dict) else body.get("error", body))
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return exc.reason or "no reason given"


def served_models(endpoint: Endpoint, deadline: float) -> list[str]:
    """The model ids the server lists (GET /v1/models, OpenAI's shape), or a ChatError."""
    answer = endpoint.ask("/v1/models", None, deadline)
    try:
        return [str(m["id"]) for m in answer["data"]]
    except (KeyError, TypeError) as exc:
        raise ChatError(f"the chat server's model list is not OpenAI's (no {exc})") from None


def completion(endpoint: Endpoint, messages: list[dict], n: int, gen: GenerateConfig, deadline: float) -> list[Reply]:
    """n replies in one chat-completions request, tried again while the server says it is busy;
    fewer when the server gives fewer choices."""
    body = {"model": endpoint.model, "messages": messages, "n": n, "max_tokens": gen.max_new_tokens,
            "temperature": gen.temperature, "top_p": gen.top_p}
    while True:
        try:
            answer = endpoint.ask("/v1/chat/completions", body, deadline)
            break
        except _Refused:
            if time.monotonic() + RETRY_S >= deadline:
                raise ChatBusy("the sampler stayed busy with other requests: try again in a moment") from None
            time.sleep(RETRY_S)
    try:
        return [Reply(str(c["message"]["content"] or ""), str(c.get("finish_reason") or "stop"))
                for c in answer["choices"]]
    except (KeyError, TypeError) as exc:
        raise ChatError(f"the chat server's answer is not a chat completion (no {exc})") from None


# --------------------------------------------------------------------------- the local sampler


class LocalSampler:
    """One chat-server process, started at construction: `ready` waits for it, `alive` watches it."""

    def __init__(self, run_dir: Path, serving: tuple[str, str], model_cfg: ModelConfig, gen: GenerateConfig,
                 limits: ChatConfig):
        """serving: (adapter folder or '', base model) of the active policy."""
        self.run_dir, self.serving = run_dir, serving
        self.token = secrets.token_urlsafe(32)
        run_dir.mkdir(parents=True, exist_ok=True)
        adapter, base = serving
        cmd = [*DEFAULT_LAUNCHER, "chat-server", "--out", str(run_dir), "--adapter", adapter,
               *to_cli_args(limits), *to_cli_args(gen),
               *to_cli_args(dataclasses.replace(model_cfg, model=base or model_cfg.model))]
        (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               OWNER_ENV: str(os.getpid()), TOKEN_ENV: self.token}
        with open(run_dir / "log.txt", "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, start_new_session=True)
        self.endpoint: Endpoint | None = None

    def alive(self) -> bool:
        return self.process.poll() is None

    def ends_within(self, seconds: float) -> bool:
        """Whether the process has ended, or ends within `seconds`."""
        try:
            self.process.wait(seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def ended(self) -> str:
        """How the process ended, in words."""
        rc = self.process.poll()
        return f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exit code {rc}"

    def ready(self, timeout_s: float) -> Endpoint:
        """Its endpoint once it has loaded the model and listens; ChatUnavailable if it ends first
        or takes longer than timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self.endpoint is None:
            status = read_status(self.run_dir)
            if status.get("ready") and status.get("port"):
                self.endpoint = Endpoint(f"http://127.0.0.1:{status['port']}", self.token, status["model"])
            elif not self.alive():
                raise ChatUnavailable(f"the sampler did not start ({self.ended()}):\n"
                                      f"{tail_text(self.run_dir / 'log.txt', 12)}")
            elif time.monotonic() > deadline:
                raise ChatUnavailable(f"the sampler did not load its model within {timeout_s:.0f} s "
                                      f"(its log: {self.run_dir / 'log.txt'})")
            else:
                time.sleep(0.1)
        return self.endpoint

    def reload(self, serving: tuple[str, str], deadline: float) -> None:
        """Serve another policy: POST /admin/reload, tried again while a request runs."""
        while True:
            try:
                answer = self.endpoint.ask("/admin/reload", {"adapter": serving[0], "base_model": serving[1]}, deadline)
                break
            except _Refused:
                if time.monotonic() + RETRY_S >= deadline:
                    raise ChatBusy("the sampler stayed busy and could not switch to the new policy: "
                                   "try again in a moment") from None
                time.sleep(RETRY_S)
        self.serving, self.endpoint = serving, Endpoint(self.endpoint.root, self.token, answer["model"])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to its process group, SIGKILL after grace_s; waited for."""
        if self.alive():
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()


# --------------------------------------------------------------------------- the service


class ChatService:
    """Replies for annotators (the module docstring). Thread-safe: one per app."""

    def __init__(self, store, runs_dir: str | Path, *, api_key: str = "", timeout_s: float = 60.0,
                 start_timeout_s: float = 300.0, model_cfg: ModelConfig | None = None,
                 generate: GenerateConfig | None = None, limits: ChatConfig | None = None):
        """store: where the active policy and the outside server setting are read (None: serve
        model_cfg's base model); api_key: the outside server's key (never stored); model_cfg: how
        the local sampler loads the policy (device, dtype, the base model), as jobs do; generate:
        how replies are sampled (the round's GenerateConfig: max_new_tokens, temperature, top_p),
        also sent to an outside server; limits: the conversation limits, checked here before any
        request, and the local sampler's."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, not {timeout_s}")
        self.store, self.runs_dir = store, Path(runs_dir)
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.model_cfg, self.generate = model_cfg or ModelConfig(), generate or GenerateConfig()
        self.limits = limits or ChatConfig()
        self.api_key = api_key
        self.local: LocalSampler | None = None
        self.restarts = 0
        self._in_flight: set = set()
        self._lock = threading.Lock()  # guards _in_flight
        self._server_lock = threading.Lock()  # one start, restart or reload at a time
        self._closed = False

    def replies(self, user_id, messages: list[dict], n: int) -> Answer:
        """n replies to `messages` and who gave them, or a ChatError (module docstring)."""
        if not 1 <= n <= self.limits.max_n:
            raise ChatError(f"n = {n}: ask for 1 to {self.limits.max_n} replies (max_n)")
        problem = conversation_problem(messages, self.limits)
        if problem:
            raise ChatError(problem[0])
        with self._lock:
            if user_id in self._in_flight:
                raise ChatBusy("your last message is still being answered: wait for its replies")
            self._in_flight.add(user_id)
        try:
            endpoint, outside, policy = self._endpoint()  # the first request waits for the model's load first
            try:
                return Answer(self._distinct(endpoint, messages, n, time.monotonic() + self.timeout_s), outside, policy)
            except ChatUnavailable:
                self._restart_if_dead()  # it died while answering: say it was restarted instead
                raise
        finally:
            with self._lock:
                self._in_flight.discard(user_id)

    def outside(self) -> Endpoint | None:
        """The outside server the store's setting names (Store.chat_server), None for the local sampler."""
        url, model = self.store.chat_server() if self.store is not None else ("", "")
        return Endpoint.from_url(url, self.api_key, model) if url else None

    def check_outside(self, timeout_s: float = CHECK_S) -> str:
        """In words, whether the outside server the store names answers and serves its model (GET
        /v1/models within timeout_s), as an admin is told on saving it; '' with no outside server."""
        outside = self.outside()
        if outside is None:
            return ""
        try:
            models = served_models(outside, time.monotonic() + timeout_s)
        except ChatError as exc:
            return f"it does not answer now ({exc})"
        if outside.model and outside.model not in models:
            return f"it answers, but does not list the model {outside.model!r} (it lists {', '.join(models) or 'none'})"
        return f"it answers ({', '.join(models) or 'no models listed'})"

    def close(self) -> None:
        """Stop the local sampler (the service then starts none again)."""
        with self._server_lock:
            self._closed = True
            if self.local is not None:
                self.local.stop()

    # -- inside

    def _distinct(self, endpoint: Endpoint, messages: list[dict], n: int, deadline: float) -> list[Reply]:
        """n replies with no two the same text (stripped), asking again for the missing ones (an
        outside server may give fewer choices or repeat itself) up to max_resample times."""
        replies, seen = [], set()
        for _ in range(1 + self.generate.max_resample):
            for reply in completion(endpoint, messages, n - len(replies), self.generate, deadline):
                if reply.text.strip() not in seen and len(replies) < n:
                    seen.add(reply.text.strip())
                    replies.append(reply)
            if len(replies) == n:
                break
        return replies

    def _active(self):
        """The store's active policy (store.ModelVersion), None without one (or without a store)."""
        return self.store.active_policy() if self.store is not None else None

    def _serving(self, active) -> tuple[str, str]:
        """(adapter folder or '', base model) of the policy `active`; the configured base model for None."""
        if active is None:
            return "", self.model_cfg.model
        return active.path or "", active.base_model or self.model_cfg.model

    def _endpoint(self) -> tuple[Endpoint, Endpoint | None, object]:
        """Where to send the request, with who answers there (Answer's outside and policy), each
        setting read once: the local sampler is started, restarted or reloaded to serve it."""
        outside = self.outside()
        with self._server_lock:
            if self._closed:
                raise ChatUnavailable("the chat service is shut down")
            if outside is not None:
                if self.local is not None:  # an admin chose an outside server: free the local one's memory
                    self.local.stop()
                    self.local = None
                return outside, outside, None
            active = self._active()
            want = self._serving(active)
            if self.local is None:
                self.local = self._start(want)
            elif not self.local.alive():
                self._restart()
            endpoint = self.local.ready(self.start_timeout_s)
            if self.local.serving != want:
                self.local.reload(want, time.monotonic() + self.timeout_s)
                endpoint = self.local.endpoint
            return endpoint, None, active

    def _restart_if_dead(self) -> None:
        """After a request could not reach the local sampler: restart it if it ended (DYING_S)."""
        with self._server_lock:
            if self.local is not None and not self._closed and self.local.ends_within(DYING_S):
                self._restart()

    def _restart(self) -> None:
        """Start a new sampler in place of one that ended, and tell the caller."""
        why = self.local.ended()
        self.local.stop()
        self.local = self._start(self._serving(self._active()))
        self.restarts += 1
        raise ChatUnavailable(f"The sampler stopped ({why}) and has been restarted; it is loading the model: "
                              "send your message again in a moment.", restarted=True)

    def _start(self, serving: tuple[str, str]) -> LocalSampler:
        chat_dir = self.runs_dir / "chat"
        chat_dir.mkdir(parents=True, exist_ok=True)
        number = 1 + max((int(p.name.split("-", 1)[0]) for p in chat_dir.iterdir()
                          if p.name.split("-", 1)[0].isdigit()), default=0)
        return LocalSampler(chat_dir / f"{number:04d}-chat-server", serving, self.model_cfg, self.generate,
                            self.limits)
