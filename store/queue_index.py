"""An in-memory mirror of the queue's state, so `next_item` answers in microseconds.

Why: choosing the next item in SQL takes DuckDB about 10 ms (aggregates over every ranking and
lease, several anti-joins), and it must run inside the write lock so two annotators never take the
same slot. With 20 annotators submitting at once that lock becomes the bottleneck. The Store is
the only writer of its file (DuckDB allows one read-write process), so it can keep the few facts
the queue needs in memory and update them when its own transactions commit:

- queued items: prompt, response ids, number of rankings, who ranked them;
- per annotator: items ranked, items skipped, leases; flagged prompts; annotator ids;
- per annotator: how many rankings they made, and when they made the recent ones (the progress
  line's "today" and "total" without a query per submit).

The database stays the source of truth: every fact here is also written there, in the transaction
that changes it, and the index mirrors the rows exactly (the `leases` rows too, expired or not, so
the Store knows whether a lease row exists without asking). It is built from the database when
first needed and rebuilt if an update ever fails; a test compares a live index with a fresh build
(`snapshot`). Updates and `pick` run with the Store's write lock held. The progress queries
(`remaining`, `ranking_counts`, `holds_lease`, `open_items`) run without it, so a progress line
never waits for another annotator's transaction: `lock` keeps them from reading a half-made
update. No SQL lives here.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter, defaultdict
from datetime import datetime, timedelta

RECENT_KEEP = timedelta(days=1)
"""How far before the earliest "today" asked about the index keeps ranking times (see
ranking_counts): older ones only count towards the totals."""


def _locked(method):
    """Run the method holding the index's own lock (see the module docstring)."""

    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run


