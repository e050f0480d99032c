"""Running a team without a browser, against a real store: the queue's rules (overlap per round and
by default, reached and never passed, never an item twice, the newest round first or an admin's
priority, gold items mixed in at their rate), the Data > Team handlers (annotate/team.py), and
`python -m store queue` / `gold`; annotators are refused every team action."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import gradio as gr
import pytest

from annotate import team
from annotate.context import AppContext, Refused
from store import RankingIn, Store
from store.errors import InvalidRequest, NotFoundError
from store.__main__ import main
from tests.fixtures_store import open_copy, seed_items
from tests.helpers import req


ANNOTATORS = ("ann", "bea", "cy", "dan")


@pytest.fixture(scope="module")
def accounts_db(tmp_path_factory) -> Path:
    """A closed store file holding boss (admin) and four annotators (scrypt hashes them once, not
    per test)."""
    path = tmp_path_factory.mktemp("team_accounts") / "rlhf.duckdb"
    with Store(path) as s:
        s.add_annotator("boss", "boss-password", role="admin")
        for name in ANNOTATORS:
            s.add_annotator(name, f"{name}-password")
    return path


@pytest.fixture
def ctx(accounts_db, tmp_path):
    s = open_copy(accounts_db, tmp_path / "db")
    yield AppContext(store=s, auth=True, data_dir=tmp_path / "data")
    s.close()


@pytest.fixture
def crew(ctx):
    """(store, [the four annotators])."""
    return ctx.store, [ctx.store.find_annotator(n) for n in ANNOTATORS]


def ids(store, *names):
    return [store.find_annotator(n).id for n in names]


# --------------------------------------------------------------------------- the queue's rules for a team


def rank_all(store, annotator_id, *, limit=1000) -> list[int]:
    """Let the annotator rank what the queue hands them (first response best); their item ids in order."""
    got = []
    while len(got) < limit and (item := store.next_item(annotator_id)) is not None:
        store.save_ranking(RankingIn(annotator_id, item.prompt.id, item.display_order))
        got.append(item.item_id)
    return got


def test_store_overlap_and_a_rounds_own_overlap_are_reached_and_not_passed(crew):
    store, (a, b, c, d) = crew
    plain = [x.item_id for x in seed_items(store, 3, 2)]
    rnd = store.create_round(status="annotating")
    in_round = [x.item_id for x in seed_items(store, 2, 2, round_id=rnd.id, prefix="round")]
    store.set_queue_overlap(2)
    store.set_round_queue(rnd.id, overlap=3)
    assert store.queue_overlap() == 2 and store.round_queue() == {rnd.id: (3, None)}
    for ann in (a, b, c, d):
        rank_all(store, ann.id)
    per_item = Counter(r.item_id for r in store.list_rankings())
    assert {i: per_item[i] for i in plain} == dict.fromkeys(plain, 2)
    assert {i: per_item[i] for i in in_round} == dict.fromkeys(in_round, 3)
    assert len({(r.item_id, r.annotator_id) for r in store.list_rankings()}) == len(store.list_rankings())  # never twice
    assert store.items_remaining() == 0 and store.remaining_count(d.id) == 0
    # raising the store's overlap opens the plain items again, for annotators who have not ranked them
    store.set_queue_overlap(3)
    assert store.items_remaining() == 3
    assert store.remaining_count(d.id) == sum(1 for i in plain if d.id not in
                                             {r.annotator_id for r in store.list_rankings(item_id=i)})
    assert store._check_queue_index()[0] == store._check_queue_index()[1]


def test_overlap_and_priority_settings_refuse_bad_values(crew):
    store, _ = crew
    rnd = store.create_round()
    for bad in (0, -1, 2.5, "2", True, 101):
        with pytest.raises(InvalidRequest, match="overlap must be a whole number from 1 to 100"):
            store.set_queue_overlap(bad)
        with pytest.raises(InvalidRequest, match="overlap"):
            store.set_round_queue(rnd.id, overlap=bad)
    with pytest.raises(InvalidRequest, match="priority"):
        store.set_round_queue(rnd.id, priority=5000)
    with pytest.raises(NotFoundError, match="round with id 99"):
        store.set_round_queue(99, overlap=2)
    for bad in (-0.1, 1.5, float("nan"), "0.2"):
        with pytest.raises(InvalidRequest, match="gold rate"):
            store.set_gold_rate(bad)
    assert store.queue_overlap() == 1 and store.round_queue() == {} and store.gold_rate() == 0.0


def test_the_newest_rounds_items_come_first_unless_an_admin_orders_otherwise(crew):
    store, (a, b, c, _) = crew
    store.set_queue_overlap(2)
    leftovers = [x.item_id for x in seed_items(store, 3, 2, prefix="old")]
    store.save_ranking(RankingIn(c.id, *_first_order(store, leftovers[0])))  # the index exists before the rounds' items
    r1 = store.create_round(status="annotating")
    first = [x.item_id for x in seed_items(store, 2, 2, round_id=r1.id, prefix="r1")]
    r2 = store.create_round(status="annotating")
    second = [x.item_id for x in seed_items(store, 2, 2, round_id=r2.id, prefix="r2")]
    # the newest round first, then the rest by need (leftover 0 has a ranking already) and age
    assert rank_all(store, a.id) == second + leftovers[1:] + first + leftovers[:1]
    # an admin puts round 1 first, and the leftovers (no round) before round 2
    store.set_round_queue(r1.id, priority=5)
    store.set_round_queue(r2.id, priority=-1)
    assert rank_all(store, b.id) == first + leftovers[1:] + second  # leftover 0 has its 2 rankings
    assert store.round_queue() == {r1.id: (None, 5), r2.id: (None, -1)}
    assert store._check_queue_index()[0] == store._check_queue_index()[1]


def _first_order(store, item_id):
    """(prompt id, order) of a ranking of the item: its responses in id order."""
    item = store.get_item(item_id)
    return item.prompt.id, [r.id for r in item.responses]


def test_skipping_a_gold_item_moves_the_turn_on(crew):
    """A skip counts as a turn: skipping gold items does not walk through the gold set."""
    store, anns = crew
    seed_items(store, 30, 2)
    gold = [x.item_id for x in seed_items(store, 20, 2, prefix="gold")]
    for item_id in gold:
        store.set_gold(item_id, [[r] for r in sorted(store.response_ids_by_item([item_id])[item_id])])
    store.set_gold_rate(0.25)
    a = anns[0].id
    served = []
    for _ in range(12):  # skip everything: the turns go on as if each item had been ranked
        item = store.next_item(a)
        served.append(item.item_id in gold)
        store.skip_item(a, item.item_id)
    assert 0 < sum(served) < 10, served  # at rate 0.25 not (nearly) every skip is answered with gold


def test_gold_items_are_mixed_in_at_the_rate_for_everyone_whatever_the_overlap(crew):
    store, anns = crew
    regular = [x.item_id for x in seed_items(store, 40, 2)]
    gold = [x.item_id for x in seed_items(store, 12, 2, prefix="gold")]
    for item_id in gold:
        store.set_gold(item_id, [[r] for r in sorted(store.response_ids_by_item([item_id])[item_id])])
    assert store.items_remaining() == 40  # gold items are not in the regular queue
    store.set_queue_overlap(1)
    store.set_gold_rate(0.25)
    leased = store.next_item(anns[0].id)
    assert store.next_item(anns[0].id).item_id == leased.item_id  # a reload: the same item, gold or not
    got = {a.id: [] for a in anns}
    for _ in range(10):  # four annotators take turns, ten items each
        for a in anns:
            item = store.next_item(a.id)
            store.save_ranking(RankingIn(a.id, item.prompt.id, item.display_order))
            got[a.id].append(item.item_id)
    n_gold = [sum(i in gold for i in items) for items in got.values()]
    assert 4 <= sum(n_gold) <= 16  # 40 draws at rate 0.25: 10 expected; the draws are fixed, not random
    assert all(len(set(items)) == 10 for items in got.values())  # never twice
    per_item = Counter(r.item_id for r in store.list_rankings())
    assert all(per_item[i] == 1 for i in regular if i in per_item)  # overlap 1 for the regular items
    # a gold item is served to each annotator: at rate 1 everyone gets every gold item they lack
    store.set_gold_rate(1.0)
    for a in anns:
        want = [i for i in gold if i not in got[a.id]]
        assert sorted(rank_all(store, a.id, limit=len(want))) == sorted(want)
    assert all(per_item_gold == len(anns) for per_item_gold in
               Counter(r.item_id for r in store.list_rankings() if r.item_id in gold).values())
    # rate 0: no gold; the regular queue goes on where it was
    store.set_gold_rate(0.0)
    item = store.next_item(anns[0].id)
    assert item.item_id in regular and store.gold_rate() == 0.0
    assert store._check_queue_index()[0] == store._check_queue_index()[1]


def test_a_gold_reference_from_a_ranking_and_back_to_the_regular_queue(crew):
    store, (a, b, *_) = crew
    it1, it2 = seed_items(store, 2, 3)
    ranking = store.save_ranking(RankingIn(a.id, it1.prompt_id, [[it1.response_ids[2]], it1.response_ids[:2]]))
    gold = store.set_gold_from_ranking(ranking.id)
    assert (gold.item_id, gold.order, gold.ranking_id, gold.annotator_id) == (
        it1.item_id, ranking.order, ranking.id, a.id)
    store.set_gold_rate(1.0)
    assert store.next_item(a.id).item_id == it2.item_id  # a made the reference: not theirs to rank
    assert store.next_item(b.id).item_id == it1.item_id  # b gets the gold item first
    store.remove_gold(it1.item_id)
    assert store.gold_items() == [] and store.items_remaining() == 1  # it1 is ranked once (overlap 1)
    with pytest.raises(NotFoundError, match="gold item"):
        store.remove_gold(it1.item_id)
    assert store._check_queue_index()[0] == store._check_queue_index()[1]


# --------------------------------------------------------------------------- Data > Team


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
    # picking the round fills its form: changing the priority alone keeps its overlap
    assert team.round_form(ctx, rnd.id, boss) == (3, -2) and team.round_form(ctx, None, boss) == (None, None)
    team.save_round(ctx, rnd.id, *team.round_form(ctx, rnd.id, boss)[:1], 5, boss)
    assert store.round_queue() == {rnd.id: (3, 5)}
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
    ra = store.save_ranking(RankingIn(ann, it1.prompt_id, [x1, x2, x3], display_order=[x1, x2, x3]))
    rb = store.save_ranking(RankingIn(bea, it1.prompt_id, [x2, x1, x3], display_order=[x3, x2, x1]))
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
    r = store.save_ranking(RankingIn(store.find_annotator("bea").id, it.prompt_id, it.response_ids))
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
    assert keys == ["1", "2", "3", "4", "5", "6", "7", "8", "9", "b", "d", "g"]
    assert not set("acefstu") & set(render.POSITION_KEYS)  # the letters of the other shortcuts
    for pos, key in enumerate(keys, start=1):
        assert f'data-pos="{pos}" data-key="{key}"' in html and f"<kbd>{key.upper()}</kbd>" in html
    assert "press 1–9, then B, D, G from best to worst" in html
    assert render.keys_hint(4) == "1–4" and render.position_key(30) == ""


@pytest.mark.parametrize("bad", [[1], {"a": 1}, "two", 2**70, -(2**70), 1.5, True, float("inf"), float("nan")])
def test_team_forms_refuse_odd_input_with_a_clear_error_and_change_nothing(ctx, bad):
    store, boss = ctx.store, req("boss")
    rnd = store.create_round()
    before = (store.queue_overlap(), store.gold_rate(), store.round_queue(), store.gold_items())
    calls = [(team.save_queue, (bad, None)), (team.save_queue, (None, bad)), (team.save_round, (bad, 2, None)),
             (team.save_round, (rnd.id, bad, None)), (team.save_round, (rnd.id, None, bad)),
             (team.mark_gold, (bad,)), (team.unmark_gold, (bad,))]
    for fn, args in calls:
        with pytest.raises(gr.Error) as err:
            fn(ctx, *args, boss)
        assert str(err.value).strip() and "Traceback" not in str(err.value)
    msg, problems, *_ = team.import_gold(ctx, bad, boss)  # not a file: refused, with the reason
    assert "was not imported" in msg and "no such file" in problems.iloc[0]["problem"]
    assert (store.queue_overlap(), store.gold_rate(), store.round_queue(), store.gold_items()) == before
