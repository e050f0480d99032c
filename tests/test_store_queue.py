"""The queue: overlap, leases and their expiry, skips, flags, counts, display order, concurrency."""

import random
import threading
from collections import Counter, defaultdict

import pytest

from store import Store
from store.errors import InvalidRequest, NotFoundError
from store.pairs import normalize_order
from store.records import RankingIn
from tests.fixtures_store import open_copy, seed_items


def test_next_item_prefers_items_needing_annotations_and_respects_overlap(store, store_annotators):
    items = seed_items(store, 3, 3)
    a, b = store_annotators
    c = store.add_annotator("ann2", "password-2")
    ids = [x.item_id for x in items]
    # a takes item 0 and ranks it; with overlap 2, b is offered the unranked items first
    got = store.next_item(a.id, overlap=2)
    assert got.item_id == ids[0]
    store.save_ranking(a.id, got.prompt.id, got.display_order)
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
        store.save_ranking(a.id, got.prompt.id, got.display_order)
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
    store.save_ranking(a.id, items[0].prompt_id, items[0].response_ids)
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
                store.save_ranking(a, got.prompt.id, [got.display_order[:2], got.display_order[2:]])
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
                    s.save_ranking(annotator_id, got.prompt.id, got.display_order,
                                   display_order=got.display_order, client_token=f"{annotator_id}-{got.item_id}")
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
                    s.save_ranking(a.id, it.prompt_id, it.response_ids)
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
        store.save_ranking(a.id, it.prompt_id, it.response_ids)
    store.save_ranking(b.id, items[3].prompt_id, items[3].response_ids)
    assert (store.progress(a.id).today, store.progress(a.id).total) == (3, 3)
    # two of a's rankings were made two days ago (as in a database that has been in use for a while)
    store._cur().execute("UPDATE rankings SET created_at = created_at - INTERVAL 2 DAY "
                         "WHERE annotator_id = ? AND item_id IN (?, ?)", [a.id, items[0].item_id, items[1].item_id])
    store._shared.queue = None  # rebuilt from the database on next use
    p = store.progress(a.id)
    assert (p.today, p.total, p.remaining) == (1, 3, 0)
    store.undo_last_ranking(a.id)  # today's ranking
    assert (store.progress(a.id).today, store.progress(a.id).total) == (0, 2)
    store.save_ranking(a.id, items[0].prompt_id, list(reversed(items[0].response_ids)))  # replaces an old one
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
    store.save_ranking(a.id, it1.prompt_id, it1.response_ids)
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
    store.save_ranking(a.id, it.prompt_id, store.response_ids_by_item([loose])[loose])
    assert store.undo_last_ranking(a.id).item_id == loose
    assert store.active_leases() == [] and store.list_rankings() == []
    assert store._check_queue_index()[0] == store._check_queue_index()[1]


def test_save_ranking_and_lease_next_in_one_transaction(store, store_annotators):
    items = seed_items(store, 4, 2)
    a, b = store_annotators
    first = store.next_item(a.id)
    on_deck = store.next_item(a.id, exclude=[first.item_id])
    ranking, ahead = store.save_ranking_and_lease_next(a.id, first.prompt.id, first.display_order,
                                                       exclude=[on_deck.item_id])
    assert ranking.item_id == first.item_id and ahead not in (first.item_id, on_deck.item_id, None)
    assert sorted(i for i, ann, _ in store.active_leases() if ann == a.id) == sorted([on_deck.item_id, ahead])
    # a refused ranking leases nothing
    with pytest.raises(InvalidRequest):
        store.save_ranking_and_lease_next(a.id, on_deck.prompt.id, on_deck.display_order[:1], exclude=[ahead])
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


# --------------------------------------------------------------------------- a team: overlap, rounds, gold


@pytest.fixture(scope="module")
def team_db(tmp_path_factory):
    """A closed store file holding four annotators t0..t3 (scrypt hashes them once, not per test)."""
    path = tmp_path_factory.mktemp("team") / "rlhf.duckdb"
    with Store(path) as s:
        for i in range(4):
            s.add_annotator(f"t{i}", f"password-{i}")
    return path


@pytest.fixture
def team(team_db, tmp_path):
    """(store, [the four annotators]) on a fresh copy of team_db."""
    s = open_copy(team_db, tmp_path / "team")
    yield s, s.list_annotators()
    s.close()


def rank_all(store, annotator_id, *, limit=1000) -> list[int]:
    """Let the annotator rank what the queue hands them (first response best); their item ids in order."""
    got = []
    while len(got) < limit and (item := store.next_item(annotator_id)) is not None:
        store.save_ranking(annotator_id, item.prompt.id, item.display_order)
        got.append(item.item_id)
    return got


def test_store_overlap_and_a_rounds_own_overlap_are_reached_and_not_passed(team):
    store, (a, b, c, d) = team
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


def test_overlap_and_priority_settings_refuse_bad_values(team):
    store, _ = team
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


def test_the_newest_rounds_items_come_first_unless_an_admin_orders_otherwise(team):
    store, (a, b, c, _) = team
    store.set_queue_overlap(2)
    leftovers = [x.item_id for x in seed_items(store, 3, 2, prefix="old")]
    store.save_ranking(c.id, *_first_order(store, leftovers[0]))  # the index exists before the rounds' items
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


def test_gold_items_are_mixed_in_at_the_rate_for_everyone_whatever_the_overlap(team):
    store, anns = team
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
            store.save_ranking(a.id, item.prompt.id, item.display_order)
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


def test_a_gold_reference_from_a_ranking_and_back_to_the_regular_queue(team):
    store, (a, b, *_) = team
    it1, it2 = seed_items(store, 2, 3)
    ranking = store.save_ranking(a.id, it1.prompt_id, [[it1.response_ids[2]], it1.response_ids[:2]])
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
