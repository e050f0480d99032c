"""The queue's rules, read from the in-memory index (store/queue_index.py): which item an annotator
gets next, and how many are left. The rules themselves are described in store/queue.py.

Overlap arguments: `overlap` is a number applied to every item, or None for each item's own (its
round's overlap if an admin set one, else `default`, the store's setting).
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import defaultdict
from datetime import datetime

NEWEST_ROUND_PRIORITY = 1
"""The priority of the newest round's items unless an admin set another (other rounds: 0)."""

WRITE_KIND = "queue"
"""Store._combined's name for the save_ranking and next_item requests written together."""


def display_order_for(annotator_id: int, item_id: int, response_ids: list[int]) -> list[int]:
    """The order an annotator sees an item's responses in: a shuffle seeded by (annotator, item),
    so it is stable across reloads and independent between annotators (guards against position
    bias; see Store.position_bias)."""
    seed = int.from_bytes(hashlib.sha256(f"{annotator_id}:{item_id}".encode()).digest()[:8], "big")
    ids = sorted(response_ids)
    random.Random(seed).shuffle(ids)
    return ids


def locked(method):
    """Run the method holding the index's own lock (see the module docstring)."""

    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run


def unit_hash(*parts) -> float:
    """A number in [0, 1) fixed by `parts`: the per-annotator draws of the gold mix, which an
    annotator cannot predict but a test can repeat."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class RoundPool:
    """One round's items in the regular queue (unflagged prompt, not gold) by number of rankings;
    each bucket sorted by id (oldest first)."""

    def __init__(self):
        self.lists: dict[int, list[int]] = defaultdict(list)
        self.sets: dict[int, set[int]] = defaultdict(set)

    def add(self, n: int, item_id: int) -> None:
        if item_id in self.sets[n]:
            return
        bisect.insort(self.lists[n], item_id)
        self.sets[n].add(item_id)

    def remove(self, n: int, item_id: int) -> None:
        if item_id not in self.sets.get(n, ()):
            return
        bucket = self.lists[n]
        del bucket[bisect.bisect_left(bucket, item_id)]
        self.sets[n].discard(item_id)
        if not bucket:
            del self.lists[n]
            del self.sets[n]


class QueueRules:
    """The choice of items, over the facts QueueIndex keeps (item_prompt, item_round, n_done,
    ranked, skipped, flagged, leases, held, ranking_total, pools, gold, newest_round,
    round_overlap, round_priority)."""

    def overlap_of(self, round_id: int | None, overlap: int | None, default: int) -> int:
        """How many rankings the items of a round need (see the module docstring)."""
        if overlap is not None:
            return overlap
        return self.round_overlap.get(round_id, default) if round_id is not None else default

    def priority_of(self, round_id: int | None) -> int:
        if round_id in self.round_priority:
            return self.round_priority[round_id]
        return NEWEST_ROUND_PRIORITY if round_id is not None and round_id == self.newest_round else 0

    def _others_leasing(self, item_id: int, annotator_id: int, now: datetime) -> int:
        return sum(1 for a, exp in self.leases.get(item_id, {}).items() if a != annotator_id and exp > now)

    def _open_to(self, item_id: int, annotator_id: int, exclude) -> bool:
        """Queued, of an unflagged prompt, not excluded, not ranked or skipped by the annotator."""
        return (item_id in self.item_prompt
                and item_id not in exclude
                and self.item_prompt[item_id] not in self.flagged
                and item_id not in self.ranked.get(annotator_id, ())
                and item_id not in self.skipped.get(annotator_id, ()))

    def _eligible(self, item_id: int, annotator_id: int, need: int, now: datetime, exclude) -> bool:
        """Open to the annotator, and a gold item or one short of its overlap."""
        return self._open_to(item_id, annotator_id, exclude) and (
            item_id in self.gold or self.n_done[item_id] + self._others_leasing(item_id, annotator_id, now) < need)

    def pick(self, annotator_id: int, overlap: int | None, default: int, now: datetime, exclude=(),
             gold_rate: float = 0.0) -> int | None:
        """The annotator's own live lease if any; else, on a gold turn, a gold item; else the
        eligible item of the highest-priority rounds with the fewest rankings plus others' leases,
        oldest first (see store/queue.py for the rules)."""
        exclude = set(exclude)
        own = [i for i in self.held.get(annotator_id, ())
               if self.leases[i][annotator_id] > now and self._eligible(
                   i, annotator_id, self.overlap_of(self.item_round[i], overlap, default), now, exclude)]
        if own:
            return min(own, key=lambda i: (self.n_done[i], i))
        if gold_rate > 0 and self.gold and unit_hash("gold", annotator_id, self._turn(annotator_id, now)) < gold_rate:
            gold = [i for i in self.gold if self._open_to(i, annotator_id, exclude)]
            if gold:  # in an order of the annotator's own, so annotators do not meet them in step
                return min(gold, key=lambda i: unit_hash("order", annotator_id, i))
        by_priority: dict[int, list[int | None]] = defaultdict(list)
        for round_id, pool in self.pools.items():
            if pool.lists:
                by_priority[self.priority_of(round_id)].append(round_id)
        for priority in sorted(by_priority, reverse=True):
            found = [self._best_in(r, annotator_id, self.overlap_of(r, overlap, default), now, exclude)
                     for r in by_priority[priority]]
            found = [f for f in found if f is not None]
            if found:
                return min(found)[1]
        return None

    def _turn(self, annotator_id: int, now: datetime) -> int:
        """The annotator's place in their own sequence of items: rankings made, items skipped and
        items held (a skip moves the turn on: skipping a gold item does not serve another gold item)."""
        held = sum(1 for i in self.held.get(annotator_id, ()) if self.leases[i][annotator_id] > now)
        return self.ranking_total.get(annotator_id, 0) + len(self.skipped.get(annotator_id, ())) + held

    def _best_in(self, round_id, annotator_id: int, need: int, now: datetime, exclude) -> tuple[int, int] | None:
        """(rankings + other annotators' live leases, item id) of the round's best eligible item:
        an item someone is already ranking needs one annotation fewer than it seems."""
        pool = self.pools[round_id]
        best: tuple[int, int] | None = None
        for n in sorted(b for b in pool.lists if b < need):
            if best is not None and best[0] < n:
                break
            for item_id in pool.lists[n]:
                if self._eligible(item_id, annotator_id, need, now, exclude):
                    score = (n + self._others_leasing(item_id, annotator_id, now), item_id)
                    best = score if best is None else min(best, score)
                    if score[0] == n:
                        break  # nothing later in this bucket can beat it
        return best

    @locked
    def remaining(self, annotator_id: int, overlap: int | None, default: int, now: datetime) -> int:
        """How many regular items pick() could still hand this annotator, their own leases
        included (gold items are mixed in at a rate: only those leased to them count)."""
        ranked = self.ranked.get(annotator_id, set())
        skipped = self.skipped.get(annotator_id, set())
        total = sum(1 for i in self.held.get(annotator_id, ())
                    if i in self.gold and self.leases[i][annotator_id] > now and self._open_to(i, annotator_id, ()))
        for round_id, pool in self.pools.items():
            need = self.overlap_of(round_id, overlap, default)
            for n, members in pool.sets.items():
                if n < need:
                    total += len(members) - len(members & ranked) - len((members & skipped) - ranked)
        for item_id in self.leases:  # items other annotators' leases have filled up
            n = self.n_done.get(item_id)
            if n is None or item_id in ranked or item_id in skipped:
                continue
            round_id = self.item_round[item_id]
            need = self.overlap_of(round_id, overlap, default)
            if (n < need and item_id in self.pools[round_id].sets.get(n, ())
                    and n + self._others_leasing(item_id, annotator_id, now) >= need):
                total -= 1
        return total

    @locked
    def open_items(self, overlap: int | None, default: int) -> int:
        """Queued items of unflagged prompts (gold items aside) short of their overlap."""
        need = {r: self.overlap_of(r, overlap, default) for r in self.pools}
        return sum(len(m) for r, pool in self.pools.items() for n, m in pool.sets.items() if n < need[r])

