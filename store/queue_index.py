"""An in-memory mirror of the queue's state, so `next_item` answers in microseconds.

Why: choosing the next item in SQL takes DuckDB about 10 ms (aggregates over every ranking and
lease, several anti-joins), and it must run inside the write lock so two annotators never take the
same slot. With 20 annotators submitting at once that lock becomes the bottleneck. The Store is
the only writer of its file (DuckDB allows one read-write process), so it can keep the few facts
the queue needs in memory and update them when its own transactions commit:

- queued items: prompt, round, response ids, number of rankings, who ranked them;
- per annotator: items ranked, items skipped, leases; flagged prompts; annotator ids;
- per annotator: how many rankings they made, and when they made the recent ones (the progress
  line's "today" and "total" without a query per submit);
- rounds' own overlap and priority, and the gold items (served apart, see store/queue.py).

The database stays the source of truth: every fact here is also written there, in the transaction
that changes it, and the index mirrors the rows exactly (the `leases` rows too, expired or not, so
the Store knows whether a lease row exists without asking). It is built from the database when
first needed and rebuilt if an update ever fails; a test compares a live index with a fresh build
(`snapshot`). Updates and `pick` run with the Store's write lock held. The progress queries
(`remaining`, `ranking_counts`, `holds_lease`, `open_items`) run without it, so a progress line
never waits for another annotator's transaction: `lock` keeps them from reading a half-made
update. The only SQL here is `read_queue_index`, the read it is built from (inside the caller's
transaction, by the core, store/db.py, when first needed), and `place_new_items`, the rounds of
items added since.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from store.queue_rules import QueueRules, RoundPool, locked

RECENT_KEEP = timedelta(days=1)
"""How far before the earliest "today" asked about the index keeps ranking times (see
ranking_counts): older ones only count towards the totals."""


@dataclass(frozen=True)
class QueueRows:
    """The queue's state as read from the database in one transaction (read_queue_index)."""

    items: list[tuple]
    """Queued items: (item, prompt, round or None, response ids)."""
    rankings: list[tuple]
    """Rankings of queued items: (item, annotator, how many)."""
    skips: list[tuple]
    """(annotator, item)."""
    flagged: list[int]
    """Flagged prompt ids."""
    leases: list[tuple]
    """Every row of the leases table, live or expired: (item, annotator, expires)."""
    annotators: list[int]
    ranking_times: list[tuple]
    """Per annotator: (annotator, number of rankings, sorted times of those made at or after
    recent_since)."""
    recent_since: datetime
    rounds: list[tuple]
    """Rounds' queue settings: (round, overlap or None, priority or None)."""
    gold: list[int]
    """Gold item ids."""


