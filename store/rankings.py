"""Rankings and their pairs, and the leases written with them: save (one or in bulk), lease the
next item, undo, list.

An annotator's submit is one transaction, and this file writes all of it (Store._write_batch): the
ranking (a records.RankingIn), its pairs (store/pairs.py), the pairs of the annotator's own answer
(an edit), the end of their lease on the item and, with save_ranking_and_lease_next, the lease of
their next item. `save_ranking`'s rules:
- the order must name every response of one item of the given prompt exactly once;
- the same (annotator, client_token) submitted twice stores one ranking and returns it
  (idempotent: a double click or a network retry is harmless);
- an annotator ranking an item they ranked before replaces the earlier ranking and its pairs,
  unless the Store was opened with replace_rerankings=False (then both are kept);
- "all bad" keeps the ranking and its pairs, marked all_bad (export leaves them out by default);
- an optional strength (records.STRENGTHS) says how much better the best response is than the
  second; it needs both alone in their tie groups, and is stored with the ranking;
- an optional edit (records.EditIn) is the annotator's own better answer, written from one of the
  responses and ranked above it: it is stored as a response of its own item (never queued) of the
  model version records.HUMAN_EDIT, its `sampling` naming the response it was made from, the
  annotator and the ranking, and the ranking gains its pairs against every response (source
  'edit'); exports give it in the pairs and as a demonstration. A re-ranking or an undo removes
  the ranking's pairs, the edit's with them, and keeps the text;
- the annotator's lease on the item is released.
`next_item` leases an item by the queue's rules (store/queue.py, store/queue_rules.py) in the same
kind of transaction: rankings and next_item calls submitted at the same moment by several
annotators are written in one, the rankings first, so the picks see them. save_rankings_bulk
writes many rankings at once for imports, simulations and benches; undo_last_ranking deletes the
latest and leases its item back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

import pyarrow as pa

from store.db import registered
from store.values import dumps, from_db_time, utcnow
from store.errors import InvalidRequest, NotFoundError
from store.queue_index import place_new_items
from store.queue_rules import WRITE_KIND
from store.ranking_checks import Checked, checked, order_groups
from store.records import HUMAN_EDIT, Item, Pair, Ranking, RankingIn


_RANKING_COLS = ("id, item_id, prompt_id, annotator_id, order_groups, display_order, all_bad, "
                 "duration_s, client_token, comment, created_at, strength")
RANKING_TYPES = {"id": pa.int64(), "item_id": pa.int64(), "prompt_id": pa.int64(), "annotator_id": pa.int64(),
                 "order_groups": pa.list_(pa.list_(pa.int64())), "display_order": pa.list_(pa.int64()),
                 "all_bad": pa.bool_(), "duration_s": pa.float64(), "client_token": pa.string(),
                 "comment": pa.string(), "created_at": pa.timestamp("us"), "strength": pa.string()}
"""The rankings table's columns as Arrow types (bulk inserts: here and Store.import_item_rows)."""
PAIR_TYPES = {"id": pa.int64(), "prompt_id": pa.int64(), "item_id": pa.int64(), "chosen_id": pa.int64(),
              "rejected_id": pa.int64(), "margin": pa.float64(), "ranking_id": pa.int64(),
              "annotator_id": pa.int64(), "all_bad": pa.bool_(), "source": pa.string(),
              "created_at": pa.timestamp("us")}
_PAIR_COLS = ("id, prompt_id, item_id, chosen_id, rejected_id, margin, ranking_id, annotator_id, "
              "all_bad, source, created_at")


def _ranking(row) -> Ranking:
    return Ranking(id=row[0], item_id=row[1], prompt_id=row[2], annotator_id=row[3],
                   order=[list(g) for g in row[4]], display_order=list(row[5]), all_bad=row[6],
                   duration_s=row[7], client_token=row[8], comment=row[9], created_at=from_db_time(row[10]),
                   strength=row[11])


