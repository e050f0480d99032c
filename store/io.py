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
  stored as its transcript (formats.chat.messages_to_text), which exports as the same messages;
- HH-RLHF: `chosen` and `rejected` hold full transcripts and no `prompt`: each is split at its last
  "\\n\\nAssistant:" and the two prefixes must be equal (that prefix, marker included, is the prompt).
Optional: `source`, and the pair's strength as `margin` or, as exports name it, `rank_gap` (1 when
neither is given). Replies are stored exactly as given (HH replies keep their leading space, so
prompt + chosen is the original transcript).

Files are read, and their fields checked, by store/readers.py. All or nothing: the whole file is
read and checked first; any problem (not parseable, missing column, empty text, text over the
length limit, file over the size limit, invalid UTF-8) raises DataError listing file, row and
problem, and nothing from the file is stored. Rows are counted from 1: JSONL by line, CSV by data
row (header not counted), Parquet by row.
"""

from __future__ import annotations

import numbers
from pathlib import Path

from formats.chat import messages_to_text, pair_from_messages, split_hh
from formats.hashing import file_sha256
from store.export import export_dataset, load_pairs_snapshot, snapshot_sha256  # noqa: F401 (re-exported)
from store.export_options import ExportOptions  # noqa: F401 (re-exported)
from store.readers import (DEFAULT_MAX_BYTES, DEFAULT_MAX_CHARS, Problems, prompt_of, read_rows, source_of,
                           text_field)

__all__ = ["import_prompts", "import_pairs", "export_dataset", "ExportOptions", "load_pairs_snapshot", "read_rows",
           "snapshot_sha256", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_CHARS"]


# ---------------------------------------------------------------- prompts


def import_prompts(store, path, *, max_bytes: int = DEFAULT_MAX_BYTES,
                   max_chars: int = DEFAULT_MAX_CHARS, source: str | None = None) -> dict:
    """Import prompts from a file (all or nothing). Prompts already stored (same text) are not
    added again. Returns {file, rows, added, duplicates}."""
    path = Path(path)
    default_source = source or f"import:{path.name}"
    problems = Problems(path)
    checked = []
    for n, row in read_rows(path, max_bytes=max_bytes):
        prompt = prompt_of(row, n, problems, max_chars)
        if prompt is not None:
            checked.append((*prompt, source_of(row, default_source)))
    problems.raise_if_any()
    _, added = store.add_prompt_rows(checked)
    return {"file": str(path), "rows": len(checked), "added": added, "duplicates": len(checked) - added}


# ---------------------------------------------------------------- pairs


def import_pairs(store, path, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_chars: int = DEFAULT_MAX_CHARS) -> dict:
    """Import preference pairs (TRL standard or conversational, or HH-RLHF transcripts; all or
    nothing).
    Returns {file, rows, pairs, prompts_added, prompts_existing, model_version_id}."""
    path = Path(path)
    default_source = f"import:{path.name}"
    problems = Problems(path)
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
        checked.append((prompt, chosen, rejected, margin, source_of(row, default_source)))
    problems.raise_if_any()
    counts = store.import_pair_rows(path.name, file_sha256(path), checked)
    return {"file": str(path), **counts}


def _standard(row: dict, n: int, problems: Problems, max_chars: int) -> tuple[str, str, str] | None:
    """(prompt, chosen, rejected) of a row of text (TRL standard, or HH-RLHF transcripts), or None
    after recording why it is unusable."""
    chosen = text_field(row, "chosen", n, problems, max_chars)
    rejected = text_field(row, "rejected", n, problems, max_chars)
    if chosen is None or rejected is None:
        return None
    if row.get("prompt") is not None:
        prompt = text_field(row, "prompt", n, problems, max_chars)
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


def _conversational(row: dict, n: int, problems: Problems, max_chars: int) -> tuple[str, str, str] | None:
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
    checked = [text_field(texts, field, n, problems, max_chars) for field in texts]  # length, NUL
    return None if None in checked else tuple(checked)


def _strength(row: dict, n: int, problems: Problems) -> float | None:
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
