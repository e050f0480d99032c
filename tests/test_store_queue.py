"""The queue: overlap, leases and their expiry, skips, flags, counts, display order, concurrency."""

import random
import threading
from collections import Counter, defaultdict

import pytest

from store import Store
from store.errors import InvalidRequest
from store.pairs import normalize_order
from store.records import RankingIn
from tests.fixtures_store import seed_items


def test_next_item_prefers_items_needing_annotations_and_respects_overlap(store, store_annotators):
    items = seed_items(store, 3, 3)
    a, b = store_annotators
    c = store.add_annotator("ann2", "password-2")
    ids = [x.item_id for x in items]
    # a takes item 0 and ranks it; with overlap 2, b is offered the unranked items first
    got = store.next_item(a.id, overlap=2)
    assert got.item_id == ids[0]
    store.save_ranking(RankingIn(a.id, got.prompt.id, got.display_order))
    assert store.next_item(b.id, overlap=2).item_id == ids[1]
    assert store.next_item(c.id, overlap=2).item_id == ids[2]
    # now every item is ranked or leased once: c (holding item 2) still gets item 2 back first
    assert store.next_item(c.id, overlap=2).item_id == ids[2]
    # ... and a prefetch that excludes it gets item 0 (1 ranking) before item 1 (1 lease by b)
    assert store.next_item(c.id, overlap=2, exclude=[ids[2]]).item_id == ids[0]


def test_leases_block_other_annotators_until_they_expire(store, store_annotators, clock):
    (it,) = seed_items(store, 1, 2)
    a, b = store_annotators
    assert store.next_item(a.id, overlap=1, lease_seconds=60).item_id == it.item_id
    assert store.next_item(b.id, overlap=1) is None  # leased by a
    assert store.remaining_count(b.id, overlap=1) == 0
    assert store.remaining_count(a.id, overlap=1) == 1  # a's own lease counts for a
    assert [(i, ann) for i, ann, _ in store.active_leases()] == [(it.item_id, a.id)]
    clock.advance(30)  # half way: still a's
    assert [(i, ann) for i, ann, _ in store.active_leases()] == [(it.item_id, a.id)]
    assert store.next_item(b.id, overlap=1) is None
    clock.advance(31)
    assert store.active_leases() == []
    assert store.next_item(b.id, overlap=1).item_id == it.item_id  # expired lease ignored
    assert store.next_item(a.id, overlap=1) is None
    store.release_lease(b.id, it.item_id)
    assert store.next_item(a.id, overlap=1).item_id == it.item_id


def test_never_the_same_item_twice_to_one_annotator(store, store_annotators):
    items = seed_items(store, 4, 2)
    a = store_annotators[0]
    seen = []
    while (got := store.next_item(a.id, overlap=3)) is not None:
        seen.append(got.item_id)
        store.save_ranking(RankingIn(a.id, got.prompt.id, got.display_order))
    assert sorted(seen) == [x.item_id for x in items]
    assert store.remaining_count(a.id, overlap=3) == 0
    assert store.items_remaining(overlap=3) == 4 and store.items_remaining(overlap=1) == 0


def test_skip_and_flag(store, store_annotators):
    it1, it2 = seed_items(store, 2, 2)
    a, b = store_annotators
    store.skip_item(a.id, it1.item_id)
    assert store.next_item(a.id).item_id == it2.item_id
    store.release_lease(a.id)
    assert store.next_item(b.id).item_id == it1.item_id  # a skip is personal
    store.release_lease(b.id)
    store.flag_prompt(it2.prompt_id, a.id, "nonsense prompt")
    assert store.is_flagged(it2.prompt_id)
    assert store.next_item(a.id) is None and store.remaining_count(a.id) == 0
    assert [(p.id, reasons) for p, reasons in store.flagged_prompts()] == [(it2.prompt_id, ["nonsense prompt"])]
    assert store.counts()["flagged_prompts"] == 1
    store.unflag_prompt(it2.prompt_id)
    assert store.next_item(a.id).item_id == it2.item_id
    assert store._check_queue_index()[0] == store._check_queue_index()[1]


