"""Runs (training and generation jobs), their metrics, and loop rounds.

A run row is the owner process's record of a job (pipeline/orchestrate/jobs.py): created `queued`, moved to
`running` (started_at set), and ended `done`, `failed` (with its error) or `cancelled`
(finished_at set). An ended run's status does not change again. Metrics are (step, key, value)
rows, keys namespaced as in DESIGN.md ("objective/kl"); re-ingesting a step overwrites it.
"""

from __future__ import annotations

import math
import numbers

import pyarrow as pa

from store.db import registered
from store.values import dumps, from_db_time, loads, utcnow
from store.errors import InvalidRequest, NotFoundError
from store.records import ROUND_STATUSES, RUN_FINAL, RUN_STATUSES, Metric, Round, Run

_RUN_COLS = "id, kind, status, config, run_dir, inputs, outputs, error, created_at, started_at, finished_at"
_ROUND_COLS = ("id, status, policy_version_id, reward_version_id, new_policy_version_id, snapshot_id, "
               "config, meta, created_at, finished_at")


def _run(row) -> Run:
    return Run(id=row[0], kind=row[1], status=row[2], config=loads(row[3]), run_dir=row[4],
               inputs=loads(row[5]), outputs=loads(row[6]), error=row[7], created_at=from_db_time(row[8]),
               started_at=from_db_time(row[9]), finished_at=from_db_time(row[10]))


def _round(row) -> Round:
    return Round(id=row[0], status=row[1], policy_version_id=row[2], reward_version_id=row[3],
                 new_policy_version_id=row[4], snapshot_id=row[5], config=loads(row[6]), meta=loads(row[7]),
                 created_at=from_db_time(row[8]), finished_at=from_db_time(row[9]))


