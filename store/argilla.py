"""An Argilla 2.x ranking dataset, read as items to rank with each person's ranking (store/import_items.py).

Argilla keeps a record's fields (a prompt and the responses to rank, each a text field) and, per
question, each user's response with its status. A ranking question's response, as the server
stores it and as the UI's "Export to Hub" writes it (the Hub dataset's `data/*.parquet` beside
`.argilla/settings.json`), is a list of {"value": <option>, "rank": <1 = best, or null when the
user left the option unranked>} in the question's option order; ties share a rank. The flat rows
have the columns

    prompt, response-1, ..., <question>.responses, <question>.responses.users, <question>.responses.status

(the users are Argilla user ids; the status is submitted, draft or discarded). Each record becomes
an item: its prompt, and one response per option of the ranking question, the text of the field the
option names. Each submitted response is a ranking by `argilla:<user id>` (an imported annotator,
store/users.py): the ranked options in rank order, equal ranks tied, unranked options left out.
Drafts and discarded responses are left out, and so are suggestions (a model's ranking, not a
person's). A record without a submitted ranking enters the queue.

Argilla's SDK exports (`Dataset.to_disk`, `records.to_datasets()`, `records.to_list()`,
`Dataset.to_hub`) write each ranking as a plain list of option values: they drop the ranks, so a
ranking made in Argilla's UI comes out in the question's option order whatever the person chose
(argilla-io/argilla#5712), and `to_disk` drops the statuses too. Such a file is refused when it
holds rankings, naming the record, rather than read as preferences nobody expressed; its records
without rankings import as items to rank.

Input: the Hub export's folder (its settings name the ranking question, its options and the
prompt field), or its rows as one Parquet, JSON Lines or JSON file (the question is the one
`<name>.responses` column, its options the values its rankings name, the prompt field `prompt`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from store.errors import DataError
from store.readers import Problems, check_responses, read_rows, text_field
from store.records import ItemIn, OrderIn

_STATUSES = ("submitted", "draft", "discarded")


def read_records(path: Path, problems: Problems, max_chars: int, source: str,
                 max_bytes: int) -> tuple[list[ItemIn], str]:
    """(the records as items, recording every problem in `problems`; the SHA-256 of the rows'
    bytes) of an Argilla export (module docstring)."""
    files, settings = _files(path)
    rows, digest, offset = [], hashlib.sha256(), 0
    for file in files:
        rows += [(offset + n, row) for n, row in read_rows(file, max_bytes=max_bytes)]
        offset = len(rows)
        digest.update(file.read_bytes())
    question, options, prompt_field = _layout(path, rows, settings)
    out = []
    for n, row in rows:
        item = _record(row, n, problems, max_chars, source, question, options, prompt_field)
        if item is not None:
            out.append(item)
    return out, digest.hexdigest()


def _files(path: Path) -> tuple[list[Path], dict | None]:
    """(the rows' files, the dataset's settings or None) of a Hub export folder or a rows file."""
    if not path.is_dir():
        return [path], None
    files = sorted((path / "data").glob("*.parquet"))
    if not files and (path / "records.json").exists():
        raise DataError(str(path), [(None, "a Dataset.to_disk folder: its rankings have neither ranks nor statuses "
                                           "(Argilla's SDK drops them, argilla-io/argilla#5712); export the dataset "
                                           "with the UI's 'Export to Hub' instead")])
    if not files:
        raise DataError(str(path), [(None, "no data/*.parquet: give the folder of Argilla's Hub export "
                                           "(data/ and .argilla/settings.json) or one file of its rows")])
    settings_file = path / ".argilla" / "settings.json"
    try:
        settings = json.loads(settings_file.read_text(encoding="utf-8")) if settings_file.exists() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(str(settings_file), [(None, f"unreadable settings: {exc}")]) from None
    return files, settings


def _layout(path: Path, rows: list[tuple[int, dict]], settings: dict | None) -> tuple[str, list[str], str]:
    """(the ranking question's name, its options in order, the prompt field's name)."""
    def refuse(problem: str):
        raise DataError(str(path), [(None, problem)])

    if settings is not None:
        questions = [q for q in settings.get("questions") or [] if (q.get("settings") or {}).get("type") == "ranking"]
        if len(questions) != 1:
            refuse(f"the dataset has {len(questions)} ranking questions in .argilla/settings.json; one is read")
        options = [o.get("value") for o in questions[0]["settings"].get("options") or []]
        fields = [f.get("name") for f in settings.get("fields") or []
                  if (f.get("settings") or {}).get("type") == "text" and f.get("name") not in options]
        prompt_field = "prompt" if "prompt" in fields or len(fields) != 1 else fields[0]
        return questions[0]["name"], options, prompt_field
    columns = {c for _, row in rows for c in row}
    questions = sorted(c[: -len(".responses")] for c in columns if c.endswith(".responses"))
    if len(questions) != 1:
        refuse(f"{len(questions)} columns '<question>.responses' {questions}: an Argilla ranking dataset's rows "
               "have one (or give the export's folder, whose settings name the question)")
    options: list[str] = []
    for _, row in rows:
        rankings = row.get(f"{questions[0]}.responses")
        for ranking in rankings if isinstance(rankings, list) else []:
            for entry in ranking if isinstance(ranking, list) else []:
                value = entry.get("value") if isinstance(entry, dict) else entry
                if isinstance(value, str) and value not in options:
                    options.append(value)
    if not options:
        refuse(f"no ranking in '{questions[0]}.responses' names the options: give the export's folder, whose "
               ".argilla/settings.json lists them")
    return questions[0], options, "prompt"


def _record(row: dict, n: int, problems: Problems, max_chars: int, source: str, question: str,
            options: list[str], prompt_field: str) -> ItemIn | None:
    where = f"record {row['id']}: " if isinstance(row.get("id"), (str, int)) else ""

    def bad(problem: str) -> None:
        problems.add(n, where + problem)

    prompt = text_field(row, prompt_field, n, problems, max_chars)
    missing = [o for o in options if o not in row]
    if missing:
        bad(f"the ranking's options {missing} name no field of the record: Argilla's ranking options "
            "must be the names of the response fields")
        return None
    if prompt is None:
        return None
    responses = check_responses([(row[o], None) for o in options], n, problems, max_chars)
    orders = _orders(row, question, options, bad)
    if responses is None or orders is None:
        return None
    return ItemIn(n, prompt, None, source, responses, queued=not orders, orders=orders)


def _orders(row: dict, question: str, options: list[str], bad) -> list[OrderIn] | None:
    """The record's submitted rankings, or None after recording why one is unusable."""
    col = f"{question}.responses"
    values, users, statuses = (row.get(c) if row.get(c) is not None else [] for c in (col, f"{col}.users",
                                                                                      f"{col}.status"))
    if not all(isinstance(v, list) for v in (values, users, statuses)):
        bad(f"'{col}', '{col}.users' and '{col}.status' must be lists (one entry per user's response)")
        return None
    if not (len(values) == len(users) == len(statuses)):
        bad(f"'{col}' has {len(values)} responses, '{col}.users' {len(users)} and '{col}.status' {len(statuses)}: "
            "one user and one status per response")
        return None
    orders = []
    for i, (value, user, status) in enumerate(zip(values, users, statuses)):
        at = f"{col}[{i}]"
        if status not in _STATUSES:
            bad(f"{at}: status {status!r} is not one of {_STATUSES}")
            return None
        if status != "submitted":
            continue
        if not isinstance(user, str) or not user:
            bad(f"{at}: no user in '{col}.users'")
            return None
        if not isinstance(value, list) or not value or not all(isinstance(e, dict) for e in value):
            bad(f"{at}: a ranking without ranks ({value!r}): Argilla's SDK exports drop each option's rank "
                "(argilla-io/argilla#5712), so a ranking made in its UI comes out in the options' order; "
                "export the dataset with the UI's 'Export to Hub' instead")
            return None
        ranks = {}
        for e in value:
            rank = e.get("rank")
            if e.get("value") not in options or (rank is not None and (type(rank) is not int or rank < 1)):
                bad(f"{at}: {e!r} is not {{value: one of {options}, rank: a whole number or null}}")
                return None
            if rank is not None:
                ranks[options.index(e["value"])] = rank
        groups = [[o for o in sorted(ranks) if ranks[o] == r] for r in sorted(set(ranks.values()))]
        if groups:
            orders.append(OrderIn(groups, annotator=f"argilla:{user}"))
    return orders
