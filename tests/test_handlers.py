"""The app's handlers without a browser: every annotate and admin action against a real store, with
a stand-in request carrying the user name (what Gradio's login puts on gr.Request)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from annotate import admin, admin_users, bootstrap, handlers, model_admin, render
from annotate.context import AppContext, Refused, served_copy
from annotate.handlers import parse_ranking
from annotate.state import Showing
from store import RankingIn, Store
from tests.fixtures_store import open_copy, seed_items
from tests.helpers import req


@pytest.fixture(scope="module")
def accounts_db(tmp_path_factory) -> Path:
    """A closed store file holding the three accounts (scrypt hashing them once, not per test)."""
    path = tmp_path_factory.mktemp("accounts") / "rlhf.duckdb"
    with Store(path) as s:
        s.add_annotator("boss", "boss-password", role="admin")
        s.add_annotator("ann", "ann-password")
        s.add_annotator("bea", "bea-password")
    return path


@pytest.fixture
def ctx(accounts_db, tmp_path):
    """A fresh copy of the accounts store per test: boss (admin), ann and bea (annotators)."""
    s = open_copy(accounts_db, tmp_path / "db")
    yield AppContext(store=s, auth=True, data_dir=tmp_path / "data")
    s.close()


def show(ctx, name="ann"):
    """Page load for `name`: (state, item_html)."""
    state, html, *_ = handlers.load(ctx, None, req(name))
    return state, html


def positions_to_ids(state, ranking):
    ids = state.current.item.display_order
    return [[ids[p - 1] for p in g] for g in parse_ranking(ranking, len(ids))]


# --------------------------------------------------------------------------- ranking strings


@pytest.mark.parametrize("text, k, all_bad, expected", [
    ("2>1=3>4", 4, False, [[2], [1, 3], [4]]),
    ("3>1", 3, False, [[3], [1], [2]]),  # the one left goes last
    (" 1 > 2 ", 2, False, [[1], [2]]),
    ("", 3, True, [[1, 2, 3]]),  # all bad, nothing ranked: all tied
    ("2", 4, True, [[2], [1, 3, 4]]),  # all bad: the unranked tie at the bottom
])
def test_parse_ranking(text, k, all_bad, expected):
    assert parse_ranking(text, k, all_bad) == expected


@pytest.mark.parametrize("text, k, message", [
    ("1>2", 4, "Rank all 4 responses"),
    ("1>5>2>3", 4, "only 4 responses"),
    ("1>1>2", 3, "ranked twice"),
    ("1>>2", 3, "empty rank"),
    ("1>x", 3, "not a response number"),
    ("", 4, "Rank all 4"),
])
def test_parse_ranking_errors(text, k, message):
    with pytest.raises(gr.Error, match=message):
        parse_ranking(text, k)


# --------------------------------------------------------------------------- rendering


def test_untrusted_text_is_escaped():
    payloads = ["<script>alert(1)</script>", '<img src=x onerror="alert(2)">', "\"><svg onload=alert(3)>"]
    prompt = f"\n\nHuman: {payloads[0]}\n\nAssistant: {payloads[1]}\n\nHuman: again\n\nAssistant:"
    resp = [SimpleNamespace(text=p + "\n```\n" + p + "\n```", token_count=5, finish_reason="length") for p in payloads]
    html = render.render_item(prompt, resp, token='tok"<x>')
    for p in payloads:
        assert p not in html
    assert "<script" not in html and "<img" not in html and "<svg" not in html and "onerror=\"" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert 'data-token="tok&quot;&lt;x&gt;"' in html
    assert html.count('class="rl-card"') == 3 and "cut off" in html


def test_markdown_bold_and_code_wrap_escaped_text_only():
    html = render.format_text("**<b>bold</b>** and `<img src=x onerror=alert(1)>`\n```\n<script>x</script>\n```")
    assert html.count("<strong>") == 1 and "<code>&lt;img src=x onerror=alert(1)&gt;</code>" in html
    assert "<b>" not in html and "<img" not in html and "<script>" not in html


def test_turns_from_hh_transcripts_and_messages():
    turns = render.split_turns("\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant:")
    assert [(t.role, t.text) for t in turns] == [("Human", "hi"), ("Assistant", "hello"), ("Human", "how are you?")]
    assert render.split_turns("just a question")[0].role == "Human"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert [(t.role, t.text) for t in render.split_turns(msgs)] == [("System", "be brief"), ("Human", "hi")]


# --------------------------------------------------------------------------- annotate actions


def test_load_shows_item_in_display_order(ctx):
    seeded = seed_items(ctx.store, 3, 4)
    state, html = show(ctx)
    item = state.current.item
    assert item.item_id in {s.item_id for s in seeded}
    # cards appear in the recorded display order
    texts = [r.text for r in item.responses]
    assert [html.index(t) for t in texts] == sorted(html.index(t) for t in texts)
    assert f'data-token="{state.current.token}"' in html and 'data-k="4"' in html


def test_submit_stores_exactly_the_ranked_pairs_and_moves_on(ctx):
    seed_items(ctx.store, 3, 4)
    state, _ = show(ctx)  # with no executor, the next item is prefetched before load returns
    first, upcoming = state.current, state.prefetched
    assert upcoming is not None and upcoming.item_id != first.item.item_id
    order = positions_to_ids(state, "2>1=3>4")
    out = handlers.submit(ctx, handlers.Submission("2>1=3>4", False, " nice ", first.token), state, req("ann"))
    state, html, progress, comment, all_bad, timer = out
    a = ctx.store.find_annotator("ann")
    (ranking,) = ctx.store.list_rankings(annotator_id=a.id)
    assert ranking.order == order and ranking.comment == "nice" and ranking.client_token == first.token
    assert ranking.display_order == first.item.display_order and ranking.duration_s >= 0
    pairs = sorted((p.chosen_id, p.rejected_id) for p in ctx.store.list_pairs(ranking_id=ranking.id))
    (b,), (t1, t2), (w,) = order
    assert pairs == sorted([(b, t1), (b, t2), (b, w), (t1, w), (t2, w)])  # the tie gives no pair
    # the prefetched item is shown next, and the inputs are reset
    assert state.current.item.item_id == upcoming.item_id != first.item.item_id
    assert comment == "" and all_bad is False and not timer["active"]
    assert "<b>1</b> today" in progress and "Saved · 5 pairs" in progress


def test_submit_refuses_bad_or_stale_rankings_and_stores_nothing(ctx):
    seed_items(ctx.store, 2, 3)
    state, _ = show(ctx)
    with pytest.raises(gr.Error, match="Rank all 3"):
        handlers.submit(ctx, handlers.Submission("1", False, "", state.current.token), state, req("ann"))
    with pytest.raises(gr.Error, match="changed"):
        handlers.submit(ctx, handlers.Submission("1>2>3", False, "", "another-token"), state, req("ann"))
    assert ctx.store.list_rankings() == []


def test_an_own_answer_is_ranked_where_placed_and_refused_when_it_cannot_be(ctx):
    """The annotator writes a better answer from response 2 and ranks it (position K+1 = 4) second:
    its pairs join the ranking's, it beats the response it came from, and undo keeps its text."""
    seed_items(ctx.store, 3, 3)
    state, _ = show(ctx)
    token, item = state.current.token, state.current.item
    by_pos = {pos: next(r for r in item.responses if r.id == rid) for pos, rid in enumerate(item.display_order, 1)}
    for ranking, edit, made_from, problem in [
            ("1>2>3", "a better one", "", "the response it was written from"),
            ("1>2>3", f"  {by_pos[2].text} ", "2", "unchanged"),
            ("1=4>2>3", "a better one", "2", "cannot tie"),
            ("1>2>4>3", "a better one", "2", "rank it above the response it was made from")]:
        with pytest.raises(gr.Error, match=problem):
            handlers.submit(ctx, handlers.Submission(ranking, False, "", token, edit=edit, edit_from=made_from), state, req("ann"))
    assert ctx.store.list_rankings() == [] and ctx.store.counts()["responses"] == 9
    state, *_ = handlers.submit(ctx, handlers.Submission("1>4>2>3", False, "", token, edit=" my better answer ", edit_from="2"), state, req("ann"))
    (ranking,) = ctx.store.list_rankings()
    assert ranking.order == [[by_pos[1].id], [by_pos[2].id], [by_pos[3].id]]  # the item's own responses
    edits = [p for p in ctx.store.list_pairs() if p.source == "edit"]
    (mine,) = {p.chosen_id for p in edits if p.rejected_id == by_pos[2].id}
    answer = ctx.store.get_response(mine)
    assert answer.text == "my better answer" and answer.sampling["edit_of"] == by_pos[2].id
    assert ctx.store.get_model_version(answer.model_version_id).name == "human edit"
    assert {(p.chosen_id, p.rejected_id, p.margin) for p in edits} == {
        (by_pos[1].id, mine, 1.0), (mine, by_pos[2].id, 1.0), (mine, by_pos[3].id, 2.0)}
    # not ranked: it goes just above the response it was written from
    state, *_ = handlers.submit(ctx, handlers.Submission("2>1>3", False, "", state.current.token, edit="mine", edit_from="3"), state, req("ann"))
    second = ctx.store.list_rankings()[-1]
    placed = [(p.chosen_id, p.rejected_id) for p in ctx.store.list_pairs(ranking_id=second.id) if p.source == "edit"]
    new = next(c for c, r in placed if r == second.order[2][0])
    # written from response 3, ranked last: the answer is just above it, below the other two
    assert sorted(placed) == sorted([(second.order[0][0], new), (second.order[1][0], new), (new, second.order[2][0])])
    handlers.undo(ctx, state, req("ann"))
    assert not [p for p in ctx.store.list_pairs() if p.chosen_id == new or p.rejected_id == new]
    assert ctx.store.get_response(new).text == "mine"  # what was written is kept


