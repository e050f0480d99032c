"""save_ranking: pairs in one transaction, idempotency, replacement, all-bad, undo, bulk; gold
reference rankings (set, from a ranking, imported)."""

import json
import re
from math import comb

import pytest

from store import DataError, InvalidRequest, NotFoundError, RankingIn, Store
from tests.fixtures_store import seed_items


def _pairs(store, **kw):
    return sorted((p.chosen_id, p.rejected_id, p.margin) for p in store.list_pairs(**kw))


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
def test_ranking_stores_every_strict_pair(store, store_annotators, k):
    (it,) = seed_items(store, 1, k)
    a = store_annotators[0]
    order = list(reversed(it.response_ids))
    r = store.save_ranking(RankingIn(a.id, it.prompt_id, order, duration_s=4.5))
    assert r.order == [[x] for x in order] and r.item_id == it.item_id
    pairs = _pairs(store, ranking_id=r.id)
    assert len(pairs) == comb(k, 2)
    best, worst = order[0], order[-1]
    assert (best, worst, float(k - 1)) in pairs
    assert store.get_ranking(r.id) == r


def test_ties_and_display_order_are_recorded(store, store_annotators):
    (it,) = seed_items(store, 1, 4)
    r1, r2, r3, r4 = it.response_ids
    a = store_annotators[0]
    shown = [r2, r4, r1, r3]
    r = store.save_ranking(RankingIn(a.id, it.prompt_id, [[r3], [r1, r2], [r4]], display_order=shown))
    assert r.display_order == shown
    assert _pairs(store) == sorted([(r3, r1, 1.0), (r3, r2, 1.0), (r3, r4, 2.0), (r1, r4, 1.0), (r2, r4, 1.0)])
    # without a display order, the annotator's deterministic shuffle is recorded
    (it2,) = seed_items(store, 1, 4, prefix="other")
    r = store.save_ranking(RankingIn(a.id, it2.prompt_id, it2.response_ids))
    assert sorted(r.display_order) == it2.response_ids
    assert r.display_order == store.get_item(it2.item_id, a.id).display_order


def test_same_client_token_stores_one_ranking(store, store_annotators):
    (it,) = seed_items(store, 1, 3)
    a = store_annotators[0]
    first = store.save_ranking(RankingIn(a.id, it.prompt_id, it.response_ids, client_token="tok-1"))
    again = store.save_ranking(RankingIn(a.id, it.prompt_id, list(reversed(it.response_ids)), client_token="tok-1"))
    assert again == first
    assert len(store.list_rankings()) == 1 and len(store.list_pairs()) == 3


def test_reranking_replaces_earlier_ranking(store, store_annotators):
    (it,) = seed_items(store, 1, 3)
    a, b = store_annotators[:2]
    store.save_ranking(RankingIn(a.id, it.prompt_id, it.response_ids))
    store.save_ranking(RankingIn(b.id, it.prompt_id, it.response_ids))
    new = store.save_ranking(RankingIn(a.id, it.prompt_id, list(reversed(it.response_ids))))
    mine = store.list_rankings(annotator_id=a.id)
    assert [r.id for r in mine] == [new.id]
    assert len(store.list_pairs(annotator_id=a.id)) == 3  # no duplicate pairs
    assert _pairs(store, annotator_id=a.id) == _pairs(store, ranking_id=new.id)
    assert len(store.list_pairs(annotator_id=b.id)) == 3  # the other annotator's ranking is untouched


def test_keep_both_rankings_when_configured(store_path):
    s = Store(store_path, replace_rerankings=False)
    try:
        (it,) = seed_items(s, 1, 3)
        a = s.add_annotator("solo", "password-x")
        s.save_ranking(RankingIn(a.id, it.prompt_id, it.response_ids))
        s.save_ranking(RankingIn(a.id, it.prompt_id, list(reversed(it.response_ids))))
        assert len(s.list_rankings()) == 2 and len(s.list_pairs()) == 6
    finally:
        s.close()


def test_all_bad_keeps_pairs_marked(store, store_annotators):
    (it,) = seed_items(store, 1, 3)
    r = store.save_ranking(RankingIn(store_annotators[0].id, it.prompt_id, it.response_ids, all_bad=True,
                                     comment="all wrong"))
    assert r.all_bad and r.comment == "all wrong"
    pairs = store.list_pairs(ranking_id=r.id)
    assert len(pairs) == 3 and all(p.all_bad for p in pairs)


@pytest.mark.parametrize("order_of, message", [
    (lambda ids, other: ids[:2], "missing"),
    (lambda ids, other: ids + [other[0]], "not in the item"),
    (lambda ids, other: [ids[0], ids[0], ids[1], ids[2]], "more than once"),
    (lambda ids, other: [[ids[0]], []], "empty tie group"),
])
def test_bad_rankings_store_nothing(store, store_annotators, order_of, message):
    it, other = seed_items(store, 2, 3)
    with pytest.raises(InvalidRequest, match=message):
        store.save_ranking(RankingIn(store_annotators[0].id, it.prompt_id,
                                     order_of(it.response_ids, other.response_ids)))
    assert store.list_rankings() == [] and store.list_pairs() == []


