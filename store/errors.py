"""Errors raised by the store. Every message says what went wrong and, where it can, what to do."""

from __future__ import annotations

from formats.rows import RowsError


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class StoreLockedError(StoreError):
    """Another process holds the DuckDB file read-write (DuckDB allows one writer process per file)."""

    def __init__(self, path: str, detail: str = ""):
        self.path = path
        msg = (
            f"{path}: the database is in use by another process (the app?): use the UI, or stop it"
        )
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class NotFoundError(StoreError, LookupError):
    """A row asked for by id or name does not exist."""


class InvalidRequest(StoreError, ValueError):
    """A write was refused because its arguments are inconsistent (nothing was stored)."""


class DataError(StoreError, RowsError):
    """A file was refused: `errors` lists (row, problem) pairs; nothing from the file was stored.

    `row` is the 1-based line number for JSONL, the 1-based data row for CSV (the header is not
    counted) and Parquet, or None for problems with the whole file (formats/rows.py).
    """

    tail = "; nothing from this file was stored"
