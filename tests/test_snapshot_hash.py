"""One snapshot hash: what train-reward records in config.json is the store's snapshot sha256."""

from __future__ import annotations

import json

import pytest

from pipeline.__main__ import main as cli
from formats.hashing import snapshot_sha256
from store import RankingIn
from store.export import export_dataset
from store.export_options import ExportOptions
from tests.fixtures_store import seed_items


@pytest.fixture
def ranked_store(store, store_annotators):
    items = seed_items(store, 4, 3)
    for it in items:
        store.save_ranking(RankingIn(store_annotators[0].id, it.prompt_id, it.response_ids))
    return store


@pytest.mark.parametrize("fmt, name", [("parquet", "pairs.parquet"), ("jsonl", "pairs.jsonl"), ("datasets", "ds")])
def test_export_records_the_shared_hash(ranked_store, tmp_path, fmt, name):
    snap = export_dataset(ranked_store, tmp_path / name, ExportOptions(format=fmt))
    assert snap.sha256 == snapshot_sha256(snap.path)
    # the manifest written beside the data is not part of the data; the bytes under null cells
    # (the rankings' durations here) are defined, so the datasets format hashes the same too
    again = export_dataset(ranked_store, tmp_path / f"again-{name}", ExportOptions(format=fmt))
    assert again.sha256 == snap.sha256


def test_train_reward_records_the_snapshot_hash(ranked_store, tmp_path, tiny_model_dir):
    snap = export_dataset(ranked_store, tmp_path / "pairs.parquet", ExportOptions(format="parquet"))
    out = tmp_path / "rm"
    rc = cli(["train-reward", "--data", snap.path, "--out", str(out), "--model", str(tiny_model_dir),
              "--device", "cpu", "--dtype", "fp32", "--lora-r", "4", "--lora-alpha", "8", "--max-steps", "1",
              "--batch-size", "4", "--norm-samples", "0", "--eval-fraction", "0.25"])
    assert rc == 0
    config = json.loads((out / "config.json").read_text())
    assert config["data_sha256"] == snap.sha256 == ranked_store.get_snapshot(snap.id).sha256