def test_wrong_prompt_unknown_annotator_and_bad_display_order(store, store_annotators):
    it, other = seed_items(store, 2, 3)
    a = store_annotators[0]
    with pytest.raises(InvalidRequest, match="answers prompt"):
        store.save_ranking(RankingIn(a.id, other.prompt_id, it.response_ids))
    with pytest.raises(NotFoundError, match="annotator"):
        store.save_ranking(RankingIn(9999, it.prompt_id, it.response_ids))
    with pytest.raises(InvalidRequest, match="display_order"):
        store.save_ranking(RankingIn(a.id, it.prompt_id, it.response_ids, display_order=it.response_ids[:2]))
    with pytest.raises(NotFoundError, match="response"):
        store.save_ranking(RankingIn(a.id, it.prompt_id, [123456, 123457]))
    assert store.list_rankings() == []


def test_undo_last_ranking_returns_item_and_removes_pairs(store, store_annotators):
    it1, it2 = seed_items(store, 2, 3)
    a = store_annotators[0]
    store.save_ranking(RankingIn(a.id, it1.prompt_id, it1.response_ids))
    store.save_ranking(RankingIn(a.id, it2.prompt_id, it2.response_ids))
    back = store.undo_last_ranking(a.id)
    assert back.item_id == it2.item_id and back.prompt.id == it2.prompt_id
    assert back.display_order == store.get_item(it2.item_id, a.id).display_order
    assert back.lease_expires_at is not None
    assert [r.item_id for r in store.list_rankings()] == [it1.item_id]
    assert len(store.list_pairs()) == 3
    # the undone item is the annotator's next item again
    assert store.next_item(a.id).item_id == it2.item_id
    assert store.undo_last_ranking(a.id).item_id == it1.item_id
    assert store.undo_last_ranking(a.id) is None
    assert store.list_pairs() == []


def test_bulk_matches_single_path(tmp_path):
    """The same rankings through save_rankings_bulk and save_ranking give the same rows."""
    results = []
    for name in ("single", "bulk"):
        s = Store(tmp_path / f"{name}.duckdb")
        items = seed_items(s, 6, 4)
        a, b = s.add_annotator("a", "password-a"), s.add_annotator("b", "password-b")
        ids = [x.response_ids for x in items]
        todo = [
            RankingIn(a.id, items[0].prompt_id, [[ids[0][1]], [ids[0][0], ids[0][2]], [ids[0][3]]], client_token="t0"),
            RankingIn(a.id, items[1].prompt_id, ids[1], all_bad=True, duration_s=2.0),
            RankingIn(b.id, items[1].prompt_id, list(reversed(ids[1]))),
            RankingIn(a.id, items[0].prompt_id, ids[0], client_token="t0"),  # same token: ignored
            RankingIn(a.id, items[2].prompt_id, ids[2]),
            RankingIn(a.id, items[2].prompt_id, list(reversed(ids[2]))),  # replaces the previous one
        ]
        if name == "single":
            out = [s.save_ranking(r).id for r in todo]
        else:
            out = s.save_rankings_bulk(todo)
        rows = [(r.item_id, r.annotator_id, r.order, r.display_order, r.all_bad) for r in s.list_rankings()]
        pairs = sorted((p.chosen_id, p.rejected_id, p.margin, p.annotator_id, p.all_bad) for p in s.list_pairs())
        results.append((out, rows, pairs))
        live, fresh = s._check_queue_index()
        assert live == fresh
        s.close()
    (out1, rows1, pairs1), (out2, rows2, pairs2) = results
    assert rows1 == rows2 and pairs1 == pairs2
    assert out2[3] == out2[0]  # the repeated token maps to the first ranking
    assert len(rows2) == 4 and len(pairs2) == 5 + 6 + 6 + 6  # the first order has a tie: 5 pairs


