"""Gold items: items with a reference ranking, mixed into annotators' queues to measure them.

An admin makes an item gold by choosing one of its rankings as the reference
(`set_gold_from_ranking`: the annotator who made it is not scored on it), by giving an order
(`set_gold`), or by importing a file of them (`import_gold`). A gold item leaves the regular
queue: every annotator who has not ranked it can get it as one of their items, at the gold rate
(store/queue.py), and nothing on screen tells it apart. Their ranking is an ordinary ranking (its
pairs are training data like any other) that is also scored against the reference
(store/agreement.py gold_agreement; Store.annotator_agreement in store/stats.py).

Import file (JSONL, JSON, CSV or Parquet, read as in store/readers.py), one gold item per row:

    {"item": 12, "ranking": [[34], [35, 36], [37]]}                  response ids, best first
    {"prompt": "...", "ranking": ["best reply", ["tie", "tie"], "worst reply"]}   response texts

Either key names the item: "item" its id; "prompt" the prompt's text, and the item is the queued
item of that prompt holding those responses. Ties are inner lists. The ranking must order every
response of the item. All or nothing: any bad row refuses the file (DataError, every problem
listed) and nothing is stored.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from store.values import from_db_time, utcnow
from store.errors import DataError, InvalidRequest, NotFoundError
from store.pairs import normalize_order
from store.readers import read_rows
from store.records import GoldItem, Ranking, Response

_GOLD_COLS = "item_id, order_groups, ranking_id, annotator_id, source, created_at"
MAX_ERRORS = 50


def _gold(row) -> GoldItem:
    return GoldItem(item_id=row[0], order=[list(g) for g in row[1]], ranking_id=row[2], annotator_id=row[3],
                    source=row[4], created_at=from_db_time(row[5]))


class GoldMixin:
    """Gold-item methods of Store. Besides the core (store/db.py) they use, declared here, an
    item's responses (store/repo.py) and a ranking (store/rankings.py)."""

    item_responses: Callable[[int], list[Response]]
    get_ranking: Callable[[int], Ranking]

    def set_gold(self, item_id: int, order, *, source: str = "manual") -> GoldItem:
        """Make an item gold with this reference order (tie groups of its response ids, best
        first), replacing any reference it had."""
        try:
            groups = normalize_order(order)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        with self._tx() as cur:
            self._write_gold(cur, [(item_id, groups, None, None, source)])
        return self.get_gold(item_id)

    def set_gold_from_ranking(self, ranking_id: int) -> GoldItem:
        """Make a ranking the reference of its item (its annotator is not scored on that item)."""
        r = self.get_ranking(ranking_id)
        with self._tx() as cur:
            self._write_gold(cur, [(r.item_id, r.order, r.id, r.annotator_id, f"ranking:{r.id}")])
        return self.get_gold(r.item_id)

    def remove_gold(self, item_id: int) -> None:
        """The item is no longer gold: it goes back to the regular queue (rankings are kept)."""
        with self._tx() as cur:
            self._need(cur.execute("SELECT 1 FROM gold WHERE item_id = ?", [item_id]).fetchone(),
                       f"gold item with id {item_id}")
            cur.execute("DELETE FROM gold WHERE item_id = ?", [item_id])
            self._on_commit(lambda q: q.set_gold(item_id, False))

    def get_gold(self, item_id: int) -> GoldItem:
        row = self._one(f"SELECT {_GOLD_COLS} FROM gold WHERE item_id = ?", [item_id])
        if row is None:
            raise NotFoundError(f"no gold item with id {item_id}")
        return _gold(row)

    def gold_items(self) -> list[GoldItem]:
        return [_gold(r) for r in self._rows(f"SELECT {_GOLD_COLS} FROM gold ORDER BY item_id")]

    def _write_gold(self, cur, rows) -> None:
        """Inside a transaction: (item, groups, ranking, annotator, source) rows, each checked
        against its item (queued, and the order names exactly its responses)."""
        for item_id, groups, ranking_id, annotator_id, source in rows:
            queued = self._need(cur.execute("SELECT queued FROM items WHERE id = ?", [item_id]).fetchone(),
                                f"item with id {item_id}")[0]
            if not queued:
                raise InvalidRequest(f"item {item_id} is not in the annotation queue (imported pairs never are)")
            have = sorted(r[0] for r in cur.execute("SELECT id FROM responses WHERE item_id = ?", [item_id]).fetchall())
            if sorted(x for g in groups for x in g) != have:
                raise InvalidRequest(f"a gold ranking of item {item_id} must order exactly its responses {have}")
            cur.execute("INSERT OR REPLACE INTO gold VALUES (?, ?, ?, ?, ?, ?)",
                        [item_id, groups, ranking_id, annotator_id, source, utcnow()])
        ids = [r[0] for r in rows]
        self._on_commit(lambda q: [q.set_gold(i, True) for i in ids])

    def import_gold(self, path, **read_options) -> dict:
        """Import gold items from a file (see the module docstring); returns {rows, items}."""
        name = Path(path).name
        problems: list[tuple[int | None, str]] = []
        ready = []
        for n, row in read_rows(path, **read_options):
            try:
                item_id, groups = self._resolve_gold_row(row)
                ready.append((item_id, groups, None, None, f"import:{name}"))
            except (InvalidRequest, NotFoundError) as exc:
                problems.append((n, str(exc)))
        seen = [r[0] for r in ready]
        problems += [(None, f"item {i} appears in more than one row") for i in sorted({i for i in seen if seen.count(i) > 1})]
        if not problems:
            try:
                with self._tx() as cur:
                    self._write_gold(cur, ready)
            except (InvalidRequest, NotFoundError) as exc:
                problems.append((None, str(exc)))
        if problems:
            raise DataError(str(path), problems[:MAX_ERRORS], more=max(0, len(problems) - MAX_ERRORS))
        return {"rows": len(ready), "items": sorted(seen)}

    def _resolve_gold_row(self, row: dict) -> tuple[int, list[list[int]]]:
        """(item id, tie groups of response ids) of one import row."""
        ranking = row.get("ranking")
        if not isinstance(ranking, list) or not ranking:
            raise InvalidRequest("'ranking' must be a list of response ids or texts, best first")
        groups = [g if isinstance(g, list) else [g] for g in ranking]
        if "item" in row and row["item"] is not None:
            item = row["item"]
            if isinstance(item, bool) or not isinstance(item, int):
                raise InvalidRequest(f"'item' must be an item id, not {item!r}")
            candidates = [(item, self.item_responses(item))]
            if not candidates[0][1]:
                raise NotFoundError(f"no item with id {item}")
        elif isinstance(row.get("prompt"), str):
            items = [r[0] for r in self._rows("SELECT i.id FROM items i JOIN prompts p ON p.id = i.prompt_id "
                                              "WHERE p.text = ? AND i.queued ORDER BY i.id", [row["prompt"]])]
            if not items:
                raise NotFoundError(f"no queued item of a prompt with the text {row['prompt'][:60]!r}")
            candidates = [(i, self.item_responses(i)) for i in items]
        else:
            raise InvalidRequest("a row needs 'item' (an item id) or 'prompt' (the prompt's text)")
        fits, problems = [], []
        for item_id, responses in candidates:
            try:
                fits.append((item_id, _order_of(groups, responses)))
            except InvalidRequest as exc:
                problems.append(exc)
        if len(fits) > 1:
            raise InvalidRequest(f"the ranking fits several items of the prompt ({[f[0] for f in fits]}): use 'item'")
        if not fits:
            raise problems[0]
        return fits[0]


def _order_of(groups: list[list], responses) -> list[list[int]]:
    """Tie groups of ranking entries (response ids or exact texts) as tie groups of the ids of
    `responses`, which they must order completely."""
    item_id = responses[0].item_id
    ids = []
    for group in groups:
        ids.append([])
        for x in group:
            if isinstance(x, bool) or not isinstance(x, (int, str)):
                raise InvalidRequest(f"a ranking entry must be a response id or text, not {x!r}")
            found = [r.id for r in responses if (r.id == x if isinstance(x, int) else r.text == x)]
            what = f"response {x}" if isinstance(x, int) else f"response with the text {x[:60]!r}"
            if not found:
                raise InvalidRequest(f"item {item_id} has no {what}")
            if len(found) > 1:
                raise InvalidRequest(f"item {item_id} has more than one {what}: rank it by response ids")
            ids[-1].append(found[0])
    try:
        ids = normalize_order(ids)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    have = sorted(r.id for r in responses)
    if sorted(x for g in ids for x in g) != have:
        raise InvalidRequest(f"a gold ranking of item {item_id} must order exactly its responses {have}")
    return ids
