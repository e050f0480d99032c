"""The chat sampler as a real process (pipeline/chat_server.py) with the tiny model, and the app's
client of it (pipeline/orchestrate/chat.py ChatService) with a real store behind the Chat tab's
handlers (annotate/chat.py):

- an OpenAI-shaped chat-completions request answered with n distinct replies, seeded;
- refused without the token (401), over a length limit (400 naming the limit), and while another
  request runs on the model (429), or while the same annotator's is in flight (ChatBusy);
- a new active policy loaded by the same process before the next request;
- killed with SIGKILL, between requests or while answering one: started again, and the annotator
  told so, nothing stored; one that cannot start says why (its log), not that it restarted;
- a request not answered in time (the sampler stopped with SIGSTOP) stores nothing;
- an outside OpenAI-compatible server set by an admin (Data > Team, app.py --chat-url), nothing started.

Waits are on events the processes show (a status file, the sampler's CPU time), with generous
timeouts, not on sleeps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from annotate import chat
from annotate.context import AppContext
from annotate.handlers import Submission
from pipeline.config import ChatConfig, GenerateConfig, ModelConfig
from pipeline.orchestrate.chat import ChatBusy, ChatError, ChatService, ChatTimeout, ChatUnavailable, LocalSampler
from pipeline.rundir import read_status
from store import Store
from tests.helpers import free_port, req, tiny_settings, wait_for
from tests.tiny import save_tiny_model_dir

LOAD_S = 300.0
"""How long a sampler may take to start and load the tiny model on a loaded machine."""
LIMITS = ChatConfig(max_message_chars=200, max_conversation_chars=500, max_n=16, max_tokens=400)
GEN = GenerateConfig(max_new_tokens=8, temperature=1.0)
HELLO = [{"role": "user", "content": "How can I shop?"}]


def model_cfg(tiny_model_dir) -> ModelConfig:
    return ModelConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def sampler(tiny_model_dir, tmp_path_factory):
    """One chat-server process for the module's HTTP tests, ready."""
    local = LocalSampler(tmp_path_factory.mktemp("chat") / "0001-chat-server", ("", str(tiny_model_dir)),
                         model_cfg(tiny_model_dir), GEN, LIMITS)
    try:
        local.ready(LOAD_S)
        yield local
    finally:
        local.stop()


