"""Import prompts and preference pairs from files; export pairs (store/export.py). Items to rank
are imported by store/import_items.py, with the readers and checks of this module.

Formats, chosen by the file extension:
- JSON Lines (.jsonl, .ndjson; .json holding one JSON array also works), one object per line;
- CSV (.csv) with a header row (a `messages` cell holds JSON);
- Parquet (.parquet, .pq).

Prompts: a `prompt` column (text), or chat `messages` ([{role, content}, ...]); optional `source`.
Pairs, in any of the layouts TRL and Anthropic use:
- TRL standard: `prompt`, `chosen`, `rejected` strings; HH-style prompts (a
  "\\n\\nHuman: ...\\n\\nAssistant:" transcript) are kept as they are;
- TRL conversational (what `python -m store export` writes by default): `prompt` a list of
  {role, content} messages and `chosen` / `rejected` one assistant message each, or, with no
  `prompt`, whole conversations that agree up to their last (assistant) message. The prompt is
  stored as its transcript (store.repo.messages_to_text), which exports as the same messages;
- HH-RLHF: `chosen` and `rejected` hold full transcripts and no `prompt`: each is split at its last
  "\\n\\nAssistant:" and the two prefixes must be equal (that prefix, marker included, is the prompt).
Optional: `source`, and the pair's strength as `margin` or, as exports name it, `rank_gap` (1 when
neither is given). Replies are stored exactly as given (HH replies keep their leading space, so
prompt + chosen is the original transcript).

All or nothing: the whole file is read and checked first; any problem (not parseable, missing
column, empty text, text over the length limit, file over the size limit, invalid UTF-8) raises
DataError listing file, row and problem, and nothing from the file is stored. Rows are counted
from 1: JSONL by line, CSV by data row (header not counted), Parquet by row.
"""

from __future__ import annotations

import csv
import hashlib
import io as _io
import json
import numbers
from pathlib import Path

from store.chat import pair_from_messages
from store.errors import DataError
from store.export import export_pairs, load_pairs_snapshot, snapshot_sha256  # noqa: F401 (re-exported)
from store.repo import check_messages, messages_to_text

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
"""Files over this size are refused (pass max_bytes to raise it)."""
DEFAULT_MAX_CHARS = 100_000
"""A prompt or reply over this many characters is refused (pass max_chars to raise it)."""
MAX_ERRORS = 50
"""Problems collected before giving up on a file."""
ASSISTANT_MARK = "\n\nAssistant:"
MIN_RESPONSES, MAX_RESPONSES = 2, 16
"""How many responses an imported item to rank holds (store/import_items.py)."""
MAX_MODEL_CHARS = 200

