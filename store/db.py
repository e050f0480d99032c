"""The connection core every part of the Store shares: open, lock, cursors, transactions.

DuckDB allows one read-write process per file (DESIGN.md, Process model). Inside that process the
Store holds one connection; each thread gets its own cursor (`con.cursor()`, a connection to the
same database) because a DuckDB connection must not be used by two threads at once. Writes are
short transactions serialised by one lock: DuckDB would otherwise abort one of two concurrent
transactions that touch the same rows (optimistic concurrency), and the queue's "check then
lease" must be atomic anyway. Reads run concurrently on their own cursors (MVCC snapshots).
Stores opened on the same file in one process share the lock (class _Shared), as DuckDB shares
the database between them.
"""

from __future__ import annotations

import os
import re
import threading
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pyarrow as pa

from store.errors import NotFoundError, StoreError, StoreLockedError
from store.migrations import migrate
from store.queue_index import read_queue_index

DEFAULT_DB = Path("data") / "rlhf.duckdb"
DEFAULT_MEMORY_LIMIT = "25%"
"""DuckDB's memory for one store, a share of the machine's, unless $RLHF_LOOP_DB_MEMORY says
otherwise (DuckDB's own default is 80%): the training jobs beside the app need the rest. Beyond it
DuckDB spills sorts and joins to `<file>.tmp`. The Parquet export of a million rankings
(bench/store_bench.py, 5.8 million pairs) sorts in it on a 24 GB machine; at 2 GB it spills and
takes 1.5x as long."""


def default_db_path() -> Path:
    """$RLHF_LOOP_DB if set, else ./data/rlhf.duckdb (relative to the working directory)."""
    env = os.environ.get("RLHF_LOOP_DB")
    return Path(env) if env else DEFAULT_DB


# ---------------------------------------------------------------- the core


