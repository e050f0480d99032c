"""The annotation queue: which item an annotator gets next, leases, skips and flags, and the
team's settings (overlap, round priority, gold rate).

An *item* is one generation call's K >= 2 responses to one prompt (Store.add_responses); imported
pairs are items too but are never queued. `next_item` (store/rankings.py, which writes a lease in
the transaction that writes rankings) hands an annotator an item that
- is queued, and its prompt is not flagged,
- this annotator has not ranked or skipped (an annotator never sees an item twice),
- has fewer than its overlap in rankings plus live leases held by *other* annotators. An item's
  overlap is its round's, if an admin set one (set_round_queue), else the store's
  (set_queue_overlap; default 1); `next_item(overlap=n)` applies n to every item;
preferring, in this order,
1. the annotator's own live lease (a reload shows the same item);
2. on a *gold turn*, a gold item they have not ranked (store/gold.py). Gold items are not in the
   regular queue: every annotator can get each one, whatever the overlap, mixed in at the gold
   rate (set_gold_rate): the annotator's n-th item is a gold turn when a draw fixed by
   (annotator, n) falls below the rate, so nothing marks it for them;
3. items of the rounds of the highest priority: an admin's number for the round, else 1 for the
   newest round with items and 0 for the rest (the current round before leftovers);
4. among those, the items with the fewest rankings plus live leases of others (the ones that
   need the most annotations), then the oldest.
Taking an item writes a lease (item, annotator, expires_at) in the same transaction as the check,
so concurrent annotators never get one item beyond the overlap; an expired lease no longer counts,
so an abandoned item returns to the queue by itself.

The choice is made in memory (store/queue_index.py explains why, store/queue_rules.py holds the
rules) and the lease is written to the `leases` table in the same transaction; next_item and
save_ranking calls made at the same moment by several annotators share one transaction
(Store._write_batch, store/rankings.py). This file holds the rest: the settings, what is left and
who holds what, giving a lease back, skips and flags.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from store.values import from_db_time, utcnow, whole_number
from store.errors import InvalidRequest
from store.queue_index import QueueIndex, local_midnight, place_new_items, read_queue_index
from store.records import Progress, Prompt

OVERLAP_KEY = "queue_overlap"
LEASE_SECONDS_KEY = "queue_lease_seconds"
GOLD_RATE_KEY = "queue_gold_rate"
DEFAULT_OVERLAP = 1
DEFAULT_LEASE_SECONDS = 600
MAX_OVERLAP = 100
MAX_PRIORITY = 1000


class QueueMixin:
    """Queue methods of Store.

    Besides the core (store/db.py), these use public methods of the Store's other parts, declared
    here: prompts (store/repo.py) and settings (store/versions.py)."""

    get_prompt: Callable[[int], Prompt]
    get_setting: Callable[..., Any]
    set_setting: Callable[[str, Any], None]

    # -- settings with defaults

    def queue_overlap(self) -> int:
        """How many annotators rank each item of a round without its own overlap (setting
        'queue_overlap', default 1)."""
        return int(self.get_setting(OVERLAP_KEY, DEFAULT_OVERLAP))

    def set_queue_overlap(self, overlap: int) -> None:
        self.set_setting(OVERLAP_KEY, whole_number(overlap, "overlap", 1, MAX_OVERLAP))

    def lease_seconds(self) -> int:
        return int(self.get_setting(LEASE_SECONDS_KEY, DEFAULT_LEASE_SECONDS))

    def gold_rate(self) -> float:
        """The share of an annotator's items that are gold turns (setting 'queue_gold_rate', default 0)."""
        return float(self.get_setting(GOLD_RATE_KEY, 0.0))

    def set_gold_rate(self, rate: float) -> None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise InvalidRequest(f"the gold rate must be a number from 0 to 1, not {rate!r}")
        self.set_setting(GOLD_RATE_KEY, float(rate))

    def set_round_queue(self, round_id: int, *, overlap: int | None = None, priority: int | None = None) -> None:
        """A round's own overlap and priority (None: the store's overlap; priority 1 for the newest
        round, 0 for the others). Items already ranked more often than a lowered overlap keep
        their rankings."""
        overlap = None if overlap is None else whole_number(overlap, "overlap", 1, MAX_OVERLAP)
        priority = None if priority is None else whole_number(priority, "priority", -MAX_PRIORITY, MAX_PRIORITY)
        with self._tx() as cur:
            self._need(cur.execute("SELECT 1 FROM rounds WHERE id = ?", [round_id]).fetchone(),
                       f"round with id {round_id}")
            cur.execute("INSERT OR REPLACE INTO round_queue VALUES (?, ?, ?, ?)", [round_id, overlap, priority, utcnow()])
            self._on_commit(lambda q: q.set_round(round_id, overlap, priority))

    def round_queue(self) -> dict[int, tuple[int | None, int | None]]:
        """{round: (overlap, priority)} of the rounds an admin set (None: the default)."""
        return {r: (o, p) for r, o, p in self._rows("SELECT round_id, overlap, priority FROM round_queue ORDER BY round_id")}

    # -- the queue

    def _queue_index(self) -> QueueIndex:
        """The queue index for the progress queries, which read it under its own lock rather than
        the write lock (built under the write lock first if needed)."""
        q = self._shared.queue
        if q is None:
            with self._queue_locked() as q:
                pass
        return q

    def warm_queue(self) -> None:
        """Build the queue index now (about 2 s per 100,000 items) instead of on the first
        next_item; the app can call it at start-up."""
        with self._queue_locked():
            pass

    def remaining_count(self, annotator_id: int, *, overlap: int | None = None) -> int:
        """Items the queue could still hand this annotator now: regular items, their own leases
        included (gold items, mixed in at a rate, count only once leased to them)."""
        overlap = None if overlap is None else int(overlap)
        return self._queue_index().remaining(annotator_id, overlap, self.queue_overlap(), utcnow())

    def progress(self, annotator_id: int, *, overlap: int | None = None) -> Progress:
        """Today's rankings (since local midnight of this machine), all rankings, items left.
        Answered from the queue index: no query, and no wait for other annotators' writes."""
        midnight = local_midnight()
        counts = self._queue_index().ranking_counts(annotator_id, midnight)
        if counts is None:  # the clock went back before what the index keeps
            counts = self._one("SELECT count(*) FILTER (WHERE created_at >= ?), count(*) FROM rankings "
                               "WHERE annotator_id = ?", [midnight, annotator_id])
        today, total = counts
        return Progress(today=today, total=total, remaining=self.remaining_count(annotator_id, overlap=overlap))

    def holds_lease(self, annotator_id: int, item_id: int) -> bool:
        """Whether the annotator holds a live lease on the item (from the queue index, no query).
        An item fetched ahead is shown only while it does: ranking, skipping or flagging it (in
        another tab, or by an action racing the prefetch), releasing it or letting it expire all
        end the lease."""
        return self._queue_index().holds_lease(annotator_id, item_id, utcnow())

    def release_lease(self, annotator_id: int, item_id: int | None = None) -> None:
        """Give back one leased item (or all of the annotator's leases: logout, closed tab)."""
        with self._tx() as cur:
            if item_id is None:
                cur.execute("DELETE FROM leases WHERE annotator_id = ?", [annotator_id])
                self._on_commit(lambda q: q.drop_leases_of(annotator_id))
            else:
                cur.execute("DELETE FROM leases WHERE annotator_id = ? AND item_id = ?", [annotator_id, item_id])
                self._on_commit(lambda q: q.drop_lease(item_id, annotator_id))

    def active_leases(self) -> list[tuple[int, int, datetime]]:
        """(item_id, annotator_id, expires_at) of every live lease."""
        return [(i, a, from_db_time(e)) for i, a, e in self._rows(
            "SELECT item_id, annotator_id, expires_at FROM leases WHERE expires_at > ? ORDER BY item_id",
            [utcnow()])]

    # -- skips and flags

    def skip_item(self, annotator_id: int, item_id: int) -> None:
        """This annotator will not be offered the item again; others still will."""
        with self._tx() as cur:
            self._need(cur.execute("SELECT 1 FROM items WHERE id = ?", [item_id]).fetchone(), f"item with id {item_id}")
            cur.execute("INSERT OR REPLACE INTO skips VALUES (?, ?, ?)", [annotator_id, item_id, utcnow()])
            cur.execute("DELETE FROM leases WHERE annotator_id = ? AND item_id = ?", [annotator_id, item_id])
            self._on_commit(lambda q: q.skip(annotator_id, item_id))

    def flag_prompt(self, prompt_id: int, annotator_id: int | None = None, reason: str = "") -> None:
        """Flag a prompt (broken, offensive, ...): its items leave the queue for everyone until an
        admin unflags it. Rankings already made are kept."""
        with self._tx() as cur:
            self._need(cur.execute("SELECT 1 FROM prompts WHERE id = ?", [prompt_id]).fetchone(),
                       f"prompt with id {prompt_id}")
            cur.execute("INSERT INTO flags VALUES (?, ?, ?, ?)", [prompt_id, annotator_id, reason or "", utcnow()])
            cur.execute("DELETE FROM leases WHERE item_id IN (SELECT id FROM items WHERE prompt_id = ?)", [prompt_id])
            self._on_commit(lambda q: q.flag(prompt_id))

    def unflag_prompt(self, prompt_id: int) -> None:
        with self._tx() as cur:
            cur.execute("DELETE FROM flags WHERE prompt_id = ?", [prompt_id])
            self._on_commit(lambda q: q.unflag(prompt_id))

    def flagged_prompts(self) -> list[tuple[Prompt, list[str]]]:
        """Flagged prompts with the reasons given, oldest flag first."""
        rows = self._rows("SELECT prompt_id, list(reason ORDER BY created_at) FROM flags "
                          "GROUP BY prompt_id ORDER BY min(created_at)")
        return [(self.get_prompt(pid), reasons) for pid, reasons in rows]

    def is_flagged(self, prompt_id: int) -> bool:
        return self._one("SELECT 1 FROM flags WHERE prompt_id = ? LIMIT 1", [prompt_id]) is not None

    def items_remaining(self, *, overlap: int | None = None) -> int:
        """Queued items of unflagged prompts (gold items aside) with fewer rankings than their
        overlap (all annotators)."""
        overlap = None if overlap is None else int(overlap)
        return self._queue_index().open_items(overlap, self.queue_overlap())

    def _check_queue_index(self) -> tuple[dict, dict]:
        """(the live index's summary, a freshly built one's): tests assert they are equal."""
        since = local_midnight()
        with self._queue_locked() as q:
            cur = self._cur()
            place_new_items(cur, q)  # as the next pick would
            live = q.snapshot(since)
            cur.execute("BEGIN TRANSACTION")
            try:
                fresh = read_queue_index(cur).snapshot(since)
            finally:
                cur.execute("COMMIT")
        return live, fresh

