"""Errors raised by the store. Every message says what went wrong and, where it can, what to do."""

from __future__ import annotations


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


class DataError(StoreError, ValueError):
    """A file was refused: `errors` lists (row, problem) pairs; nothing from the file was stored.

    `row` is the 1-based line number for JSONL, the 1-based data row for CSV (the header is not
    counted) and Parquet, or None for problems with the whole file.
    """

    def __init__(self, path: str, errors: list[tuple[int | None, str]], *, more: int = 0):
        self.path = str(path)
        self.errors = list(errors)
        self.more = more
        shown = "; ".join(_where(row) + problem for row, problem in self.errors[:5])
        extra = len(self.errors) - 5 + more
        tail = f" (and {extra} more)" if extra > 0 else ""
        super().__init__(f"{self.path}: {shown}{tail}; nothing from this file was stored")


def _where(row: int | None) -> str:
    return "" if row is None else f"row {row}: "
