"""Agreement (overall, per item, per annotator, against gold) and position bias against
hand-computed numbers, through the pure functions and the Store."""

import pytest

from store import RankingIn
from store.agreement import (
    agreement_summary,
    annotator_agreement,
    gold_agreement,
    item_agreement,
    kendall_tau_b,
    krippendorff_alpha_ordinal,
    position_bias,
)
from tests.fixtures_store import seed_items


def test_krippendorff_alpha_ordinal_reference_example():
    """Krippendorff (2011), "Computing Krippendorff's Alpha-Reliability": 4 coders, 12 units with
    missing values; the paper reports ordinal alpha = 0.815."""
    n = None
    coders = [[1, 2, 3, 3, 2, 1, 4, 1, 2, n, n, n],
              [1, 2, 3, 3, 2, 2, 4, 1, 2, 5, n, 3],
              [n, 3, 3, 3, 2, 3, 4, 2, 2, 5, 1, n],
              [1, 2, 3, 3, 2, 4, 4, 1, 2, 5, 1, n]]
    units = [[c[u] for c in coders if c[u] is not None] for u in range(12)]
    assert krippendorff_alpha_ordinal(units) == pytest.approx(0.815, abs=5e-4)


def test_two_annotators_one_item_by_hand():
    """A ranks 1 > 2 > 3, B ranks 2 > 1 > 3.
    Pairs: (1,2) disagree, (1,3) agree, (2,3) agree -> agreement 2/3; tau = (2 - 1) / 3.
    Alpha: units (1,2), (2,1), (3,3); n_c = 2 each, n = 6; ordinal d2(1,2) = d2(2,3) = (4-2)^2 = 4,
    d2(1,3) = (6-2)^2 = 16; observed sum o*d2 = 2*4 + 2*4 = 16; expected sum n_c n_k d2 =
    2 * (4*4 + 4*16 + 4*4) = 192; alpha = 1 - (6-1) * 16/192 = 7/12."""
    out = agreement_summary({10: {1: [[1], [2], [3]], 2: [[2], [1], [3]]}})
    assert out["items"] == 1 and out["comparisons"] == 3
    assert out["pairwise_agreement"] == pytest.approx(2 / 3)
    assert out["kendall_tau"] == pytest.approx(1 / 3)
    assert out["krippendorff_alpha"] == pytest.approx(7 / 12)


def test_ties_are_left_out_of_pairwise_agreement_and_corrected_in_tau():
    # A: 1 = 2 > 3, B: 1 > 2 > 3. Pair (1,2) is tied by A: not compared. tau-b = 2 / sqrt(2 * 3).
    out = agreement_summary({1: {1: [[1, 2], [3]], 2: [[1], [2], [3]]}})
    assert out["comparisons"] == 2 and out["pairwise_agreement"] == 1.0
    assert out["kendall_tau"] == pytest.approx(2 / 6 ** 0.5)
    assert kendall_tau_b({1: 1.0, 2: 1.0}, {1: 1.0, 2: 2.0}) is None  # all tied by one side


def test_single_annotator_items_do_not_count():
    out = agreement_summary({1: {1: [[1], [2]]}})
    assert out == {"items": 0, "comparisons": 0, "pairwise_agreement": None,
                   "krippendorff_alpha": None, "kendall_tau": None}


def test_position_bias_by_hand():
    # first shown (5) best; first shown (5) not best; first shown (8) in the tied top group
    out = position_bias([([[5], [6]], [5, 6]), ([[6], [5]], [5, 6]), ([[7, 8], [9]], [8, 9, 7])])
    assert out["rankings"] == 3
    assert out["first_shown_best_rate"] == pytest.approx(2 / 3)
    assert out["expected_rate"] == pytest.approx((1 / 2 + 1 / 2 + 2 / 3) / 3)
    assert out["best_rate_by_position"] == pytest.approx([2 / 3, 1 / 3, 1.0])


def test_store_statistics(store, store_annotators):
    it1, it2 = seed_items(store, 2, 3)
    a, b = store_annotators
    x1, x2, x3 = it1.response_ids
    store.save_ranking(RankingIn(a.id, it1.prompt_id, [x1, x2, x3], display_order=[x1, x2, x3], duration_s=2.0))
    store.save_ranking(RankingIn(b.id, it1.prompt_id, [x2, x1, x3], display_order=[x1, x2, x3], duration_s=6.0))
    store.save_ranking(RankingIn(a.id, it2.prompt_id, it2.response_ids, all_bad=True, duration_s=4.0))
    store.skip_item(b.id, it2.item_id)
    ag = store.agreement()
    assert (ag.items, ag.comparisons) == (1, 3)
    assert ag.pairwise_agreement == pytest.approx(2 / 3) and ag.krippendorff_alpha == pytest.approx(7 / 12)
    stats = {s.name: s for s in store.annotator_stats()}
    assert (stats["ann0"].rankings, stats["ann0"].pairs, stats["ann0"].all_bad) == (2, 6, 1)
    assert stats["ann0"].median_duration_s == pytest.approx(3.0) and stats["ann0"].rankings_today == 2
    assert (stats["ann1"].rankings, stats["ann1"].skips, stats["ann1"].median_duration_s) == (1, 1, 6.0)
    pb = store.position_bias()
    assert pb.rankings == 3 and pb.first_shown_best_rate is not None
    counts = store.counts(overlap=2)
    assert (counts["rankings"], counts["pairs"], counts["items"], counts["items_remaining"]) == (3, 9, 2, 1)


