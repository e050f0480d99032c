"""Model versions (and their lineage), key/value settings, and export snapshot manifests."""

from __future__ import annotations

import json

from store.values import dumps, from_db_time, loads, utcnow
from store.errors import InvalidRequest, NotFoundError
from store.records import EXPORT_FORMATS, MODEL_KINDS, ModelVersion, Snapshot

ACTIVE_POLICY_KEY = "active_policy_version_id"
GUIDELINES_KEY = "guidelines_markdown"

_MV_COLS = ("id, kind, name, parent_id, path, base_model, run_id, snapshot_id, reward_version_id, "
            "meta, created_at")
_SNAPSHOT_COLS = "id, path, format, counts, filters, sha256, created_at"


def _model_version(row) -> ModelVersion:
    return ModelVersion(id=row[0], kind=row[1], name=row[2], parent_id=row[3], path=row[4],
                        base_model=row[5], run_id=row[6], snapshot_id=row[7],
                        reward_version_id=row[8], meta=loads(row[9]), created_at=from_db_time(row[10]))


def _snapshot(row) -> Snapshot:
    return Snapshot(id=row[0], path=row[1], format=row[2], counts=loads(row[3]),
                    filters=loads(row[4]), sha256=row[5], created_at=from_db_time(row[6]))


class VersionsMixin:
    """Model version, settings and snapshot methods of Store."""

    def register_model_version(self, kind: str, name: str | None = None, *, parent_id: int | None = None,
                               path: str | None = None, base_model: str | None = None,
                               run_id: int | None = None, snapshot_id: int | None = None,
                               reward_version_id: int | None = None, meta: dict | None = None) -> ModelVersion:
        """Record a model version. `name` defaults to '<kind>-v<n>'; names are unique."""
        if kind not in MODEL_KINDS:
            raise InvalidRequest(f"kind must be one of {MODEL_KINDS}, not {kind!r}")
        with self._tx() as cur:
            for ref, table, what in ((parent_id, "model_versions", "parent model version"),
                                     (reward_version_id, "model_versions", "reward model version"),
                                     (run_id, "runs", "run"), (snapshot_id, "snapshots", "snapshot")):
                if ref is not None:
                    self._need(cur.execute(f"SELECT 1 FROM {table} WHERE id = ?", [ref]).fetchone(),
                               f"{what} with id {ref}")
            if name is None:
                n = cur.execute("SELECT count(*) FROM model_versions WHERE kind = ?", [kind]).fetchone()[0]
                name = f"{kind}-v{n + 1}"
                while cur.execute("SELECT 1 FROM model_versions WHERE name = ?", [name]).fetchone():
                    n += 1
                    name = f"{kind}-v{n + 1}"
            elif cur.execute("SELECT 1 FROM model_versions WHERE name = ?", [name]).fetchone():
                raise InvalidRequest(f"a model version named {name!r} already exists")
            row = cur.execute(
                f"INSERT INTO model_versions VALUES (nextval('model_versions_id_seq'), ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                f"RETURNING {_MV_COLS}",
                [kind, name, parent_id, None if path is None else str(path), base_model, run_id,
                 snapshot_id, reward_version_id, dumps(meta or {}), utcnow()]).fetchone()
        return _model_version(row)

    def update_model_version(self, version_id: int, *, meta: dict | None = None,
                             path: str | None = None) -> ModelVersion:
        """Merge `meta` into the version's meta (e.g. eval metrics) and/or set its path."""
        with self._tx() as cur:
            row = self._need(cur.execute("SELECT meta, path FROM model_versions WHERE id = ?",
                                         [version_id]).fetchone(), f"model version with id {version_id}")
            merged = {**loads(row[0]), **(meta or {})}
            cur.execute("UPDATE model_versions SET meta = ?, path = ? WHERE id = ?",
                        [dumps(merged), row[1] if path is None else str(path), version_id])
        return self.get_model_version(version_id)

    def get_model_version(self, version_id: int) -> ModelVersion:
        row = self._one(f"SELECT {_MV_COLS} FROM model_versions WHERE id = ?", [version_id])
        if row is None:
            raise NotFoundError(f"no model version with id {version_id}")
        return _model_version(row)

    def find_model_version(self, name: str) -> ModelVersion | None:
        row = self._one(f"SELECT {_MV_COLS} FROM model_versions WHERE name = ?", [name])
        return None if row is None else _model_version(row)

    def list_model_versions(self, kind: str | None = None) -> list[ModelVersion]:
        if kind is None:
            rows = self._rows(f"SELECT {_MV_COLS} FROM model_versions ORDER BY id")
        else:
            rows = self._rows(f"SELECT {_MV_COLS} FROM model_versions WHERE kind = ? ORDER BY id", [kind])
        return [_model_version(r) for r in rows]

    def model_lineage(self, version_id: int) -> list[ModelVersion]:
        """[version, its parent, the parent's parent, ...] up to a version without parent."""
        chain = [self.get_model_version(version_id)]
        while chain[-1].parent_id is not None and len(chain) < 10_000:
            chain.append(self.get_model_version(chain[-1].parent_id))
        return chain

    # ------------------------------------------------------------------ settings

    def get_setting(self, key: str, default=None):
        """A JSON value stored under `key` (e.g. 'guidelines_markdown'), or `default`.
        Cached: this process is the file's only writer, and set_setting refreshes the cache."""
        cache = self._shared.settings
        if key not in cache:
            row = self._one("SELECT value FROM settings WHERE key = ?", [key])
            cache[key] = None if row is None else row[0]
        text = cache[key]
        return default if text is None else loads(text)

    def set_setting(self, key: str, value) -> None:
        self.set_settings({key: value})

    def set_settings(self, values: dict) -> None:
        """Several settings in one transaction: every one is written, or (on an error) none."""
        texts = {key: json.dumps(value, ensure_ascii=False) for key, value in values.items()}
        now = utcnow()
        with self._tx() as cur:
            for key, text in texts.items():
                self._shared.settings.pop(key, None)
                cur.execute("INSERT OR REPLACE INTO settings VALUES (?, ?, ?)", [key, text, now])
        self._shared.settings.update(texts)

    def active_policy(self) -> ModelVersion | None:
        """The policy used for generation (setting 'active_policy_version_id'), or None."""
        vid = self.get_setting(ACTIVE_POLICY_KEY)
        return None if vid is None else self.get_model_version(vid)

    def set_active_policy(self, version_id: int) -> ModelVersion:
        mv = self.get_model_version(version_id)
        if mv.kind != "policy":
            raise InvalidRequest(f"model version {version_id} is a {mv.kind}, not a policy")
        self.set_setting(ACTIVE_POLICY_KEY, version_id)
        return mv

    # ------------------------------------------------------------------ export snapshots

    def record_snapshot(self, path: str, fmt: str, counts: dict, filters: dict, sha256: str) -> Snapshot:
        """Record an export's manifest (store.export.export_dataset calls this)."""
        if fmt not in EXPORT_FORMATS:
            raise InvalidRequest(f"format must be one of {EXPORT_FORMATS}, not {fmt!r}")
        with self._tx() as cur:
            row = cur.execute(
                f"INSERT INTO snapshots VALUES (nextval('snapshots_id_seq'), ?, ?, ?, ?, ?, ?) "
                f"RETURNING {_SNAPSHOT_COLS}",
                [str(path), fmt, dumps(counts), dumps(filters), sha256, utcnow()]).fetchone()
        return _snapshot(row)

    def get_snapshot(self, snapshot_id: int) -> Snapshot:
        row = self._one(f"SELECT {_SNAPSHOT_COLS} FROM snapshots WHERE id = ?", [snapshot_id])
        if row is None:
            raise NotFoundError(f"no snapshot with id {snapshot_id}")
        return _snapshot(row)

    def list_snapshots(self) -> list[Snapshot]:
        return [_snapshot(r) for r in self._rows(f"SELECT {_SNAPSHOT_COLS} FROM snapshots ORDER BY id")]
