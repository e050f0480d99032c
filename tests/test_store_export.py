"""Export: TRL columns, round trip through every format, filters, split by prompt, snapshots."""

import json
from datetime import datetime, timedelta, timezone

import pytest

from store import InvalidRequest
from store.export import COLUMNS, load_pairs_snapshot, snapshot_sha256
from store.io import export_pairs, import_pairs
from tests.fixtures_store import seed_items


@pytest.fixture
def ranked(store, store_annotators, tmp_path):
    """Round 1: 4 items of K=3. ann0 ranks all four (the last 'all bad'); ann1 ranks item 0 the
    same way and item 1 the other way. Plus one imported TRL pair."""
    rnd = store.create_round()
    items = seed_items(store, 4, 3, round_id=rnd.id)
    a, b = store_annotators
    for i, it in enumerate(items):
        store.save_ranking(a.id, it.prompt_id, it.response_ids, all_bad=(i == 3))
    store.save_ranking(b.id, items[0].prompt_id, items[0].response_ids)
    store.save_ranking(b.id, items[1].prompt_id, list(reversed(items[1].response_ids)))
    trl = tmp_path / "trl.jsonl"
    trl.write_text(json.dumps({"prompt": "Q?", "chosen": "good", "rejected": "bad"}) + "\n", encoding="utf-8")
    import_pairs(store, trl)
    return rnd, items


def test_jsonl_rows_are_trl_explicit_with_ids(store, ranked, tmp_path):
    rnd, items = ranked
    snap = export_pairs(store, tmp_path / "out.jsonl", "jsonl")
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert list(rows[0]) == COLUMNS
    # 6 rankings x 3 pairs, minus the all-bad ranking's 3, plus 1 imported
    assert len(rows) == snap.counts["pairs"] == 6 * 3 - 3 + 1
    first = rows[0]
    r0 = store.get_response(first["chosen_id"])
    assert first["chosen"] == r0.text and first["prompt"] == store.get_prompt(first["prompt_id"]).text
    assert first["chosen_model_version"] == r0.model_version_id and first["annotator"] == "ann0"
    assert first["margin"] == 1.0 and first["round"] == rnd.id and first["split"] == "train"
    imported = [r for r in rows if r["ranking_id"] is None]
    assert [(r["prompt"], r["chosen"], r["rejected"], r["annotator"]) for r in imported] == [
        ("Q?", "good", "bad", None)]
    assert snap.counts["imported"] == 1 and snap.counts["annotators"] == 2


def test_round_trip_parquet_and_datasets(store, ranked, tmp_path):
    import datasets

    ref = load_pairs_snapshot(export_pairs(store, tmp_path / "a.jsonl", "jsonl").path)
    pq_rows = load_pairs_snapshot(export_pairs(store, tmp_path / "a.parquet", "parquet").path)
    snap = export_pairs(store, tmp_path / "ds", "datasets")
    loaded = datasets.load_from_disk(str(tmp_path / "ds"))
    assert list(loaded) == ["train"] and loaded["train"].column_names == COLUMNS
    assert loaded["train"].to_list() == ref == pq_rows
    assert load_pairs_snapshot(snap.path) == ref
    assert snapshot_sha256(snap.path) == snap.sha256
    manifest = json.loads((tmp_path / "ds" / "snapshot.json").read_text())
    assert manifest["snapshot_id"] == snap.id and manifest["sha256"] == snap.sha256


def test_split_by_prompt_is_disjoint_and_recorded(store, ranked, tmp_path):
    import datasets

    snap = export_pairs(store, tmp_path / "ds", "datasets", test_fraction=0.4, seed=3)
    dd = datasets.load_from_disk(str(tmp_path / "ds"))
    train, test = dd["train"], dd["test"]
    assert set(train["prompt_id"]).isdisjoint(test["prompt_id"])
    assert len(set(test["prompt_id"])) == 2  # round(0.4 * 4 distinct prompts) = 2 (all-bad item left out)
    assert snap.counts["train"] == len(train) and snap.counts["test"] == len(test)
    assert store.get_snapshot(snap.id).filters["test_fraction"] == 0.4
    again = export_pairs(store, tmp_path / "again.jsonl", "jsonl", test_fraction=0.4, seed=3)
    rows = load_pairs_snapshot(again.path, split="test")
    assert {r["prompt_id"] for r in rows} == set(test["prompt_id"])  # same seed, same split


def test_filters(store, ranked, tmp_path):
    rnd, items = ranked

    def n(**kw):
        return export_pairs(store, tmp_path / f"f{len(store.list_snapshots())}.jsonl", "jsonl", **kw).counts["pairs"]

    assert n(include_all_bad=True) == 6 * 3 + 1
    assert n(include_imported=False) == 15
    assert n(annotators=["ann1"]) == 6
    assert n(rounds=[rnd.id]) == 15
    with pytest.raises(InvalidRequest, match="no pairs match"):
        n(rounds=rnd.id + 1)
    # item 0: both agree on every pair (1.0); item 1: they disagree on every pair (0.5 each)
    assert n(min_agreement=1.0) == 3 + 3 + 3 + 1  # item 0 by both, item 2 by ann0, imported
    now = datetime.now(timezone.utc)
    with pytest.raises(InvalidRequest, match="no pairs match"):
        n(since=now + timedelta(hours=1))
    assert n(until=now + timedelta(hours=1)) == 16
    assert n(since=(now - timedelta(days=1)).date().isoformat()) == 16
    with pytest.raises(InvalidRequest, match="no annotator"):
        n(annotators=["nobody"])
    with pytest.raises(InvalidRequest, match="min_agreement"):
        n(min_agreement=2)


def test_snapshots_are_recorded_and_outputs_protected(store, ranked, tmp_path):
    out = tmp_path / "o.parquet"
    snap = export_pairs(store, out, "parquet", annotators=["ann0"])
    assert store.list_snapshots() == [snap]
    assert snap.filters["annotators"] == ["ann0"] and snap.format == "parquet"
    assert (tmp_path / "o.parquet.snapshot.json").is_file()
    with pytest.raises(InvalidRequest, match="already exists"):
        export_pairs(store, out, "parquet")
    again = export_pairs(store, out, "parquet", annotators=["ann0"], overwrite=True)
    assert again.sha256 == snap.sha256 and again.id != snap.id  # same data, same hash
    with pytest.raises(InvalidRequest, match="format"):
        export_pairs(store, tmp_path / "x.csv", "csv")
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary leftovers
    # the reward model names its data
    rm = store.register_model_version("reward", snapshot_id=snap.id)
    assert store.get_model_version(rm.id).snapshot_id == snap.id