def test_single_response_and_imported_items_are_not_queued(store, store_annotators, store_policy):
    pid = store.add_prompts(["lonely"])[0]
    store.add_responses(pid, store_policy.id, ["only one"])
    store.add_responses(pid, store_policy.id, ["x", "y"], queued=False)
    assert store.next_item(store_annotators[0].id) is None
    assert store.counts()["items"] == 0


def test_display_order_is_shuffled_per_annotator_and_stable(store, store_annotators):
    items = seed_items(store, 12, 5)
    a, b = store_annotators
    orders_a = [store.get_item(x.item_id, a.id).display_order for x in items]
    assert orders_a == [store.get_item(x.item_id, a.id).display_order for x in items]  # stable
    orders_b = [store.get_item(x.item_id, b.id).display_order for x in items]
    assert orders_a != orders_b
    assert any(o != sorted(o) for o in orders_a)  # actually shuffled
    got = store.next_item(a.id)
    assert got.display_order == orders_a[0] == [r.id for r in got.responses]


def test_progress_line(store, store_annotators):
    items = seed_items(store, 3, 2)
    a = store_annotators[0]
    store.save_ranking(RankingIn(a.id, items[0].prompt_id, items[0].response_ids))
    p = store.progress(a.id)
    assert (p.today, p.total, p.remaining) == (1, 1, 2)


def test_index_follows_random_operations(store, store_annotators):
    """After a random mix of every queue-changing call, the in-memory index equals one rebuilt
    from the database."""
    rng = random.Random(7)
    items = seed_items(store, 10, 3)
    anns = store_annotators
    rnd = store.create_round()
    for _ in range(70):
        a = rng.choice(anns).id
        op = rng.random()
        if op < 0.4:
            got = store.next_item(a, overlap=2)
            if got is not None:
                store.save_ranking(RankingIn(a, got.prompt.id, [got.display_order[:2], got.display_order[2:]]))
        elif op < 0.5:
            store.undo_last_ranking(a)
        elif op < 0.6:
            store.skip_item(a, rng.choice(items).item_id)
        elif op < 0.7:
            store.flag_prompt(rng.choice(items).prompt_id, a)
        elif op < 0.8:
            store.unflag_prompt(rng.choice(items).prompt_id)
        elif op < 0.85:  # a gold item, or one no longer gold
            it = rng.choice(items)
            if any(g.item_id == it.item_id for g in store.gold_items()):
                store.remove_gold(it.item_id)
            else:
                store.set_gold(it.item_id, it.response_ids)
        elif op < 0.9:  # a round's items arrive, or its settings change
            if rng.random() < 0.5:
                items += seed_items(store, 1, 3, round_id=rnd.id, prefix=f"round {_}")
            else:
                store.set_round_queue(rnd.id, overlap=rng.choice([None, 1, 3]), priority=rng.choice([None, -1, 2]))
        else:
            store.release_lease(a)
    seed_items(store, 2, 3, prefix="late")
    live, fresh = store._check_queue_index()
    assert live == fresh
    # remaining_count agrees with what next_item actually hands out
    for a in anns:
        expected = store.remaining_count(a.id, overlap=2)
        taken = []
        while (got := store.next_item(a.id, overlap=2, exclude=taken)) is not None:
            taken.append(got.item_id)
        assert len(taken) == expected
        store.release_lease(a.id)