def test_per_annotator_agreement_with_the_others_and_their_majority_by_hand():
    """One item, responses 1, 2, 3. A and B: 1 > 2 > 3; C: 3 > 2 > 1; D: 1 = 2 > 3.
    A, pair (1,2): B agrees, C disagrees, D tied (not compared); (1,3) and (2,3): B, D agree, C not.
    Pairwise A = (1 + 2 + 2) / (2 + 3 + 3) = 5/8. Majority of the others (leave-one-out): (1,2)
    splits B against C (left out); (1,3), (2,3) go A's way: 2/2.
    C: every strict preference against everyone: pairwise 0/8, majority 0/3.
    D: (1,2) tied by D itself (left out); (1,3), (2,3): A, B agree, C not: pairwise 4/6, majority 2/2."""
    out = annotator_agreement({7: {"A": [[1], [2], [3]], "B": [[1], [2], [3]], "C": [[3], [2], [1]],
                                   "D": [[1, 2], [3]]}})
    assert out["A"] == out["B"] == {"items": 1, "pairwise": (5, 8), "majority": (2, 2)}
    assert out["C"] == {"items": 1, "pairwise": (0, 8), "majority": (0, 3)}
    assert out["D"] == {"items": 1, "pairwise": (4, 6), "majority": (2, 2)}
    assert annotator_agreement({8: {"A": [[1], [2]]}}) == {}  # nobody to agree with


def test_item_agreement_and_gold_agreement_by_hand():
    one = item_agreement({1: [[1], [2], [3]], 2: [[2], [1], [3]]})
    assert one == {"annotators": 2, "comparisons": 3, "pairwise_agreement": pytest.approx(2 / 3),
                   "kendall_tau": pytest.approx(1 / 3)}
    assert item_agreement({1: [[1], [2]]})["pairwise_agreement"] is None
    # gold 1 > 2 > 3 against 2 > 1 = 3: (1,2) reversed 0, (1,3) tied 1/2, (2,3) kept 1
    assert gold_agreement([[2], [1, 3]], [[1], [2], [3]]) == (1.5, 3)
    # a gold tie (1 = 2) is no question: only (1,3) tied 1/2 and (2,3) kept 1 count
    assert gold_agreement([[2], [1, 3]], [[1, 2], [3]]) == (1.5, 2)
    assert gold_agreement([[1, 2, 3]], [[3], [2], [1]]) == (1.5, 3)  # tying everything scores half


def test_store_agreement_per_item_and_annotator_and_quality(store, store_annotators):
    it1, it2 = seed_items(store, 2, 3)
    a, b = store_annotators
    x1, x2, x3 = it1.response_ids
    y1, y2, y3 = it2.response_ids
    ra = store.save_ranking(RankingIn(a.id, it1.prompt_id, [x1, x2, x3], display_order=[x1, x2, x3]))
    rb = store.save_ranking(RankingIn(b.id, it1.prompt_id, [x2, x1, x3], display_order=[x1, x2, x3]))
    store.set_gold_from_ranking(ra.id)  # a made the reference of it1: only b is scored on it
    store.set_gold(it2.item_id, [[y1], [y2], [y3]])
    store.save_ranking(RankingIn(a.id, it2.prompt_id, [[y1], [y2, y3]], display_order=[y1, y2, y3]))
    (item,) = store.item_agreement()
    assert (item.item_id, item.annotators, item.gold, item.rankings) == (
        it1.item_id, 2, True, sorted([(ra.id, a.id), (rb.id, b.id)]))
    assert item.pairwise_agreement == pytest.approx(2 / 3) and item.kendall_tau == pytest.approx(1 / 3)
    per = {x.name: x for x in store.annotator_agreement()}
    assert (per["ann0"].rankings, per["ann0"].shared_items, per["ann0"].gold_items) == (2, 1, 1)
    assert per["ann0"].gold_accuracy == pytest.approx(2.5 / 3)  # (1,2) 1, (1,3) 1, (2,3) tied 1/2
    assert per["ann1"].gold_accuracy == pytest.approx(2 / 3)  # 2 > 1 > 3 against 1 > 2 > 3
    assert per["ann0"].majority_agreement == per["ann1"].majority_agreement == pytest.approx(2 / 3)
    # position bias: a ranked the first-shown response best both times, b never; no bias = 1/3
    assert (per["ann0"].first_shown_best_rate, per["ann1"].first_shown_best_rate) == (1.0, 0.0)
    assert per["ann0"].expected_first_rate == pytest.approx(1 / 3)
    assert store.annotator_quality() == {
        a.id: {"gold_accuracy": pytest.approx(2.5 / 3), "majority_agreement": pytest.approx(2 / 3),
               "n_gold": 1, "n_ranked": 2, "gold_comparisons": 3, "majority_comparisons": 3},
        b.id: {"gold_accuracy": pytest.approx(2 / 3), "majority_agreement": pytest.approx(2 / 3),
               "n_gold": 1, "n_ranked": 1, "gold_comparisons": 3, "majority_comparisons": 3}}


