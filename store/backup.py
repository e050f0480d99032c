"""Backups of the whole database, taken while the app runs, and their restore.

A backup is a DuckDB file holding every table of the store as it was at one instant. `backup`
takes the store's write lock only long enough to open a read transaction (every write of the
Store happens under that lock, store/db.py, so no transaction is half done at that moment: a
ranking and its pairs are both in the backup or both out of it), then copies that transaction's
snapshot with DuckDB's `COPY FROM DATABASE` into a freshly ATTACHed file while annotators keep
submitting (DuckDB's MVCC keeps the snapshot). The file is written under a temporary name, checked,
and renamed, so a crash never leaves half a backup under the final name.

`check_backup` opens a file read-only and reads every table in full (DuckDB verifies each block's
checksum as it reads): it refuses files that are not DuckDB databases, lack a table of the
store, or were written by a newer version (a migration this code does not know).

`restore` checks the backup, copies it next to the database under a temporary name, checks the
copy, and renames it into place. It refuses while the database is in use (by the app or any other
process), and keeps the database it replaces as `<name>.before-restore-<time>`.

`relocate` points the file paths a store records (model versions' folders, run directories,
pairs snapshots, the files a run's arguments name) from one folder to another, in one
transaction: for a store restored where its runs folder is not where it was.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
import shutil
from pathlib import Path

import duckdb

from store.db import connect, open_in_this_process
from store.errors import InvalidRequest, StoreError, StoreLockedError
from store.migrations import MIGRATIONS

# The store's own tables (schema_migrations included): a backup lacking one is refused.
REQUIRED_TABLES = ("settings", "rounds", "prompts", "model_versions", "items", "responses", "annotators",
                   "rankings", "pairs", "leases", "skips", "flags", "runs", "metrics", "snapshots",
                   "schema_migrations")


class BackupError(StoreError):
    """A backup file was refused: the message names the file and the problem."""


def table_checksums(con) -> dict[str, tuple[int, int]]:
    """{table: (rows, checksum of its rows)} for every table of the connection's main database.

    The checksum is the sum of a hash of each whole row, so it does not depend on row order; two
    databases with equal checksums hold the same rows (up to hash collisions)."""
    tables = [r[0] for r in con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
        "AND schema_name = 'main' AND NOT temporary ORDER BY table_name").fetchall()]
    out = {}
    for t in tables:
        rows, total = con.execute(f'SELECT count(*), coalesce(sum(hash(x)), 0) FROM "{t}" AS x').fetchone()
        out[t] = (int(rows), int(total))
    return out


def store_checksums(store) -> dict[str, tuple[int, int]]:
    """table_checksums of an open Store, read in one transaction (one instant)."""
    cur = store.cursor()
    cur.execute("BEGIN TRANSACTION")
    try:
        return table_checksums(cur)
    finally:
        cur.execute("COMMIT")


def backup(store, out_path, *, overwrite: bool = False) -> dict:
    """Copy the whole store, as of one instant, to the DuckDB file `out_path`.

    Returns {"path", "tables": {table: (rows, checksum)}, "bytes"}. The store stays usable
    throughout; writes wait only while the snapshot is opened (milliseconds)."""
    out = Path(out_path)
    if out.exists() and not overwrite:
        raise InvalidRequest(f"{out} already exists (choose another name, or overwrite)")
    if out.resolve() == Path(store.path).resolve():
        raise InvalidRequest(f"{out} is the database itself: choose another file for the backup")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    _remove(tmp)
    cur = store.cursor()
    source = cur.execute("SELECT current_database()").fetchone()[0]
    alias = f"backup_{secrets.token_hex(6)}"
    cur.execute(f"ATTACH '{_sql_path(tmp)}' AS {alias}")
    try:
        with store.write_lock:  # no write is in flight: the snapshot opened now is one instant
            cur.execute("BEGIN TRANSACTION")
            try:
                tables = table_checksums(cur)  # reading pins this transaction's snapshot
            except BaseException:
                cur.execute("ROLLBACK")
                raise
        try:
            cur.execute(f"COPY FROM DATABASE {source} TO {alias}")
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
    except BaseException:
        _detach(cur, alias)
        _remove(tmp)
        raise
    _detach(cur, alias)
    try:
        copied = check_backup(tmp)
        if copied != tables:
            raise BackupError(f"{out}: the copy differs from the store's snapshot; nothing was written")
        os.replace(tmp, out)
    finally:
        _remove(tmp)
    return {"path": str(out), "tables": tables, "bytes": out.stat().st_size}


def check_backup(path) -> dict[str, tuple[int, int]]:
    """{table: (rows, checksum)} of a backup file, read in full; BackupError naming the problem."""
    path = Path(path)
    if not path.is_file():
        raise BackupError(f"{path}: no such file")
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error as exc:
        raise BackupError(f"{path}: not a DuckDB database this version can read ({_first_line(exc)})") from None
    try:
        present = {r[0] for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main'").fetchall()}
        missing = [t for t in REQUIRED_TABLES if t not in present]
        if missing:
            raise BackupError(f"{path}: not an rlhf-loop backup (missing tables: {', '.join(missing)})")
        known = {name for name, _ in MIGRATIONS}
        unknown = [r[0] for r in con.execute("SELECT name FROM schema_migrations").fetchall() if r[0] not in known]
        if unknown:
            raise BackupError(f"{path}: written by a newer rlhf-loop (migrations {unknown}); upgrade the code first")
        return table_checksums(con)
    except duckdb.Error as exc:
        raise BackupError(f"{path}: the file is damaged ({_first_line(exc)})") from None
    finally:
        con.close()


def restore(backup_path, db_path) -> dict:
    """Replace the database at `db_path` by the backup at `backup_path` (checked first).

    Refuses (StoreLockedError) while any process, this one included, has the database open.
    Returns {"tables", "replaced": the path the old database was moved to, or None}."""
    src, db = Path(backup_path), Path(db_path)
    tables = check_backup(src)
    if src.resolve() == db.resolve():
        raise InvalidRequest(f"{src} is the database itself")
    if open_in_this_process(db):
        raise StoreLockedError(str(db), "open in this process")
    db.parent.mkdir(parents=True, exist_ok=True)
    tmp = db.with_name(f".{db.name}.restore-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if check_backup(tmp) != tables:
            raise BackupError(f"{src}: the copy at {tmp} differs from the backup; nothing was restored")
        replaced = None
        if db.exists():
            # Open read-write once: refused if another process holds it, and any WAL it left is
            # folded into the file. Then hold it read-only (no other process can open it for
            # writing) while the files are swapped; a read-only connection writes nothing.
            connect(db, {}).close()
            guard = duckdb.connect(str(db), read_only=True)
            try:
                replaced = db.with_name(f"{db.name}.before-restore-{dt.datetime.now():%Y%m%d-%H%M%S}")
                os.replace(db, replaced)
                os.replace(tmp, db)
            finally:
                guard.close()
        else:
            os.replace(tmp, db)
    finally:
        _remove(tmp)
    return {"tables": tables, "replaced": None if replaced is None else str(replaced)}


def _detach(cur, alias: str) -> None:
    try:
        cur.execute(f"DETACH {alias}")
    except duckdb.Error:
        pass


def _remove(path: Path) -> None:
    for p in (path, path.with_name(path.name + ".wal")):
        if p.exists():
            p.unlink()


def _sql_path(path: Path) -> str:
    return str(path).replace("'", "''")


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


RELOCATED = (("model_versions", "path"), ("model_versions", "base_model"), ("runs", "run_dir"),
             ("snapshots", "path"), ("runs", "config"), ("runs", "inputs"), ("runs", "outputs"))
"""The columns that hold file paths: plain paths (a base model that is a local folder among them),
and JSON documents holding them (a run's command line, its input and output files)."""


def relocate(store, old_root, new_root) -> dict[str, int]:
    """Every path the store records under the folder `old_root` now under `new_root` (the same
    relative path), in one transaction; {"table.column": rows changed}. Paths elsewhere are kept."""
    old, new = str(old_root).rstrip("/") + "/", str(new_root).rstrip("/") + "/"
    if old == new:
        return {}
    changed = {}
    with store.write_lock:
        cur = store.cursor()
        cur.execute("BEGIN TRANSACTION")
        try:
            for table, column in RELOCATED:
                text = f"CAST({column} AS VARCHAR)"
                moved = f"replace({text}, ?, ?)"
                if column in ("path", "run_dir", "base_model"):  # a plain path: only its start
                    moved = f"? || substr({column}, {len(old) + 1})"
                    where, args = f"starts_with({column}, ?)", [new, old]
                else:
                    where, args = f"contains({text}, ?)", [old, new, old]
                n = cur.execute(f"SELECT count(*) FROM {table} WHERE {where}", args[-1:]).fetchone()[0]
                if n:
                    cur.execute(f"UPDATE {table} SET {column} = {moved} WHERE {where}", args)
                changed[f"{table}.{column}"] = n
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
    return changed