def post(local: LocalSampler, path: str, body: dict, token: str | None = None, timeout: float = 120.0):
    """(status, JSON body) of a POST to the sampler; token None: the sampler's own."""
    request = urllib.request.Request(local.endpoint.root + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {local.token if token is None else token}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ------------------------------------------------------------------------- the HTTP endpoint


def test_an_openai_request_gets_n_distinct_seeded_replies(sampler):
    status, answer = post(sampler, "/v1/chat/completions", {"model": sampler.endpoint.model, "messages": HELLO,
                                                           "n": 4, "max_tokens": 6, "seed": 7})
    assert status == 200 and answer["object"] == "chat.completion" and answer["model"] == sampler.endpoint.model
    texts = [c["message"]["content"] for c in answer["choices"]]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert len({t.strip() for t in texts}) == 4  # duplicates re-sampled, as generation does
    assert {c["message"]["role"] for c in answer["choices"]} == {"assistant"}
    assert {c["finish_reason"] for c in answer["choices"]} <= {"stop", "length"}
    assert answer["usage"]["completion_tokens"] <= 4 * 6 and answer["usage"]["prompt_tokens"] > 0
    # the same seed gives the same replies; the model list names what "model" must be
    assert [c["message"]["content"] for c in post(sampler, "/v1/chat/completions",
                                                  {"messages": HELLO, "n": 4, "max_tokens": 6, "seed": 7})[1]
            ["choices"]] == texts
    models = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(urllib.request.Request(
        sampler.endpoint.root + "/v1/models", headers={"Authorization": f"Bearer {sampler.token}"}), timeout=60)
    assert [m["id"] for m in json.loads(models.read())["data"]] == [sampler.endpoint.model]


def test_a_request_without_the_token_is_refused(sampler):
    for token in ("", "not-the-token-at-all"):
        status, answer = post(sampler, "/v1/chat/completions", {"messages": HELLO}, token=token)
        assert status == 401 and answer["error"]["type"] == "authentication_error"
    assert post(sampler, "/admin/reload", {"adapter": ""}, token="")[0] == 401


@pytest.mark.parametrize("messages, limit", [
    ([{"role": "user", "content": "x" * 201}], "max_message_chars"),
    ([{"role": "user", "content": "a" * 150}, {"role": "assistant", "content": "b" * 150},
      {"role": "user", "content": "c" * 150}, {"role": "assistant", "content": "d" * 150},
      {"role": "user", "content": "e"}], "max_conversation_chars"),
])
def test_a_message_or_conversation_over_its_limit_is_refused_naming_it(sampler, messages, limit):
    status, answer = post(sampler, "/v1/chat/completions", {"messages": messages, "n": 2})
    assert status == 400 and answer["error"]["code"] == limit and limit in answer["error"]["message"]
    # the app's client checks the same limits before it asks
    service = ChatService(None, "unused", limits=LIMITS)
    with pytest.raises(ChatError, match=limit):
        service.replies(1, messages, 2)
    status, answer = post(sampler, "/v1/chat/completions", {"messages": HELLO, "n": 17})
    assert status == 400 and answer["error"]["code"] == "max_n"


def test_a_second_request_while_one_samples_is_refused_at_once(sampler):
    process = psutil.Process(sampler.process.pid)
    cpu_before = sum(process.cpu_times()[:2])
    long = []  # the first request's (status, answer): 16 replies of up to 400 tokens, seconds of sampling

    def ask_long():
        long.append(post(sampler, "/v1/chat/completions", {"messages": HELLO, "n": 16, "max_tokens": 400, "seed": 1},
                         timeout=600))

    first = threading.Thread(target=ask_long)
    first.start()
    try:
        # the first request is on the model once the idle sampler starts computing
        wait_for(lambda: sum(process.cpu_times()[:2]) - cpu_before > 0.3, 120, "the sampler to compute", 0.02)
        refused_at = time.monotonic()
        status, answer = post(sampler, "/v1/chat/completions", {"messages": HELLO, "n": 1, "max_tokens": 1})
        assert status == 429 and answer["error"]["code"] == "busy"
        assert time.monotonic() - refused_at < 30  # answered at once, not after the first request
        assert first.is_alive()
    finally:
        first.join(600)
    status, answer = long[0]
    assert status == 200 and len(answer["choices"]) == 16


# ------------------------------------------------------------------------- the app's client


@pytest.fixture
def ctx(tmp_path, tiny_model_dir):
    """A store with an annotator and a ChatService on the tiny model (its sampler started by the
    first message), closed after the test."""
    store = Store(tmp_path / "db" / "rlhf.duckdb")
    store.add_annotator("ann", "password-ann")
    service = ChatService(store, tmp_path / "runs", timeout_s=120.0, start_timeout_s=LOAD_S,
                          model_cfg=model_cfg(tiny_model_dir), generate=GEN, limits=LIMITS)
    yield AppContext(store=store, auth=True, data_dir=tmp_path / "data", chat=service,
                     train_settings=tiny_settings(tiny_model_dir))
    service.close()
    store.close()


def stored(store: Store) -> tuple[int, int, int]:
    """(conversations, turns, responses) in the store."""
    counts = store.counts()
    return counts["conversations"], counts["conversation_turns"], counts["responses"]


def test_the_same_annotators_second_request_in_flight_is_refused(ctx):
    ann = ctx.store.find_annotator("ann").id
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.chat.replies(ann, HELLO, 2), done.set()), daemon=True).start()
    # the first request waits for the sampler to start and load the model: seconds at least
    wait_for(lambda: (ctx.chat.runs_dir / "chat").exists(), 60, "the sampler to be started")
    assert not done.is_set()
    with pytest.raises(ChatBusy, match="still being answered"):
        ctx.chat.replies(ann, HELLO, 2)
    assert done.wait(LOAD_S)
    assert len(ctx.chat.replies(ann, HELLO, 2).replies) == 2  # once answered, the next one runs


def test_a_killed_sampler_is_restarted_and_the_annotator_told(ctx):
    state, *_ = chat.send(ctx, None, "How can I shop?", req("ann"))
    assert len(state.showing.item.responses) == 4 and stored(ctx.store) == (1, 1, 4)
    first = ctx.chat.local.process
    state, status, *_ = chat.submit(ctx, rank_best_first(state), state, req("ann"))
    os.kill(first.pid, signal.SIGKILL)
    first.wait(60)
    state, status, body, message, *_ = chat.send(ctx, state, "And where?", req("ann"))
    assert state.error and "restarted" in state.note and "send your message again" in state.note
    assert "restarted" in status and message == "And where?"  # the message stays to send again
    assert stored(ctx.store) == (1, 1, 4) and ctx.chat.restarts == 1
    assert ctx.chat.local.process.pid != first.pid and ctx.chat.local.run_dir.name == "0002-chat-server"
    state, *_ = chat.send(ctx, state, "And where?", req("ann"))
    assert not state.error and state.turns == 2 and stored(ctx.store) == (1, 2, 8)