def _reference(rankings) -> dict[int, dict[int, list]]:
    """{item: {annotator: order}} of the latest ranking of each annotator, as the definitions read it."""
    out: dict[int, dict[int, list]] = {}
    for r in sorted(rankings, key=lambda r: r.id):
        out.setdefault(r.item_id, {})[r.annotator_id] = r.order
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == (pytest.approx(b[key], rel=1e-9, abs=1e-12) if isinstance(b[key], float) else b[key]), key


@pytest.mark.parametrize("replace", [True, False], ids=["rerankings-replace", "rerankings-kept"])
def test_the_stored_agreement_follows_every_write_and_equals_the_definitions(tmp_path, replace):
    """agreement_items (store/agreement_table.py) against the pure definitions over the rankings,
    after random rankings, re-rankings, bulk saves and undos, read between writes (so the table is
    brought up to date piece by piece), overall, per round, per item, per annotator, for an
    export's subset of rankings, and position bias."""
    import random

    from store import Store

    rng = random.Random(7)
    store = Store(tmp_path / "agree.duckdb", replace_rerankings=replace)
    rounds = [store.create_round(config={}).id for _ in range(2)]
    items = [it for r in rounds for it in seed_items(store, 6, 4, round_id=r, prefix=f"round {r}")]
    round_of = {it.item_id: r for r, chunk in zip(rounds, (items[:6], items[6:])) for it in chunk}
    people = [store.add_annotator(f"p{i}", f"password-{i}").id for i in range(5)]

    def order_of(it):
        ids = list(it.response_ids)
        rng.shuffle(ids)
        groups, i = [], 0
        while i < len(ids):
            size = 2 if rng.random() < 0.25 and i + 1 < len(ids) else 1
            groups.append(ids[i:i + size])
            i += size
        return groups, rng.sample(it.response_ids, len(it.response_ids))

    for step in range(160):
        roll, it, who = rng.random(), rng.choice(items), rng.choice(people)
        if roll < 0.6:
            order, shown = order_of(it)
            store.save_ranking(RankingIn(who, it.prompt_id, order, display_order=shown))
        elif roll < 0.8:
            batch = []
            for _ in range(4):
                it = rng.choice(items)
                order, shown = order_of(it)
                batch.append(RankingIn(rng.choice(people), it.prompt_id, order, display_order=shown))
            store.save_rankings_bulk(batch)
        else:
            store.undo_last_ranking(who)
        if step % 20 != 19:
            continue
        rankings = store.list_rankings()
        ref = _reference(rankings)
        _same(vars(store.agreement()), agreement_summary(ref))
        for r in rounds:
            _same(vars(store.agreement(round_id=r)),
                  agreement_summary({i: by for i, by in ref.items() if round_of[i] == r}))
        stored = {x.item_id: x for x in store.item_agreement()}
        assert stored.keys() == {i for i, by in ref.items() if len(by) >= 2}
        for item_id, x in stored.items():
            _same({k: getattr(x, k) for k in ("annotators", "comparisons", "pairwise_agreement", "kendall_tau")},
                  item_agreement(ref[item_id]))
            latest = {r.annotator_id: r.id for r in sorted(rankings, key=lambda r: r.id) if r.item_id == item_id}
            assert x.rankings == sorted((rid, a) for a, rid in latest.items())
        least = [x.pairwise_agreement for x in store.item_agreement(limit=3)]
        assert least == sorted(least, key=lambda v: (v is None, v or 0.0))
        per = annotator_agreement(ref)
        for row in store.annotator_agreement():
            mine = per.get(row.annotator_id, {"items": 0, "pairwise": (0, 0), "majority": (0, 0)})
            assert row.shared_items == mine["items"]
            assert row.pairwise_agreement == (mine["pairwise"][0] / mine["pairwise"][1] if mine["pairwise"][1]
                                              else None)
            assert row.majority_agreement == (mine["majority"][0] / mine["majority"][1] if mine["majority"][1]
                                              else None)
        _same(vars(store.position_bias()), position_bias([(r.order, r.display_order) for r in rankings]))
        # an export of some of the rankings: the stored rows where they are whole, computed where not
        kept = [r for r in rankings if rng.random() < 0.7]
        cur = store.cursor()
        cur.execute("CREATE OR REPLACE TEMP TABLE _export_rankings AS SELECT id AS ranking_id, item_id, annotator_id, "
                    "order_groups FROM rankings WHERE id IN (SELECT unnest(?))", [[r.id for r in kept]])
        _same(store.export_agreement(cur), agreement_summary(_reference(kept)))
        cur.execute("DROP TABLE _export_rankings")
    assert store.refresh_agreement() == 0  # nothing changed since the last read
    store.close()
