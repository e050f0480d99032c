"""Import items to rank: a prompt and 2..16 responses per row, each response with an optional
model (or source) name; or the export of another annotation tool with the rankings made there:
Label Studio (store/labelstudio.py), Argilla (store/argilla.py).

Files are read as every import file (store/readers.py) (JSON Lines, a JSON array, CSV, Parquet; chosen by extension).
A row holds the prompt as `prompt` (text) or chat `messages` (in CSV a cell of JSON), an optional
`source`, and its responses in either layout:
- `responses`: a list whose entries are texts or {"text": ..., "model": ...} objects (in CSV a
  cell of JSON);
- one column per response: `response_1` .. `response_n`, with `model_1` .. `model_n` naming
  their models. Empty trailing cells are no response, so one CSV holds rows of different K.

    {"prompt": "Name a prime.", "responses": [{"text": "7", "model": "gpt-4o"}, {"text": "9", "model": "ours"}]}
    prompt,response_1,model_1,response_2,model_2
    Name a prime.,7,gpt-4o,9,ours

Each model name becomes a model version of that name (store/repo.py `import_item_rows`): an
existing policy or external version, else a new version of kind 'external'; exports name it in
`chosen_model` / `rejected_model`. The items enter the annotation queue like generated ones (no
round), except a tool's tasks or records that were ranked there: their rankings come in instead,
each as a ranking of the person who made it (an imported annotator, store/users.py), or as pairs
alone when the file does not say who.

All or nothing, as every import: a row is refused with its number and why (no prompt, fewer than
2 or more than 16 responses, an empty or overlong text, two identical responses, a model name that
is not text, a gap among response_N columns), and so is a row repeating an earlier row's prompt
and responses or an item already stored; the same file imported twice is refused. Any problem
refuses the whole file and nothing from it is stored.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from formats.hashing import file_sha256
from store import argilla, labelstudio
from store.errors import DataError
from store.readers import (DEFAULT_MAX_BYTES, DEFAULT_MAX_CHARS, Problems, check_responses, prompt_of, read_rows,
                           source_of)
from store.records import ITEM_FORMATS, ItemIn

_WIDE = re.compile(r"response_(\d+)$")


def import_items(store, path, *, fmt: str = "items", max_bytes: int = DEFAULT_MAX_BYTES,
                 max_chars: int = DEFAULT_MAX_CHARS, evaluation: str | None = None) -> dict:
    """Import items to rank from a file (module docstring), all or nothing. With `evaluation`, the
    items are a blind evaluation of that name between the models the file names
    (store/evaluations.py): every row has one response from each of the same models, and no
    ranking from another tool. Returns {file, rows, items, queued, responses, prompts_added,
    prompts_existing, pairs, models, models_created, model_version_id, evaluation_id}."""
    if fmt not in ITEM_FORMATS:
        raise DataError(str(path), [(None, f"unknown items format {fmt!r}: use one of {ITEM_FORMATS}")])
    path = Path(path)
    problems = Problems(path)
    default_source = f"import:{path.name}"
    if fmt == "argilla":
        checked, sha256 = argilla.read_records(path, problems, max_chars, default_source, max_bytes)
    else:
        rows, sha256 = read_rows(path, max_bytes=max_bytes), file_sha256(path)
        if fmt == "labelstudio":
            checked = labelstudio.read_tasks(rows, problems, max_chars, default_source)
        else:
            checked = [item for n, row in rows
                       if (item := _item(row, n, problems, max_chars, default_source)) is not None]
    _refuse_repeats(checked, problems)
    if evaluation is not None:
        _check_evaluation(checked, problems)
    problems.raise_if_any()
    counts = store.import_item_rows(str(path), sha256, fmt, checked, evaluation=evaluation)
    return {"file": str(path), **counts}


def _check_evaluation(items: list[ItemIn], problems: Problems) -> None:
    """Record each row that cannot be part of one blind evaluation (import_items `evaluation`)."""
    first = None
    for item in items:
        models = [m for _, m in item.responses]
        if None in models:
            problems.add(item.n, "every response of an evaluation names its model (the versions compared)")
        elif len(set(models)) != len(models):
            problems.add(item.n, f"two responses from one model ({sorted(models)}): an evaluation takes one each")
        elif first is None:
            first = (item.n, sorted(models))
        elif sorted(models) != first[1]:
            problems.add(item.n, f"its models {sorted(models)} differ from row {first[0]}'s {first[1]}: every "
                                 "prompt of an evaluation is answered by the same models")
        if item.orders:
            problems.add(item.n, "ranked in another tool: an evaluation is ranked blind here")


def _item(row: dict, n: int, problems: Problems, max_chars: int, default_source: str) -> ItemIn | None:
    prompt = prompt_of(row, n, problems, max_chars)
    entries = _entries(row, n, problems)
    if prompt is None or entries is None:
        return None
    responses = check_responses(entries, n, problems, max_chars)
    if responses is None:
        return None
    return ItemIn(n, prompt[0], prompt[1], source_of(row, default_source), responses)


def _entries(row: dict, n: int, problems: Problems) -> list[tuple[object, object]] | None:
    """The row's responses as (text, model) in either layout, or None after recording why not."""
    wide = sorted((int(m.group(1)), key) for key in row if (m := _WIDE.match(key)))
    if "responses" in row and row["responses"] not in (None, ""):
        if wide:
            problems.add(n, "both 'responses' and response_N columns: use one layout")
            return None
        value = row["responses"]
        if isinstance(value, str):  # a CSV cell
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                problems.add(n, f"'responses' is not valid JSON: {exc.msg}")
                return None
        if not isinstance(value, list):
            problems.add(n, "'responses' must be a list of texts or {text, model} objects, "
                            f"not {type(value).__name__}")
            return None
        entries = []
        for i, r in enumerate(value, 1):
            if isinstance(r, dict):
                if "text" not in r:
                    problems.add(n, f"responses[{i}] has no 'text'")
                    return None
                entries.append((r["text"], r.get("model")))
            else:
                entries.append((r, None))
        return entries
    if not wide:
        problems.add(n, f"missing 'responses' (or response_1, response_2, ... columns); columns: {sorted(row)}")
        return None
    given = [(i, key) for i, key in wide if row[key] not in (None, "")]
    numbers = [i for i, _ in given]
    odd = [key for _, key in wide if key != f"response_{int(key[9:])}" or key == "response_0"]
    if odd:
        problems.add(n, f"{odd[0]}: response columns are named response_1, response_2, ...")
        return None
    if numbers != list(range(1, len(numbers) + 1)):
        missing = next(i for i in range(1, numbers[-1]) if i not in numbers)
        problems.add(n, f"response_{missing} is empty or missing but a later response_N is given")
        return None
    models = [key for key in row if key.startswith("model_") and row[key] not in (None, "")
              and key[6:].isdigit() and int(key[6:]) > len(numbers)]
    if models:
        problems.add(n, f"{sorted(models)[0]} names the model of a response the row does not have")
        return None
    return [(row[key], row.get(f"model_{i}")) for i, key in given]


def _refuse_repeats(items: list[ItemIn], problems: Problems) -> None:
    """Record each row with the prompt and the same responses as an earlier row of the file."""
    seen: dict[tuple, int] = {}
    for item in items:
        key = (item.prompt, tuple(sorted(t for t, _ in item.responses)))
        if key in seen:
            problems.add(item.n, f"a duplicate of row {seen[key]}: the same prompt and responses")
        else:
            seen[key] = item.n