def test_double_submit_of_one_showing_stores_one_ranking(ctx):
    seed_items(ctx.store, 2, 3)
    state, _ = show(ctx)
    token, item = state.current.token, state.current.item
    handlers.submit(ctx, handlers.Submission("1>2>3", False, "", token), state, req("ann"))
    # the same showing again (a retry): same client token -> the store keeps one ranking
    state.current = Showing(item, token=token)
    handlers.submit(ctx, handlers.Submission("1>2>3", False, "", token), state, req("ann"))
    assert len(ctx.store.list_rankings()) == 1


def test_all_bad_without_ranking(ctx):
    seed_items(ctx.store, 1, 3)
    state, _ = show(ctx)
    handlers.submit(ctx, handlers.Submission("", True, "", ""), state, req("ann"))
    (r,) = ctx.store.list_rankings()
    assert r.all_bad and len(r.order) == 1 and ctx.store.list_pairs() == []
    assert state.current is None  # the queue is empty now


def test_never_shows_an_item_already_ranked(ctx):
    seed_items(ctx.store, 4, 2)
    state, _ = show(ctx)
    seen = []
    while state.current is not None:
        seen.append(state.current.item.item_id)
        state, *_ = handlers.submit(ctx, handlers.Submission("1>2", False, "", ""), state, req("ann"))
    assert len(seen) == len(set(seen)) == 4
    _, html, progress, *_ = handlers.load(ctx, state, req("ann"))
    assert "all caught up" in html and "<b>0</b> in queue" in progress