def test_a_sampler_killed_while_answering_is_restarted_and_the_request_says_so(ctx):
    ann = ctx.store.find_annotator("ann").id
    ctx.chat.replies(ann, HELLO, 2)  # started and warm
    process = psutil.Process(ctx.chat.local.process.pid)
    cpu_before = sum(process.cpu_times()[:2])
    ctx.chat.generate = dataclasses.replace(GEN, max_new_tokens=400)  # seconds of sampling
    failed = []

    def ask():
        try:
            ctx.chat.replies(ann, HELLO, 16)
        except ChatUnavailable as exc:
            failed.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    wait_for(lambda: sum(process.cpu_times()[:2]) - cpu_before > 0.3, 120, "the sampler to compute", 0.02)
    process.kill()
    asking.join(LOAD_S)
    (exc,) = failed
    assert exc.restarted and "killed by signal 9" in str(exc) and ctx.chat.restarts == 1
    ctx.chat.generate = GEN
    assert len(ctx.chat.replies(ann, HELLO, 2).replies) == 2  # the new sampler answers


def rank_best_first(state):
    """The Annotate panel's submission of the replies on screen in their display order."""
    k = len(state.showing.item.responses)
    return Submission(ranking=">".join(str(i + 1) for i in range(k)), all_bad=False, comment="",
                      token=state.showing.token, edit="", edit_from="")


def test_a_request_that_times_out_stores_nothing(ctx):
    ann = ctx.store.find_annotator("ann").id
    assert len(ctx.chat.replies(ann, HELLO, 2).replies) == 2  # started and warm; nothing stored by the client
    assert stored(ctx.store) == (0, 0, 0)
    ctx.chat.timeout_s = 2.0
    os.kill(ctx.chat.local.process.pid, signal.SIGSTOP)  # it accepts the connection and never answers
    try:
        with pytest.raises(ChatTimeout):
            ctx.chat.replies(ann, HELLO, 2)
        state, status, body, message, *_ = chat.send(ctx, None, "How can I shop?", req("ann"))
        assert state.error and "in time" in state.note and message == "How can I shop?"
        assert state.conversation_id is None and stored(ctx.store) == (0, 0, 0)
    finally:
        os.kill(ctx.chat.local.process.pid, signal.SIGCONT)
    ctx.chat.timeout_s = 120.0
    state, *_ = chat.send(ctx, state, "How can I shop?", req("ann"))
    assert not state.error and stored(ctx.store) == (1, 1, 4)


def test_a_new_active_policy_is_served_from_the_next_request(ctx, tmp_path):
    """The store's active policy changes (a round's new policy): the same sampler process loads
    it before the next request (POST /admin/reload) and names it in its answers."""
    ann = ctx.store.find_annotator("ann").id
    first = ctx.store.register_model_version("policy", "base", base_model=str(ctx.chat.model_cfg.model))
    ctx.store.set_active_policy(first.id)
    ctx.chat.replies(ann, HELLO, 2)
    process, served = ctx.chat.local.process, ctx.chat.local.endpoint.model
    other = save_tiny_model_dir(tmp_path / "other_policy", seed=1)
    v1 = ctx.store.register_model_version("policy", "v1", base_model=str(other))
    ctx.store.set_active_policy(v1.id)
    answer = ctx.chat.replies(ann, HELLO, 2)
    assert len(answer.replies) == 2 and answer.outside is None and answer.policy.id == v1.id  # who answered
    assert ctx.chat.local.process is process and ctx.chat.restarts == 0  # reloaded, not restarted
    assert ctx.chat.local.serving == ("", str(other)) and ctx.chat.local.endpoint.model != served
    assert read_status(ctx.chat.local.run_dir)["model"] == ctx.chat.local.endpoint.model


