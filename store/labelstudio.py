"""Label Studio's JSON export of a ranking project, read as items to rank (store/import_items.py).

Label Studio exports a project as one JSON array of tasks ("Label Studio JSON format of annotated
tasks", labelstud.io/guide/task_format): each task has its `data` and its `annotations`, each
annotation a `result` list of regions. A ranking project is the LLM Ranker layout
(labelstud.io/templates/generative-llm-ranker): `data` holds a `prompt` and `items`, a list of
{"id", "title", "body"}, shown by `<List name="answers" value="$items"/>` and ordered by
`<Ranker name="rank" toName="answers"/>`. The Ranker's result (labelstud.io/tags/ranker) is

    {"from_name": "rank", "to_name": "answers", "type": "ranker",
     "value": {"ranker": {"rank": ["llm_2", "llm_1", "llm_3"]}}}

a dict with one key, the Ranker's name, holding the item ids best first (older releases saved the
list itself: "value": {"ranker": ["llm_2", ...]}). A Ranker with Buckets sorts items into named
groups, which is no order, and is refused.

Each task becomes an item: its prompt, each item's `body` a response, its `title` the response's
model name (the template titles items by the model that wrote them). Each annotation that was not
cancelled must hold a full ranking of the task's items; it is stored as the pairs of that order
(no annotator here knows who ranked it), and a task ranked there does not enter the queue. A task
without annotations enters the queue. A missing field refuses the file naming the field, the
task's row (its place in the array, from 1) and its id.
"""

from __future__ import annotations

from store.readers import check_responses
from store.records import ItemIn, OrderIn


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
            bad("missing 'data' (the task's data: 'prompt' and 'items')" if data is None
                else f"'data' must be an object, not {type(data).__name__}")
            continue
        prompt, items = data.get("prompt"), data.get("items")
        if not isinstance(prompt, str) or not prompt.strip():
            bad("missing 'data.prompt'" if prompt is None else "'data.prompt' must be non-empty text")
            continue
        if len(prompt) > max_chars:
            bad(f"'data.prompt' has {len(prompt):,} characters, over the limit of {max_chars:,}")
            continue
        ids = _item_ids(items, bad)
        if ids is None:
            continue
        responses = check_responses([(i.get("body"), i.get("title")) for i in items], n, problems, max_chars,
                                    what="item")
        if responses is None:
            continue
        annotations = task.get("annotations")
        orders = _orders([] if annotations is None else annotations, ids, bad)
        if orders is None:
            continue
        out.append(ItemIn(n, prompt, None, source, responses, queued=not orders, orders=orders))
    return out


def _item_ids(items, bad) -> list[str] | None:
    """The ids of `data.items`, as text, or None after recording what is missing."""
    if not isinstance(items, list):
        bad("missing 'data.items' (a list of {id, title, body})" if items is None
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


def _orders(annotations, ids: list[str], bad) -> list[list[list[int]]] | None:
    """Each kept annotation's ranking as tie groups of item indices, or None after recording why
    an annotation is unusable."""
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
        rankers = [(r, region) for r, region in enumerate(annotation["result"] or [])
                   if isinstance(region, dict) and region.get("type") == "ranker"]
        if not rankers:
            bad(f"{at}: no result of type 'ranker' (a ranking project's annotations hold one)")
            return None
        if len(rankers) > 1:
            bad(f"{at}: {len(rankers)} ranker results; one ranking per annotation")
            return None
        r, region = rankers[0]
        order = _ranked_ids(region, f"{at}.result[{r}]", bad)
        if order is None:
            return None
        if sorted(order) != sorted(ids):
            missing, extra = sorted(set(ids) - set(order)), sorted(set(order) - set(ids))
            bad(f"{at}.result[{r}]: the ranking must order every item of data.items exactly once"
                + (f"; missing {missing}" if missing else "") + (f"; not an item {extra}" if extra else "")
                + ("; an id appears twice" if len(order) != len(set(order)) else ""))
            return None
        orders.append(OrderIn([[ids.index(x)] for x in order]))
    return orders


def _ranked_ids(region: dict, at: str, bad) -> list[str] | None:
    """The item ids a ranker result orders, best first."""
    if "value" not in region:
        bad(f"{at}: missing 'value'")
        return None
    value = region["value"]
    if not isinstance(value, dict) or "ranker" not in value:
        bad(f"{at}: missing 'value.ranker'")
        return None
    ranker = value["ranker"]
    if isinstance(ranker, dict):
        if len(ranker) != 1 or "_" in ranker:
            bad(f"{at}: value.ranker holds buckets {sorted(ranker)}: a Ranker with Buckets groups items "
                "without ordering them; export a project whose Ranker has no Buckets")
            return None
        ranker = next(iter(ranker.values()))
    if not isinstance(ranker, list) or not all(isinstance(x, (str, int)) for x in ranker):
        bad(f"{at}: value.ranker must list item ids, best first")
        return None
    return [str(x) for x in ranker]