class RunsMixin:
    """Run, metric and round methods of Store."""

    # ------------------------------------------------------------------ runs

    def create_run(self, kind: str, config: dict | None = None, run_dir: str | None = None,
                   inputs: dict | None = None) -> Run:
        """A new run in status 'queued'. `kind`: 'generate', 'train-reward', 'ppo', 'round', ..."""
        if not kind:
            raise InvalidRequest("run kind is empty")
        with self._tx() as cur:
            row = cur.execute(
                f"INSERT INTO runs VALUES (nextval('runs_id_seq'), ?, 'queued', ?, ?, ?, '{{}}', NULL, ?, NULL, NULL) "
                f"RETURNING {_RUN_COLS}",
                [kind, dumps(config or {}), None if run_dir is None else str(run_dir), dumps(inputs or {}),
                 utcnow()]).fetchone()
        return _run(row)

    def update_run(self, run_id: int, *, status: str | None = None, error: str | None = None,
                   outputs: dict | None = None, run_dir: str | None = None) -> Run:
        """Change a run's status (started_at/finished_at follow), set its error, merge `outputs`
        into its outputs. Setting an ended run to another status is refused."""
        if status is not None and status not in RUN_STATUSES:
            raise InvalidRequest(f"status must be one of {RUN_STATUSES}, not {status!r}")
        with self._tx() as cur:
            row = cur.execute(f"SELECT {_RUN_COLS} FROM runs WHERE id = ?", [run_id]).fetchone()
            run = _run(self._need(row, f"run with id {run_id}"))
            now = utcnow()
            new_status = run.status if status is None else status
            if run.status in RUN_FINAL and new_status != run.status:
                raise InvalidRequest(f"run {run_id} already ended as {run.status}; cannot set it to {new_status}")
            started = row[9] if row[9] is not None or new_status == "queued" else now
            finished = row[10] if row[10] is not None or new_status not in RUN_FINAL else now
            cur.execute(
                "UPDATE runs SET status = ?, error = ?, outputs = ?, run_dir = ?, started_at = ?, finished_at = ? "
                "WHERE id = ?",
                [new_status, run.error if error is None else error, dumps({**run.outputs, **(outputs or {})}),
                 run.run_dir if run_dir is None else str(run_dir), started, finished, run_id])
        return self.get_run(run_id)

    def get_run(self, run_id: int) -> Run:
        row = self._one(f"SELECT {_RUN_COLS} FROM runs WHERE id = ?", [run_id])
        if row is None:
            raise NotFoundError(f"no run with id {run_id}")
        return _run(row)

    def list_runs(self, *, kind: str | None = None, status: str | None = None,
                  limit: int | None = None) -> list[Run]:
        """Runs, newest first."""
        cond, params = [], []
        if kind is not None:
            cond.append("kind = ?")
            params.append(kind)
        if status is not None:
            cond.append("status = ?")
            params.append(status)
        sql = f"SELECT {_RUN_COLS} FROM runs" + (" WHERE " + " AND ".join(cond) if cond else "") + " ORDER BY id DESC"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [_run(r) for r in self._rows(sql, params)]

    # ------------------------------------------------------------------ metrics

    def add_metrics(self, run_id: int, rows) -> int:
        """Store (step, key, value) rows in one transaction (Arrow insert: thousands per call are
        cheap). A (step, key) stored before is overwritten. Returns the number of rows written."""
        latest: dict[tuple[int, str], float | None] = {}
        for i, row in enumerate(rows):
            try:
                step, key, value = row
            except (TypeError, ValueError):
                raise InvalidRequest(f"metric row {i}: expected (step, key, value), got {row!r}") from None
            if not isinstance(key, str) or not key:
                raise InvalidRequest(f"metric row {i}: key must be a non-empty string, got {key!r}")
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                raise InvalidRequest(f"metric row {i} ({key}): value must be a number, got {value!r}")
            latest[(int(step), key)] = None if value is None else float(value)
        if not latest:
            return 0
        with self._tx() as cur:
            self._need(cur.execute("SELECT 1 FROM runs WHERE id = ?", [run_id]).fetchone(), f"run with id {run_id}")
            tbl = pa.table({
                "run_id": pa.array([run_id] * len(latest), pa.int64()),
                "step": pa.array([k[0] for k in latest], pa.int64()),
                "key": pa.array([k[1] for k in latest], pa.string()),
                "value": pa.array(list(latest.values()), pa.float64()),
            })
            with registered(cur, "_incoming_metrics", tbl):
                cur.execute("INSERT OR REPLACE INTO metrics SELECT run_id, step, key, value FROM _incoming_metrics")
        return len(latest)

    def metrics(self, run_id: int, *, keys: list[str] | None = None,
                since_step: int | None = None) -> list[Metric]:
        """A run's metrics ordered by step then key; optionally only some keys or steps > since_step."""
        sql, params = "SELECT run_id, step, key, value FROM metrics WHERE run_id = ?", [run_id]
        if keys is not None:
            sql += " AND list_contains(?, key)"
            params.append(list(keys))
        if since_step is not None:
            sql += " AND step > ?"
            params.append(int(since_step))
        return [Metric(run_id=r[0], step=r[1], key=r[2], value=math.nan if r[3] is None else r[3])
                for r in self._rows(sql + " ORDER BY step, key", params)]

    def last_metric_step(self, run_id: int) -> int | None:
        return self._scalar("SELECT max(step) FROM metrics WHERE run_id = ?", [run_id])

    # ------------------------------------------------------------------ rounds

    def create_round(self, policy_version_id: int | None = None, config: dict | None = None,
                     status: str = "generating") -> Round:
        if status not in ROUND_STATUSES:
            raise InvalidRequest(f"round status must be one of {ROUND_STATUSES}, not {status!r}")
        with self._tx() as cur:
            if policy_version_id is not None:
                self._need(cur.execute("SELECT 1 FROM model_versions WHERE id = ?", [policy_version_id]).fetchone(),
                           f"model version with id {policy_version_id}")
            row = cur.execute(
                f"INSERT INTO rounds VALUES (nextval('rounds_id_seq'), ?, ?, NULL, NULL, NULL, ?, '{{}}', ?, NULL) "
                f"RETURNING {_ROUND_COLS}",
                [status, policy_version_id, dumps(config or {}), utcnow()]).fetchone()
        return _round(row)

    def update_round(self, round_id: int, *, status: str | None = None, policy_version_id: int | None = None,
                     reward_version_id: int | None = None, new_policy_version_id: int | None = None,
                     snapshot_id: int | None = None, meta: dict | None = None) -> Round:
        """Set the given fields (None = unchanged); `meta` is merged; "done" sets finished_at."""
        if status is not None and status not in ROUND_STATUSES:
            raise InvalidRequest(f"round status must be one of {ROUND_STATUSES}, not {status!r}")
        with self._tx() as cur:
            row = cur.execute(f"SELECT {_ROUND_COLS} FROM rounds WHERE id = ?", [round_id]).fetchone()
            rnd = _round(self._need(row, f"round with id {round_id}"))
            for ref in (policy_version_id, reward_version_id, new_policy_version_id):
                if ref is not None:
                    self._need(cur.execute("SELECT 1 FROM model_versions WHERE id = ?", [ref]).fetchone(),
                               f"model version with id {ref}")
            if snapshot_id is not None:
                self._need(cur.execute("SELECT 1 FROM snapshots WHERE id = ?", [snapshot_id]).fetchone(),
                           f"snapshot with id {snapshot_id}")
            new_status = rnd.status if status is None else status
            finished = row[9] if row[9] is not None or new_status != "done" else utcnow()
            cur.execute(
                "UPDATE rounds SET status = ?, policy_version_id = ?, reward_version_id = ?, "
                "new_policy_version_id = ?, snapshot_id = ?, meta = ?, finished_at = ? WHERE id = ?",
                [new_status, _keep(policy_version_id, rnd.policy_version_id),
                 _keep(reward_version_id, rnd.reward_version_id),
                 _keep(new_policy_version_id, rnd.new_policy_version_id), _keep(snapshot_id, rnd.snapshot_id),
                 dumps({**rnd.meta, **(meta or {})}), finished, round_id])
        return self.get_round(round_id)

    def get_round(self, round_id: int) -> Round:
        row = self._one(f"SELECT {_ROUND_COLS} FROM rounds WHERE id = ?", [round_id])
        if row is None:
            raise NotFoundError(f"no round with id {round_id}")
        return _round(row)

    def list_rounds(self) -> list[Round]:
        """Rounds, oldest first (round n is the n-th in this list)."""
        return [_round(r) for r in self._rows(f"SELECT {_ROUND_COLS} FROM rounds ORDER BY id")]

    def round_counts(self, round_id: int) -> dict:
        """{prompts, items, rankings, ranked_items, pairs} generated for / collected in a round
        (ranked_items: items with at least one ranking)."""
        row = self._one(
            "SELECT (SELECT count(DISTINCT prompt_id) FROM items WHERE round_id = $r), "
            "(SELECT count(*) FROM items WHERE round_id = $r), "
            "(SELECT count(*) FROM rankings k JOIN items i ON i.id = k.item_id WHERE i.round_id = $r), "
            "(SELECT count(DISTINCT k.item_id) FROM rankings k JOIN items i ON i.id = k.item_id "
            "WHERE i.round_id = $r), "
            "(SELECT count(*) FROM pairs p JOIN items i ON i.id = p.item_id WHERE i.round_id = $r)",
            {"r": round_id})
        return dict(zip(("prompts", "items", "rankings", "ranked_items", "pairs"), row))


def _keep(new, old):
    return old if new is None else new
