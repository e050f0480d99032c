"""Import of a Label Studio project (store/labelstudio.py), on exports Label Studio 1.23 itself wrote
(tests/data/labelstudio/README.md): the stock LLM Ranker template with its buckets and the pairwise
RLHF template, each annotation a ranking of the person who made it (their agreement computed like
anyone's), skipped and unannotated tasks, the older list result, and every missing field refused
naming it with nothing stored."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from store import DataError
from store.export import load_pairs_snapshot
from store.import_items import import_items
from store.io import ExportOptions, export_dataset

DATA = Path(__file__).parent / "data" / "labelstudio"
RANKER = json.loads((DATA / "llm_ranker_export.json").read_text())


def _pairs(store) -> set[tuple[str, str, str, float]]:
    """(annotator, chosen, rejected, margin) of the stored pairs; texts as item ids / sides."""
    def key(response_id):
        text = store.get_response(response_id).text
        return _ids.get(text, text)
    return {(store.get_annotator(p.annotator_id).name, key(p.chosen_id), key(p.rejected_id), p.margin)
            for p in store.list_pairs()}


# every response text of the fixtures -> its item id ("left"/"right" for the pairwise answers)
_ids = {i["body"]: i["id"] for t in RANKER for i in t["data"]["items"]}
_ids.update({t["data"][f]: side for t in json.loads((DATA / "pairwise_export_all_tasks.json").read_text())
             for f, side in (("answer1", "left"), ("answer2", "right"))})


def _file(tmp_path, tasks, name="project-1-at-2026-12-05.json"):
    path = tmp_path / name
    path.write_text(json.dumps(tasks, indent=2), encoding="utf-8")
    return path


@pytest.mark.parametrize("name", ["llm_ranker_export.json", "llm_ranker_export_all_tasks.json"])
def test_the_stock_llm_ranker_with_buckets_reads_relevant_over_biased(store, name):
    """Task 1: alice sorted llama, opossum into Relevant and cobra into Biased; bob left opossum
    unsorted. Task 2: alice sorted; bob skipped. Task 3 (only in the all-tasks export): unannotated."""
    out = import_items(store, DATA / name, fmt="labelstudio")
    all_tasks = name.endswith("all_tasks.json")
    assert (out["items"], out["queued"], out["rankings"]) == (2 + all_tasks, int(all_tasks), 3)
    assert out["annotators"] == out["annotators_created"] == ["labelstudio:1", "labelstudio:2"]
    # each item's title names the model that wrote it (the template's titles are model names)
    titles = {i["title"] for t in json.loads((DATA / name).read_text()) for i in t["data"]["items"]}
    assert out["models"] == sorted(titles) and len(titles) == 3 * out["items"]
    alice, bob = "labelstudio:1", "labelstudio:2"
    assert _pairs(store) == {
        (alice, "llama_model", "opossum_logic", 1.0), (alice, "llama_model", "cobra_ai", 2.0),
        (alice, "opossum_logic", "cobra_ai", 1.0),
        (bob, "llama_model", "cobra_ai", 1.0),  # opossum_logic unsorted: in no pair
        (alice, "turtle_mind", "eagle_algorithm", 1.0), (alice, "turtle_mind", "puma_intelligence", 2.0),
        (alice, "eagle_algorithm", "puma_intelligence", 1.0),
    }
    # the two people agree on the one pair both ordered; their time per task came in with them
    agreement = store.agreement()
    assert (agreement.items, agreement.comparisons, agreement.pairwise_agreement) == (1, 1, 1.0)
    assert sorted(r.duration_s for r in store.list_rankings()) == [27.118, 35.204, 41.532]


def test_the_pairwise_rlhf_template_and_who_made_each_choice(store, tmp_path):
    """Task 4: alice chose left, bob right; task 5: alice left, bob skipped; task 6 unannotated."""
    out = import_items(store, DATA / "pairwise_export_all_tasks.json", fmt="labelstudio")
    assert (out["items"], out["queued"], out["rankings"], out["pairs"]) == (3, 1, 3, 3)
    assert _pairs(store) == {("labelstudio:1", "left", "right", 1.0), ("labelstudio:2", "right", "left", 1.0),
                             ("labelstudio:1", "left", "right", 1.0)} and len(store.list_pairs()) == 3
    agreement = store.agreement()
    assert (agreement.items, agreement.comparisons, agreement.pairwise_agreement) == (1, 1, 0.0)
    rows = load_pairs_snapshot(export_dataset(store, tmp_path / "export", ExportOptions(format="jsonl")).path)
    assert sorted(r["annotator"] for r in rows) == ["labelstudio:1", "labelstudio:1", "labelstudio:2"]


def test_an_expanded_completed_by_names_the_person_by_email(store):
    out = import_items(store, DATA / "pairwise_export_snapshot_completed_by_expanded.json", fmt="labelstudio")
    assert out["annotators"] == ["labelstudio:alice@example.com", "labelstudio:bob@example.com"]
    account = store.find_annotator("labelstudio:alice@example.com")
    assert not account.active and store.authenticate(account.name, "") is None  # nobody signs in as them


def test_a_json_min_export_is_refused_saying_which_export_to_use(store):
    with pytest.raises(DataError) as refused:
        import_items(store, DATA / "pairwise_export_min.json", fmt="labelstudio")
    assert "a JSON_MIN row" in refused.value.errors[0][1] and "export the project as JSON" in refused.value.errors[0][1]
    assert store.counts()["items"] == 0


def test_a_ranker_without_buckets_and_the_older_list_result(store, tmp_path):
    tasks = copy.deepcopy(RANKER[:1])
    first, second = tasks[0]["annotations"]
    first["result"][0]["value"] = {"ranker": {"rank": ["cobra_ai", "llama_model", "opossum_logic"]}}
    second["result"][0]["value"] = {"ranker": ["opossum_logic", "cobra_ai", "llama_model"]}  # older releases
    tasks[0]["annotations"].append(copy.deepcopy(first) | {"result": [], "completed_by": 3})  # submitted empty
    out = import_items(store, _file(tmp_path, tasks), fmt="labelstudio")
    assert out["rankings"] == 2 and out["pairs"] == 6 and out["annotators"] == ["labelstudio:1", "labelstudio:2"]
    assert ("labelstudio:2", "opossum_logic", "llama_model", 2.0) in _pairs(store)


def _without(path: list):
    """A copy of the ranker export with the field at `path` (keys and list indices) removed."""
    tasks = copy.deepcopy(RANKER)
    parent = tasks
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return tasks


@pytest.mark.parametrize("path, problem", [
    ([0, "data"], "task 1: missing 'data'"),
    ([0, "data", "prompt"], "task 1: missing 'data.prompt'"),
    ([0, "data", "items"], "task 1: missing 'data.items'"),
    ([0, "data", "items", 1, "body"], "task 1: data.items[1]: missing 'body'"),
    ([0, "data", "items", 0, "id"], "task 1: data.items[0]: missing 'id'"),
    ([0, "annotations", 0, "result"], "task 1: annotations[0]: missing 'result'"),
    ([0, "annotations", 0, "result", 0, "value"], "task 1: annotations[0].result[0]: missing 'value'"),
    ([0, "annotations", 0, "result", 0, "value", "ranker"], "task 1: annotations[0].result[0]: missing 'value.ranker'"),
    ([0, "annotations", 0, "result", 0, "type"], "task 1: annotations[0]: no results of type 'ranker'"),
])
def test_a_missing_field_is_refused_naming_it(store, tmp_path, path, problem):
    with pytest.raises(DataError) as info:
        import_items(store, _file(tmp_path, _without(path)), fmt="labelstudio")
    (row, message), = info.value.errors
    assert row == 1 and message.startswith(problem), message
    assert store.counts()["items"] == 0 and store.list_model_versions() == [] and store.list_annotators() == []


def test_a_ranking_naming_other_items_is_refused(store, tmp_path):
    tasks = copy.deepcopy(RANKER)
    tasks[0]["annotations"][0]["result"][0]["value"] = {"ranker": {"rank": ["llama_model", "nine"]}}
    tasks[1]["annotations"][0]["result"][0]["value"]["ranker"]["biased_results"] = ["turtle_mind"]
    with pytest.raises(DataError) as info:
        import_items(store, _file(tmp_path, tasks), fmt="labelstudio")
    (n1, p1), (n2, p2) = info.value.errors
    assert n1 == 1 and "must order every item of data.items exactly once; missing ['cobra_ai', 'opossum_logic']" in p1
    assert "not an item ['nine']" in p1
    assert n2 == 2 and "task 2: annotations[0].result[0]" in p2 and "an id appears twice" in p2
    assert store.counts()["items"] == 0
