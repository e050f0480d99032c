"""Import of items to rank (store/import_items.py): every layout, the queue serving them, the source
model travelling into pairs and exports, every refusal naming its row with nothing stored. (The
annotation tools' exports: tests/test_import_labelstudio.py, tests/test_import_argilla.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store import DataError, RankingIn
from store.export import load_pairs_snapshot
from store.import_items import import_items
from store.io import ExportOptions, export_dataset

TWO_MODELS = [
    {"prompt": "Name a prime number.", "responses": [{"text": "7 is prime.", "model": "gpt-4o"},
                                                      {"text": "9 is prime.", "model": "prod-v3"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
     "responses": [{"text": "Paris.", "model": "prod-v3"}, {"text": "Lyon.", "model": "gpt-4o"},
                   {"text": "Paris, on the Seine.", "model": "gpt-4o"}]},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _stored(store) -> dict:
    c = store.counts()
    return {k: c[k] for k in ("prompts", "responses", "items", "pairs")} | {
        "versions": len(store.list_model_versions())}


def test_items_from_two_models_are_queued_ranked_and_exported_with_their_models(store, tmp_path):
    out = import_items(store, _jsonl(tmp_path / "two_models.jsonl", TWO_MODELS))
    assert (out["rows"], out["items"], out["queued"], out["responses"]) == (2, 2, 2, 5)
    assert out["models"] == out["models_created"] == ["gpt-4o", "prod-v3"] and out["pairs"] == 0
    versions = {mv.name: mv for mv in store.list_model_versions()}
    assert {versions[n].kind for n in ("gpt-4o", "prod-v3")} == {"external"}
    assert versions[f"import:two_models.jsonl:{_sha(tmp_path / 'two_models.jsonl')[:8]}"].kind == "external"
    assert store.list_model_versions("policy") == []  # nothing to generate with
    chat = [p for p in store.list_prompts() if p.messages][0]
    assert chat.messages == TWO_MODELS[1]["messages"] and chat.text.endswith("\n\nAssistant:")

    # the queue serves them like generated items; an annotator ranks each one best-first by text
    ann = store.add_annotator("ann", "ann-password-1")
    model_of = {r["text"]: r["model"] for row in TWO_MODELS for r in row["responses"]}
    best_first = {"7 is prime.": 0, "9 is prime.": 1, "Paris, on the Seine.": 0, "Paris.": 1, "Lyon.": 2}
    ranked = 0
    while (item := store.next_item(ann.id)) is not None:
        assert len(item.responses) in (2, 3)
        order = sorted(item.responses, key=lambda r: best_first[r.text])
        store.save_ranking(RankingIn(ann.id, item.prompt.id, [r.id for r in order]))
        ranked += 1
    assert ranked == 2 and len(store.list_pairs()) == 1 + 3

    snap = export_dataset(store, tmp_path / "export", ExportOptions(format="jsonl"))
    rows = load_pairs_snapshot(snap.path)
    assert len(rows) == 4
    for r in rows:
        chosen, rejected = r["chosen"][0]["content"], r["rejected"][0]["content"]
        assert (r["chosen_model"], r["rejected_model"]) == (model_of[chosen], model_of[rejected])
        assert r["chosen_model_version"] == versions[model_of[chosen]].id
    rankings = [json.loads(line) for line in (tmp_path / "export" / "rankings" / "rankings.jsonl").open()]
    assert {x["text"]: x["model"] for k in rankings for x in k["responses"]} == model_of
    card = (tmp_path / "export" / "README.md").read_text()
    assert "gpt-4o" in card and "prod-v3" in card and "external" in card


def test_csv_one_column_per_response_and_parquet_and_unnamed_models(store, tmp_path):
    csv = tmp_path / "wide.csv"
    csv.write_text("prompt,response_1,model_1,response_2,model_2,response_3,model_3\n"
                   "Two replies,first,api-a,second,api-b,,\n"
                   '"Three, quoted",one,api-a,two,,three,api-b\n', encoding="utf-8")
    out = import_items(store, csv)
    assert (out["items"], out["responses"], out["models"]) == (2, 5, ["api-a", "api-b"])
    file_version = store.get_model_version(out["model_version_id"])
    assert file_version.name.startswith("import:wide.csv:") and file_version.meta["format"] == "items"
    by_text = {r.text: store.get_model_version(r.model_version_id).name
               for p in store.list_prompts() for r in store.prompt_responses(p.id)}
    assert by_text["first"] == by_text["one"] == "api-a" and by_text["three"] == "api-b"
    assert by_text["two"] == file_version.name  # no model named: the file's own version

    table = pa.table({"prompt": ["From parquet"],
                      "responses": [[{"text": "p1", "model": "api-a"}, {"text": "p2", "model": "api-c"}]]})
    pq.write_table(table, tmp_path / "items.parquet")
    out = import_items(store, tmp_path / "items.parquet")
    assert out["models"] == ["api-a", "api-c"] and out["models_created"] == ["api-c"]  # api-a reused
    assert store.counts()["items_remaining"] == 3


def test_a_named_policy_of_this_store_is_reused(store, store_policy, tmp_path):
    path = _jsonl(tmp_path / "ours.jsonl", [{"prompt": "q", "responses": [
        {"text": "a", "model": store_policy.name}, {"text": "b", "model": "other"}]}])
    out = import_items(store, path)
    assert out["models_created"] == ["other"]
    assert {r.model_version_id for r in store.prompt_responses(store.list_prompts()[0].id)} >= {store_policy.id}


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "q", "responses": ["only one"]}, "1 responses: an item has 2 to 16"),
    ({"prompt": "q", "responses": [f"r{i}" for i in range(17)]}, "17 responses: an item has 2 to 16"),
    ({"prompt": "q", "responses": ["a", "  "]}, "'response 2' is empty"),
    ({"prompt": "q", "responses": ["same", "other", "same"]}, "responses 1 and 3 are identical"),
    ({"prompt": "q", "responses": [{"text": "a", "model": 7}, "b"]}, "the model of response 1 must be text"),
    ({"prompt": "q", "responses": [{"model": "m"}, "b"]}, "responses[1] has no 'text'"),
    ({"prompt": "q", "responses": "not a list"}, "'responses' is not valid JSON"),
    ({"prompt": "q", "response_1": "a", "response_3": "c"}, "response_2 is empty or missing"),
    ({"prompt": "q", "response_1": "a", "response_2": "b", "model_3": "m"}, "model_3 names the model of a response"),
    ({"prompt": "q", "answers": ["a", "b"]}, "missing 'responses' (or response_1, response_2, ... columns)"),
    ({"responses": ["a", "b"]}, "missing 'prompt' (or 'messages')"),
    ({"messages": [{"role": "robot", "content": "x"}], "responses": ["a", "b"]}, "messages[0].role must be one of"),
])
def test_malformed_rows_are_refused_with_their_row_and_why(store, tmp_path, row, problem):
    before = _stored(store)
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "responses": ["x", "y"]}, row])
    with pytest.raises(DataError) as info:
        import_items(store, path)
    assert [(n, p) for n, p in info.value.errors if problem in p] and info.value.errors[0][0] == 2, info.value.errors
    assert _stored(store) == before


def test_duplicates_in_the_file_in_the_store_and_the_same_file_again_are_refused(store, tmp_path):
    rows = [{"prompt": "q1", "responses": ["a", "b"]}, {"prompt": "q2", "responses": ["c", "d"]},
            {"prompt": "q1", "responses": ["b", "a"]}]
    with pytest.raises(DataError) as info:
        import_items(store, _jsonl(tmp_path / "repeats.jsonl", rows))
    assert info.value.errors == [(3, "a duplicate of row 1: the same prompt and responses")]
    assert _stored(store)["items"] == 0

    import_items(store, _jsonl(tmp_path / "first.jsonl", rows[:2]))
    before = _stored(store)
    with pytest.raises(DataError, match="already imported") as info:
        import_items(store, tmp_path / "first.jsonl")
    assert info.value.path == str(tmp_path / "first.jsonl")
    later = [{"prompt": "q3", "responses": ["e", "f"]}, {"prompt": "q2", "responses": ["d", "c"]}]
    with pytest.raises(DataError) as info:
        import_items(store, _jsonl(tmp_path / "later.jsonl", later))
    assert len(info.value.errors) == 1 and info.value.errors[0][0] == 2 and info.value.path.endswith("later.jsonl")
    assert "already stored: item" in info.value.errors[0][1]
    assert _stored(store) == before  # q3 was not half-imported either
    # a new response to the same prompt is a new item
    assert import_items(store, _jsonl(tmp_path / "new.jsonl", [{"prompt": "q2", "responses": ["c", "z"]}]))["items"] == 1


def test_a_model_name_of_a_reward_model_is_refused(store, tmp_path):
    store.register_model_version("reward", "rm-v1")
    before = _stored(store)
    path = _jsonl(tmp_path / "rm.jsonl", [{"prompt": "q", "responses": [{"text": "a", "model": "rm-v1"}, "b"]}])
    with pytest.raises(DataError) as info:
        import_items(store, path)
    assert info.value.errors[0][0] == 1 and "'rm-v1' is a reward model version" in info.value.errors[0][1]
    assert _stored(store) == before


def test_cli_imports_and_refuses_with_the_row(tmp_path):
    db = tmp_path / "cli.duckdb"
    good = _jsonl(tmp_path / "good.jsonl", TWO_MODELS)
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "responses": ["one"]}])
    run = lambda *a: subprocess.run([sys.executable, "-m", "store", "--db", str(db), "import-items", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    ok = run(str(good))
    assert ok.returncode == 0 and json.loads(ok.stdout)["models"] == ["gpt-4o", "prod-v3"]
    refused = run(str(bad))
    assert refused.returncode == 1
    assert "nothing was stored" in refused.stderr and "row 1: 1 responses: an item has 2 to 16" in refused.stderr


def _sha(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
