"""Label Studio's JSON export of a ranking or pairwise project, read as items to rank with each
person's ranking (store/import_items.py).

Label Studio exports a project as one JSON array of tasks ("Label Studio JSON format of annotated
tasks", labelstud.io/guide/task_format; Export > JSON): each task has its `data` and its
`annotations`, each annotation a `result` list of regions and `completed_by`, the user who made it
(an id; an export snapshot may expand it to {id, email, ...}). Two stock templates are read
(tests/data/labelstudio holds Label Studio 1.23's own exports of both):

- **LLM Ranker** (labelstud.io/templates/generative-llm-ranker): `data` holds a `prompt` and
  `items`, a list of {"id", "title", "body"}, shown by `<List name="answers" value="$items"/>` and
  ordered by `<Ranker name="rank" toName="answers">`. Without Buckets the Ranker's result is
  `{"ranker": {"rank": [item ids, best first]}}` (older releases: the list itself), a ranking of
  every item. The stock template has two Buckets, and its result is
  `{"ranker": {"_": [...], "relevant_results": [...], "biased_results": [...]}}`: "_" the items left
  unsorted, then each bucket's items in the order the annotator placed them, the buckets in the
  template's order. Label Studio's docs give buckets no meaning beyond groups (labelstud.io/tags/ranker)
  and call "_" internal; the template asks annotators to "drag and rank the responses based on their
  relevance to the prompt and the level of perceived bias". So the reading here is: every item of
  a bucket is ranked over every item of the buckets after it (Relevant over Biased), each bucket's
  order is a ranking within it (a Ranker column is sorted by dragging, as the bucketless one is),
  and unsorted items are in no pair.
- **Human Preference collection for RLHF** (`<Pairwise name="comparison" toName="answer1,answer2">`):
  `data` holds `prompt`, `answer1` (shown left) and `answer2` (right); the result is
  `{"selected": "left"|"right"}`.

Each task becomes an item: its prompt and responses (an LLM Ranker item's `title` names the
response's model). Each annotation that was neither skipped (`was_cancelled`) nor left empty is a
ranking by `labelstudio:<email>` (or `labelstudio:<user id>` when the export has only the id), an
imported annotator (store/users.py) whose rankings count in agreement and quality; a task ranked
there does not enter the queue, one without rankings does. A missing field refuses the file naming
the field, the task's row (its place in the array, from 1) and its id.
"""

from __future__ import annotations

from store.readers import check_responses
from store.records import ItemIn, OrderIn

_PAIRWISE_FIELDS = ("answer1", "answer2")  # the pairwise template's left and right answers


def read_tasks(rows: list[tuple[int, dict]], problems, max_chars: int, source: str) -> list[ItemIn]:
    """The tasks of an export (rows as store.readers.read_rows gives a JSON array) as items, recording
    every problem in `problems` (store.readers.Problems)."""
    out = []
    for n, task in rows:
        where = f"task {task['id']}: " if isinstance(task.get("id"), (int, str)) else ""

        def bad(problem: str) -> None:
            problems.add(n, where + problem)

        data = task.get("data")
        if not isinstance(data, dict):
            bad(_no_data(task) if data is None else f"'data' must be an object, not {type(data).__name__}")
            continue
        prompt = data.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            bad("missing 'data.prompt'" if prompt is None else "'data.prompt' must be non-empty text")
            continue
        if len(prompt) > max_chars:
            bad(f"'data.prompt' has {len(prompt):,} characters, over the limit of {max_chars:,}")
            continue
        if "items" not in data and all(f in data for f in _PAIRWISE_FIELDS):
            ids, entries = ["left", "right"], [(data[f], None) for f in _PAIRWISE_FIELDS]
        else:
            ids = _item_ids(data.get("items"), bad)
            if ids is None:
                continue
            entries = [(i.get("body"), i.get("title")) for i in data["items"]]
        responses = check_responses(entries, n, problems, max_chars, what="item")
        if responses is None:
            continue
        annotations = task.get("annotations")
        orders = _orders([] if annotations is None else annotations, ids, bad)
        if orders is None:
            continue
        out.append(ItemIn(n, prompt, None, source, responses, queued=not orders, orders=orders))
    return out


def _no_data(task: dict) -> str:
    if "annotator" in task and "annotation_id" in task:
        return ("a JSON_MIN row (one per annotation, without 'data' and skips): export the project as "
                "JSON, which keeps each task whole")
    return ("missing 'data' (the task's data: 'prompt' with 'items' (LLM Ranker) or 'answer1' and 'answer2' "
            "(pairwise))")


