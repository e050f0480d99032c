"""Running a team without a browser: the Data > Team handlers (annotate/team.py) and
`python -m store queue` / `gold`, against a real store; annotators are refused every team action."""

from __future__ import annotations

import json
from pathlib import Path

import gradio as gr
import pytest

from annotate import team
from annotate.context import AppContext, Refused
from store import Store
from store.__main__ import main
from tests.fixtures_store import open_copy, seed_items
from tests.helpers import req


@pytest.fixture(scope="module")
def accounts_db(tmp_path_factory) -> Path:
    """A closed store file holding boss (admin), ann and bea (scrypt hashes them once, not per test)."""
    path = tmp_path_factory.mktemp("team_accounts") / "rlhf.duckdb"
    with Store(path) as s:
        s.add_annotator("boss", "boss-password", role="admin")
        s.add_annotator("ann", "ann-password")
        s.add_annotator("bea", "bea-password")
    return path


@pytest.fixture
def ctx(accounts_db, tmp_path):
    s = open_copy(accounts_db, tmp_path / "db")
    yield AppContext(store=s, auth=True, data_dir=tmp_path / "data")
    s.close()


def ids(store, *names):
    return [store.find_annotator(n).id for n in names]


def test_admin_sets_the_overlap_the_gold_rate_and_a_rounds_queue(ctx):
    store, boss = ctx.store, req("boss")
    rnd = store.create_round(status="annotating")
    seed_items(store, 2, 2, round_id=rnd.id)
    msg = team.save_queue(ctx, 2, 0.2, boss)
    assert (store.queue_overlap(), store.gold_rate()) == (2, 0.2)
    assert "ranked by **2** annotator(s)" in msg and "**20%**" in msg
    overlap, rate, picker, rounds = team.queue_form(ctx, boss)
    assert (overlap, rate, picker["value"]) == (2, 0.2, rnd.id)
    assert rounds.to_dict("records") == [{"round": rnd.id, "status": "annotating", "items": 2, "rankings": 0,
                                          "overlap": "2 (store)", "priority": "default"}]
    msg, rounds = team.save_round(ctx, rnd.id, 3, -2, boss)
    assert store.round_queue() == {rnd.id: (3, -2)} and msg == f"Round {rnd.id}: overlap 3 and priority -2."
    assert rounds.iloc[0][["overlap", "priority"]].tolist() == ["3", "-2"]
    msg, _ = team.save_round(ctx, rnd.id, None, None, boss)  # blank: back to the defaults
    assert store.round_queue() == {rnd.id: (None, None)} and "the store's overlap" in msg
    # bad input names the problem and changes nothing
    for args, message in (((0, None), "overlap must be a whole number from 1 to 100"),
                          ((2.5, None), "Overlap must be a whole number"),
                          ((None, 1.5), "gold rate must be a number from 0 to 1")):
        with pytest.raises(gr.Error, match=message):
            team.save_queue(ctx, *args, boss)
    with pytest.raises(gr.Error, match="Choose a round"):
        team.save_round(ctx, None, 2, None, boss)
    with pytest.raises(gr.Error, match="no round with id 77"):
        team.save_round(ctx, 77, 2, None, boss)
    assert (store.queue_overlap(), store.gold_rate()) == (2, 0.2)


def test_agreement_and_gold_tables_follow_the_rankings(ctx, tmp_path):
    store, boss = ctx.store, req("boss")
    ann, bea = ids(store, "ann", "bea")
    it1, it2 = seed_items(store, 2, 3)
    x1, x2, x3 = it1.response_ids
    summary, people, items, gold = team.team_tables(ctx, boss)
    assert summary.startswith("**0** items") and len(people) == 0 and len(items) == 0 and len(gold) == 0
    ra = store.save_ranking(ann, it1.prompt_id, [x1, x2, x3], display_order=[x1, x2, x3])
    rb = store.save_ranking(bea, it1.prompt_id, [x2, x1, x3], display_order=[x3, x2, x1])
    summary, people, items, gold = team.team_tables(ctx, boss)
    assert summary.startswith("**1** item ranked by 2+ annotators · pairwise agreement **0.667**")
    assert items.to_dict("records") == [{
        "item": it1.item_id, "round": "–", "prompt": store.get_prompt(it1.prompt_id).text, "annotators": 2,
        "agreement": "0.667", "Kendall τ": "0.333", "gold": "", "rankings (id: annotator)": f"#{ra.id}: ann · #{rb.id}: bea"}]
    by_name = people.set_index("annotator")
    assert by_name.loc["ann", "agrees with others"] == "0.667" and by_name.loc["ann", "gold accuracy"] == "–"
    assert by_name.loc["ann", "first shown ranked best"] == "1.000" and by_name.loc["bea", "first shown ranked best"] == "0.000"
    # ann's ranking becomes the reference: bea is scored against it, ann is not
    msg, summary, people, items, gold = team.mark_gold(ctx, ra.id, boss)
    assert f"Item {it1.item_id} is gold" in msg and items.iloc[0]["gold"] == "gold"
    assert gold.to_dict("records") == [{"item": it1.item_id, "reference (response ids, best first)": f"{x1} > {x2} > {x3}",
                                        "from": f"ann's ranking #{ra.id}"}]
    by_name = people.set_index("annotator")
    assert (by_name.loc["bea", "gold items"], by_name.loc["bea", "gold accuracy"]) == (1, "0.667")
    assert (by_name.loc["ann", "gold items"], by_name.loc["ann", "gold accuracy"]) == (0, "–")
    with pytest.raises(gr.Error, match="no ranking with id 999"):
        team.mark_gold(ctx, 999, boss)
    msg, *_, gold = team.unmark_gold(ctx, it1.item_id, boss)
    assert "no longer gold" in msg and len(gold) == 0
    with pytest.raises(gr.Error, match="no gold item"):
        team.unmark_gold(ctx, it1.item_id, boss)
    # a gold file: refused whole with its rows, then a good one
    bad = tmp_path / "gold.jsonl"
    bad.write_text(json.dumps({"item": it2.item_id, "ranking": it2.response_ids[:1]}) + "\n")
    msg, problems, *_ = team.import_gold(ctx, str(bad), boss)
    assert "was not imported" in msg and problems.iloc[0]["row"] == "1" and store.gold_items() == []
    good = tmp_path / "gold_ok.jsonl"
    good.write_text(json.dumps({"item": it2.item_id, "ranking": list(reversed(it2.response_ids))}) + "\n")
    msg, problems, *_, gold = team.import_gold(ctx, str(good), boss)
    assert msg == "**Imported gold_ok.jsonl**: 1 gold items."
    assert len(problems) == 0 and gold.iloc[0]["from"] == "import:gold_ok.jsonl"