class QueueIndex(QueueRules):
    """The facts and their updates; the choice of items is QueueRules' (store/queue_rules.py)."""

    def __init__(self):
        self.item_prompt: dict[int, int] = {}
        self.item_round: dict[int, int | None] = {}
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
        # the regular queue by round (None: items of no round); gold items are kept apart
        self.pools: dict[int | None, RoundPool] = defaultdict(RoundPool)
        self.gold: set[int] = set()
        self.newest_round: int | None = None  # the newest round with queued items
        self.unplaced: set[int] = set()  # items added since the build whose round is not read yet
        self.round_overlap: dict[int, int] = {}  # set by an admin (else the store's default)
        self.round_priority: dict[int, int] = {}  # set by an admin (else NEWEST_ROUND_PRIORITY or 0)

    @classmethod
    def build(cls, rows: QueueRows) -> "QueueIndex":
        """From the rows read in one transaction (read_queue_index). Buckets are sorted once, not
        item by item."""
        q = cls()
        q.recent_since = rows.recent_since
        for annotator_id, total, times in rows.ranking_times:
            q.ranking_total[annotator_id] = total
            if times:
                q.recent[annotator_id] = sorted(times)
        q.flagged = set(rows.flagged)
        q.annotators = set(rows.annotators)
        for round_id, overlap, priority in rows.rounds:
            q.set_round(round_id, overlap, priority)
        for item_id, prompt_id, round_id, response_ids in rows.items:
            q._add_item_facts(item_id, prompt_id, round_id, response_ids)
        q.gold = {i for i in rows.gold if i in q.item_prompt}
        for item_id, annotator_id, count in rows.rankings:
            if item_id in q.item_prompt:
                q.rankers[item_id][annotator_id] += count
                q.ranked[annotator_id].add(item_id)
                q.n_done[item_id] += count
        for annotator_id, item_id in rows.skips:
            q.skipped[annotator_id].add(item_id)
        for item_id, annotator_id, expires in rows.leases:
            q.set_lease(item_id, annotator_id, expires)
        by_pool: dict[int | None, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for item_id in sorted(q.item_prompt):
            if q._in_pool(item_id):
                by_pool[q.item_round[item_id]][q.n_done[item_id]].append(item_id)
        for round_id, buckets in by_pool.items():
            pool = q.pools[round_id]
            for n, ids in buckets.items():
                pool.lists[n], pool.sets[n] = ids, set(ids)
        return q

    # ------------------------------------------------------------------ updates

    def _add_item_facts(self, item_id: int, prompt_id: int, round_id: int | None, response_ids) -> None:
        self.item_prompt[item_id] = prompt_id
        self.item_responses[item_id] = tuple(response_ids)
        for rid in response_ids:
            self.response_item[rid] = item_id
        self.prompt_items[prompt_id].append(item_id)
        self.n_done[item_id] = 0
        self._add_item_round(item_id, round_id)

    def _add_item_round(self, item_id: int, round_id: int | None) -> None:
        self.item_round[item_id] = round_id
        if round_id is not None and (self.newest_round is None or round_id > self.newest_round):
            self.newest_round = round_id

    @locked
    def add_item(self, item_id: int, prompt_id: int, response_ids) -> None:
        """A new queued item (Store.add_responses_bulk). Its round is not known here: it waits in
        the pool of items without a round, listed in `unplaced`, until `place` moves it (the
        Store reads the rounds in its next pick's transaction)."""
        if item_id in self.item_prompt:
            return
        self._add_item_facts(item_id, prompt_id, None, response_ids)
        self.unplaced.add(item_id)
        if self._in_pool(item_id):
            self.pools[None].add(0, item_id)

    @locked
    def place(self, rounds: dict[int, int | None]) -> None:
        """The rounds of items added without one: {item: round}."""
        for item_id, round_id in rounds.items():
            self.unplaced.discard(item_id)
            if item_id not in self.item_prompt or round_id is None:
                continue
            self._pool_remove(item_id)
            self._add_item_round(item_id, round_id)
            self._pool_add(item_id)

    @locked
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

    @locked
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

    @locked
    def set_lease(self, item_id: int, annotator_id: int, expires: datetime) -> None:
        self.leases[item_id][annotator_id] = expires
        self.held[annotator_id].add(item_id)

    @locked
    def drop_lease(self, item_id: int, annotator_id: int) -> None:
        self.leases.get(item_id, {}).pop(annotator_id, None)
        if not self.leases.get(item_id):
            self.leases.pop(item_id, None)
        self.held.get(annotator_id, set()).discard(item_id)

    @locked
    def drop_leases_of(self, annotator_id: int) -> None:
        for item_id in list(self.held.get(annotator_id, ())):
            self.drop_lease(item_id, annotator_id)

    @locked
    def drop_expired(self, now: datetime) -> None:
        for item_id in list(self.leases):
            for annotator_id, expires in list(self.leases[item_id].items()):
                if expires <= now:
                    self.drop_lease(item_id, annotator_id)

    @locked
    def skip(self, annotator_id: int, item_id: int) -> None:
        self.skipped[annotator_id].add(item_id)
        self.drop_lease(item_id, annotator_id)

    @locked
    def flag(self, prompt_id: int) -> None:
        if prompt_id in self.flagged:
            return
        for item_id in self.prompt_items.get(prompt_id, ()):
            self._pool_remove(item_id)
            for annotator_id in list(self.leases.get(item_id, {})):
                self.drop_lease(item_id, annotator_id)
        self.flagged.add(prompt_id)

    @locked
    def unflag(self, prompt_id: int) -> None:
        if prompt_id not in self.flagged:
            return
        self.flagged.discard(prompt_id)
        for item_id in self.prompt_items.get(prompt_id, ()):
            self._pool_add(item_id)

    @locked
    def set_gold(self, item_id: int, gold: bool) -> None:
        """An item became a gold item (it leaves the regular queue) or stopped being one."""
        if item_id not in self.item_prompt or (item_id in self.gold) == gold:
            return
        if gold:
            self._pool_remove(item_id)
            self.gold.add(item_id)
        else:
            self.gold.discard(item_id)
            self._pool_add(item_id)

    @locked
    def set_round(self, round_id: int, overlap: int | None, priority: int | None) -> None:
        """A round's own overlap and priority (None: the defaults)."""
        for table, value in ((self.round_overlap, overlap), (self.round_priority, priority)):
            if value is None:
                table.pop(round_id, None)
            else:
                table[round_id] = int(value)

    # ------------------------------------------------------------------ queries

    def has_lease_row(self, item_id: int, annotator_id: int) -> bool:
        """Whether the leases table holds a row (live or expired) for this item and annotator."""
        return annotator_id in self.leases.get(item_id, ())

    @locked
    def holds_lease(self, annotator_id: int, item_id: int, now: datetime) -> bool:
        """Whether the annotator holds a live lease on the item."""
        expires = self.leases.get(item_id, {}).get(annotator_id)
        return expires is not None and expires > now

    @locked
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

    # ------------------------------------------------------------------ the regular queue

    def _in_pool(self, item_id: int) -> bool:
        return self.item_prompt[item_id] not in self.flagged and item_id not in self.gold

    def _pool_add(self, item_id: int) -> None:
        if self._in_pool(item_id):
            self.pools[self.item_round[item_id]].add(self.n_done[item_id], item_id)

    def _pool_remove(self, item_id: int) -> None:
        pool = self.pools.get(self.item_round[item_id])
        if pool is not None:
            pool.remove(self.n_done[item_id], item_id)

    def _move(self, item_id: int, new_n: int) -> None:
        self._pool_remove(item_id)
        self.n_done[item_id] = new_n
        self._pool_add(item_id)

    @locked
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
            "rounds": {i: r for i, r in self.item_round.items() if r is not None},
            "responses": dict(self.item_responses),
            "n_done": dict(self.n_done),
            "rankers": {i: dict(c) for i, c in self.rankers.items() if c},
            "skipped": {a: set(s) for a, s in self.skipped.items() if s},
            "flagged": set(self.flagged),
            "annotators": set(self.annotators),
            "pools": {r: {n: list(b) for n, b in p.lists.items() if b} for r, p in self.pools.items() if p.lists},
            "gold": set(self.gold),
            "round_settings": (dict(self.round_overlap), dict(self.round_priority)),
            "newest_round": self.newest_round,
        }