def test_skip_and_flag(ctx):
    seeded = seed_items(ctx.store, 3, 2)
    state, _ = show(ctx)
    skipped = state.current.item
    state, *_ = handlers.skip(ctx, state, req("ann"))
    flagged = state.current.item
    state, *_ = handlers.flag(ctx, state, "broken prompt", req("ann"))
    assert ctx.store.is_flagged(flagged.prompt.id)
    assert [reasons for p, reasons in ctx.store.flagged_prompts()] == [["broken prompt"]]
    left = state.current.item
    assert {skipped.item_id, flagged.item_id, left.item_id} == {s.item_id for s in seeded}
    # another annotator still gets the skipped item, never the flagged one
    other, _ = show(ctx, "bea")
    got = set()
    while other.current is not None:
        got.add(other.current.item.item_id)
        other, *_ = handlers.skip(ctx, other, req("bea"))
    assert flagged.item_id not in got and skipped.item_id in got


def test_undo_shows_the_last_item_again_and_deletes_its_pairs(ctx):
    seed_items(ctx.store, 3, 3)
    state, _ = show(ctx)
    first = state.current.item
    state, *_ = handlers.submit(ctx, handlers.Submission("1>2>3", False, "", ""), state, req("ann"))
    second = state.current.item
    state, *_ = handlers.submit(ctx, handlers.Submission("3>2>1", False, "", ""), state, req("ann"))
    third = state.current.item
    state, html, progress, *_ = handlers.undo(ctx, state, req("ann"))
    assert state.current.item.item_id == second.item_id and state.prefetched.item_id == third.item_id
    assert [r.item_id for r in ctx.store.list_rankings()] == [first.item_id]
    assert len(ctx.store.list_pairs()) == 3 and "Undone" in progress
    # ranking it again, then the item that was on screen comes back
    state, *_ = handlers.submit(ctx, handlers.Submission("2>1>3", False, "", ""), state, req("ann"))
    assert state.current.item.item_id == third.item_id
    assert len(ctx.store.list_rankings()) == 2


def test_a_prefetched_item_no_longer_leased_is_not_shown(ctx):
    """An item fetched ahead is shown only while its lease holds: here another tab of the same
    annotator skipped it (a racing prefetch can leave one behind the same way)."""
    seed_items(ctx.store, 3, 2)
    state, _ = show(ctx)
    upcoming = state.prefetched
    ctx.store.skip_item(ctx.store.find_annotator("ann").id, upcoming.item_id)
    state, *_ = handlers.submit(ctx, handlers.Submission("1>2", False, "", ""), state, req("ann"))
    assert state.current is not None and state.current.item.item_id != upcoming.item_id


def test_prefetch_runs_in_the_background_executor(ctx):
    from concurrent.futures import ThreadPoolExecutor

    seed_items(ctx.store, 3, 2)
    ctx.background = ThreadPoolExecutor(max_workers=2)
    state, _ = show(ctx)
    ctx.background.shutdown(wait=True)
    assert state.prefetched is not None and state.prefetched.item_id != state.current.item.item_id
    assert not state.prefetching