def test_an_outside_server_chosen_while_the_local_sampler_runs_stops_it(ctx, sampler):
    """An admin points the Chat tab at an outside server: the next request goes there, and the
    local sampler the service had started stops (its memory is the jobs' again)."""
    ann = ctx.store.find_annotator("ann").id
    ctx.chat.replies(ann, HELLO, 2)
    local = ctx.chat.local.process
    ctx.store.set_chat_settings(server_url=sampler.endpoint.root + "/v1", server_model=sampler.endpoint.model)
    ctx.chat.api_key = sampler.token
    answer = ctx.chat.replies(ann, HELLO, 2)
    assert len(answer.replies) == 2 and answer.outside.model == sampler.endpoint.model and answer.policy is None
    assert ctx.chat.local is None and local.poll() is not None


def test_the_server_a_message_is_sent_to_is_read_once_and_names_its_replies(ctx, sampler, monkeypatch):
    """An admin switches from an outside server back to the local sampler as a message is sent:
    the replies come from one of them, and are stored under the name of that one."""
    ctx.store.set_chat_settings(server_url=sampler.endpoint.root + "/v1", server_model=sampler.endpoint.model)
    ctx.chat.api_key = sampler.token
    setting, reads = ctx.store.chat_server, []

    def switched_once_read():
        found = setting()
        reads.append(found)
        if len(reads) == 1:
            ctx.store.set_chat_settings(server_url="")  # the admin's switch, just after the first read
        return found

    monkeypatch.setattr(ctx.store, "chat_server", switched_once_read)
    state, *_ = chat.send(ctx, None, "How can I shop?", req("ann"))
    assert not state.error and ctx.chat.local is None  # the outside server answered; no sampler started
    version = ctx.store.get_model_version(state.showing.item.model_version_id)
    assert version.kind == "external" and version.name == f"chat:{sampler.endpoint.model}"
    assert setting() == ("", "")  # the switch happened


def test_a_closed_service_starts_no_sampler(ctx):
    ctx.chat.close()
    with pytest.raises(ChatUnavailable, match="shut down"):
        ctx.chat.replies(1, HELLO, 2)
    assert not (ctx.chat.runs_dir / "chat").exists()


def test_an_outside_server_set_by_an_admin_is_asked_and_its_replies_stored_as_its_model(sampler, tmp_path):
    """Data > Team's chat server setting (or app.py --chat-url): the same client against any
    OpenAI-compatible server (here the tiny sampler, standing in for vLLM or llama.cpp's server);
    nothing is started, the replies name the server's model as an external version."""
    store = Store(tmp_path / "rlhf.duckdb")
    store.add_annotator("ann", "password-ann")
    store.add_annotator("boss", "password-boss", role="admin")
    service = ChatService(store, tmp_path / "runs", api_key=sampler.token, generate=GEN, limits=LIMITS)
    try:
        ctx = AppContext(store=store, auth=True, data_dir=tmp_path / "data", chat=service)
        url = sampler.endpoint.root + "/v1"
        dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
        assert "it does not answer now (cannot reach" in chat.save_settings(ctx, 4, 8, dead, "", req("boss"))
        assert "does not list the model 'other'" in chat.save_settings(ctx, 4, 8, url, "other", req("boss"))
        saved = chat.save_settings(ctx, 4, 8, url, sampler.endpoint.model, req("boss"))
        assert saved.endswith(f"(model {sampler.endpoint.model}): it answers ({sampler.endpoint.model}).")
        state, *_ = chat.send(ctx, None, "How can I shop?", req("ann"))
        item = state.showing.item
        assert len(item.responses) == 4 and not (tmp_path / "runs").exists()
        version = store.get_model_version(item.model_version_id)
        assert version.kind == "external" and version.name == f"chat:{sampler.endpoint.model}"
        wrong = ChatService(store, tmp_path / "runs", api_key="wrong-key", limits=LIMITS)
        with pytest.raises(ChatError, match="401"):
            wrong.replies(1, HELLO, 2)
    finally:
        service.close()
        store.close()


def test_a_sampler_that_cannot_start_says_why(tmp_path):
    """A model folder that does not load: the start's failure and its log are shown, not a restart."""
    service = ChatService(None, tmp_path / "runs", start_timeout_s=LOAD_S,
                          model_cfg=ModelConfig(model=str(tmp_path / "no-such-model"), device="cpu"), generate=GEN)
    try:
        with pytest.raises(ChatUnavailable, match="did not start") as raised:
            service.replies(1, HELLO, 2)
        assert not raised.value.restarted and service.restarts == 0
    finally:
        service.close()