def test_eight_threads_submitting_at_once_lose_nothing(store_path):
    """8 annotators on 8 threads take and rank items concurrently (overlap 2): every item ends
    with exactly 2 rankings, nobody ranks an item twice, and every pair is stored."""
    s = Store(store_path)
    try:
        seed_items(s, 40, 3)
        anns = [s.add_annotator(f"t{i}", "password-t") for i in range(8)]
        handed = defaultdict(set)
        lock = threading.Lock()
        errors = []
        barrier = threading.Barrier(len(anns))

        def work(annotator_id):
            try:
                barrier.wait()
                while (got := s.next_item(annotator_id, overlap=2)) is not None:
                    with lock:
                        handed[got.item_id].add(annotator_id)
                    s.save_ranking(RankingIn(annotator_id, got.prompt.id, got.display_order,
                                             display_order=got.display_order,
                                             client_token=f"{annotator_id}-{got.item_id}"))
            except Exception as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(a.id,)) for a in anns]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        rankings = s.list_rankings()
        per_item = Counter(r.item_id for r in rankings)
        assert len(rankings) == 80 and set(per_item.values()) == {2} and len(per_item) == 40
        assert len({(r.item_id, r.annotator_id) for r in rankings}) == 80
        assert all(len(v) <= 2 for v in handed.values())  # never handed beyond the overlap
        assert len(s.list_pairs()) == 80 * 3
        assert s.counts()["rankings"] == 80 and s.items_remaining(overlap=2) == 0
        assert s._check_queue_index()[0] == s._check_queue_index()[1]
    finally:
        s.close()


def test_concurrent_submissions_of_preassigned_rankings(store_path):
    """8 threads call save_ranking at the same moment (no queue): all 8 x 5 rankings arrive."""
    s = Store(store_path)
    try:
        items = seed_items(s, 5, 4)
        anns = [s.add_annotator(f"c{i}", "password-c") for i in range(8)]
        barrier = threading.Barrier(8)
        errors = []

        def work(a):
            try:
                barrier.wait()
                for it in items:
                    s.save_ranking(RankingIn(a.id, it.prompt_id, it.response_ids))
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(a,)) for a in anns]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(s.list_rankings()) == 40 and len(s.list_pairs()) == 40 * 6
    finally:
        s.close()


def test_next_item_requests_written_together_respect_each_other(store, store_annotators):
    """Store._combined runs queued next_item calls in one transaction, in order: a later pick sees
    the leases of the earlier ones."""
    it1, it2 = seed_items(store, 2, 2)
    a, b = store_annotators
    c = store.add_annotator("ann2", "password-2")
    requests = [(a.id, 1, 60.0, frozenset()), (b.id, 1, 60.0, frozenset()), (c.id, 1, 60.0, frozenset()),
                (a.id, 1, 60.0, frozenset())]
    with store._shared.lock:
        with store._tx_locked(queue=True) as cur:
            out = store._next_item_batch(cur, requests)
    assert [x and x[0] for x in out] == [it1.item_id, it2.item_id, None, it1.item_id]  # a keeps its lease
    assert sorted((i, ann) for i, ann, _ in store.active_leases()) == [(it1.item_id, a.id), (it2.item_id, b.id)]
    assert store._check_queue_index()[0] == store._check_queue_index()[1]


def test_progress_counts_come_from_the_index_and_match_the_database(store, store_annotators):
    """The progress line's today/total are kept in memory; rankings from before today count in
    the total only, also after the index is rebuilt from the database."""
    items = seed_items(store, 4, 2)
    a, b = store_annotators
    for it in items[:3]:
        store.save_ranking(RankingIn(a.id, it.prompt_id, it.response_ids))
    store.save_ranking(RankingIn(b.id, items[3].prompt_id, items[3].response_ids))
    assert (store.progress(a.id).today, store.progress(a.id).total) == (3, 3)
    # two of a's rankings were made two days ago (as in a database that has been in use for a while)
    store._cur().execute("UPDATE rankings SET created_at = created_at - INTERVAL 2 DAY "
                         "WHERE annotator_id = ? AND item_id IN (?, ?)", [a.id, items[0].item_id, items[1].item_id])
    store._shared.queue = None  # rebuilt from the database on next use
    p = store.progress(a.id)
    assert (p.today, p.total, p.remaining) == (1, 3, 0)
    store.undo_last_ranking(a.id)  # today's ranking
    assert (store.progress(a.id).today, store.progress(a.id).total) == (0, 2)
    # replaces an old one
    store.save_ranking(RankingIn(a.id, items[0].prompt_id, list(reversed(items[0].response_ids))))
    assert (store.progress(a.id).today, store.progress(a.id).total) == (1, 2)
    assert (store.progress(b.id).today, store.progress(b.id).total) == (1, 1)
    live, fresh = store._check_queue_index()
    assert live == fresh and live["ranking_total"] == {a.id: 2, b.id: 1}