def test_a_prefetch_racing_an_action_never_doubles_the_item_on_screen(ctx, monkeypatch):
    seed_items(ctx.store, 3, 2)
    state, _ = show(ctx)
    state.prefetched = None
    real = ctx.store.next_item

    def next_item_while_an_action_shows_it(annotator_id, **kw):
        item = real(annotator_id, **kw)
        state.current = Showing(item)  # a Submit ran meanwhile and showed this very item
        return item

    monkeypatch.setattr(ctx.store, "next_item", next_item_while_an_action_shows_it)
    handlers.prefetch(ctx, state, ctx.store.find_annotator("ann"))
    assert state.prefetched is None and not state.prefetching


def test_no_prefetch_mode(ctx):
    seed_items(ctx.store, 3, 2)
    ctx.prefetch = False
    state, _ = show(ctx)
    assert state.prefetched is None
    state, *_ = handlers.submit(ctx, handlers.Submission("1>2", False, "", ""), state, req("ann"))
    assert state.current is not None and state.prefetched is None


def test_leaving_gives_the_leased_items_back(ctx):
    seed_items(ctx.store, 2, 2)
    state, _ = show(ctx)  # the item on screen and the prefetched one are leased to ann
    other, _ = show(ctx, "bea")
    assert other.current is None  # both items are leased to ann (one ranking per item)
    handlers.leave(ctx, req("ann"))
    other, _ = show(ctx, "bea")
    assert other.current is not None


def test_actions_before_any_item_was_shown(ctx):
    seed_items(ctx.store, 1, 2)
    for call in (lambda: handlers.submit(ctx, handlers.Submission("1>2", False, "", ""), None, req("ann")),
                 lambda: handlers.skip(ctx, None, req("ann")),
                 lambda: handlers.flag(ctx, None, "", req("ann"))):
        with pytest.raises(gr.Error, match="no item on screen"):
            call()
    with pytest.raises(gr.Error, match="Nothing to undo"):
        handlers.undo(ctx, None, req("ann"))
    assert ctx.store.list_rankings() == [] and not ctx.store.flagged_prompts()


def test_undo_with_nothing_to_undo(ctx):
    seed_items(ctx.store, 1, 2)
    state, _ = show(ctx)
    with pytest.raises(gr.Error, match="Nothing to undo"):
        handlers.undo(ctx, state, req("ann"))


def test_refresh_leaves_a_shown_item_alone_and_picks_up_new_ones(ctx):
    state, html, *_, timer = handlers.load(ctx, None, req("ann"))
    assert state.current is None and "all caught up" in html and timer["active"]
    seed_items(ctx.store, 1, 2)
    state, html, *_, timer = handlers.refresh(ctx, state, req("ann"))
    assert state.current is not None and "rl-card" in html and not timer["active"]
    out = handlers.refresh(ctx, state, req("ann"))
    assert all(isinstance(o, type(gr.skip())) for o in out[1:5]) and not out[5]["active"]


def test_open_page_shows_admin_tabs_to_admins_only(ctx):
    header, *tabs, timer, guide = handlers.open_page(ctx, None, req("boss"))[:6]
    assert all(t["visible"] for t in tabs) and "boss" in header and "admin" in header
    assert not timer["active"]  # no job runs: nothing to poll
    header, *tabs, timer, guide = handlers.open_page(ctx, None, req("ann"))[:6]
    assert not any(t["visible"] for t in tabs) and not timer["active"]
    assert "Rank the responses" in guide


def test_requests_without_a_known_user_are_refused(ctx):
    seed_items(ctx.store, 1, 2)
    for request in (req(None), None, req("nobody")):
        with pytest.raises(Refused):
            handlers.load(ctx, None, request)


def test_a_demoted_admin_is_refused_at_once(ctx):
    boss = ctx.store.find_annotator("boss")
    handlers.open_page(ctx, None, req("boss"))  # the account lookup is now cached
    admin_users.users_table(ctx, req("boss"))
    ctx.store.set_role(ctx.store.find_annotator("bea").id, "admin")  # the last admin cannot be demoted
    ctx.store.set_role(boss.id, "annotator")
    with pytest.raises(Refused):
        admin_users.users_table(ctx, req("boss"))
    assert not handlers.open_page(ctx, None, req("boss"))[1]["visible"]


def test_no_auth_mode_acts_as_the_local_admin(store, tmp_path):
    bootstrap.ensure_admin(store, auth=False)
    ctx = AppContext(store=store, auth=False, data_dir=tmp_path)
    seed_items(store, 1, 2)
    state, *_ = handlers.load(ctx, None, None)
    handlers.submit(ctx, handlers.Submission("1>2", False, "", ""), state, None)
    (r,) = store.list_rankings()
    assert store.get_annotator(r.annotator_id).name == "local"
    assert len(admin_users.users_table(ctx, None)) == 1


