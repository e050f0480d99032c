"""The resident chat sampler: `python -m pipeline chat-server`, a policy answering while a person waits.

Every other model runs in a job that ends (docs/DESIGN.md, Process model); a conversation cannot
wait for a job's start and model load at every turn, so this stage loads the policy once and
answers on a loopback port until it is stopped, in the shape of OpenAI's chat-completions API
(the same client then talks to vLLM, llama.cpp's server or TGI instead, pipeline/orchestrate/chat.py):

    POST /v1/chat/completions  {"model", "messages": [{"role", "content"}, ...], "n", "max_tokens",
                                "temperature", "top_p", "seed"}   -> a chat.completion with n choices
    GET  /v1/models            the one model it serves (its id is what "model" must name)
    POST /admin/reload         {"adapter": a policy folder or "", "base_model": ...} -> serve another
                               policy (not part of OpenAI's API: the endpoints above stay as theirs)

The n replies are sampled as a round's generation samples its K responses (pipeline/responses.py
`generate_responses`: the chat template with SYSTEM_PROMPT, duplicates re-sampled), with the
stage's GenerateConfig options as defaults that a request's max_tokens, temperature, top_p and seed
override; a request without a seed gets a fresh one. One request runs on the model at a time: one
that comes while another runs (or a reload) is answered 429 at once, so a caller never waits
unseen. ChatConfig sets the port and the limits a request must keep (400 naming the limit).

Security: it listens on 127.0.0.1 only, and every request must carry `Authorization: Bearer
TOKEN`, the token whoever starts it draws and passes in $RLHF_LOOP_CHAT_TOKEN (an environment is
readable by its own user only; a command line by everyone). Without a token it does not start.

Its run folder holds config.json, log.txt (when started by the app) and status.json: state
'running' with ready false while it loads, then ready true, the port and the model's id.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import json
import os
import random
import secrets
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from formats.chat import conversation_problem
from pipeline.config import ChatConfig, GenerateConfig, ModelConfig, add_arguments, from_args, to_dict
from pipeline.policy import sampling_policy
from pipeline.responses import generate_responses
from pipeline.rows_first import rows_first
from pipeline.rundir import write_json, write_status
from pipeline.text import prompt_token_ids

TOKEN_ENV = "RLHF_LOOP_CHAT_TOKEN"
"""The environment variable that carries the bearer token every request must show."""
HOST = "127.0.0.1"
MAX_BODY_BYTES = 1 << 20
FINISH = {"eos": "stop", "length": "length"}
"""Our finish reasons as OpenAI names them."""


class RequestError(Exception):
    """A request refused, as an HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


# --------------------------------------------------------------------------- a request, checked