__all__ = ["import_prompts", "import_pairs", "export_pairs", "load_pairs_snapshot", "read_rows",
           "snapshot_sha256", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_CHARS"]


# ---------------------------------------------------------------- reading files


class _Problems:
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
    problems = _Problems(path)
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


def _read_json(path: Path, problems: _Problems) -> list[tuple[int, dict]]:
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


def _decode(raw: bytes, problems: _Problems) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        problems.add(None, f"invalid UTF-8 at byte {exc.start} (line {line} of the file)")
        return None


def _read_csv(path: Path, problems: _Problems) -> list[tuple[int, dict]]:
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


def _read_parquet(path: Path, problems: _Problems) -> list[tuple[int, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        problems.add(None, f"not a readable Parquet file: {exc}")
        return []
    return list(enumerate(table.to_pylist(), 1))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- checking rows


def _text(row: dict, field: str, n: int, problems: _Problems, max_chars: int) -> str | None:
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


def _source(row: dict, default: str) -> str:
    value = row.get("source")
    return value if isinstance(value, str) and value.strip() else default


# ---------------------------------------------------------------- prompts


def prompt_of(row: dict, n: int, problems: _Problems, max_chars: int) -> tuple[str, str | None] | None:
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
    text = _text(row, "prompt", n, problems, max_chars)
    return None if text is None else (text, None)


def import_prompts(store, path, *, max_bytes: int = DEFAULT_MAX_BYTES,
                   max_chars: int = DEFAULT_MAX_CHARS, source: str | None = None) -> dict:
    """Import prompts from a file (all or nothing). Prompts already stored (same text) are not
    added again. Returns {file, rows, added, duplicates}."""
    path = Path(path)
    default_source = source or f"import:{path.name}"
    problems = _Problems(path)
    checked = []
    for n, row in read_rows(path, max_bytes=max_bytes):
        prompt = prompt_of(row, n, problems, max_chars)
        if prompt is not None:
            checked.append((*prompt, _source(row, default_source)))
    problems.raise_if_any()
    _, added = store._add_prompt_rows(checked)
    return {"file": str(path), "rows": len(checked), "added": added, "duplicates": len(checked) - added}


# ---------------------------------------------------------------- responses of items to rank


def check_responses(responses: list[tuple[str | None, object]], n: int, problems: _Problems,
                    max_chars: int, what: str = "response") -> list[tuple[str, str | None]] | None:
    """[(text, model name or None)] of a row's (text, model) entries, or None after recording
    what is wrong: their number, an unusable text or model name, identical texts."""
    if not MIN_RESPONSES <= len(responses) <= MAX_RESPONSES:
        problems.add(n, f"{len(responses)} {what}s: an item has {MIN_RESPONSES} to {MAX_RESPONSES}")
        return None
    out = []
    for i, (text, model) in enumerate(responses, 1):
        text = _text({f"{what} {i}": text}, f"{what} {i}", n, problems, max_chars)
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


# ---------------------------------------------------------------- pairs


def split_hh(transcript: str) -> tuple[str, str] | None:
    """Split an HH-RLHF transcript at its last "\\n\\nAssistant:" -> (prompt incl. marker, reply)."""
    at = transcript.rfind(ASSISTANT_MARK)
    if at < 0:
        return None
    cut = at + len(ASSISTANT_MARK)
    return transcript[:cut], transcript[cut:]


def import_pairs(store, path, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_chars: int = DEFAULT_MAX_CHARS) -> dict:
    """Import preference pairs (TRL standard or conversational, or HH-RLHF transcripts; all or
    nothing).
    Returns {file, rows, pairs, prompts_added, prompts_existing, model_version_id}."""
    path = Path(path)
    default_source = f"import:{path.name}"
    problems = _Problems(path)
    checked = []
    for n, row in read_rows(path, max_bytes=max_bytes):
        conversational = any(isinstance(row.get(k), list) for k in ("prompt", "chosen", "rejected"))
        texts = (_conversational if conversational else _standard)(row, n, problems, max_chars)
        if texts is None:
            continue
        prompt, chosen, rejected = texts
        if chosen == rejected:
            problems.add(n, "'chosen' and 'rejected' are identical")
            continue
        margin = _strength(row, n, problems)
        if margin is None:
            continue
        checked.append((prompt, chosen, rejected, margin, _source(row, default_source)))
    problems.raise_if_any()
    counts = store._import_pair_rows(path.name, _sha256(path), checked)
    return {"file": str(path), **counts}


def _standard(row: dict, n: int, problems: _Problems, max_chars: int) -> tuple[str, str, str] | None:
    """(prompt, chosen, rejected) of a row of text (TRL standard, or HH-RLHF transcripts), or None
    after recording why it is unusable."""
    chosen = _text(row, "chosen", n, problems, max_chars)
    rejected = _text(row, "rejected", n, problems, max_chars)
    if chosen is None or rejected is None:
        return None
    if row.get("prompt") is not None:
        prompt = _text(row, "prompt", n, problems, max_chars)
        return None if prompt is None else (prompt, chosen, rejected)
    a, b = split_hh(chosen), split_hh(rejected)  # HH-RLHF: full transcripts
    if a is None or b is None:
        problems.add(n, "no 'prompt' column and no \"\\n\\nAssistant:\" turn to split the transcripts at")
        return None
    if a[0] != b[0]:
        problems.add(n, "the chosen and rejected transcripts differ before their last Assistant turn")
        return None
    if not a[1].strip() or not b[1].strip():
        problems.add(n, "an empty reply after the last Assistant turn")
        return None
    return a[0], a[1], b[1]


def _conversational(row: dict, n: int, problems: _Problems, max_chars: int) -> tuple[str, str, str] | None:
    """(prompt transcript, chosen, rejected) of a row in TRL's conversational format, or None
    after recording why it is unusable."""
    prompt, chosen, rejected = row.get("prompt"), row.get("chosen"), row.get("rejected")
    if not all(isinstance(v, list) for v in (chosen, rejected) + (() if prompt is None else (prompt,))):
        problems.add(n, "'prompt', 'chosen' and 'rejected' mix text and message lists: in TRL's conversational "
                        "format all three are lists of {role, content} messages")
        return None
    pair = pair_from_messages(prompt, chosen, rejected)
    if isinstance(pair, str):
        problems.add(n, pair)
        return None
    messages, chosen, rejected = pair
    texts = {"prompt": messages_to_text(messages), "chosen": chosen, "rejected": rejected}
    checked = [_text(texts, field, n, problems, max_chars) for field in texts]  # length, NUL
    return None if None in checked else tuple(checked)


def _strength(row: dict, n: int, problems: _Problems) -> float | None:
    """The pair's strength: `margin`, else `rank_gap` (an export's column), else 1; None after
    recording a value that is not a number."""
    name = "margin" if row.get("margin") not in (None, "") else "rank_gap"
    value = row.get(name)
    if value is None or value == "":
        return 1.0
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not isinstance(number, numbers.Real) or number != number:
        problems.add(n, f"'{name}' must be a number, got {value!r}")
        return None
    return number