# --------------------------------------------------------------------------- role refusal


def _admin_calls(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    return {
        "import_file": lambda c, r: admin.import_file(c, str(prompts), "prompts", None, r),
        "generate": lambda c, r: admin.generate(c, 4, 4, 16, 0.7, 1.0, None, r),
        "job_poll": lambda c, r: admin.job_poll(c, r),
        "policy_choices": lambda c, r: admin.policy_choices(c, r),
        "statistics": lambda c, r: admin.statistics(c, r),
        "export": lambda c, r: admin.export(c, admin.ExportForm(), r),
        "users_table": lambda c, r: admin_users.users_table(c, r),
        "flagged_table": lambda c, r: admin.flagged_table(c, r),
        "unflag": lambda c, r: admin.unflag(c, 1, r),
        "annotator_names": lambda c, r: admin_users.annotator_names(c, r),
        "add_user": lambda c, r: admin_users.add_user(c, "mallory", "admin", "mallory-password", r),
        "save_guidelines": lambda c, r: admin.save_guidelines(c, "be evil", r),
        "load_guidelines": lambda c, r: admin.load_guidelines(c, r),
    }


def test_annotators_are_refused_every_admin_action_and_nothing_happens(ctx, tmp_path):
    seed_items(ctx.store, 2, 2)
    def snapshot():
        s = ctx.store
        return s.counts(), [a.name for a in s.list_annotators()], s.get_setting("guidelines_markdown")

    before = snapshot()
    for name, call in _admin_calls(tmp_path).items():
        for who in ("ann", None):
            with pytest.raises(Refused):
                call(ctx, req(who))
    assert snapshot() == before
    assert not ctx.export_dir.exists()


# --------------------------------------------------------------------------- admin actions


def test_import_prompts_and_a_bad_file(ctx, tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "one"}\n{"prompt": "two"}\n{"prompt": "one"}\n')
    msg, errors = admin.import_file(ctx, str(good), "prompts", None, req("boss"))
    assert "2 new prompts" in msg and len(errors) == 0 and ctx.store.counts()["prompts"] == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "three"}\n{"text": "no prompt"}\n{"prompt": "four"}\n{"prompt": ""}\n')
    msg, errors = admin.import_file(ctx, str(bad), "prompts", None, req("boss"))
    assert "was not imported" in msg and "Nothing from this file was stored" in msg
    assert list(errors["row"]) == ["2", "4"] and "missing 'prompt'" in errors["problem"][0]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "five"}\nnot json\n')
    msg, errors = admin.import_file(ctx, str(broken), "prompts", None, req("boss"))
    assert list(errors["row"]) == ["2"] and "not valid JSON" in errors["problem"][0]
    assert ctx.store.counts()["prompts"] == 2  # nothing from either bad file was stored


def test_import_pairs(ctx, test_data, tmp_path):
    rows = [json.loads(line) for line in (test_data / "hh_dev_pairs.jsonl").open()][:5]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    msg, errors = admin.import_file(ctx, str(path), "pairs", None, req("boss"))
    assert "5 preference pairs" in msg and len(ctx.store.list_pairs()) == 5


def test_import_items_to_rank_and_a_label_studio_export(ctx, tmp_path):
    items = tmp_path / "items.csv"
    items.write_text("prompt,response_1,model_1,response_2,model_2\nq1,a,<b>api</b>,b,ours\nq2,c,ours,d,ours\n")
    msg, errors = admin.import_file(ctx, str(items), "items to rank", None, req("boss"))
    assert "2 items to rank (2 in the queue" in msg and "&lt;b&gt;api&lt;/b&gt;, ours" in msg and len(errors) == 0
    state, html = show(ctx)
    assert state.current is not None  # the queue serves them
    table = model_admin.models_table(ctx, req("boss"))
    assert set(table[table["kind"] == "external"]["name"]) >= {"<b>api</b>", "ours"}
    *_, caption = model_admin.version_details(ctx, "ours", req("boss"))
    assert "an external model, whose responses were imported" in caption
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,response_1,response_2\nq3,x,x\n")
    msg, errors = admin.import_file(ctx, str(bad), "items to rank", None, req("boss"))
    assert "was not imported" in msg and list(errors["row"]) == ["1"] and "identical" in errors["problem"][0]
    ls = tmp_path / "label_studio.json"
    ls.write_text(json.dumps([{"id": 7, "data": {"prompt": "p", "items": [{"id": "a", "title": "m1", "body": "x"},
                                                                         {"id": "b", "title": "m2", "body": "y"}]},
                               "annotations": [{"result": [{"type": "ranker", "from_name": "rank", "to_name": "answers",
                                                            "value": {"ranker": {"rank": ["b", "a"]}}}]}]}]))
    msg, errors = admin.import_file(ctx, str(ls), "Label Studio export", None, req("boss"))
    assert "1 items to rank (0 in the queue" in msg and "1 pairs from its rankings" in msg
    with pytest.raises(Refused):
        admin.import_file(ctx, str(ls), "Label Studio export", None, req("ann"))