def test_holds_lease_follows_every_way_a_lease_ends(store, store_annotators, store_policy, clock):
    it1, it2, it3, it4 = seed_items(store, 4, 2)
    a, b = store_annotators
    (loose,) = store.add_responses_bulk(store_policy.id, [(it1.prompt_id, ["x", "y"])], queued=False)
    got = []
    for i in range(4):  # four leases at once (each next_item excludes the ones held)
        got.append(store.next_item(a.id, lease_seconds=60 if i == 3 else None, exclude=[g.item_id for g in got]))
    assert [g.item_id for g in got] == [it1.item_id, it2.item_id, it3.item_id, it4.item_id]
    assert all(store.holds_lease(a.id, g.item_id) for g in got) and not store.holds_lease(b.id, it1.item_id)
    store.save_ranking(RankingIn(a.id, it1.prompt_id, it1.response_ids))
    store.skip_item(a.id, it2.item_id)
    store.flag_prompt(it3.prompt_id, b.id)
    assert store.holds_lease(a.id, it4.item_id)
    clock.advance(61)  # it4's 60 s lease expires; the default one (600 s) would not have
    assert not any(store.holds_lease(a.id, g.item_id) for g in got)
    assert store.undo_last_ranking(a.id).item_id == it1.item_id and store.holds_lease(a.id, it1.item_id)
    store.release_lease(a.id, it1.item_id)
    assert not store.holds_lease(a.id, it1.item_id) and not store.holds_lease(a.id, loose)
    assert store._check_queue_index()[0] == store._check_queue_index()[1]


def test_undo_of_an_item_outside_the_queue_leases_nothing(store, store_annotators, store_policy):
    (it,) = seed_items(store, 1, 2)
    a = store_annotators[0]
    (loose,) = store.add_responses_bulk(store_policy.id, [(it.prompt_id, ["x", "y"])], queued=False)
    store.save_ranking(RankingIn(a.id, it.prompt_id, store.response_ids_by_item([loose])[loose]))
    assert store.undo_last_ranking(a.id).item_id == loose
    assert store.active_leases() == [] and store.list_rankings() == []
    assert store._check_queue_index()[0] == store._check_queue_index()[1]


def test_save_ranking_and_lease_next_in_one_transaction(store, store_annotators):
    items = seed_items(store, 4, 2)
    a, b = store_annotators
    first = store.next_item(a.id)
    on_deck = store.next_item(a.id, exclude=[first.item_id])
    ranking, ahead = store.save_ranking_and_lease_next(RankingIn(a.id, first.prompt.id, first.display_order),
                                                       exclude=[on_deck.item_id])
    assert ranking.item_id == first.item_id and ahead not in (first.item_id, on_deck.item_id, None)
    assert sorted(i for i, ann, _ in store.active_leases() if ann == a.id) == sorted([on_deck.item_id, ahead])
    # a refused ranking leases nothing
    with pytest.raises(InvalidRequest):
        store.save_ranking_and_lease_next(RankingIn(a.id, on_deck.prompt.id, on_deck.display_order[:1]),
                                          exclude=[ahead])
    assert len(store.active_leases()) == 2
    # a ranking and a pick of the same annotator written together: the pick sees the ranking
    (last,) = [x for x in items if x.item_id not in (first.item_id, on_deck.item_id, ahead)]
    store.release_lease(a.id)
    rank = RankingIn(a.id, on_deck.prompt.id, on_deck.display_order)
    requests = [("next", (a.id, 1, 60.0, frozenset())),  # arrives first, picked after the ranking
                ("rank", (rank, normalize_order(rank.order))),
                ("next", (b.id, 1, 60.0, frozenset()))]
    with store._shared.lock:
        with store._tx_locked(queue=True) as cur:
            got_a, saved, got_b = store._write_batch(cur, requests)
    assert saved.item_id == on_deck.item_id
    # on_deck is the oldest unranked item: a would get it back had the pick not seen the ranking
    assert got_a[0] == ahead and got_b[0] == last.item_id
    assert store._check_queue_index()[0] == store._check_queue_index()[1]