def checked_messages(body: dict, limits: ChatConfig) -> list[dict]:
    """The request's messages as {role, content} (OpenAI's other message fields, such as "name",
    dropped), within the limits, the last one the user's (formats/chat.py conversation_problem)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RequestError(400, "messages must be a non-empty list of {role, content}", "messages")
    turns = [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m for m in messages]
    problem = conversation_problem(turns, limits)
    if problem:
        raise RequestError(400, problem[0], "messages", problem[1])
    return turns


def _number(body: dict, key: str, kind, low, high, default):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise RequestError(400, f"{key} must be {'an integer' if kind is int else 'a number'}, not {value!r}", key)
    if not low <= value <= high:
        limit = f"max_{key}" if key in ("n", "max_tokens") else None  # the ChatConfig limit it passed
        raise RequestError(400, f"{key} = {value} is outside {low}..{high}" + (f" (the limit {limit})" if limit else ""),
                           key, limit)
    return kind(value)


def sampling_of(body: dict, limits: ChatConfig, defaults: GenerateConfig) -> GenerateConfig:
    """The GenerateConfig of one request: the stage's, with the request's n, max_tokens,
    temperature, top_p and seed (a fresh seed when it gives none)."""
    seed = _number(body, "seed", int, 0, 2**63 - 1, None)
    return dataclasses.replace(
        defaults,
        k=_number(body, "n", int, 1, limits.max_n, 1),
        max_new_tokens=_number(body, "max_tokens", int, 1, limits.max_tokens, defaults.max_new_tokens),
        temperature=_number(body, "temperature", float, 0.0, 2.0, defaults.temperature),
        top_p=_number(body, "top_p", float, 1e-6, 1.0, defaults.top_p),
        seed=random.SystemRandom().randrange(2**31) if seed is None else seed)


# --------------------------------------------------------------------------- the model


class Sampler:
    """The policy served and the lock that keeps one request at a time on it."""

    def __init__(self, model_cfg: ModelConfig, gen_cfg: GenerateConfig, limits: ChatConfig):
        self.model_cfg, self.gen_cfg, self.limits = model_cfg, gen_cfg, limits
        self.busy = threading.Lock()
        self.policy = self.tokenizer = None
        self.model_id, self.adapter = "", ""

    def load(self, adapter: str, base_model: str = "") -> None:
        """Serve `adapter` (a policy folder; "" = the base model `base_model`, else the stage's)."""
        cfg = dataclasses.replace(self.model_cfg, model=base_model or self.model_cfg.model)
        policy, tokenizer, model_id = sampling_policy(adapter, cfg)
        rows_first(policy, self.limits.max_n)  # K replies decode K rows: the faster product for them
        self.policy, self.tokenizer, self.model_id, self.adapter = policy, tokenizer, model_id, adapter
        print(f"serving {model_id}", flush=True)

    def complete(self, body: dict) -> dict:
        """A chat.completion for a checked request (the caller holds `busy`)."""
        model = body.get("model")
        if model not in (None, "", self.model_id):
            raise RequestError(404, f"the model {model!r} is not served here; this sampler serves {self.model_id!r} "
                               "(GET /v1/models)", "model", "model_not_found")
        messages = checked_messages(body, self.limits)
        cfg = sampling_of(body, self.limits, self.gen_cfg)
        try:
            prompt_tokens = len(prompt_token_ids(self.tokenizer, messages, cfg.max_prompt_tokens))
            gens = generate_responses(self.policy, self.tokenizer, [messages], cfg.k, cfg)[0]
        except ValueError as exc:
            raise RequestError(400, str(exc), "messages") from None
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_id, "seed": cfg.seed,
            "choices": [{"index": i, "message": {"role": "assistant", "content": g.text},
                         "finish_reason": FINISH.get(g.finish_reason, g.finish_reason)} for i, g in enumerate(gens)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": sum(len(g.token_ids) for g in gens),
                      "total_tokens": prompt_tokens + sum(len(g.token_ids) for g in gens)}}


# --------------------------------------------------------------------------- HTTP


class Handler(BaseHTTPRequestHandler):
    """One request: the token first, then the route. The sampler is `self.server.sampler`."""

    server_version = "rlhf-loop-chat"  # HTTP/1.0: a connection per request, closed after its answer

    def do_GET(self):  # noqa: N802 (http.server's names)
        self._answer(lambda: self._models() if self.path.rstrip("/") == "/v1/models" else self._unknown())

    def do_POST(self):  # noqa: N802
        routes = {"/v1/chat/completions": self._complete, "/admin/reload": self._reload}
        self._answer(routes.get(self.path.rstrip("/"), self._unknown))

    def _answer(self, route) -> None:
        try:
            self._check_token()
            status, body = 200, route()
        except RequestError as exc:
            status, body = exc.status, exc.body()
        except Exception as exc:  # noqa: BLE001  (the server outlives a failed request; the log has why)
            self.log_error("request failed: %s: %s", type(exc).__name__, exc)
            status, body = 500, RequestError(500, f"the sampler failed: {type(exc).__name__}: {exc}").body()
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _check_token(self) -> None:
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.server.token}".encode()):
            raise RequestError(401, "a valid 'Authorization: Bearer <token>' header is required")

    def _body(self) -> dict:
        try:
            size = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise RequestError(400, "Content-Length is not a number") from None
        if size > MAX_BODY_BYTES:
            raise RequestError(400, f"the request body has {size} bytes: the limit is {MAX_BODY_BYTES}")
        try:
            body = json.loads(self.rfile.read(size) or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"the request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        return body

    def _busy(self):
        """The sampler's lock, or 429 when a request (or a reload) holds it."""
        sampler = self.server.sampler
        if not sampler.busy.acquire(blocking=False):
            raise RequestError(429, "the sampler is answering another request; try again when it is done",
                               code="busy")
        return sampler

    def _complete(self) -> dict:
        body = self._body()
        sampler = self._busy()
        try:
            return sampler.complete(body)
        finally:
            sampler.busy.release()

    def _reload(self) -> dict:
        body = self._body()
        adapter, base = body.get("adapter", ""), body.get("base_model", "")
        if not isinstance(adapter, str) or not isinstance(base, str):
            raise RequestError(400, "adapter and base_model must be text (a folder, or '')", "adapter")
        sampler = self._busy()
        try:
            sampler.load(adapter, base)
        except (OSError, ValueError) as exc:
            raise RequestError(400, f"cannot load {adapter or base!r}: {exc}; still serving {sampler.model_id!r}",
                               "adapter") from None
        finally:
            sampler.busy.release()
        write_status(self.server.out, "running", 0, 0, ready=True, port=self.server.server_port,
                     model=sampler.model_id, adapter=sampler.adapter, pid=os.getpid())
        return {"model": sampler.model_id, "adapter": sampler.adapter}

    def _models(self) -> dict:
        return {"object": "list", "data": [{"id": self.server.sampler.model_id, "object": "model",
                                            "created": int(self.server.started), "owned_by": "rlhf-loop"}]}

    def _unknown(self) -> dict:
        raise RequestError(404, f"no route {self.command} {self.path}")

    def log_message(self, fmt, *args):  # into the run's log, with the time
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} {fmt % args}\n")


