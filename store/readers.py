"""Reading import files into checked rows: pure functions, no database.

`read_rows(path)` reads a file into (row number, row dict) pairs (formats/rows.py: JSON Lines,
JSON, CSV or Parquet); the checks below turn a row's fields into stored form, recording every
problem in a `Problems` (which raises one DataError listing them all). store/io.py,
store/import_items.py, store/labelstudio.py and gold imports (store/gold.py) read through this
module; what a file's rows mean is theirs.
"""

from __future__ import annotations

import json
from pathlib import Path

from formats import rows
from formats.chat import check_messages, messages_to_text
from formats.rows import DEFAULT_MAX_BYTES
from store.errors import DataError

DEFAULT_MAX_CHARS = 100_000
"""A prompt or reply over this many characters is refused (pass max_chars to raise it)."""
MIN_RESPONSES, MAX_RESPONSES = 2, 16
"""How many responses an imported item to rank holds (store/import_items.py)."""
MAX_MODEL_CHARS = 200


# ---------------------------------------------------------------- reading files


class Problems(rows.Problems):
    """Collects (row, problem) pairs; raises DataError once there are any (or too many)."""

    error = DataError


def read_rows(path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[int, dict]]:
    """(row number, row dict) for every row of a JSONL, JSON, CSV or Parquet file (formats/rows.py).
    Raises DataError for an unreadable file (missing, too big, bad encoding, unparseable rows)."""
    return rows.read_rows(path, max_bytes=max_bytes, problems=Problems(Path(path)))


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
