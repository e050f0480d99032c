"""Store: every query of the application, returning frozen dataclasses (store/records.py).

This file holds prompts and responses (grouped into items, an evaluation's too) and imported rows;
the rest of the Store's methods live beside it by responsibility:
  store/users.py     accounts               store/queue.py  the queue's settings, skips, flags
  store/rankings.py  rankings and pairs, and the leases their transaction writes
  store/runs.py      runs, metrics, rounds  store/gold.py   gold items
  store/evaluations.py  blind evaluations
  store/stats.py     counts, agreement, position bias
  store/versions.py  model versions, settings, export snapshots
store/db.py opens the file, hands each thread its cursor and wraps every write in one
transaction. Import and export of files are in store/io.py and store/export.py.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pyarrow as pa

from formats.chat import check_messages, messages_to_text
from store.db import StoreBase, registered
from store.values import dumps, from_db_time, loads, utcnow
from store.errors import DataError, InvalidRequest, NotFoundError
from store.agreement_table import AgreementTableMixin
from store.conversations import ConversationsMixin, own_open, turns_of
from store.evaluations import EvaluationsMixin, new_evaluation
from store.gold import GoldMixin
from store.pairs import ranking_to_pairs
from store.queue import QueueMixin
from store.queue_rules import display_order_for
from store.sessions import SessionsMixin
from store.records import ChatTurn, Item, Prompt, Response
from store.rankings import PAIR_TYPES, RANKING_TYPES, RankingsMixin
from store.runs import RunsMixin
from store.stats import StatsMixin
from store.users import UsersMixin
from store.versions import VersionsMixin

_PROMPT_COLS = "id, text, messages, source, round_id, created_at"
_RESPONSE_COLS = "id, prompt_id, item_id, model_version_id, text, token_count, finish_reason, sampling, created_at"


def _prompt(row) -> Prompt:
    return Prompt(id=row[0], text=row[1], messages=None if row[2] is None else loads(row[2]),
                  source=row[3], round=row[4], created_at=from_db_time(row[5]))


def _response(row) -> Response:
    return Response(id=row[0], prompt_id=row[1], item_id=row[2], model_version_id=row[3],
                    text=row[4], token_count=row[5], finish_reason=row[6],
                    sampling=loads(row[7]), created_at=from_db_time(row[8]))


def _response_row(r) -> tuple:
    """(text, token_count, finish_reason, sampling) from a tuple, dict or plain string."""
    if isinstance(r, str):
        return r, None, None, {}
    if isinstance(r, dict):
        r = (r.get("text"), r.get("token_count"), r.get("finish_reason"), r.get("sampling"))
    text, token_count, finish_reason, sampling = (tuple(r) + (None,) * 4)[:4]
    if not isinstance(text, str):
        raise InvalidRequest(f"response text must be a string, got {type(text).__name__}")
    return text, token_count, finish_reason, sampling or {}


class Store(QueueMixin, RankingsMixin, GoldMixin, EvaluationsMixin, ConversationsMixin, UsersMixin, SessionsMixin,
            VersionsMixin, RunsMixin, StatsMixin, AgreementTableMixin, StoreBase):
    """The persistence layer. `Store(path)` opens or creates and migrates a DuckDB file."""

    # ------------------------------------------------------------------ prompts

    def add_prompts(self, prompts, source: str = "manual") -> list[int]:
        """Add prompts (strings, or dicts with 'prompt' or 'messages' and optional 'source') in one
        transaction; returns their ids in input order. Prompts are deduplicated by exact text: a
        prompt already stored (or repeated in the input) keeps its first id."""
        rows = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                p = {"prompt": p}
            if not isinstance(p, dict):
                raise InvalidRequest(f"prompt {i}: expected a string or a dict, got {type(p).__name__}")
            messages = p.get("messages")
            if messages is not None:
                problem = check_messages(messages)
                if problem:
                    raise InvalidRequest(f"prompt {i}: {problem}")
                text = messages_to_text(messages)
            else:
                text = p.get("prompt")
                if not isinstance(text, str) or not text.strip():
                    raise InvalidRequest(f"prompt {i}: empty or missing prompt text")
            rows.append((text, None if messages is None else dumps(messages), p.get("source") or source))
        return self.add_prompt_rows(rows)[0]

    def add_prompt_rows(self, rows: list[tuple[str, str | None, str]]) -> tuple[list[int], int]:
        """Checked (text, messages_json, source) rows in one transaction -> (ids, number added):
        the write behind add_prompts and store.io.import_prompts."""
        with self._tx() as cur:
            return self._insert_prompts(cur, rows)

    def _insert_prompts(self, cur, rows: list[tuple[str, str | None, str]]) -> tuple[list[int], int]:
        """Inside a transaction: insert (text, messages_json, source) rows not already stored.
        Returns (id per input row, number newly added)."""
        first: dict[str, int] = {}
        for i, (text, _, _) in enumerate(rows):
            first.setdefault(text, i)
        texts = list(first)
        existing: dict[str, int] = {}
        if texts:
            with registered(cur, "_incoming_texts", pa.table({"text": pa.array(texts, pa.string())})):
                existing = dict(cur.execute(
                    "SELECT t.text, min(p.id) FROM _incoming_texts t JOIN prompts p ON p.text = t.text "
                    "GROUP BY t.text").fetchall())
        new = [t for t in texts if t not in existing]
        new_ids = self._reserve_ids(cur, "prompts_id_seq", len(new))
        existing.update(zip(new, new_ids))
        now = utcnow()
        self._insert_arrow(cur, "prompts", {
            "id": new_ids,
            "text": new,
            "messages": [rows[first[t]][1] for t in new],
            "source": [rows[first[t]][2] for t in new],
            "created_at": [now] * len(new),
        }, {"id": pa.int64(), "text": pa.string(), "messages": pa.string(), "source": pa.string(),
            "created_at": pa.timestamp("us")})
        return [existing[text] for text, _, _ in rows], len(new)

    def get_prompt(self, prompt_id: int) -> Prompt:
        row = self._one(f"SELECT {_PROMPT_COLS} FROM prompts WHERE id = ?", [prompt_id])
        if row is None:
            raise NotFoundError(f"no prompt with id {prompt_id}")
        return _prompt(row)

    def list_prompts(self, limit: int = 100, offset: int = 0) -> list[Prompt]:
        return [_prompt(r) for r in self._rows(
            f"SELECT {_PROMPT_COLS} FROM prompts ORDER BY id LIMIT ? OFFSET ?", [limit, offset])]

    def prompts_without_responses(self, limit: int | None = None) -> list[Prompt]:
        """Prompts that have no responses and are not flagged (the generator's pool), oldest first."""
        sql = (f"SELECT {_PROMPT_COLS} FROM prompts p WHERE NOT EXISTS "
               "(SELECT 1 FROM responses r WHERE r.prompt_id = p.id) "
               "AND NOT EXISTS (SELECT 1 FROM flags f WHERE f.prompt_id = p.id) ORDER BY id")
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [_prompt(r) for r in self._rows(sql)]

    # ------------------------------------------------------------------ responses and items

    def add_responses(self, prompt_id: int, model_version_id: int, responses, *,
                      round_id: int | None = None, queued: bool = True) -> list[Response]:
        """Store one generation call's responses to one prompt, in one transaction, as one item.

        `responses`: (text, token_count, finish_reason, sampling) tuples, dicts with those keys, or
        strings. An item with >= 2 responses enters the annotation queue (unless queued=False).
        """
        (item_id,) = self.add_responses_bulk(model_version_id, [(prompt_id, responses)],
                                             round_id=round_id, queued=queued)
        return self.item_responses(item_id)

    def add_responses_bulk(self, model_version_id: int, batches, *, round_id: int | None = None,
                           queued: bool = True) -> list[int]:
        """Many prompts' responses from one model version in one transaction (Arrow inserts).

        `batches`: [(prompt_id, responses), ...] as in add_responses. Returns one item id per batch.
        Prompts that get their first responses in a round are marked with that round.
        """
        batches = [(int(pid), [_response_row(r) for r in rs]) for pid, rs in batches]
        for pid, rs in batches:
            if not rs:
                raise InvalidRequest(f"prompt {pid}: no responses given")
        prompt_ids = sorted({pid for pid, _ in batches})
        with self._tx() as cur:
            self._check_policy_version(cur, model_version_id)
            if round_id is not None:
                self._need(cur.execute("SELECT 1 FROM rounds WHERE id = ?", [round_id]).fetchone(),
                           f"round with id {round_id}")
            found = cur.execute("SELECT count(*) FROM prompts WHERE id IN (SELECT unnest(?))",
                                [prompt_ids]).fetchone()[0]
            if found != len(prompt_ids):
                have = {r[0] for r in cur.execute("SELECT id FROM prompts WHERE id IN (SELECT unnest(?))",
                                                  [prompt_ids]).fetchall()}
                raise NotFoundError(f"no prompt with id {sorted(set(prompt_ids) - have)[:10]}")
            item_ids, resp_ids = self._insert_items(cur, model_version_id, batches, round_id, queued)
            new_items = [(iid, pid, rids) for iid, (pid, _), rids in zip(item_ids, batches, resp_ids)
                         if queued and len(rids) >= 2]
            self._queue_new_items(new_items)
            if round_id is not None:
                cur.execute("UPDATE prompts SET round_id = ? WHERE round_id IS NULL AND id IN "
                            "(SELECT unnest(?))", [round_id, prompt_ids])
        return item_ids

    def add_evaluation_items(self, evaluation_id: int, rows) -> list[int]:
        """One queued item per prompt of the evaluation, in one transaction.

        rows: [(prompt_id, [(version_id, text, token_count, finish_reason, sampling), ...])], each
        prompt one of the evaluation's with exactly one response from each of its versions (a
        prompt that already has its item is refused). Returns the item ids."""
        ev = self.get_evaluation(evaluation_id)
        want, prompts = sorted(ev.version_ids), set(ev.prompt_ids)
        batches, versions = [], []
        for prompt_id, responses in rows:
            prompt_id = int(prompt_id)
            if prompt_id not in prompts:
                raise InvalidRequest(f"prompt {prompt_id} is not one of evaluation {ev.name!r}'s prompts")
            got = sorted(int(r[0]) for r in responses)
            if got != want:
                raise InvalidRequest(f"prompt {prompt_id}: evaluation {ev.name!r} needs one response from each of "
                                     f"versions {want}, got {got}")
            batches.append((prompt_id, [(r[1], r[2], r[3], r[4] or {}) for r in responses]))
            versions.append([int(r[0]) for r in responses])
        if not batches:
            return []
        ids = [pid for pid, _ in batches]
        if len(set(ids)) != len(ids):
            raise InvalidRequest(f"evaluation {ev.name!r}: a prompt is given twice")
        with self._tx() as cur:
            done = [r[0] for r in cur.execute("SELECT prompt_id FROM items WHERE evaluation_id = ? AND prompt_id IN "
                                              "(SELECT unnest(?))", [evaluation_id, ids]).fetchall()]
            if done:
                raise InvalidRequest(f"evaluation {ev.name!r} already has items for prompts {sorted(done)[:10]}")
            item_ids, resp_ids = self._insert_items(cur, versions[0][0], batches, None, True, versions,
                                                    evaluation_id=evaluation_id)
            new_items = [(iid, pid, rids) for iid, (pid, _), rids in zip(item_ids, batches, resp_ids)]
            self._queue_new_items(new_items)
        return item_ids

    def add_chat_turn(self, annotator_id: int, conversation_id: int | None, messages: list[dict],
                      model_version_id: int, replies) -> ChatTurn:
        """A turn of a conversation (store/conversations.py), in one transaction: its prompt
        (`messages`, the conversation so far, the annotator's message last), an item of the K
        `replies` (as add_responses takes them) written by `model_version_id`, marked with the
        conversation and its turn number and not queued, and the annotator's lease on it.
        conversation_id None starts a conversation. A later turn must continue the last one:
        that turn ranked, and `messages` its messages, the reply it went on from and one user
        message. Nothing is stored when anything is refused."""
        problem = check_messages(messages)
        if problem is None and messages[-1]["role"] != "user":
            problem = "the last message must be the annotator's (role 'user')"
        if problem:
            raise InvalidRequest(f"chat turn: {problem}")
        rows = [_response_row(r) for r in replies]
        if len(rows) < 2:
            raise InvalidRequest(f"chat turn: {len(rows)} replies; a turn ranks 2 or more")
        lease_seconds, now = self.lease_seconds(), utcnow()
        with self._tx() as cur:
            self._check_policy_version(cur, model_version_id)
            if cur.execute("SELECT 1 FROM annotators WHERE id = ?", [annotator_id]).fetchall() == []:
                raise NotFoundError(f"no annotator with id {annotator_id}")
            if conversation_id is None:
                conversation_id = cur.execute(
                    "INSERT INTO conversations VALUES (nextval('conversations_id_seq'), ?, 'open', '', ?, NULL) "
                    "RETURNING id", [annotator_id, now]).fetchall()[0][0]
                turn = 1
            else:
                own_open(cur.execute("SELECT annotator_id, status FROM conversations WHERE id = ?",
                                     [conversation_id]).fetchall(), annotator_id, conversation_id)
                turns = turns_of(cur, conversation_id)
                _check_continues(turns[-1] if turns else None, messages)
                turn = len(turns) + 1
            (prompt_id,), _ = self._insert_prompts(cur, [(messages_to_text(messages), dumps(messages), "chat")])
            (item_id,), (response_ids,) = self._insert_items(cur, model_version_id, [(prompt_id, rows)], None, False)
            cur.execute("UPDATE items SET conversation_id = ?, turn = ? WHERE id = ?", [conversation_id, turn, item_id])
            expires = now + timedelta(seconds=lease_seconds)
            cur.execute("INSERT INTO leases VALUES (?, ?, ?)", [item_id, annotator_id, expires])
            self._on_commit(lambda q: q.set_lease(item_id, annotator_id, expires))
        return ChatTurn(conversation_id=conversation_id, turn=turn, item_id=item_id, prompt_id=prompt_id,
                        messages=list(messages), ranking_id=None, reply=None)

    def _check_policy_version(self, cur, model_version_id: int) -> None:
        row = cur.execute("SELECT kind FROM model_versions WHERE id = ?", [model_version_id]).fetchone()
        if row is None:
            raise NotFoundError(f"no model version with id {model_version_id}")
        if row[0] not in ("policy", "external"):
            raise InvalidRequest(f"model version {model_version_id} is a {row[0]}; responses come from policies "
                                 "(or external models, for imported items)")

    def _insert_items(self, cur, model_version_id, batches, round_id, queued, response_versions=None,
                      evaluation_id: int | None = None):
        """Inside a transaction: one item per (prompt_id, rows) batch, its responses written by
        `model_version_id`, or each by its own version (response_versions: one list of version ids
        per batch). `queued`: one bool for all items, or one per batch. `evaluation_id`: the items
        belong to that blind evaluation (store/evaluations.py).
        Returns (item ids, [response ids of each batch])."""
        item_ids = self._reserve_ids(cur, "items_id_seq", len(batches))
        n = sum(len(rs) for _, rs in batches)
        resp_ids = self._reserve_ids(cur, "responses_id_seq", n)
        now = utcnow()
        queued = [queued] * len(batches) if isinstance(queued, bool) else list(queued)
        versions = ([model_version_id] * n if response_versions is None
                    else [v for vs in response_versions for v in vs])
        self._insert_arrow(cur, "items", {
            "id": item_ids, "prompt_id": [pid for pid, _ in batches],
            "model_version_id": [model_version_id] * len(batches), "round_id": [round_id] * len(batches),
            "n_responses": [len(rs) for _, rs in batches],
            "queued": [bool(q) and len(rs) >= 2 for q, (_, rs) in zip(queued, batches)],
            "created_at": [now] * len(batches), "evaluation_id": [evaluation_id] * len(batches),
        }, {"id": pa.int64(), "prompt_id": pa.int64(), "model_version_id": pa.int64(),
            "round_id": pa.int64(), "n_responses": pa.int32(), "queued": pa.bool_(),
            "created_at": pa.timestamp("us"), "evaluation_id": pa.int64()})
        flat = [(iid, pid, r) for iid, (pid, rs) in zip(item_ids, batches) for r in rs]
        self._insert_arrow(cur, "responses", {
            "id": resp_ids, "item_id": [f[0] for f in flat], "prompt_id": [f[1] for f in flat],
            "model_version_id": versions, "text": [f[2][0] for f in flat],
            "token_count": [f[2][1] for f in flat], "finish_reason": [f[2][2] for f in flat],
            "sampling": [dumps(f[2][3]) for f in flat], "created_at": [now] * n,
        }, {"id": pa.int64(), "item_id": pa.int64(), "prompt_id": pa.int64(),
            "model_version_id": pa.int64(), "text": pa.string(), "token_count": pa.int32(),
            "finish_reason": pa.string(), "sampling": pa.string(), "created_at": pa.timestamp("us")})
        out, k = [], 0
        for _, rs in batches:
            out.append(resp_ids[k:k + len(rs)])
            k += len(rs)
        return item_ids, out

    def item_responses(self, item_id: int) -> list[Response]:
        """An item's responses in id order."""
        return [_response(r) for r in self._rows(
            f"SELECT {_RESPONSE_COLS} FROM responses WHERE item_id = ? ORDER BY id", [item_id])]

    def response_ids_by_item(self, item_ids) -> dict[int, list[int]]:
        """{item id: its response ids in id order} for many items in one query."""
        ids = [int(i) for i in item_ids]
        if not ids:
            return {}
        cur = self._cur()
        with registered(cur, "_wanted_items", pa.table({"item_id": pa.array(ids, pa.int64())})):
            rows = cur.execute("SELECT r.item_id, list(r.id ORDER BY r.id) FROM responses r "
                               "JOIN _wanted_items w ON w.item_id = r.item_id GROUP BY r.item_id").fetchall()
        return {item_id: list(rids) for item_id, rids in rows}

    def prompt_responses(self, prompt_id: int) -> list[Response]:
        return [_response(r) for r in self._rows(
            f"SELECT {_RESPONSE_COLS} FROM responses WHERE prompt_id = ? ORDER BY id", [prompt_id])]

    def get_response(self, response_id: int) -> Response:
        row = self._one(f"SELECT {_RESPONSE_COLS} FROM responses WHERE id = ?", [response_id])
        if row is None:
            raise NotFoundError(f"no response with id {response_id}")
        return _response(row)

    def get_item(self, item_id: int, annotator_id: int | None = None) -> Item:
        """An item with its responses in `annotator_id`'s display order (id order if None)."""
        # two point queries: cheaper in DuckDB than one join (about 1 ms each)
        rows = self._rows(f"SELECT {_RESPONSE_COLS} FROM responses WHERE item_id = ? ORDER BY id", [item_id])
        if not rows:
            raise NotFoundError(f"no item with id {item_id}")
        prompt = self.get_prompt(rows[0][1])
        responses = {row[0]: _response(row) for row in rows}
        order = list(responses) if annotator_id is None else display_order_for(annotator_id, item_id, list(responses))
        return Item(item_id=item_id, prompt=prompt, responses=[responses[i] for i in order],
                    display_order=order, model_version_id=rows[0][3])

    # ------------------------------------------------------------------ imported pairs

    def import_pair_rows(self, file_name: str, sha256: str, rows: list[tuple]) -> dict:
        """Store checked pairs (prompt, chosen, rejected, margin, source) from one file in one
        transaction (store/io.py reads and checks the file).

        Imported responses need a model version like every response: the file gets its own
        'policy' version named 'import:<file name>:<first 8 hex of its SHA-256>' (meta: file name,
        hash, rows). Importing the same file twice is refused. Each row becomes an item that is
        not queued, with responses (chosen, rejected) and one pair (annotator None, source
        'import:<file name>'); prompts are deduplicated by text as in add_prompts.
        """
        now = utcnow()
        with self._tx() as cur:
            mv_id = self._file_version(cur, "policy", file_name, sha256, {"rows": len(rows)}, now)
            prompt_ids, added = self._insert_prompts(cur, [(r[0], None, r[4]) for r in rows])
            batches = [(pid, [(r[1], None, "import", {}), (r[2], None, "import", {})])
                       for pid, r in zip(prompt_ids, rows)]
            item_ids, resp_ids = self._insert_items(cur, mv_id, batches, None, False)
            pair_ids = self._reserve_ids(cur, "pairs_id_seq", len(rows))
            self._insert_arrow(cur, "pairs", {
                "id": pair_ids, "prompt_id": prompt_ids, "item_id": item_ids,
                "chosen_id": [r[0] for r in resp_ids], "rejected_id": [r[1] for r in resp_ids],
                "margin": [float(r[3]) for r in rows], "ranking_id": [None] * len(rows),
                "annotator_id": [None] * len(rows), "all_bad": [False] * len(rows),
                "source": [f"import:{file_name}"] * len(rows), "created_at": [now] * len(rows),
            }, PAIR_TYPES)
        return {"rows": len(rows), "pairs": len(rows), "prompts_added": added,
                "prompts_existing": len(set(prompt_ids)) - added, "model_version_id": mv_id}

    # ------------------------------------------------------------------ imported items to rank

    def import_item_rows(self, path: str, sha256: str, fmt: str, rows: list, *, evaluation: str | None = None) -> dict:
        """Store checked items (store/import_items.py reads and checks the file) in one transaction.

        `path`: the file (errors name it); `rows`: records.ItemIn (row number, prompt text,
        messages JSON, source, [(text, model name or None)], queued, orders over response
        indices). The file gets a model version of
        kind 'external' named 'import:<file name>:<first 8 hex of its SHA-256>' (meta: file, hash,
        rows, format): the items' version, and the version of every response without a model
        name. Each model name is a version of that name: an existing policy or external version,
        else a new external one. Importing the same file twice, or an item whose prompt already
        has an item of exactly these response texts, is refused naming the row. Orders (rankings
        made in another tool) are stored by _insert_orders. `evaluation`: the items are a blind
        evaluation of that name between the rows' models (rows checked by import_items).
        """
        file_name, now = os.path.basename(path), utcnow()
        with self._tx() as cur:
            file_mv = self._file_version(cur, "external", file_name, sha256, {"rows": len(rows), "format": fmt}, now,
                                         where=path)
            versions, created = self._external_versions(cur, path, rows, now)
            prompt_ids, added = self._insert_prompts(cur, [(r.prompt, r.messages, r.source) for r in rows])
            self._refuse_stored_items(cur, path, rows, prompt_ids)
            batches = [(pid, [(text, None, "import", {}) for text, _ in r.responses])
                       for pid, r in zip(prompt_ids, rows)]
            response_versions = [[file_mv if m is None else versions[m] for _, m in r.responses] for r in rows]
            evaluation_id = None if evaluation is None else new_evaluation(
                cur, evaluation, sorted({v for vs in response_versions for v in vs}), prompt_ids)
            item_ids, resp_ids = self._insert_items(cur, file_mv, batches, None, [r.queued for r in rows],
                                                    response_versions, evaluation_id=evaluation_id)
            rankings, pairs, annotators, annotators_created = self._insert_orders(
                cur, file_name, rows, prompt_ids, item_ids, resp_ids, now)
            new_items = [(iid, pid, rids) for iid, pid, rids, r in zip(item_ids, prompt_ids, resp_ids, rows)
                         if r.queued]
            self._queue_new_items(new_items)
        return {"rows": len(rows), "items": len(rows), "queued": len(new_items),
                "responses": sum(len(r.responses) for r in rows), "prompts_added": added,
                "prompts_existing": len(set(prompt_ids)) - added, "rankings": rankings, "pairs": pairs,
                "annotators": annotators, "annotators_created": annotators_created,
                "models": sorted(versions), "models_created": created, "model_version_id": file_mv,
                "evaluation_id": evaluation_id}

    def _insert_orders(self, cur, file_name: str, rows: list, prompt_ids: list[int], item_ids: list[int],
                       resp_ids: list[list[int]], now) -> tuple[int, int, list[str], list[str]]:
        """Inside a transaction: the rows' orders (records.OrderIn) as rankings and pairs, source
        'import:<file name>', margin the rank gap. An order that says who ranked is a ranking of that
        person's imported account (_imported_annotators), shown in the file's order, so it
        counts in agreement and quality; a person's later order of the same item replaces their
        earlier one, as a re-ranking here does. An order without an annotator is pairs alone.
        Returns (rankings, pairs, the annotators named, those created)."""
        named = sorted({o.annotator for r in rows for o in r.orders if o.annotator is not None})
        accounts, created = self._imported_annotators(cur, named, now) if named else ({}, [])
        latest = {}  # (item, annotator) -> (prompt, the item's responses, tie groups, duration)
        anonymous = []
        for pid, iid, rids, r in zip(prompt_ids, item_ids, resp_ids, rows):
            for o in r.orders:
                groups = [[rids[i] for i in g] for g in o.groups]
                if o.annotator is None:
                    anonymous.append((pid, iid, groups))
                else:
                    latest[(iid, accounts[o.annotator])] = (pid, list(rids), groups, o.duration_s)
        keys, kept = list(latest), list(latest.values())
        ranking_ids = self._reserve_ids(cur, "rankings_id_seq", len(kept))
        self._insert_arrow(cur, "rankings", {
            "id": ranking_ids, "item_id": [k[0] for k in keys], "prompt_id": [v[0] for v in kept],
            "annotator_id": [k[1] for k in keys], "order_groups": [v[2] for v in kept],
            "display_order": [v[1] for v in kept], "all_bad": [False] * len(kept),
            "duration_s": [v[3] for v in kept], "client_token": [None] * len(kept), "comment": [""] * len(kept),
            "created_at": [now] * len(kept), "strength": [None] * len(kept),
        }, RANKING_TYPES)
        pairs = [(pid, iid, c, j, gap, rid, aid)
                 for rid, (iid, aid), (pid, _, groups, _) in zip(ranking_ids, keys, kept)
                 for c, j, gap in ranking_to_pairs(groups)]
        pairs += [(pid, iid, c, j, gap, None, None) for pid, iid, groups in anonymous
                  for c, j, gap in ranking_to_pairs(groups)]
        self._insert_arrow(cur, "pairs", {
            "id": self._reserve_ids(cur, "pairs_id_seq", len(pairs)), "prompt_id": [p[0] for p in pairs],
            "item_id": [p[1] for p in pairs], "chosen_id": [p[2] for p in pairs],
            "rejected_id": [p[3] for p in pairs], "margin": [float(p[4]) for p in pairs],
            "ranking_id": [p[5] for p in pairs], "annotator_id": [p[6] for p in pairs],
            "all_bad": [False] * len(pairs), "source": [f"import:{file_name}"] * len(pairs),
            "created_at": [now] * len(pairs),
        }, PAIR_TYPES)
        return len(kept), len(pairs), named, created

    def _imported_annotators(self, cur, names: list[str], now) -> tuple[dict[str, int], list[str]]:
        """Inside a transaction: {name: account id} for the people another tool says ranked
        (store/import_items.py), and the names created. An account of that name is the same person
        (an earlier import, or one an admin made); a new one is an inactive annotator with no
        password, whose rankings count in agreement and quality like anyone's: an admin who wants
        that person to go on ranking here activates the account and sets a password."""
        found = dict(cur.execute("SELECT name, id FROM annotators WHERE name IN (SELECT unnest(?))",
                                 [sorted(set(names))]).fetchall())
        created = sorted(set(names) - set(found))
        for name in created:
            found[name] = cur.execute(
                "INSERT INTO annotators (id, name, role, password_hash, created_at, active) "
                "VALUES (nextval('annotators_id_seq'), ?, 'annotator', '!', ?, FALSE) RETURNING id",
                [name, now]).fetchone()[0]
        if created:
            new_ids = [found[n] for n in created]
            self._on_commit(lambda q: q.annotators.update(new_ids))
        return found, created

    def _external_versions(self, cur, path: str, rows: list, now) -> tuple[dict[str, int], list[str]]:
        """Inside a transaction: {model name: version id} for every model the rows name (an existing
        policy or external version of that name, else a new external one), and the names created."""
        names = sorted({m for r in rows for _, m in r.responses if m is not None})
        found = {n: (i, k) for i, n, k in cur.execute(
            "SELECT id, name, kind FROM model_versions WHERE name IN (SELECT unnest(?))", [names]).fetchall()}
        wrong = [(n, k) for n, (_, k) in found.items() if k not in ("policy", "external")]
        if wrong:
            raise DataError(path, [(r.n, f"model {n!r} is a {k} model version of this store, which writes no "
                                              "responses: name the response's model otherwise")
                                        for n, k in wrong for r in rows if any(m == n for _, m in r.responses)][:50])
        versions = {n: i for n, (i, _) in found.items()}
        created = [n for n in names if n not in versions]
        for n in created:
            versions[n] = self._new_version(cur, "external", n, {"first_imported_from": os.path.basename(path)}, now)
        return versions, created

    def _file_version(self, cur, kind: str, file_name: str, sha256: str, meta: dict, now, *,
                      where: str | None = None) -> int:
        """Inside a transaction: the version an imported file's responses get, named
        'import:<file name>:<first 8 hex of its SHA-256>'; a file imported before is refused
        (DataError naming `where`, default the file name)."""
        name = f"import:{file_name}:{sha256[:8]}"
        if cur.execute("SELECT 1 FROM model_versions WHERE name = ?", [name]).fetchall():
            raise DataError(where or file_name, [(None, f"this file was already imported (model version {name!r})")])
        return self._new_version(cur, kind, name, {"imported_from": file_name, "sha256": sha256, **meta}, now)

    @staticmethod
    def _new_version(cur, kind: str, name: str, meta: dict, now) -> int:
        return cur.execute(
            "INSERT INTO model_versions (id, kind, name, meta, created_at) "
            "VALUES (nextval('model_versions_id_seq'), ?, ?, ?, ?) RETURNING id",
            [kind, name, dumps(meta), now]).fetchall()[0][0]

    def _refuse_stored_items(self, cur, path: str, rows: list, prompt_ids: list[int]) -> None:
        """Inside a transaction: DataError naming each row whose prompt already has an item of
        exactly the same response texts."""
        stored: dict[tuple[int, tuple[str, ...]], int] = {}
        for item_id, pid, texts in cur.execute(
                "SELECT item_id, any_value(prompt_id), list(text ORDER BY text) FROM responses "
                "WHERE prompt_id IN (SELECT unnest(?)) GROUP BY item_id", [sorted(set(prompt_ids))]).fetchall():
            stored.setdefault((pid, tuple(texts)), item_id)
        problems = [(r.n, f"already stored: item {stored[key]} has this prompt and these responses")
                    for pid, r in zip(prompt_ids, rows)
                    if (key := (pid, tuple(sorted(t for t, _ in r.responses)))) in stored]
        if problems:
            raise DataError(path, problems[:50], more=max(0, len(problems) - 50))


def _check_continues(last: ChatTurn | None, messages: list[dict]) -> None:
    """InvalidRequest unless `messages` continue the conversation's last turn: ranked, and its
    messages, the reply it went on from and one user message."""
    if last is None:
        return
    if last.ranking_id is None:
        raise InvalidRequest(f"turn {last.turn} of conversation {last.conversation_id} is not ranked yet: "
                             "rank its replies first")
    expected = [*last.messages, {"role": "assistant", "content": last.reply}]
    if len(messages) != len(expected) + 1 or messages[:-1] != expected:
        raise InvalidRequest(f"chat turn: the messages do not continue conversation {last.conversation_id} "
                             f"from its turn {last.turn}'s chosen reply")