def test_outside_models_are_evaluated_blind_from_the_import_form_while_the_app_runs(ctx, tmp_path):
    """Data > Import "a blind evaluation": two outside models' answers (an API, production) become an
    evaluation in the open store; annotators rank them in the ordinary queue with no names shown, and
    Models > Blind evaluation gives their leaderboard."""
    from annotate import evaluation_admin

    items = tmp_path / "api-vs-prod.jsonl"
    items.write_text("".join(json.dumps({"prompt": f"q{i}", "responses": [{"text": f"api says {i}", "model": "api"},
                                                                         {"text": f"prod says {i}", "model": "prod"}]})
                             + "\n" for i in range(3)))
    msg, errors = admin.import_file(ctx, str(items), admin.IMPORT_EVALUATION, "  ", req("boss"))
    assert "as the blind evaluation **api-vs-prod**: 3 prompts, one answer each from api, prod" in msg
    assert len(errors) == 0
    state, html = show(ctx, "ann")
    ranked = 0
    while state.current is not None:
        assert "api" not in html.replace("api says", "")  # the models are not named
        item = state.current.item
        api = next(r.id for r in item.responses if r.text.startswith("api"))
        position = 1 + item.display_order.index(api)
        state, html, *_ = handlers.submit(ctx, handlers.Submission(f"{position}>{3 - position}", False, "", ""), state, req("ann"))
        ranked += 1
    text, board, rates, table = evaluation_admin.results(ctx, "api-vs-prod", req("boss"))
    assert ranked == 3 and "3 comparisons on 3 prompts" in text and list(board["version"]) == ["api", "prod"]
    assert (rates["A"][0], rates["B"][0], rates["A wins"][0]) == ("api", "prod", "100%")
    assert list(table["name"]) == ["api-vs-prod"] and table["rankings"][0] == 3
    with pytest.raises(Refused):
        admin.import_file(ctx, str(items), admin.IMPORT_EVALUATION, "x", req("ann"))


@pytest.mark.parametrize("fmt", ["jsonl", "datasets"])
def test_export_downloads_the_snapshot(ctx, fmt):
    seeded = seed_items(ctx.store, 4, 3)
    a = ctx.store.find_annotator("ann")
    for s in seeded:
        ctx.store.save_ranking(RankingIn(a.id, s.prompt_id, s.response_ids))
    paths, summary = admin.export(ctx, admin.ExportForm(fmt=fmt, annotators=["ann"], test_fraction=0.5), req("boss"))
    (snap,) = ctx.store.list_snapshots()
    assert f"Snapshot #{snap.id}" in summary and snap.counts["pairs"] == 12
    assert snap.filters["annotators"] == ["ann"] and Path(snap.path).parent == ctx.export_dir
    download = Path(paths[0])
    assert not download.is_relative_to(ctx.data_dir)  # a copy is served, not the export folder
    if fmt == "jsonl":
        rows = [json.loads(line) for line in download.read_text().splitlines()]
        assert len(rows) == 12 and {r["split"] for r in rows} == {"train", "test"}
        assert {r["annotator"] for r in rows} == {"ann"}
    else:
        assert download.suffix == ".zip"
        names = zipfile.ZipFile(download).namelist()
        assert "dataset_dict.json" in names and "snapshot.json" in names
        assert "README.md" in names and "rankings/dataset_info.json" in names


