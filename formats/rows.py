"""Reading a data file into numbered rows, for the store's imports and the trainers alike.

`read_rows(path)` reads a JSON Lines (.jsonl, .ndjson), JSON (.json: JSON lines or one array), CSV
(.csv, header row; a `messages` cell holds JSON) or Parquet (.parquet, .pq) file, chosen by the
extension, into (row number, row dict) pairs. Rows are counted from 1: JSONL by line, CSV by data
row (header not counted), JSON arrays and Parquet by row. A file that cannot be read, in whole or
in any row, raises one `RowsError` listing every problem (`Problems` collects them); what the rows
mean is the caller's (store/readers.py checks them for the store, pipeline/pairs_data.py for training).
"""

from __future__ import annotations

import csv
import io as _io
import json
from pathlib import Path

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
"""Files over this size are refused (pass max_bytes to raise it)."""
MAX_ERRORS = 50
"""Problems collected before giving up on a file."""
EMPTY = "the file holds no rows"
"""The problem of a file without rows (callers may say it in their own words)."""


class RowsError(ValueError):
    """A file was refused: `errors` lists (row, problem) pairs, row None for the whole file."""

    tail = ""
    """Appended to the message (the store's says that nothing was stored)."""

    def __init__(self, path: str, errors: list[tuple[int | None, str]], *, more: int = 0):
        self.path = str(path)
        self.errors = list(errors)
        self.more = more
        shown = "; ".join(_where(row) + problem for row, problem in self.errors[:5])
        extra = len(self.errors) - 5 + more
        super().__init__(f"{self.path}: {shown}{f' (and {extra} more)' if extra > 0 else ''}{self.tail}")


def _where(row: int | None) -> str:
    return "" if row is None else f"row {row}: "


class Problems:
    """Collects (row, problem) pairs; raises `error` (RowsError, or a caller's subclass) once there
    are any (or too many)."""

    error = RowsError

    def __init__(self, path: Path):
        self.path = path
        self.items: list[tuple[int | None, str]] = []
        self.more = 0

    def add(self, row: int | None, problem: str) -> None:
        if len(self.items) < MAX_ERRORS:
            self.items.append((row, problem))
        else:
            self.more += 1

    def raise_if_any(self) -> None:
        if self.items:
            raise self.error(str(self.path), self.items, more=self.more)

    def fail(self, problem: str):
        """Refuse the whole file now."""
        raise self.error(str(self.path), [(None, problem)])


def read_rows(path, *, max_bytes: int = DEFAULT_MAX_BYTES, problems: Problems | None = None) -> list[tuple[int, dict]]:
    """(row number, row dict) for every row of a JSONL, JSON, CSV or Parquet file. An unreadable
    file (missing, too big, bad encoding, unparseable rows, no rows) raises `problems.error`."""
    path = Path(path)
    problems = problems or Problems(path)
    if not path.is_file():
        problems.fail("no such file")
    size = path.stat().st_size
    if size > max_bytes:
        problems.fail(f"the file has {size:,} bytes, over the limit of {max_bytes:,} bytes")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        rows = _read_json(path, problems)
    elif suffix == ".csv":
        rows = _read_csv(path, problems)
    elif suffix in (".parquet", ".pq"):
        rows = _read_parquet(path, problems)
    else:
        problems.fail(f"unknown file type {suffix!r}: use .jsonl, .json, .csv or .parquet")
    problems.raise_if_any()
    if not rows:
        problems.fail(EMPTY)
    return rows


def _read_json(path: Path, problems: Problems) -> list[tuple[int, dict]]:
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte order mark
    if path.suffix.lower() == ".json" and raw.lstrip()[:1] == b"[":
        text = _decode(raw, problems)
        if text is None:
            return []
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            problems.add(None, f"not valid JSON: {exc}")
            return []
        rows = list(enumerate(data, 1))
    else:
        rows = []
        for n, line in enumerate(raw.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                problems.add(n, f"invalid UTF-8 at byte {exc.start} of the line")
                continue
            try:
                rows.append((n, json.loads(text)))
            except json.JSONDecodeError as exc:
                problems.add(n, f"not valid JSON: {exc.msg} (column {exc.colno})")
    out = []
    for n, obj in rows:
        if isinstance(obj, dict):
            out.append((n, obj))
        else:
            problems.add(n, f"expected a JSON object, got {type(obj).__name__}")
    return out


def _decode(raw: bytes, problems: Problems) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        problems.add(None, f"invalid UTF-8 at byte {exc.start} (line {line} of the file)")
        return None


def _read_csv(path: Path, problems: Problems) -> list[tuple[int, dict]]:
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    text = _decode(raw, problems)
    if text is None:
        return []
    try:
        reader = csv.DictReader(_io.StringIO(text, newline=""))
        rows = []
        for n, row in enumerate(reader, 1):
            if None in row:
                problems.add(n, "more cells than header columns")
                continue
            if "messages" in row and row["messages"]:
                try:
                    row["messages"] = json.loads(row["messages"])
                except json.JSONDecodeError as exc:
                    problems.add(n, f"'messages' is not valid JSON: {exc.msg}")
                    continue
            rows.append((n, {k: v for k, v in row.items() if v is not None}))
        return rows
    except csv.Error as exc:
        problems.add(None, f"not valid CSV: {exc}")
        return []


def _read_parquet(path: Path, problems: Problems) -> list[tuple[int, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        problems.add(None, f"not a readable Parquet file: {exc}")
        return []
    return list(enumerate(table.to_pylist(), 1))