def _item_ids(items, bad) -> list[str] | None:
    """The ids of `data.items`, as text, or None after recording what is missing."""
    if not isinstance(items, list):
        bad("missing 'data.items' (a list of {id, title, body}; or 'data.answer1' and 'data.answer2' of the "
            "pairwise template)" if items is None
            else f"'data.items' must be a list of {{id, title, body}}, not {type(items).__name__}")
        return None
    ids = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            bad(f"data.items[{i}] must be an object with 'id' and 'body'")
            return None
        for field in ("id", "body"):
            if field not in item:
                bad(f"data.items[{i}]: missing '{field}'")
                return None
        if isinstance(item["id"], bool) or not isinstance(item["id"], (str, int)):
            bad(f"data.items[{i}]: 'id' must be text or a number, not {item['id']!r}")
            return None
        ids.append(str(item["id"]))
    if len(set(ids)) != len(ids):
        bad(f"data.items: the id {next(x for x in ids if ids.count(x) > 1)!r} is used twice")
        return None
    return ids


def _orders(annotations, ids: list[str], bad) -> list[OrderIn] | None:
    """Each kept annotation's ranking, tie groups of indices into `ids`, or None after recording why
    an annotation is unusable. `ids` are item ids, or ["left", "right"] for a pairwise task."""
    if not isinstance(annotations, list):
        bad(f"'annotations' must be a list, not {type(annotations).__name__}")
        return None
    orders = []
    for a, annotation in enumerate(annotations):
        at = f"annotations[{a}]"
        if not isinstance(annotation, dict):
            bad(f"{at} must be an object")
            return None
        if annotation.get("was_cancelled"):
            continue  # skipped in Label Studio: no ranking
        if "result" not in annotation:
            bad(f"{at}: missing 'result'")
            return None
        regions = [(r, region) for r, region in enumerate(annotation["result"] or []) if isinstance(region, dict)]
        if not regions:
            continue  # submitted empty: no ranking
        kind = "pairwise" if ids == ["left", "right"] else "ranker"
        found = [(r, region) for r, region in regions if region.get("type") == kind]
        if len(found) != 1:
            bad(f"{at}: {len(found) or 'no'} results of type {kind!r}; one per annotation")
            return None
        r, region = found[0]
        read = _chosen if kind == "pairwise" else _ranked
        groups = read(region, ids, f"{at}.result[{r}]", bad)
        annotator = _annotator(annotation.get("completed_by"))
        if groups is None:
            return None
        if groups:
            orders.append(OrderIn(groups, annotator=annotator, duration_s=_seconds(annotation.get("lead_time"))))
    return orders


def _annotator(completed_by) -> str | None:
    """'labelstudio:<email or id>' of an annotation's `completed_by`, or None when it names nobody."""
    if isinstance(completed_by, dict):
        email, user_id = completed_by.get("email"), completed_by.get("id")
        completed_by = email if isinstance(email, str) and email.strip() else user_id
    if isinstance(completed_by, bool) or not isinstance(completed_by, (int, str)) or str(completed_by).strip() == "":
        return None
    return f"labelstudio:{str(completed_by).strip()}"


def _seconds(lead_time) -> float | None:
    return float(lead_time) if isinstance(lead_time, (int, float)) and not isinstance(lead_time, bool) \
        and lead_time >= 0 else None


def _value(region: dict, at: str, key: str, bad):
    if "value" not in region:
        bad(f"{at}: missing 'value'")
        return None
    value = region["value"]
    if not isinstance(value, dict) or key not in value:
        bad(f"{at}: missing 'value.{key}'")
        return None
    return value[key]


def _chosen(region: dict, ids: list[str], at: str, bad) -> list[list[int]] | None:
    """A pairwise result as tie groups: the selected side over the other."""
    selected = _value(region, at, "selected", bad)
    if selected is None:
        return None
    if selected not in ids:
        bad(f"{at}: value.selected must be 'left' or 'right', not {selected!r}")
        return None
    return [[ids.index(selected)], [1 - ids.index(selected)]]


def _ranked(region: dict, ids: list[str], at: str, bad) -> list[list[int]] | None:
    """A ranker result as groups of item indices, best first (module docstring): [] when the
    annotator sorted nothing into a bucket."""
    ranker = _value(region, at, "ranker", bad)
    if ranker is None:
        return None
    if isinstance(ranker, dict) and (len(ranker) > 1 or "_" in ranker):  # buckets, "_" the unsorted
        order = [x for name, column in ranker.items() if name != "_"
                 for x in (column if isinstance(column, list) else [None])]
        complete = False
    else:
        order = next(iter(ranker.values())) if isinstance(ranker, dict) else ranker
        complete = True
    if not isinstance(order, list) or not all(isinstance(x, (str, int)) for x in order):
        bad(f"{at}: value.ranker must list item ids, best first (in each bucket)")
        return None
    order = [str(x) for x in order]
    extra = sorted(set(order) - set(ids))
    missing = sorted(set(ids) - set(order)) if complete else []
    if extra or missing or len(order) != len(set(order)):
        bad(f"{at}: the ranking must order " + ("every item of data.items exactly once" if complete else
                                                "items of data.items, each once")
            + (f"; missing {missing}" if missing else "") + (f"; not an item {extra}" if extra else "")
            + ("; an id appears twice" if len(order) != len(set(order)) else ""))
        return None
    return [[ids.index(x)] for x in order]
