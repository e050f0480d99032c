"""Preference strength (records.STRENGTHS, Llama 2's scale): stored with the ranking for K = 2 and
for the top pair of K > 2, refused where it names no top pair, exported as `strength` on that
pair (TRL's `margin` with --margin-column, which train-reward reads), the comment as `rationale`;
and through the Annotate handler."""

from __future__ import annotations

import json

import gradio as gr
import pytest

from annotate import handlers
from annotate.context import AppContext
from pipeline.pairs_data import read_pairs
from store import InvalidRequest, RankingIn
from store.export import load_pairs_snapshot
from store.io import ExportOptions, export_dataset
from store.records import STRENGTHS
from tests.fixtures_store import seed_items
from tests.helpers import req


def test_strength_is_stored_with_the_ranking_and_exported_on_the_top_pair(store, store_annotators, tmp_path):
    ann = store_annotators[0]
    two, four = seed_items(store, 1, 2, prefix="two")[0], seed_items(store, 1, 4, prefix="four")[0]
    a, b = two.response_ids
    r2 = store.save_ranking(RankingIn(ann.id, two.prompt_id, [b, a], strength="slightly better", comment="b is exact"))
    w, x, y, z = four.response_ids
    r4 = store.save_ranking(RankingIn(ann.id, four.prompt_id, [[x], [w], [y, z]], strength="much better"))
    assert store.get_ranking(r2.id).strength == "slightly better" and r4.strength == "much better"

    rows = load_pairs_snapshot(export_dataset(store, tmp_path / "plain", ExportOptions(format="jsonl")).path)
    by_ids = {(r["chosen_id"], r["rejected_id"]): r for r in rows}
    assert len(rows) == 1 + 5 and "margin" not in rows[0]
    assert by_ids[(b, a)]["strength"] == "slightly better" and by_ids[(b, a)]["rationale"] == "b is exact"
    assert by_ids[(x, w)]["strength"] == "much better"  # the top pair of K = 4 ...
    assert all(r["strength"] is None for key, r in by_ids.items() if key not in ((b, a), (x, w)))  # ... only
    assert by_ids[(x, w)]["rationale"] is None  # no comment written
    rankings = [json.loads(line) for line in (tmp_path / "plain" / "rankings" / "rankings.jsonl").open()]
    assert {k["ranking_id"]: k["strength"] for k in rankings} == {r2.id: "slightly better", r4.id: "much better"}

    # --margin-column: the strength as Llama 2's margin where there is one, else the rank gap
    path = export_dataset(store, tmp_path / "margin.jsonl", ExportOptions(format="jsonl", margin_column=True)).path
    margins = {(r["chosen_id"], r["rejected_id"]): r["margin"] for r in load_pairs_snapshot(path)}
    assert margins[(b, a)] == pytest.approx(1 / 3) and margins[(x, w)] == 1.0
    assert margins[(x, y)] == 2.0 and margins[(w, z)] == 1.0  # rank gaps
    pairs, _ = read_pairs(path)  # what train-reward --margin trains on
    assert sorted(round(p.margin, 4) for p in pairs) == sorted(round(m, 4) for m in margins.values())


@pytest.mark.parametrize("order, strength, problem", [
    ("tie", "better", "rank one response first and one second, without ties"),
    ("second tie", "better", "rank one response first and one second, without ties"),
    ("full", "a lot better", "strength must be one of"),
])
def test_a_strength_that_names_no_top_pair_is_refused(store, store_annotators, order, strength, problem):
    ann = store_annotators[0]
    it = seed_items(store, 1, 3)[0]
    a, b, c = it.response_ids
    groups = {"tie": [[a, b], [c]], "second tie": [[a], [b, c]], "full": [[a], [b], [c]]}[order]
    with pytest.raises(InvalidRequest, match=problem):
        store.save_ranking(RankingIn(ann.id, it.prompt_id, groups, strength=strength))
    with pytest.raises(InvalidRequest, match=problem):
        store.save_rankings_bulk([RankingIn(ann.id, it.prompt_id, groups, strength=strength)])
    assert store.list_rankings() == [] and store.list_pairs() == []


def test_bulk_rankings_keep_their_strength(store, store_annotators):
    items = seed_items(store, 3, 2)
    ids = store.save_rankings_bulk([RankingIn(store_annotators[0].id, it.prompt_id, it.response_ids, strength=s)
                                    for it, s in zip(items, [None, *list(STRENGTHS)[2:]])])
    assert [store.get_ranking(i).strength for i in ids] == [None, "slightly better", "about the same"]


def test_the_annotate_handler_takes_a_strength(store, store_annotators, tmp_path):
    seed_items(store, 3, 2)
    ctx = AppContext(store=store, auth=True, data_dir=tmp_path / "data")
    state, *_ = handlers.load(ctx, None, req("ann0"))
    token = state.current.token
    with pytest.raises(gr.Error, match="Strength must be one of"):
        handlers.submit(ctx, handlers.Submission("1>2", False, "", token, strength="very much"), state, req("ann0"))
    with pytest.raises(gr.Error, match="Not saved: a strength"):
        handlers.submit(ctx, handlers.Submission("1=2", False, "", token, strength="better"), state, req("ann0"))
    assert store.list_rankings() == []
    state, *_ = handlers.submit(ctx, handlers.Submission("2>1", False, " clearer ", token, strength="better"), state, req("ann0"))
    (ranking,) = store.list_rankings()
    assert (ranking.strength, ranking.comment) == ("better", "clearer")
    assert "the best is better" in state.note
    handlers.submit(ctx, handlers.Submission("1>2", False, "", state.current.token), state, req("ann0"))  # none given: none stored
    assert store.list_rankings()[-1].strength is None