def test_concurrent_submissions_written_together_follow_the_same_rules(tmp_path):
    """Store._combined writes queued save_ranking calls in one transaction: a few with the
    statement-per-ranking path, 8 or more with the Arrow path. Both give what one-by-one calls give,
    and a bad request fails alone."""
    from store.pairs import normalize_order

    outcomes = []
    for name, chunk in (("sequential", 1), ("small-batches", 5), ("one-batch", 100)):
        s = Store(tmp_path / f"{name}.duckdb")
        items = seed_items(s, 10, 3)
        a, b = s.add_annotator("a", "password-a"), s.add_annotator("b", "password-b")
        ids = [x.response_ids for x in items]
        reqs = [RankingIn(a.id, x.prompt_id, x.response_ids, client_token=f"t{i}") for i, x in enumerate(items)]
        reqs += [
            RankingIn(a.id, items[0].prompt_id, list(reversed(ids[0])), client_token="t0"),  # repeated token
            RankingIn(b.id, items[1].prompt_id, ids[1][:2]),  # incomplete order: refused alone
            RankingIn(999, items[1].prompt_id, ids[1]),  # unknown annotator: refused alone
            RankingIn(a.id, items[2].prompt_id, list(reversed(ids[2])), client_token="re"),  # replaces t2
            RankingIn(b.id, items[2].prompt_id, [[ids[2][0]], ids[2][1:]], all_bad=True),
        ]
        results = []
        for start in range(0, len(reqs), chunk):
            part = [(r, normalize_order(r.order)) for r in reqs[start:start + chunk]]
            with s._shared.lock:
                with s._tx_locked(queue=True) as cur:
                    results += s._save_ranking_batch(cur, part)
        kinds = [type(x).__name__ for x in results]
        assert kinds[10] == "int" and results[10] == results[0].id  # the earlier ranking's id
        assert kinds[11] == "InvalidRequest" and kinds[12] == "NotFoundError"
        rows = sorted((r.item_id, r.annotator_id, r.order, r.all_bad, r.client_token) for r in s.list_rankings())
        pairs = sorted((p.chosen_id, p.rejected_id, p.margin, p.annotator_id, p.all_bad) for p in s.list_pairs())
        assert s._check_queue_index()[0] == s._check_queue_index()[1]
        outcomes.append((rows, pairs))
        s.close()
    assert outcomes[0] == outcomes[1] == outcomes[2]
    rows, pairs = outcomes[0]
    assert len(rows) == 11 and len(pairs) == 11 * 3 - 1  # the all-bad order has a tie: 2 pairs


# --------------------------------------------------------------------------- gold reference rankings


def test_set_gold_checks_the_order_against_its_item(store, store_policy):
    it1, it2 = seed_items(store, 2, 3)
    gold = store.set_gold(it1.item_id, [it1.response_ids[1], it1.response_ids[0], it1.response_ids[2]])
    assert gold.order == [[it1.response_ids[1]], [it1.response_ids[0]], [it1.response_ids[2]]]
    assert (gold.source, gold.ranking_id, gold.annotator_id) == ("manual", None, None)
    with pytest.raises(InvalidRequest, match=re.escape(f"exactly its responses {it2.response_ids}")):
        store.set_gold(it2.item_id, it2.response_ids[:2])
    with pytest.raises(InvalidRequest, match="more than once"):
        store.set_gold(it2.item_id, [it2.response_ids[0]] * 3)
    with pytest.raises(NotFoundError, match="item with id 999"):
        store.set_gold(999, [1, 2])
    (loose,) = store.add_responses_bulk(store_policy.id, [(it1.prompt_id, ["x", "y"])], queued=False)
    with pytest.raises(InvalidRequest, match="not in the annotation queue"):
        store.set_gold(loose, store.response_ids_by_item([loose])[loose])
    with pytest.raises(NotFoundError, match="no ranking"):
        store.set_gold_from_ranking(12345)
    assert [g.item_id for g in store.gold_items()] == [it1.item_id]


def test_import_gold_by_item_id_or_by_prompt_and_texts(store, tmp_path):
    it1, it2 = seed_items(store, 2, 3)
    r2 = store.item_responses(it2.item_id)
    good = tmp_path / "gold.jsonl"
    good.write_text(json.dumps({"item": it1.item_id, "ranking": [[it1.response_ids[2]], it1.response_ids[:2]]}) + "\n"
                    + json.dumps({"prompt": store.get_prompt(it2.prompt_id).text,
                                  "ranking": [r2[1].text, r2[0].text, r2[2].text]}) + "\n")
    assert store.import_gold(good) == {"rows": 2, "items": [it1.item_id, it2.item_id]}
    got = {g.item_id: g for g in store.gold_items()}
    assert got[it1.item_id].order == [[it1.response_ids[2]], it1.response_ids[:2]]
    assert got[it2.item_id].order == [[r2[1].id], [r2[0].id], [r2[2].id]]
    assert got[it2.item_id].source == "import:gold.jsonl"


def test_a_bad_gold_file_is_refused_whole_with_every_problem(store, tmp_path):
    it1, it2 = seed_items(store, 2, 3)
    bad = tmp_path / "bad_gold.jsonl"
    rows = [{"item": it1.item_id, "ranking": it1.response_ids},  # fine on its own
            {"item": it2.item_id, "ranking": it2.response_ids[:2]},  # a response missing
            {"prompt": "no such prompt", "ranking": ["a", "b"]},
            {"prompt": store.get_prompt(it2.prompt_id).text, "ranking": ["not one of its replies", "x", "y"]},
            {"ranking": [1, 2]},
            {"item": it1.item_id, "ranking": "1>2>3"}]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as err:
        store.import_gold(bad)
    problems = dict(err.value.errors)
    assert sorted(problems) == [2, 3, 4, 5, 6]
    assert "must order exactly its responses" in problems[2]
    assert "no queued item of a prompt with the text 'no such prompt'" in problems[3]
    assert f"item {it2.item_id} has no response with the text 'not one of its replies'" in problems[4]
    assert "needs 'item'" in problems[5] and "must be a list" in problems[6]
    assert store.gold_items() == []  # nothing stored