def test_a_served_copy_is_made_once_per_version_of_a_file(tmp_path, monkeypatch):
    """Downloads are served from the temp folder: the same file served again is the same copy
    (repeated downloads leave nothing behind), a changed file a new one, a folder a zip; no
    temporary file is left beside them."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    data = tmp_path / "data"
    (data / "snap").mkdir(parents=True)
    (data / "snap" / "pairs.jsonl").write_text('{"a": 1}\n')
    first = served_copy(data / "snap" / "pairs.jsonl", "downloads")
    assert first.read_text() == '{"a": 1}\n' and not first.is_relative_to(data)
    assert served_copy(data / "snap" / "pairs.jsonl", "downloads") == first
    (data / "snap" / "pairs.jsonl").write_text('{"a": 2}\n')
    second = served_copy(data / "snap" / "pairs.jsonl", "downloads")
    assert second != first and second.read_text() == '{"a": 2}\n'
    zipped = served_copy(data / "snap", "downloads")
    assert zipped.name == "snap.zip" and zipfile.ZipFile(zipped).read("pairs.jsonl") == b'{"a": 2}\n'
    assert served_copy(data / "snap", "downloads") == zipped
    served = sorted(p.name for p in (tmp_path / "tmp" / "downloads").rglob("*") if p.is_file())
    assert served == ["pairs.jsonl", "pairs.jsonl", "snap.zip"]


def test_export_filters_and_bad_input(ctx):
    with pytest.raises(gr.Error, match="date"):
        admin.export(ctx, admin.ExportForm(since="yesterday"), req("boss"))
    with pytest.raises(gr.Error, match="no annotator named"):
        admin.export(ctx, admin.ExportForm(annotators=["ghost"]), req("boss"))
    assert ctx.store.list_snapshots() == []


def test_flagged_prompts_are_listed_and_unflagged_by_admins_only(ctx):
    seed_items(ctx.store, 2, 2)
    state, _ = show(ctx)
    flagged = state.current.item
    state, *_ = handlers.flag(ctx, state, "<b>broken</b> prompt", req("ann"))
    kept = state.current.item  # now on ann's screen (leased to ann)
    table = admin.flagged_table(ctx, req("boss"))
    assert list(table["prompt id"]) == [flagged.prompt.id] and list(table["flags"]) == [1]
    assert table["reasons"][0] == "<b>broken</b> prompt"  # plain text: the table renders no markup
    assert table["prompt"][0] == " ".join(flagged.prompt.text.split())
    # an annotator (or nobody) can neither list nor unflag, through the API too: nothing changes
    for call in (lambda r: admin.flagged_table(ctx, r), lambda r: admin.unflag(ctx, flagged.prompt.id, r)):
        for who in ("ann", None):
            with pytest.raises(Refused):
                call(req(who))
    assert ctx.store.is_flagged(flagged.prompt.id)
    with pytest.raises(gr.Error, match="is not flagged"):
        admin.unflag(ctx, kept.prompt.id, req("boss"))
    with pytest.raises(gr.Error, match="must be a number"):
        admin.unflag(ctx, None, req("boss"))
    msg, table = admin.unflag(ctx, flagged.prompt.id, req("boss"))
    assert f"Prompt {flagged.prompt.id} is back in the queue" in msg and len(table) == 0
    assert not ctx.store.is_flagged(flagged.prompt.id)
    # its item is offered again: to bea, since the other item is leased to ann
    other, _ = show(ctx, "bea")
    assert other.current.item.item_id == flagged.item_id


def test_add_user_with_generated_password(ctx):
    msg, table = admin_users.add_user(ctx, "newbie", "annotator", "", req("boss"))
    password = msg.split("`")[1]
    assert ctx.store.authenticate("newbie", password).role == "annotator"
    assert "newbie" in list(table["name"])
    with pytest.raises(gr.Error, match="already exists"):
        admin_users.add_user(ctx, "newbie", "annotator", "another-password", req("boss"))


def test_guidelines_roundtrip(ctx):
    admin.save_guidelines(ctx, "# Be kind\nPrefer **short** answers.", req("boss"))
    assert handlers.guidelines(ctx, req("ann")).startswith("# Be kind")
    assert admin.load_guidelines(ctx, req("boss")).startswith("# Be kind")


def test_statistics(ctx):
    seeded = seed_items(ctx.store, 2, 3)
    ann, bea = ctx.store.find_annotator("ann"), ctx.store.find_annotator("bea")
    for s in seeded:
        ctx.store.save_ranking(RankingIn(ann.id, s.prompt_id, s.response_ids, duration_s=4.0))
    ctx.store.save_ranking(RankingIn(bea.id, seeded[0].prompt_id, seeded[0].response_ids, duration_s=6.0))
    counts, people, agreement, bias, per_annotator, by_position = admin.statistics(ctx, req("boss"))
    c = dict(zip(counts["what"], counts["count"]))
    assert c["rankings"] == 3 and c["pairs"] == 9 and c["prompts"] == 2
    row = people.set_index("annotator").loc["ann"]
    assert row["rankings"] == 2 and row["median s"] == 4.0
    assert dict(zip(agreement["measure"], agreement["value"]))["pairwise agreement"] == "1.000"
    assert len(by_position) == 3 and abs(by_position["best rate"].sum() - 1.0) < 1e-9


# --------------------------------------------------------------------------- first start and generation


def test_first_start_creates_one_admin_and_imports_the_bundled_prompts(store):
    password = bootstrap.ensure_admin(store, auth=True)
    assert store.authenticate("admin", password).is_admin
    assert bootstrap.ensure_admin(store, auth=True) is None  # a restart creates nothing
    added = bootstrap.ensure_prompts(store)
    assert added > 2000 and bootstrap.ensure_prompts(store) == 0


def test_generation_is_a_job_whose_chunks_become_items(store, tiny_model_dir, tmp_path):
    from pipeline.orchestrate.loop import make_runner
    from tests.helpers import tiny_settings

    store.add_annotator("boss", "boss-password", role="admin")
    store.add_prompts(["say hi", "\n\nHuman: hello\n\nAssistant: hey\n\nHuman: bye?\n\nAssistant:", "count to 3"])
    runner = make_runner(store, tmp_path / "runs", poll_s=0.1)
    ctx = AppContext(store=store, data_dir=tmp_path, jobs=runner, train_settings=tiny_settings(tiny_model_dir))
    try:
        with pytest.raises(gr.Error, match="No policy version"):
            admin.generate(ctx, 3, 3, 8, 1.0, 1.0, "policy-v9", req("boss"))
        html, timer = admin.generate(ctx, 3, 3, 8, 1.0, 1.0, None, req("boss"))
        assert "rl-job" in html and timer["active"]
        (run,) = store.list_runs(kind="generate")
        with pytest.raises(gr.Error, match="being generated for"):  # a second click takes no prompt twice
            admin.generate(ctx, 3, 3, 8, 1.0, 1.0, None, req("boss"))
        # while it is in flight an annotator's empty page says so, and an admin's page keeps polling
        assert handlers.open_page(ctx, None, req("boss"))[4]["active"]
        assert "being generated" in handlers.empty_html(ctx)
        run = runner.wait(run.id, timeout=120)
        assert run.status == "done", run.error
        assert store.counts()["items"] == 3 and store.counts()["responses"] == 9
        assert (run.outputs["items"], run.outputs["responses"]) == (3, 9)
        policy = store.active_policy()
        assert run.inputs["model_version_id"] == policy.id
        assert {r.model_version_id for p in store.list_prompts() for r in store.prompt_responses(p.id)} == {policy.id}
        html, timer = admin.job_poll(ctx, req("boss"))
        assert 'data-status="done"' in html and "width:100.0%" in html and not timer["active"]
        assert not handlers.open_page(ctx, None, req("boss"))[4]["active"]
        assert admin.policy_choices(ctx, req("boss"))["value"] == policy.name
        with pytest.raises(gr.Error, match="already has responses"):
            admin.generate(ctx, 3, 3, 8, 1.0, 1.0, policy.name, req("boss"))
    finally:
        runner.shutdown()


def test_chunks_of_a_running_generate_job_are_ingested_as_they_arrive(store, tmp_path):
    """Each whole chunk file becomes items at the next poll, in order; a missing one waits."""
    from pipeline.orchestrate.ingest import Partial

    ids = store.add_prompts([f"prompt {i}" for i in range(4)])
    policy = store.register_model_version("policy", base_model="tiny")
    run = store.create_run("generate", run_dir=str(tmp_path), inputs={"model_version_id": policy.id})
    (tmp_path / "chunks").mkdir()

    def chunk(n, prompt_ids):
        rows = [{"prompt_id": pid, "text": f"answer {j} to {pid}", "token_count": 3, "finish_reason": "eos"}
                for pid in prompt_ids for j in range(2)]
        (tmp_path / "chunks" / f"{n:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    partial = Partial(store, run)
    partial.poll()
    assert store.counts()["items"] == 0
    chunk(0, ids[:2])
    chunk(2, ids[3:])  # ahead of chunk 1: waits for it
    partial.poll()
    assert store.counts()["items"] == 2 and partial.next_chunk == 1
    chunk(1, ids[2:3])
    partial.poll()
    assert store.counts()["items"] == 4 and (partial.items, partial.responses) == (4, 8)


def test_after_a_restart_submit_skip_and_flag_act_on_the_item_the_page_names(ctx):
    """A restarted app has no state for the page (gr.State lives in the process); the page's token
    names its item, and the annotator's lease on it is in the store: each action acts on that item.
    A token of an item not leased to the annotator (or none) acts on nothing."""
    seed_items(ctx.store, 4, 2)
    state, _ = show(ctx)
    first = state.current
    handlers.submit(ctx, handlers.Submission("2>1", False, "", first.token), None, req("ann"))  # as if after a restart
    (ranking,) = ctx.store.list_rankings()
    assert ranking.item_id == first.item.item_id and ranking.client_token == first.token
    assert ranking.order == [[first.item.display_order[1]], [first.item.display_order[0]]]
    state, _ = show(ctx)
    second = state.current
    state, *_ = handlers.skip(ctx, None, req("ann"), second.token)
    assert state.current.item.item_id not in (first.item.item_id, second.item.item_id)
    third = state.current
    handlers.flag(ctx, None, "broken", req("ann"), third.token)
    assert ctx.store.is_flagged(third.item.prompt.id)
    for call in (lambda: handlers.skip(ctx, None, req("bea"), third.token),  # not bea's lease
                 lambda: handlers.submit(ctx, handlers.Submission("1>2", False, "", ""), None, req("ann"))):
        with pytest.raises(gr.Error, match="no item on screen"):
            call()