def test_annotators_are_refused_every_team_action(ctx):
    store, ann = ctx.store, req("ann")
    (it,) = seed_items(store, 1, 2)
    r = store.save_ranking(store.find_annotator("bea").id, it.prompt_id, it.response_ids)
    calls = [(team.save_queue, (3, 1.0)), (team.save_round, (1, 2, 2)), (team.mark_gold, (r.id,)),
             (team.unmark_gold, (it.item_id,)), (team.import_gold, ("gold.jsonl",)), (team.team_tables, ()),
             (team.queue_form, ()), (team.go_live, ())]
    for fn, args in calls:
        with pytest.raises(Refused, match="admins only"):
            fn(ctx, *args, ann)
    assert (store.queue_overlap(), store.gold_rate(), store.gold_items()) == (1, 0.0, [])


def test_the_queue_and_gold_commands(tmp_path, capsys):
    db = tmp_path / "rlhf.duckdb"
    with Store(db) as s:
        rnd = s.create_round(status="annotating")
        (it,) = seed_items(s, 1, 3, round_id=rnd.id)
    assert main(["--db", str(db), "queue", "--overlap", "3", "--gold-rate", "0.1"]) == 0
    assert main(["--db", str(db), "queue", "--round", str(rnd.id), "--priority", "4"]) == 0
    assert main(["--db", str(db), "queue", "--round", str(rnd.id), "--round-overlap", "2"]) == 0
    out = capsys.readouterr().out
    assert "overlap 3 (rounds without their own), gold rate 0.1" in out
    assert out.rstrip().endswith(f"round {rnd.id:<4} annotating  overlap 2        priority 4")
    assert main(["--db", str(db), "queue", "--priority", "1"]) == 1
    assert main(["--db", str(db), "queue", "--round", str(rnd.id), "--round-overlap", "two"]) == 1
    assert "--round-overlap takes a whole number or 'default'" in capsys.readouterr().err
    gold = tmp_path / "gold.jsonl"
    gold.write_text(json.dumps({"item": it.item_id, "ranking": it.response_ids}) + "\n")
    assert main(["--db", str(db), "gold", "import", str(gold)]) == 0
    assert main(["--db", str(db), "gold", "remove", str(it.item_id)]) == 0
    assert main(["--db", str(db), "gold", "remove", str(it.item_id)]) == 1
    out = capsys.readouterr().out
    a, b, c = it.response_ids
    assert "imported 1 gold items" in out and f"item {it.item_id:<6} {a} > {b} > {c}" in out
    with Store(db) as s:
        assert (s.queue_overlap(), s.gold_rate(), s.round_queue(), s.gold_items()) == (3, 0.1, {rnd.id: (2, 4)}, [])


def test_cards_past_nine_are_ranked_by_the_letters_they_show():
    from types import SimpleNamespace

    from annotate import render

    html = render.render_item("a question", [SimpleNamespace(text=f"reply {i}") for i in range(12)], token="t")
    keys = [render.position_key(p) for p in range(1, 13)]
    assert keys == ["1", "2", "3", "4", "5", "6", "7", "8", "9", "b", "d", "e"]
    assert not set("acfstu") & set(render.POSITION_KEYS)  # the letters of the other shortcuts
    for pos, key in enumerate(keys, start=1):
        assert f'data-pos="{pos}" data-key="{key}"' in html and f"<kbd>{key.upper()}</kbd>" in html
    assert "press 1–9, then B, D, E from best to worst" in html
    assert render.keys_hint(4) == "1–4" and render.position_key(30) == ""