def local_midnight() -> datetime:
    """The start of today on this machine's clock, as the naive UTC the database stores."""
    midnight = datetime.now().astimezone().replace(hour=0, minute=0, second=0, microsecond=0)
    return midnight.astimezone(timezone.utc).replace(tzinfo=None)


def place_new_items(cur, q: QueueIndex) -> None:
    """Read the rounds of the items added since the index was built (QueueIndex.add_item), inside
    the caller's transaction."""
    if q.unplaced:
        ids = sorted(q.unplaced)
        q.place(dict.fromkeys(ids) | dict(cur.execute(
            "SELECT id, round_id FROM items WHERE id IN (SELECT unnest(?))", [ids]).fetchall()))


def read_queue_index(cur) -> QueueIndex:
    """Read the queue's state (inside the caller's transaction) into a QueueIndex."""
    items = cur.execute(
        "SELECT i.id, i.prompt_id, i.round_id, list(r.id ORDER BY r.id) FROM items i JOIN responses r "
        "ON r.item_id = i.id WHERE i.queued GROUP BY i.id, i.prompt_id, i.round_id").fetchall()
    rankings = cur.execute(
        "SELECT k.item_id, k.annotator_id, count(*) FROM rankings k JOIN items i ON i.id = k.item_id "
        "WHERE i.queued GROUP BY ALL").fetchall()
    skips = cur.execute("SELECT annotator_id, item_id FROM skips").fetchall()
    flagged = [r[0] for r in cur.execute("SELECT DISTINCT prompt_id FROM flags").fetchall()]
    leases = cur.execute("SELECT item_id, annotator_id, expires_at FROM leases").fetchall()
    annotators = [r[0] for r in cur.execute("SELECT id FROM annotators").fetchall()]
    # ranking times from a day before today: enough for the progress line's "today"
    recent_since = local_midnight() - RECENT_KEEP
    ranking_times = cur.execute(
        "SELECT annotator_id, count(*), coalesce(list(created_at ORDER BY created_at) "
        "FILTER (WHERE created_at >= ?), []) FROM rankings GROUP BY annotator_id", [recent_since]).fetchall()
    rounds = cur.execute("SELECT round_id, overlap, priority FROM round_queue").fetchall()
    gold = [r[0] for r in cur.execute("SELECT item_id FROM gold").fetchall()]
    return QueueIndex.build(QueueRows(items=items, rankings=rankings, skips=skips, flagged=flagged, leases=leases,
                                      annotators=annotators, ranking_times=ranking_times,
                                      recent_since=recent_since, rounds=rounds, gold=gold))
