"""Chat-tab handlers (annotate/chat.py) with a real store: a turn on screen is resumed from the
store, ranked with the Annotate tab's ranking string and own answer, and the conversation goes on
from the chosen reply; roles and the missing sampler are refused on the server."""

from __future__ import annotations

import gradio as gr
import pytest

from annotate import chat
from annotate.context import AppContext, Refused
from annotate.handlers import Submission
from store import Store
from tests.helpers import req


@pytest.fixture
def ctx(tmp_path):
    s = Store(tmp_path / "db" / "rlhf.duckdb")
    s.add_annotator("ann", "password-ann")
    s.add_annotator("boss", "password-boss", role="admin")
    yield AppContext(store=s, auth=True, data_dir=tmp_path / "data")
    s.close()


def test_a_stored_turn_is_resumed_ranked_with_an_own_answer_and_continued(ctx):
    ann = ctx.store.find_annotator("ann")
    policy = ctx.store.register_model_version("policy", "base", base_model="tiny")
    first = [{"role": "user", "content": "Name a fruit."}]
    turn = ctx.store.add_chat_turn(ann.id, None, first, policy.id, ["Apple.", "Pear.", "A rock."])
    state, status, body, *_ = chat.open_chat(ctx, None, req("ann"))
    assert state.showing.item.item_id == turn.item_id and 'data-k="3"' in body and "1</b> of 8 turns" in status
    shown = [r.text for r in state.showing.item.responses]
    pos = {text: i + 1 for i, text in enumerate(shown)}
    form = Submission(ranking=f"4>{pos['Pear.']}>{pos['Apple.']}>{pos['A rock.']}", all_bad=False, comment="",
                      token=state.showing.token, edit="A ripe pear.", edit_from=str(pos["Pear."]))
    state, status, body, *_ = chat.submit(ctx, form, state, req("ann"))
    assert state.showing is None and state.messages[-1] == {"role": "assistant", "content": "A ripe pear."}
    assert "your answer" in status and "A ripe pear." in body
    with pytest.raises(gr.Error, match="without a chat sampler"):  # this app has no ChatService
        chat.sampling(ctx, state, "And a vegetable?", req("ann"))
    assert ctx.store.counts()["pairs"] == 3 + 3  # the replies' pairs and the own answer's


def test_end_and_settings_are_checked_on_the_server(ctx):
    with pytest.raises(gr.Error, match="no conversation to end"):
        chat.end(ctx, None, req("ann"))
    with pytest.raises(Refused):
        chat.save_settings(ctx, 2, 3, "", "", req("ann"))
    assert "2 replies per turn, 3 turns" in chat.save_settings(ctx, 2, 3, "", "", req("boss"))
    with pytest.raises(gr.Error, match="Not saved"):
        chat.save_settings(ctx, 1, None, "", "", req("boss"))


def test_an_outside_server_setting_is_checked_and_saved_whole_or_not_at_all(ctx):
    with pytest.raises(gr.Error, match="'localhost:8000' is not an http"):  # no scheme: named, nothing saved
        chat.save_settings(ctx, 3, 5, "localhost:8000", "m", req("boss"))
    assert (ctx.store.chat_replies(), ctx.store.chat_max_turns(), ctx.store.chat_server()) == (4, 8, ("", ""))
    saved = chat.save_settings(ctx, 3, 5, " http://gpu-box:8000/v1 ", "llama", req("boss"))
    assert "replies from http://gpu-box:8000/v1 (model llama)" in saved
    assert chat.settings_form(ctx, req("boss")) == (3, 5, "http://gpu-box:8000/v1", "llama")
    chat.save_settings(ctx, 3, 5, "", "llama", req("boss"))  # blank: back to the local sampler
    assert ctx.store.chat_server() == ("", "") and chat.settings_form(ctx, req("boss"))[2:] == ("", "")