class StoreBase:
    """Opens (creating and migrating) a DuckDB file and hands out cursors and transactions."""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        replace_rerankings: bool = True,
        threads: int | None = None,
        memory_limit: str | None = None,
    ):
        """Open or create the database at `path` (default: default_db_path()) and migrate it.

        replace_rerankings: when an annotator ranks an item they ranked before, the new ranking
            replaces the old one and its pairs (True), or both are kept (False).
        threads: DuckDB's threads (None: its default, one per core).
        memory_limit: DuckDB's memory, e.g. "8GB" (None: $RLHF_LOOP_DB_MEMORY, else DEFAULT_MEMORY_LIMIT).
        Raises StoreLockedError when another process has the file open.
        """
        self.path = Path(path) if path is not None else default_db_path()
        if str(self.path) == ":memory:":
            raise StoreError("the Store needs a file path; ':memory:' is not supported")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.replace_rerankings = replace_rerankings
        config = {}
        if threads:
            config["threads"] = int(threads)
        config["memory_limit"] = memory_limit or os.environ.get("RLHF_LOOP_DB_MEMORY") or DEFAULT_MEMORY_LIMIT
        self._con = connect(self.path, config)
        self._shared = _Shared.acquire(self.path)
        self._local = threading.local()
        self._cursors: list = []
        self._cursors_lock = threading.Lock()
        self._closed = False
        try:
            with self._shared.lock:
                self.migrations_applied = migrate(self._con)
        except BaseException:
            self.close()
            raise

    # -- lifecycle

    def close(self) -> None:
        """Close every cursor and the connection (DuckDB checkpoints the WAL into the file)."""
        if self._closed:
            return
        self._closed = True
        with self._cursors_lock:
            for cur in self._cursors:
                try:
                    cur.close()
                except duckdb.Error:
                    pass
            self._cursors.clear()
        self._con.close()
        _Shared.release(self.path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r})"

    # -- for the modules that read or copy the whole store (store/export.py, store/backup.py)

    def cursor(self):
        """This thread's cursor: reads see their own snapshot; write only through the methods."""
        return self._cur()

    @property
    def write_lock(self):
        """The lock every write holds: while it is held, no write is in flight."""
        return self._shared.lock

    # -- cursors and transactions

    def _cur(self):
        """This thread's cursor (created on first use)."""
        if self._closed:
            raise StoreError(f"{self.path}: the store is closed")
        cur = getattr(self._local, "cur", None)
        if cur is None:
            cur = self._con.cursor()
            self._local.cur = cur
            with self._cursors_lock:
                self._cursors.append(cur)
        return cur

    @contextmanager
    def _tx(self, *, queue: bool = False):
        """One short write transaction under the write lock (see _tx_locked)."""
        with self._shared.lock:
            with self._tx_locked(queue=queue) as cur:
                yield cur

    @contextmanager
    def _tx_locked(self, *, queue: bool = False):
        """BEGIN, the caller's statements, COMMIT (ROLLBACK on error); the write lock is held.

        Functions given to _on_commit(fn) run after COMMIT, still under the write lock, with the
        queue index (store/queue_index.py) if it exists: that is how the index follows the data.
        queue=True builds the index first if needed (from this transaction's snapshot, before any
        of the caller's writes), so the caller can use self._shared.queue.
        """
        cur = self._cur()
        hooks: list = []
        self._local.hooks = hooks
        cur.execute("BEGIN TRANSACTION")
        try:
            if queue and self._shared.queue is None:
                self._shared.queue = read_queue_index(cur)
            yield cur
        except BaseException:
            self._local.hooks = None
            cur.execute("ROLLBACK")
            raise
        self._local.hooks = None
        try:
            cur.execute("COMMIT")
        except duckdb.Error:
            # A failed COMMIT has already aborted the transaction; make sure none is left open.
            try:
                cur.execute("ROLLBACK")
            except duckdb.Error:
                pass
            raise
        index = self._shared.queue
        if index is not None:
            try:
                for fn in hooks:
                    if fn is None:  # the change was too large to follow: rebuild on next use
                        self._shared.queue = None
                        break
                    fn(index)
            except Exception:
                self._shared.queue = None  # rebuilt from the database on next use

    def _combined(self, kind: str, request, run_batch):
        """Write `request` together with whatever other threads have queued of the same kind.

        Flat combining (Hendler et al. 2010, "Flat combining and the synchronization-parallelism
        tradeoff"): each caller queues its request, then takes the write lock; the first to get it
        runs every queued request in ONE transaction (`run_batch(cur, requests) -> results`, one
        result or exception per request) and the others find theirs done when they get the lock.
        With 20 annotators submitting at once this turns 20 transactions into a few. Alone, a
        caller simply runs its own request.
        """
        slot = _Slot(request)
        shared = self._shared
        with shared.pending_lock:
            shared.pending.setdefault(kind, []).append(slot)
        with shared.lock:
            if not slot.done:
                with shared.pending_lock:
                    batch = shared.pending.pop(kind, [])
                try:
                    with self._tx_locked(queue=True) as cur:
                        results = run_batch(cur, [s.request for s in batch])
                except BaseException as exc:  # the whole transaction failed: every request fails
                    results = [exc if s is slot else StoreError(f"{self.path}: the write failed: {exc!r}")
                               for s in batch]
                    shared.queue = None  # a batch may have touched the index: rebuild it from the database
                for s, result in zip(batch, results):
                    s.result, s.done = result, True
        if isinstance(slot.result, BaseException):
            raise slot.result
        return slot.result

    def _queue_new_items(self, new_items: list[tuple[int, int, list[int]]]) -> None:
        """Inside a transaction: after the commit the queue index takes these (item id, prompt id,
        response ids) as queued items; a batch too large to follow drops the index instead (it is
        rebuilt from the database when next needed)."""
        def follow(q):
            for item_id, prompt_id, response_ids in new_items:
                q.add_item(item_id, prompt_id, response_ids)

        self._on_commit(follow if len(new_items) <= 20_000 else None)

    def _on_commit(self, fn) -> None:
        """Run fn(queue_index) after the current transaction commits (see _tx); None drops the
        index instead (it is rebuilt from the database when next needed)."""
        self._local.hooks.append(fn)

    @contextmanager
    def _queue_locked(self):
        """The queue index under the write lock (built from a consistent snapshot if needed)."""
        with self._shared.lock:
            if self._shared.queue is None:
                cur = self._cur()
                cur.execute("BEGIN TRANSACTION")
                try:
                    self._shared.queue = read_queue_index(cur)
                finally:
                    cur.execute("COMMIT")
            yield self._shared.queue

    def _rows(self, sql: str, params=None) -> list[tuple]:
        return self._cur().execute(sql, params or []).fetchall()

    def _one(self, sql: str, params=None):
        # fetchall, not fetchone: an unread rest of a result would keep the cursor busy (DuckDB 2)
        rows = self._cur().execute(sql, params or []).fetchall()
        return rows[0] if rows else None

    def _scalar(self, sql: str, params=None):
        row = self._one(sql, params)
        return None if row is None else row[0]

    # -- bulk helpers (used inside _tx)

    @staticmethod
    def _reserve_ids(cur, sequence: str, n: int) -> list[int]:
        """Take n ids from a sequence. All writes hold the write lock, so they are contiguous."""
        if n <= 0:
            return []
        lo, hi, count = cur.execute(
            f"SELECT min(v), max(v), count(*) FROM (SELECT nextval('{sequence}') AS v FROM range(?))",
            [n],
        ).fetchone()
        if hi - lo + 1 == count == n:
            return list(range(lo, hi + 1))
        raise StoreError(f"ids from {sequence} were not contiguous ({lo}..{hi} for {n})")

    @staticmethod
    def _insert_arrow(cur, table: str, data: dict[str, pa.Array | list], types: dict) -> None:
        """INSERT INTO table (cols...) from columns, through an Arrow table (fast for many rows)."""
        arrays = {
            col: values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(values, types[col])
            for col, values in data.items()
        }
        if not arrays or len(next(iter(arrays.values()))) == 0:
            return
        cols = ", ".join(f'"{c}"' for c in arrays)
        with registered(cur, f"_incoming_{table}", pa.table(arrays)) as view:
            cur.execute(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM {view}")

    @staticmethod
    def _need(row, what: str):
        if row is None:
            raise NotFoundError(f"no {what}")
        return row


@contextmanager
def registered(cur, name: str, table: pa.Table):
    """Expose an Arrow table to SQL as `name` for the duration of the block.

    DuckDB 2 refuses register() while the cursor has an unread result (even a fetchone() of a
    one-row result counts), so the pending result is run to its end first.
    """
    cur.complete()
    cur.register(name, table)
    try:
        yield name
    finally:
        cur.complete()
        cur.unregister(name)


class _Slot:
    """One queued request of _combined: its result (or exception) once done."""

    __slots__ = ("request", "result", "done")

    def __init__(self, request):
        self.request, self.result, self.done = request, None, False


class _Shared:
    """State shared by every Store open on one file in this process: DuckDB gives them one database
    instance, so they must also share the write lock and the queue index."""

    _by_path: dict[str, "_Shared"] = {}
    _registry_lock = threading.Lock()

    def __init__(self):
        self.lock = threading.Lock()  # the write lock
        self.pending_lock = threading.Lock()  # guards `pending`
        self.pending: dict[str, list[_Slot]] = {}  # requests waiting for _combined
        self.refs = 0
        self.queue = None  # QueueIndex, built on first use
        self.agreement_lock = threading.Lock()  # one refresh of agreement_items at a time
        self.agreement_signature = None  # (count, newest id) of the rankings it was last brought up to
        self.settings: dict[str, str | None] = {}  # key -> JSON text (None: not set)
        self.lease_gc_at = None
        # Bumped after every committed account change (role, password, active): callers that
        # cache an account (annotate/context.py) compare it to know their copy is stale.
        self.accounts_version = 0

    @classmethod
    def acquire(cls, path: Path) -> "_Shared":
        key = os.path.realpath(path)
        with cls._registry_lock:
            shared = cls._by_path.setdefault(key, cls())
            shared.refs += 1
            return shared

    @classmethod
    def release(cls, path: Path) -> None:
        key = os.path.realpath(path)
        with cls._registry_lock:
            shared = cls._by_path.get(key)
            if shared is not None:
                shared.refs -= 1
                if shared.refs <= 0:
                    del cls._by_path[key]


def connect(path: Path, config: dict):
    try:
        return duckdb.connect(str(path), config=config)
    except duckdb.ConnectionException as exc:
        raise StoreError(f"{path}: already open in this process with other settings ({exc})") from exc
    except duckdb.IOException as exc:
        text = str(exc)
        if "lock" in text.lower():
            pid = re.search(r"PID (\d+)", text)
            raise StoreLockedError(str(path), f"held by PID {pid.group(1)}" if pid else "") from None
        raise StoreError(f"{path}: cannot open the database: {text}") from exc


def open_in_this_process(path) -> bool:
    """True while a Store of this process has the file at `path` open."""
    return os.path.realpath(path) in _Shared._by_path
