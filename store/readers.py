"""Reading import files into checked rows: pure functions, no database.

`read_rows(path)` reads a JSON Lines, JSON (one array), CSV or Parquet file (chosen by the
extension) into (row number, row dict) pairs; the checks below turn a row's fields into stored
form, recording every problem in a `Problems` (which raises one DataError listing them all).
Rows are counted from 1: JSONL by line, CSV by data row (header not counted), Parquet by row.
store/io.py, store/import_items.py, store/labelstudio.py and gold imports (store/gold.py) read
through this module; what a file's rows mean is theirs.
"""

from __future__ import annotations

import csv
import hashlib
import io as _io
import json
from pathlib import Path

from formats.chat import check_messages, messages_to_text
from store.errors import DataError

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
"""Files over this size are refused (pass max_bytes to raise it)."""
DEFAULT_MAX_CHARS = 100_000
"""A prompt or reply over this many characters is refused (pass max_chars to raise it)."""
MAX_ERRORS = 50
"""Problems collected before giving up on a file."""
MIN_RESPONSES, MAX_RESPONSES = 2, 16
"""How many responses an imported item to rank holds (store/import_items.py)."""
MAX_MODEL_CHARS = 200


# ---------------------------------------------------------------- reading files


class Problems:
    """Collects (row, problem) pairs; raises DataError once there are any (or too many)."""

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
            raise DataError(str(self.path), self.items, more=self.more)


def read_rows(path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[int, dict]]:
    """(row number, row dict) for every row of a JSONL, JSON, CSV or Parquet file.
    Raises DataError for an unreadable file (missing, too big, bad encoding, unparseable rows)."""
    path = Path(path)
    problems = Problems(path)
    if not path.is_file():
        raise DataError(str(path), [(None, "no such file")])
    size = path.stat().st_size
    if size > max_bytes:
        raise DataError(str(path), [(None, f"the file has {size:,} bytes, over the limit of {max_bytes:,} bytes")])
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        rows = _read_json(path, problems)
    elif suffix == ".csv":
        rows = _read_csv(path, problems)
    elif suffix in (".parquet", ".pq"):
        rows = _read_parquet(path, problems)
    else:
        raise DataError(str(path), [(None, f"unknown file type {suffix!r}: use .jsonl, .json, .csv or .parquet")])
    problems.raise_if_any()
    if not rows:
        raise DataError(str(path), [(None, "the file holds no rows")])
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


def file_sha256(path) -> str:
    """SHA-256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- checking rows


def text_field(row: dict, field: str, n: int, problems: Problems, max_chars: int) -> str | None:
    """The row's text field, or None after recording why it is unusable."""
    if field not in row or row[field] is None:
        problems.add(n, f"missing '{field}'")
        return None
    value = row[field]
    if not isinstance(value, str):
        problems.add(n, f"'{field}' must be text, got {type(value).__name__}")
        return None
    if not value.strip():
        problems.add(n, f"'{field}' is empty")
        return None
    if len(value) > max_chars:
        problems.add(n, f"'{field}' has {len(value):,} characters, over the limit of {max_chars:,}")
        return None
    if "\x00" in value:
        problems.add(n, f"'{field}' contains a NUL character")
        return None
    return value


def source_of(row: dict, default: str) -> str:
    """The row's `source`, or `default` when it has none."""
    value = row.get("source")
    return value if isinstance(value, str) and value.strip() else default


# ---------------------------------------------------------------- prompts and responses


def prompt_of(row: dict, n: int, problems: Problems, max_chars: int) -> tuple[str, str | None] | None:
    """(text, messages as JSON or None) of a row's `messages` (chat) or `prompt` (text), or None
    after recording why it is unusable."""
    messages = row.get("messages")
    if messages is not None and messages != "":
        problem = check_messages(messages)
        if problem:
            problems.add(n, problem)
            return None
        text = messages_to_text(messages)
        if len(text) > max_chars:
            problems.add(n, f"'messages' has {len(text):,} characters, over the limit of {max_chars:,}")
            return None
        return text, json.dumps(messages, ensure_ascii=False)
    if "prompt" not in row:
        problems.add(n, f"missing 'prompt' (or 'messages'); columns: {sorted(row)}")
        return None
    text = text_field(row, "prompt", n, problems, max_chars)
    return None if text is None else (text, None)


def check_responses(responses: list[tuple[str | None, object]], n: int, problems: Problems,
                    max_chars: int, what: str = "response") -> list[tuple[str, str | None]] | None:
    """[(text, model name or None)] of a row's (text, model) entries, or None after recording
    what is wrong: their number, an unusable text or model name, identical texts."""
    if not MIN_RESPONSES <= len(responses) <= MAX_RESPONSES:
        problems.add(n, f"{len(responses)} {what}s: an item has {MIN_RESPONSES} to {MAX_RESPONSES}")
        return None
    out = []
    for i, (text, model) in enumerate(responses, 1):
        text = text_field({f"{what} {i}": text}, f"{what} {i}", n, problems, max_chars)
        if model is not None and not isinstance(model, str):
            problems.add(n, f"the model of {what} {i} must be text, got {type(model).__name__}")
            text = None
        elif isinstance(model, str) and len(model.strip()) > MAX_MODEL_CHARS:
            problems.add(n, f"the model name of {what} {i} is over {MAX_MODEL_CHARS} characters")
            text = None
        if text is None:
            return None
        out.append((text, model.strip() if isinstance(model, str) and model.strip() else None))
    first: dict[str, int] = {}
    for i, (text, _) in enumerate(out, 1):
        if text in first:
            problems.add(n, f"{what}s {first[text]} and {i} are identical: an item ranks different responses")
            return None
        first[text] = i
    return out