def _pair(row) -> Pair:
    return Pair(id=row[0], prompt_id=row[1], item_id=row[2], chosen_id=row[3], rejected_id=row[4],
                margin=row[5], ranking_id=row[6], annotator_id=row[7], all_bad=row[8], source=row[9],
                created_at=from_db_time(row[10]))


class RankingsMixin:
    """Ranking methods of Store, and the leases written in their transaction.

    Besides the core (store/db.py), these use public methods of the Store's other parts, declared
    here: items (store/repo.py) and the queue's settings (store/queue.py)."""

    get_item: Callable[..., Item]
    lease_seconds: Callable[[], int]
    queue_overlap: Callable[[], int]
    gold_rate: Callable[[], float]

    # -- a submit: the ranking, its pairs, an edit's answer, the lease's end and the next lease

    def save_ranking(self, ranking: RankingIn) -> Ranking:
        """Save one ranking (records.RankingIn) and its pairs in one transaction (see the module
        docstring). Raises InvalidRequest or NotFoundError (nothing stored) when the order does not
        fit. Concurrent calls are written together in one transaction (Store._combined)."""
        result = self._combined(WRITE_KIND, ("rank", (ranking, order_groups(ranking.order))), self._write_batch)
        return result if isinstance(result, Ranking) else self.get_ranking(result)

    def save_ranking_and_lease_next(self, ranking: RankingIn, *, exclude=()) -> tuple[Ranking, int | None]:
        """save_ranking, and in the same transaction lease this annotator's next item as next_item
        would (not one of `exclude`): one commit per submit instead of two. Returns the ranking and
        the leased item's id (None when the queue holds nothing more for them); fetch the item with
        get_item. Nothing is leased when the ranking is refused."""
        pick = self._next_request(ranking.annotator_id, None, None, exclude)
        result, picked = self._combined(WRITE_KIND, ("rank+next", ((ranking, order_groups(ranking.order)), pick)),
                                        self._write_batch)
        saved = result if isinstance(result, Ranking) else self.get_ranking(result)
        return saved, None if picked is None else picked[0]

    def next_item(self, annotator_id: int, *, overlap: int | None = None,
                  lease_seconds: float | None = None, exclude=()) -> Item | None:
        """The next item for this annotator, leased to them for `lease_seconds`; None when the
        queue holds nothing for them. `exclude`: item ids not to return (e.g. the one on screen,
        when prefetching the next). Concurrent calls share one transaction (Store._write_batch)."""
        picked = self._combined(WRITE_KIND, ("next", self._next_request(annotator_id, overlap, lease_seconds, exclude)),
                                self._write_batch)
        if picked is None:
            return None
        item_id, expires = picked
        item = self.get_item(item_id, annotator_id)
        return dataclasses.replace(item, lease_expires_at=from_db_time(expires))

    def _next_request(self, annotator_id: int, overlap, lease_seconds, exclude) -> tuple:
        overlap = None if overlap is None else int(overlap)
        lease_seconds = self.lease_seconds() if lease_seconds is None else float(lease_seconds)
        return annotator_id, overlap, lease_seconds, frozenset(int(i) for i in exclude)

    def _write_batch(self, cur, requests) -> list:
        """One transaction for the save_ranking and next_item requests that arrived together
        (Store._combined): the rankings first, then the picks, which see them. A commit costs
        DuckDB about 4 ms (it syncs its log to disk) and holds the write lock, so under load
        annotators' rankings and leases share one. Requests are ("rank", ranking), ("next", pick)
        or ("rank+next", (ranking, pick)) (Store.save_ranking_and_lease_next: the pick is made
        only if the ranking is stored). Returns one result or exception per request."""
        out: list = [None] * len(requests)
        # 1. the rankings
        ranks = [i for i, (kind, _) in enumerate(requests) if kind != "next"]
        if ranks:
            rankings = [req if kind == "rank" else req[0] for kind, req in (requests[i] for i in ranks)]
            for i, result in zip(ranks, self._save_ranking_batch(cur, rankings)):
                out[i] = result
        # 2. the picks: of next_item, and of each save_ranking_and_lease_next whose ranking was stored
        picks = [i for i, (kind, _) in enumerate(requests)
                 if kind == "next" or (kind == "rank+next" and not isinstance(out[i], BaseException))]
        if picks:
            wanted = [req if kind == "next" else req[1] for kind, req in (requests[i] for i in picks)]
            for i, picked in zip(picks, self._next_item_batch(cur, wanted)):
                out[i] = picked if requests[i][0] == "next" else (out[i], picked)
        return out

    # -- 1. the rankings of a write batch

    def _save_ranking_batch(self, cur, requests) -> list:
        """Inside the write transaction (Store._write_batch): check and write queued save_ranking
        requests, updating the queue index at once so the picks after them see them. Returns per
        request a Ranking, the id of an earlier ranking to return (repeated token), or an error."""
        q = self._shared.queue
        now = utcnow()
        out: list = [None] * len(requests)
        ready: list[tuple[int, Checked]] = []
        for i, (r, groups) in enumerate(requests):
            try:
                if r.annotator_id not in q.annotators:
                    raise NotFoundError(f"no annotator with id {r.annotator_id}")
                ready.append((i, checked(r, groups, *self._item_of(cur, q, groups[0][0]))))
            except (InvalidRequest, NotFoundError) as exc:
                out[i] = exc
        if len(ready) < 8:
            # a few statements each beat the fixed cost of the Arrow path for small batches
            seen: set[tuple[int, int]] = set()
            written = []
            for _, x in ready:
                key = (x.r.annotator_id, x.item_id)
                written.append(self._write_one(cur, q, x, now, check_db=key in seen))
                seen.add(key)
        else:
            written = self._write_many(cur, [x for _, x in ready], now, follow_now=True)
        self._write_edits(cur, [(x, ranking_id) for (_, x), (ranking_id, new) in zip(ready, written) if new], now)
        for (i, x), (ranking_id, new) in zip(ready, written):
            out[i] = x.record(ranking_id, now) if new else ranking_id
        return out

    def _write_edits(self, cur, written: list[tuple[Checked, int]], now) -> None:
        """Inside the write transaction: the annotators' own answers of rankings just written (module
        docstring), each a response of a new item of its prompt, with its pairs."""
        edits = [(x, ranking_id) for x, ranking_id in written if x.r.edit is not None]
        if not edits:
            return
        found = cur.execute("SELECT id FROM model_versions WHERE name = ?", [HUMAN_EDIT]).fetchall()
        version = found[0][0] if found else cur.execute(
            "INSERT INTO model_versions (id, kind, name, meta, created_at) VALUES "
            "(nextval('model_versions_id_seq'), 'external', ?, ?, ?) RETURNING id",
            [HUMAN_EDIT, dumps({"about": "annotators' own answers, each written from a response it ranks above"}),
             now]).fetchone()[0]
        for x, ranking_id in edits:
            r = x.r
            item_id = cur.execute(
                "INSERT INTO items (id, prompt_id, model_version_id, round_id, n_responses, queued, created_at) "
                "VALUES (nextval('items_id_seq'), ?, ?, NULL, 1, FALSE, ?) RETURNING id",
                [r.prompt_id, version, now]).fetchone()[0]
            sampling = {"edit_of": r.edit.made_from, "annotator_id": r.annotator_id, "ranking_id": ranking_id}
            edit_id = cur.execute(
                "INSERT INTO responses (id, item_id, prompt_id, model_version_id, text, sampling, created_at) "
                "VALUES (nextval('responses_id_seq'), ?, ?, ?, ?, ?, ?) RETURNING id",
                [item_id, r.prompt_id, version, r.edit.text, dumps(sampling), now]).fetchone()[0]
            pairs = x.edit_pairs(edit_id)
            cur.execute(
                "INSERT INTO pairs SELECT nextval('pairs_id_seq'), ?, ?, unnest(?), unnest(?), unnest(?), "
                "?, ?, ?, 'edit', ?",
                [r.prompt_id, x.item_id, [p[0] for p in pairs], [p[1] for p in pairs],
                 [float(p[2]) for p in pairs], ranking_id, r.annotator_id, bool(r.all_bad), now])

    def _write_one(self, cur, q, x: Checked, now, *, check_db: bool = False) -> tuple[int, bool]:
        """One ranking in the fewest statements (the common case of the UI): (id, newly written)."""
        r, item_id, annotator_id = x.r, x.item_id, x.r.annotator_id
        # 1. a re-ranking of the same item replaces the earlier ranking and its pairs. The index
        #    says whether there is one for queued items (unless this transaction already wrote one:
        #    check_db); other items ask the database.
        replaced: list[tuple[int, object]] = []  # (id, created_at)
        if self.replace_rerankings and (check_db or item_id not in q.item_prompt
                                        or q.rankers.get(item_id, {}).get(annotator_id)):
            prior = cur.execute(
                "SELECT id, client_token, item_id, created_at FROM rankings WHERE annotator_id = ? "
                "AND (item_id = ? OR client_token = ?)", [annotator_id, item_id, r.client_token]).fetchall()
            if r.client_token is None or all(p[1] != r.client_token for p in prior):
                replaced = [(p[0], p[3]) for p in prior if p[2] == item_id]
        if replaced:
            ids = [rid for rid, _ in replaced]
            cur.execute("DELETE FROM pairs WHERE ranking_id IN (SELECT unnest(?))", [ids])
            cur.execute("DELETE FROM rankings WHERE id IN (SELECT unnest(?))", [ids])
        # 2. the ranking, unless this client token was stored before (idempotent: return that one)
        inserted = cur.execute(
            f"INSERT INTO rankings ({_RANKING_COLS}) SELECT nextval('rankings_id_seq'), ?, ?, ?, ?, ?, ?, ?, ?, "
            "?, ?, ? WHERE ?::VARCHAR IS NULL OR NOT EXISTS "
            "(SELECT 1 FROM rankings WHERE annotator_id = ? AND client_token = ?) RETURNING id",
            [item_id, r.prompt_id, annotator_id, x.groups, x.display, bool(r.all_bad), r.duration_s,
             r.client_token, r.comment or "", now, r.strength, r.client_token, annotator_id,
             r.client_token]).fetchall()
        if not inserted:
            return cur.execute("SELECT min(id) FROM rankings WHERE annotator_id = ? AND client_token = ?",
                               [annotator_id, r.client_token]).fetchall()[0][0], False
        ranking_id = inserted[0][0]
        # 3. its pairs, and the end of the lease
        if x.pairs:
            cur.execute(
                "INSERT INTO pairs SELECT nextval('pairs_id_seq'), ?, ?, unnest(?), unnest(?), unnest(?), "
                "?, ?, ?, 'ranking', ?",
                [r.prompt_id, item_id, [p[0] for p in x.pairs], [p[1] for p in x.pairs],
                 [float(p[2]) for p in x.pairs], ranking_id, annotator_id, bool(r.all_bad), now])
        if q.has_lease_row(item_id, annotator_id):
            cur.execute("DELETE FROM leases WHERE item_id = ? AND annotator_id = ?", [item_id, annotator_id])

        for _, created_at in replaced:  # the index follows at once (see _save_ranking_batch)
            q.remove_ranking(item_id, annotator_id, created_at)
        q.add_ranking(item_id, annotator_id, now)
        return ranking_id, True

    def _item_of(self, cur, q, response_id: int) -> tuple[int, int, tuple[int, ...]]:
        """(item id, prompt id, the item's response ids) of a response: from the queue index for
        queued items, else from the database."""
        item_id = q.response_item.get(response_id)
        if item_id is not None:
            return item_id, q.item_prompt[item_id], q.item_responses[item_id]
        rows = cur.execute(
            "SELECT item_id, prompt_id, id FROM responses WHERE item_id = "
            "(SELECT item_id FROM responses WHERE id = ?) ORDER BY id", [response_id]).fetchall()
        if not rows:
            raise NotFoundError(f"no response with id {response_id}")
        return rows[0][0], rows[0][1], tuple(x[2] for x in rows)

    # -- 2. the picks of a write batch, and their leases

    def _next_item_batch(self, cur, requests) -> list:
        """Inside the write transaction: pick an item for each queued next_item request, in order,
        and write their leases. Each pick sees the leases of the picks before it (the index is
        updated at once; Store._combined drops the index if the transaction fails)."""
        q = self._shared.queue
        now = utcnow()
        self._collect_expired_leases(cur, q, now)
        place_new_items(cur, q)
        default, gold_rate = self.queue_overlap(), self.gold_rate()
        out, leases, renewed = [], {}, set()
        for annotator_id, overlap, lease_seconds, exclude in requests:
            item_id = q.pick(annotator_id, overlap, default, now, exclude, gold_rate)
            if item_id is None:
                out.append(None)
                continue
            expires = now + timedelta(seconds=lease_seconds)
            key = (item_id, annotator_id)
            if key not in leases and q.has_lease_row(item_id, annotator_id):
                renewed.add(key)  # the table holds a row for it already (a reload, an expired lease)
            leases[key] = expires
            q.set_lease(item_id, annotator_id, expires)
            out.append((item_id, expires))
        self._write_leases(cur, {k: e for k, e in leases.items() if k not in renewed},
                           {k: leases[k] for k in renewed})
        return out

    @staticmethod
    def _write_leases(cur, new: dict, renewed: dict) -> None:
        """Write lease rows: {(item, annotator): expires} of rows the table lacks (one INSERT),
        and of rows it holds (UPDATE). The queue index knows which is which; a plain INSERT costs
        DuckDB a fifth of an INSERT OR REPLACE (which checks the key and rewrites the row)."""
        for (item_id, annotator_id), expires in renewed.items():
            cur.execute("UPDATE leases SET expires_at = ? WHERE item_id = ? AND annotator_id = ?",
                        [expires, item_id, annotator_id])
        if 0 < len(new) <= 64:
            cur.execute("INSERT INTO leases VALUES " + ", ".join(["(?, ?, ?)"] * len(new)),
                        [x for (i, a), e in new.items() for x in (i, a, e)])
        elif new:
            tbl = pa.table({"item_id": pa.array([k[0] for k in new], pa.int64()),
                            "annotator_id": pa.array([k[1] for k in new], pa.int64()),
                            "expires_at": pa.array(list(new.values()), pa.timestamp("us"))})
            with registered(cur, "_new_leases", tbl):
                cur.execute("INSERT INTO leases SELECT item_id, annotator_id, expires_at FROM _new_leases")

    def _collect_expired_leases(self, cur, q, now: datetime) -> None:
        """Delete expired leases at most once a minute (they are ignored anyway; this keeps the
        table and the index small)."""
        last = self._shared.lease_gc_at
        if last is None or (now - last).total_seconds() > 60:
            cur.execute("DELETE FROM leases WHERE expires_at <= ?", [now])
            q.drop_expired(now)  # at once, like the picks (Store._combined drops the index on failure)
            self._shared.lease_gc_at = now

    # -- many rankings at once

    def save_rankings_bulk(self, rankings: Sequence[RankingIn]) -> list[int]:
        """Save many rankings in one transaction with Arrow inserts; same rules as save_ranking,
        applied in input order. Returns the ranking id for each input (the earlier id for a
        repeated client token; the replacing ranking's id for a replaced one). One bad ranking
        refuses the whole batch (nothing stored)."""
        rankings = list(rankings)
        if not rankings:
            return []
        groups = [order_groups(r.order) for r in rankings]
        lookup = self._item_lookup([g[0][0] for g in groups])
        annotators = {r[0] for r in self._rows("SELECT id FROM annotators")}
        ready = []
        for r, g in zip(rankings, groups):
            if r.annotator_id not in annotators:
                raise NotFoundError(f"no annotator with id {r.annotator_id}")
            if g[0][0] not in lookup:
                raise NotFoundError(f"no response with id {g[0][0]}")
            ready.append(checked(r, g, *lookup[g[0][0]]))
        with self._tx() as cur:
            now = utcnow()
            written = self._write_many(cur, ready, now)
            self._write_edits(cur, [(x, ranking_id) for x, (ranking_id, new) in zip(ready, written) if new], now)
            return [ranking_id for ranking_id, _ in written]

    def _write_many(self, cur, ready: list[Checked], now, *, follow_now: bool = False) -> list[tuple[int, bool]]:
        """Inside a transaction: write checked rankings with Arrow inserts, in input order.
        Returns (ranking id, newly written) per input. The queue index follows after the commit,
        or at once with follow_now (inside Store._write_batch, which drops the index on failure)."""
        # 1. idempotency and replacement against what is stored and within the batch
        result, kept = self._to_write(cur, ready)
        rows = [ready[i] for i in kept]
        deleted = []
        if self.replace_rerankings:
            deleted = self._delete_rankings_of(cur, [(x.r.annotator_id, x.item_id) for x in rows])
        # 2. rankings
        ids = self._reserve_ids(cur, "rankings_id_seq", len(kept))
        id_of = dict(zip(kept, ids))
        self._insert_arrow(cur, "rankings", {
            "id": ids, "item_id": [x.item_id for x in rows], "prompt_id": [x.r.prompt_id for x in rows],
            "annotator_id": [x.r.annotator_id for x in rows], "order_groups": [x.groups for x in rows],
            "display_order": [x.display for x in rows], "all_bad": [bool(x.r.all_bad) for x in rows],
            "duration_s": [x.r.duration_s for x in rows], "client_token": [x.r.client_token for x in rows],
            "comment": [x.r.comment or "" for x in rows], "created_at": [now] * len(rows),
            "strength": [x.r.strength for x in rows],
        }, RANKING_TYPES)
        # 3. pairs
        flat = [(rid, x, p) for rid, x in zip(ids, rows) for p in x.pairs]
        pair_ids = self._reserve_ids(cur, "pairs_id_seq", len(flat))
        self._insert_arrow(cur, "pairs", {
            "id": pair_ids, "prompt_id": [x.r.prompt_id for _, x, _ in flat],
            "item_id": [x.item_id for _, x, _ in flat], "chosen_id": [p[0] for _, _, p in flat],
            "rejected_id": [p[1] for _, _, p in flat], "margin": [float(p[2]) for _, _, p in flat],
            "ranking_id": [rid for rid, _, _ in flat], "annotator_id": [x.r.annotator_id for _, x, _ in flat],
            "all_bad": [bool(x.r.all_bad) for _, x, _ in flat], "source": ["ranking"] * len(flat),
            "created_at": [now] * len(flat),
        }, PAIR_TYPES)
        # 4. leases of the ranked items
        self._with_keys(cur, [(x.r.annotator_id, x.item_id) for x in rows],
                        "DELETE FROM leases l USING {keys} k "
                        "WHERE l.annotator_id = k.annotator_id AND l.item_id = k.item_id")
        # 5. the queue index follows (or is rebuilt when the batch is large)
        added = [(x.item_id, x.r.annotator_id) for x in rows]

        def follow(q):
            for annotator_id, item_id, created_at in deleted:
                q.remove_ranking(item_id, annotator_id, created_at)
            for item_id, annotator_id in added:
                q.add_ranking(item_id, annotator_id, now)

        if follow_now:
            follow(self._shared.queue)
        else:
            self._on_commit(follow if len(kept) + len(deleted) <= 2000 else None)
        out = []
        for i, res in enumerate(result):
            own = res is None
            while isinstance(res, tuple):  # follow "same as input j" links
                i = res[1]
                res = result[i]
            out.append((id_of[i] if res is None else res, own))
        return out

    def _to_write(self, cur, ready: list[Checked]) -> tuple[list, list[int]]:
        """Which inputs to write: (per input its stored ranking id, ("same", j) when input j stands
        for it, or None when it is written; the input indices written, in order). A client token
        already stored or seen earlier in the batch is the same ranking; with replace_rerankings the
        last ranking of an (annotator, item) replaces the earlier ones."""
        tokens = [(x.r.annotator_id, x.r.client_token) for x in ready if x.r.client_token is not None]
        stored_tokens = self._stored_tokens(cur, tokens)
        result: list = [None] * len(ready)
        keep: dict = {}  # (annotator, item), or the input index when re-rankings are kept -> input index
        token_seen: dict = {}
        for i, x in enumerate(ready):
            tok = (x.r.annotator_id, x.r.client_token)
            if x.r.client_token is not None and tok in stored_tokens:
                result[i] = stored_tokens[tok]
                continue
            if x.r.client_token is not None and tok in token_seen:
                result[i] = ("same", token_seen[tok])
                continue
            if x.r.client_token is not None:
                token_seen[tok] = i
            key = (x.r.annotator_id, x.item_id) if self.replace_rerankings else i
            if key in keep:
                result[keep[key]] = ("same", i)
            keep[key] = i
        return result, sorted(keep.values())

    def _item_lookup(self, response_ids: list[int]) -> dict[int, tuple[int, int, list[int]]]:
        """response id -> (item id, prompt id, the item's response ids)."""
        cur = self._cur()
        with registered(cur, "_lookup_ids", pa.table({"id": pa.array(sorted(set(response_ids)), pa.int64())})):
            rows = cur.execute(
                "WITH its AS (SELECT DISTINCT r.item_id FROM responses r JOIN _lookup_ids k ON k.id = r.id) "
                "SELECT r.item_id, any_value(r.prompt_id), list(r.id ORDER BY r.id) FROM responses r "
                "JOIN its ON its.item_id = r.item_id GROUP BY r.item_id").fetchall()
        out = {}
        for item_id, prompt_id, ids in rows:
            for rid in ids:
                out[rid] = (item_id, prompt_id, ids)
        return out

    def _stored_tokens(self, cur, tokens: list[tuple[int, str]]) -> dict:
        if not tokens:
            return {}
        tbl = pa.table({"annotator_id": pa.array([t[0] for t in tokens], pa.int64()),
                        "client_token": pa.array([t[1] for t in tokens], pa.string())})
        with registered(cur, "_tokens", tbl):
            rows = cur.execute("SELECT r.annotator_id, r.client_token, min(r.id) FROM rankings r JOIN _tokens t "
                               "ON r.annotator_id = t.annotator_id AND r.client_token = t.client_token "
                               "GROUP BY ALL").fetchall()
        return {(a, t): rid for a, t, rid in rows}

    def _delete_rankings_of(self, cur, keys: list[tuple[int, int]]) -> list[tuple]:
        """Delete the stored rankings (and their pairs) of these (annotator, item) keys; returns
        (annotator, item, created_at) of each ranking deleted."""
        deleted = self._with_keys(cur, keys, "SELECT r.annotator_id, r.item_id, r.created_at "
                                             "FROM rankings r, {keys} k "
                                             "WHERE r.annotator_id = k.annotator_id AND r.item_id = k.item_id")
        self._with_keys(cur, keys, "DELETE FROM pairs p USING rankings r, {keys} k WHERE p.ranking_id = r.id "
                                   "AND r.annotator_id = k.annotator_id AND r.item_id = k.item_id")
        self._with_keys(cur, keys, "DELETE FROM rankings r USING {keys} k "
                                   "WHERE r.annotator_id = k.annotator_id AND r.item_id = k.item_id")
        return deleted

    @staticmethod
    def _with_keys(cur, keys: list[tuple[int, int]], sql: str) -> list[tuple]:
        """Run sql with {keys} bound to a table of (annotator_id, item_id); returns its rows."""
        if not keys:
            return []
        tbl = pa.table({"annotator_id": pa.array([k[0] for k in keys], pa.int64()),
                        "item_id": pa.array([k[1] for k in keys], pa.int64())})
        with registered(cur, "_keys", tbl):
            result = cur.execute(sql.format(keys="_keys"))
            return result.fetchall() if sql.lstrip().upper().startswith("SELECT") else []

    # -- undo

    def undo_last_ranking(self, annotator_id: int, *, lease_seconds: float | None = None) -> Item | None:
        """Delete the annotator's latest ranking and its pairs (one transaction) and lease its item
        back to them (if it is queued); returns that item (in their display order) for the UI to show again, or
        None when they have no ranking."""
        lease_seconds = self.lease_seconds() if lease_seconds is None else float(lease_seconds)
        with self._tx(queue=True) as cur:
            q = self._shared.queue
            row = cur.execute("SELECT id, item_id, created_at FROM rankings WHERE annotator_id = ? "
                              "ORDER BY created_at DESC, id DESC LIMIT 1", [annotator_id]).fetchone()
            if row is None:
                return None
            ranking_id, item_id, created_at = row
            cur.execute("DELETE FROM pairs WHERE ranking_id = ?", [ranking_id])
            cur.execute("DELETE FROM rankings WHERE id = ?", [ranking_id])
            expires = None
            if item_id in q.item_prompt:  # only queued items are leased
                expires = utcnow() + timedelta(seconds=lease_seconds)
                lease, row_exists = {(item_id, annotator_id): expires}, q.has_lease_row(item_id, annotator_id)
                self._write_leases(cur, {} if row_exists else lease, lease if row_exists else {})

            def follow(q):
                q.remove_ranking(item_id, annotator_id, created_at)
                if expires is not None:
                    q.set_lease(item_id, annotator_id, expires)

            self._on_commit(follow)
        return dataclasses.replace(self.get_item(item_id, annotator_id), lease_expires_at=from_db_time(expires))

    # -- reads

    def get_ranking(self, ranking_id: int) -> Ranking:
        row = self._one(f"SELECT {_RANKING_COLS} FROM rankings WHERE id = ?", [ranking_id])
        if row is None:
            raise NotFoundError(f"no ranking with id {ranking_id}")
        return _ranking(row)

    def list_rankings(self, *, annotator_id: int | None = None, item_id: int | None = None,
                      prompt_id: int | None = None, limit: int | None = None) -> list[Ranking]:
        where, params = _filters(annotator_id=annotator_id, item_id=item_id, prompt_id=prompt_id)
        sql = f"SELECT {_RANKING_COLS} FROM rankings{where} ORDER BY id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [_ranking(r) for r in self._rows(sql, params)]

    def list_pairs(self, *, ranking_id: int | None = None, prompt_id: int | None = None,
                   annotator_id: int | None = None, limit: int | None = None) -> list[Pair]:
        where, params = _filters(ranking_id=ranking_id, prompt_id=prompt_id, annotator_id=annotator_id)
        sql = f"SELECT {_PAIR_COLS} FROM pairs{where} ORDER BY id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [_pair(r) for r in self._rows(sql, params)]


def _filters(**eq) -> tuple[str, list]:
    """' WHERE a = ? AND b = ?' for the given non-None column values (names are ours, not input)."""
    cols = [(k, v) for k, v in eq.items() if v is not None]
    if not cols:
        return "", []
    return " WHERE " + " AND ".join(f"{k} = ?" for k, _ in cols), [v for _, v in cols]