def serve(sampler: Sampler, token: str, port: int, out: Path) -> ThreadingHTTPServer:
    """The HTTP server on 127.0.0.1:port (0 = any free port), not yet serving."""
    server = ThreadingHTTPServer((HOST, port), Handler)
    server.daemon_threads = True
    server.sampler, server.token, server.out, server.started = sampler, token, out, time.time()
    return server


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline chat-server", description=(
        f"Serve a policy as an OpenAI chat-completions endpoint on {HOST}; the bearer token comes "
        f"from ${TOKEN_ENV}."))
    parser.add_argument("--out", required=True, help="run directory (created): status.json with the port, its log")
    parser.add_argument("--adapter", default="", help="a policy folder saved by save_policy ('' = the base model)")
    add_arguments(parser, ChatConfig)
    add_arguments(parser, GenerateConfig)
    add_arguments(parser, ModelConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    token = os.environ.pop(TOKEN_ENV, "")  # nothing this process starts inherits it
    if len(token) < 16:
        print(f"error: set ${TOKEN_ENV} to a token of at least 16 characters (e.g. python -c "
              "'import secrets; print(secrets.token_urlsafe())'); the sampler never answers without one")
        return 2
    limits, gen_cfg, model_cfg = from_args(ChatConfig, args), from_args(GenerateConfig, args), from_args(ModelConfig, args)
    write_status(out, "running", 0, 0, ready=False, pid=os.getpid())
    write_json(out / "config.json", {"stage": "chat-server", "adapter": args.adapter, "chat": to_dict(limits),
                                     "generate": to_dict(gen_cfg), "model_config": to_dict(model_cfg)})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a stop (or the owner's death) ends serve_forever
    try:
        sampler = Sampler(model_cfg, gen_cfg, limits)
        sampler.load(args.adapter)
        server = serve(sampler, token, limits.port, out)
    except (OSError, ValueError, RuntimeError) as exc:
        write_status(out, "failed", 0, 0, error=f"{type(exc).__name__}: {exc}")
        print(f"error: {exc}")
        return 1
    write_status(out, "running", 0, 0, ready=True, port=server.server_port, model=sampler.model_id,
                 adapter=sampler.adapter, pid=os.getpid())
    print(f"listening on http://{HOST}:{server.server_port}/v1", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except (SystemExit, KeyboardInterrupt):
        pass
    finally:
        server.server_close()
        write_status(out, "done", 0, 0)
    # its files are written: skip the interpreter's teardown, whose collection of torch's objects
    # took 30 s on a loaded 2-core machine, and which a stop (the app's close) would wait for
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