class QueueIndex:
    def __init__(self):
        self.item_prompt: dict[int, int] = {}
        self.item_responses: dict[int, tuple[int, ...]] = {}
        self.response_item: dict[int, int] = {}
        self.annotators: set[int] = set()
        self.prompt_items: dict[int, list[int]] = defaultdict(list)
        self.n_done: dict[int, int] = {}
        self.rankers: dict[int, Counter] = defaultdict(Counter)  # item -> annotator -> rankings
        self.ranked: dict[int, set[int]] = defaultdict(set)  # annotator -> items ranked
        self.skipped: dict[int, set[int]] = defaultdict(set)  # annotator -> items skipped
        self.flagged: set[int] = set()  # prompt ids
        # every row of the leases table, live or expired: item -> annotator -> expiry
        self.leases: dict[int, dict[int, datetime]] = defaultdict(dict)
        self.held: dict[int, set[int]] = defaultdict(set)  # annotator -> leased items
        # rankings of every item (queued or not) by annotator, and the creation times of those made
        # at or after `recent_since` (sorted), so "how many today" is a bisect
        self.ranking_total: Counter = Counter()
        self.recent: dict[int, list[datetime]] = defaultdict(list)
        self.recent_since: datetime = datetime.min
        self.lock = threading.RLock()
        # items of unflagged prompts by number of rankings; each bucket sorted by id (oldest first)
        self.buckets: dict[int, list[int]] = defaultdict(list)
        self.bucket_sets: dict[int, set[int]] = defaultdict(set)

    @classmethod
    def build(cls, items, rankings, skips, flagged, leases, annotators, ranking_times,
              recent_since: datetime) -> "QueueIndex":
        """From rows read in one transaction: items [(item, prompt, response ids)], rankings of
        queued items [(item, annotator, count)], skips [(annotator, item)], flagged prompt ids,
        every lease row [(item, annotator, expires)], annotator ids, and per annotator
        [(annotator, number of rankings, sorted times of those made at or after recent_since)].
        Buckets are sorted once, not item by item."""
        q = cls()
        q.recent_since = recent_since
        for annotator_id, total, times in ranking_times:
            q.ranking_total[annotator_id] = total
            if times:
                q.recent[annotator_id] = sorted(times)
        q.flagged = set(flagged)
        q.annotators = set(annotators)
        for item_id, prompt_id, response_ids in items:
            q.item_prompt[item_id] = prompt_id
            q.item_responses[item_id] = tuple(response_ids)
            for rid in response_ids:
                q.response_item[rid] = item_id
            q.prompt_items[prompt_id].append(item_id)
            q.n_done[item_id] = 0
        for item_id, annotator_id, count in rankings:
            if item_id in q.item_prompt:
                q.rankers[item_id][annotator_id] += count
                q.ranked[annotator_id].add(item_id)
                q.n_done[item_id] += count
        for annotator_id, item_id in skips:
            q.skipped[annotator_id].add(item_id)
        for item_id, annotator_id, expires in leases:
            q.set_lease(item_id, annotator_id, expires)
        for item_id in sorted(q.item_prompt):
            if q.item_prompt[item_id] not in q.flagged:
                n = q.n_done[item_id]
                q.buckets[n].append(item_id)
                q.bucket_sets[n].add(item_id)
        return q

    # ------------------------------------------------------------------ updates

    @_locked
    def add_item(self, item_id: int, prompt_id: int, response_ids) -> None:
        if item_id in self.item_prompt:
            return
        self.item_prompt[item_id] = prompt_id
        self.item_responses[item_id] = tuple(response_ids)
        for rid in response_ids:
            self.response_item[rid] = item_id
        self.prompt_items[prompt_id].append(item_id)
        self.n_done[item_id] = 0
        if prompt_id not in self.flagged:
            self._bucket_add(0, item_id)

    @_locked
    def add_ranking(self, item_id: int, annotator_id: int, created_at: datetime) -> None:
        """A ranking was stored (its lease row, if any, was deleted in the same transaction)."""
        self.ranking_total[annotator_id] += 1
        if created_at >= self.recent_since:
            bisect.insort(self.recent[annotator_id], created_at)
        self.drop_lease(item_id, annotator_id)
        if item_id not in self.item_prompt:
            return  # not a queued item (e.g. imported pairs)
        self.rankers[item_id][annotator_id] += 1
        self.ranked[annotator_id].add(item_id)
        self._move(item_id, self.n_done[item_id] + 1)

    @_locked
    def remove_ranking(self, item_id: int, annotator_id: int, created_at: datetime) -> None:
        """A ranking made at `created_at` was deleted (undo, or replaced by a re-ranking)."""
        self.ranking_total[annotator_id] -= 1
        if self.ranking_total[annotator_id] <= 0:
            del self.ranking_total[annotator_id]
        times = self.recent.get(annotator_id)
        if times and created_at >= self.recent_since:
            at = bisect.bisect_left(times, created_at)
            if at < len(times) and times[at] == created_at:
                del times[at]
        if item_id not in self.item_prompt or self.rankers[item_id][annotator_id] <= 0:
            return
        self.rankers[item_id][annotator_id] -= 1
        if self.rankers[item_id][annotator_id] == 0:
            del self.rankers[item_id][annotator_id]
            self.ranked[annotator_id].discard(item_id)
        self._move(item_id, self.n_done[item_id] - 1)

    @_locked
    def set_lease(self, item_id: int, annotator_id: int, expires: datetime) -> None:
        self.leases[item_id][annotator_id] = expires
        self.held[annotator_id].add(item_id)

    @_locked
    def drop_lease(self, item_id: int, annotator_id: int) -> None:
        self.leases.get(item_id, {}).pop(annotator_id, None)
        if not self.leases.get(item_id):
            self.leases.pop(item_id, None)
        self.held.get(annotator_id, set()).discard(item_id)

    @_locked
    def drop_leases_of(self, annotator_id: int) -> None:
        for item_id in list(self.held.get(annotator_id, ())):
            self.drop_lease(item_id, annotator_id)

    @_locked
    def drop_expired(self, now: datetime) -> None:
        for item_id in list(self.leases):
            for annotator_id, expires in list(self.leases[item_id].items()):
                if expires <= now:
                    self.drop_lease(item_id, annotator_id)

    @_locked
    def skip(self, annotator_id: int, item_id: int) -> None:
        self.skipped[annotator_id].add(item_id)
        self.drop_lease(item_id, annotator_id)

    @_locked
    def flag(self, prompt_id: int) -> None:
        if prompt_id in self.flagged:
            return
        self.flagged.add(prompt_id)
        for item_id in self.prompt_items.get(prompt_id, ()):
            self._bucket_remove(self.n_done[item_id], item_id)
            for annotator_id in list(self.leases.get(item_id, {})):
                self.drop_lease(item_id, annotator_id)

    @_locked
    def unflag(self, prompt_id: int) -> None:
        if prompt_id not in self.flagged:
            return
        self.flagged.discard(prompt_id)
        for item_id in self.prompt_items.get(prompt_id, ()):
            self._bucket_add(self.n_done[item_id], item_id)

    # ------------------------------------------------------------------ queries

    def has_lease_row(self, item_id: int, annotator_id: int) -> bool:
        """Whether the leases table holds a row (live or expired) for this item and annotator."""
        return annotator_id in self.leases.get(item_id, ())

    @_locked
    def holds_lease(self, annotator_id: int, item_id: int, now: datetime) -> bool:
        """Whether the annotator holds a live lease on the item."""
        expires = self.leases.get(item_id, {}).get(annotator_id)
        return expires is not None and expires > now

    @_locked
    def ranking_counts(self, annotator_id: int, since: datetime) -> tuple[int, int] | None:
        """(rankings made at or after `since`, all rankings) of an annotator; None when `since` is
        earlier than the times the index keeps (the clock went back: ask the database). Times
        older than a day before `since` are dropped now and then: "today" only moves forward."""
        if since < self.recent_since:
            return None
        if since - RECENT_KEEP > self.recent_since + RECENT_KEEP:
            self._forget_before(since - RECENT_KEEP)
        times = self.recent.get(annotator_id, ())
        return len(times) - bisect.bisect_left(times, since), self.ranking_total.get(annotator_id, 0)

    def _forget_before(self, cutoff: datetime) -> None:
        for annotator_id in list(self.recent):
            times = self.recent[annotator_id]
            del times[:bisect.bisect_left(times, cutoff)]
            if not times:
                del self.recent[annotator_id]
        self.recent_since = cutoff

    def _others_leasing(self, item_id: int, annotator_id: int, now: datetime) -> int:
        return sum(1 for a, exp in self.leases.get(item_id, {}).items() if a != annotator_id and exp > now)

    def _eligible(self, item_id: int, annotator_id: int, overlap: int, now: datetime, exclude) -> bool:
        return (item_id in self.item_prompt
                and item_id not in exclude
                and self.item_prompt[item_id] not in self.flagged
                and item_id not in self.ranked.get(annotator_id, ())
                and item_id not in self.skipped.get(annotator_id, ())
                and self.n_done[item_id] + self._others_leasing(item_id, annotator_id, now) < overlap)

    def pick(self, annotator_id: int, overlap: int, now: datetime, exclude=()) -> int | None:
        """The annotator's own live lease if any, else the eligible item with the fewest rankings
        plus others' leases, oldest first (see store/queue.py for the rules)."""
        exclude = set(exclude)
        own = [i for i in self.held.get(annotator_id, ())
               if self.leases[i][annotator_id] > now and self._eligible(i, annotator_id, overlap, now, exclude)]
        if own:
            return min(own, key=lambda i: (self.n_done[i], i))
        # fewest (rankings + other annotators' live leases) first, then oldest: an item someone
        # is already ranking needs one annotation fewer than it seems
        best: tuple[int, int] | None = None
        for n in sorted(b for b in self.buckets if b < overlap):
            if best is not None and best[0] < n:
                break
            for item_id in self.buckets[n]:
                if self._eligible(item_id, annotator_id, overlap, now, exclude):
                    score = (n + self._others_leasing(item_id, annotator_id, now), item_id)
                    best = score if best is None else min(best, score)
                    if score[0] == n:
                        break  # nothing later in this bucket can beat it
        return None if best is None else best[1]

    @_locked
    def remaining(self, annotator_id: int, overlap: int, now: datetime) -> int:
        """How many items pick() could still hand this annotator (their own leases included)."""
        ranked = self.ranked.get(annotator_id, set())
        skipped = self.skipped.get(annotator_id, set())
        total = 0
        for n, members in self.bucket_sets.items():
            if n >= overlap:
                continue
            total += len(members) - len(members & ranked) - len((members & skipped) - ranked)
        for item_id in self.leases:  # items other annotators' leases have filled up
            n = self.n_done.get(item_id)
            if (n is not None and n < overlap and item_id in self.bucket_sets.get(n, ())
                    and item_id not in ranked and item_id not in skipped
                    and n + self._others_leasing(item_id, annotator_id, now) >= overlap):
                total -= 1
        return total

    @_locked
    def open_items(self, overlap: int) -> int:
        """Queued items of unflagged prompts with fewer than `overlap` rankings."""
        return sum(len(m) for n, m in self.bucket_sets.items() if n < overlap)

    # ------------------------------------------------------------------ buckets

    def _move(self, item_id: int, new_n: int) -> None:
        old_n = self.n_done[item_id]
        self.n_done[item_id] = new_n
        if self.item_prompt[item_id] in self.flagged:
            return
        self._bucket_remove(old_n, item_id)
        self._bucket_add(new_n, item_id)

    def _bucket_add(self, n: int, item_id: int) -> None:
        if item_id in self.bucket_sets[n]:
            return
        bisect.insort(self.buckets[n], item_id)
        self.bucket_sets[n].add(item_id)

    def _bucket_remove(self, n: int, item_id: int) -> None:
        if item_id not in self.bucket_sets.get(n, ()):
            return
        bucket = self.buckets[n]
        del bucket[bisect.bisect_left(bucket, item_id)]
        self.bucket_sets[n].discard(item_id)
        if not bucket:
            del self.buckets[n]
            del self.bucket_sets[n]

    @_locked
    def snapshot(self, since: datetime) -> dict:
        """A comparable summary (tests check an updated index equals a freshly built one); the
        ranking times are compared from `since` on (two indexes built at different times keep
        different spans of them)."""
        return {
            "leases": {(i, a): exp for i, by in self.leases.items() for a, exp in by.items()},
            "ranking_total": {a: n for a, n in self.ranking_total.items() if n},
            "recent": {a: t[bisect.bisect_left(t, since):] for a, t in self.recent.items()
                       if t and t[-1] >= since},
            "items": dict(self.item_prompt),
            "responses": dict(self.item_responses),
            "n_done": dict(self.n_done),
            "rankers": {i: dict(c) for i, c in self.rankers.items() if c},
            "skipped": {a: set(s) for a, s in self.skipped.items() if s},
            "flagged": set(self.flagged),
            "annotators": set(self.annotators),
            "buckets": {n: list(b) for n, b in self.buckets.items() if b},
        }
