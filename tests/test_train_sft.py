"""Supervised fine-tuning on annotators' own answers (pipeline/train_sft.py) on the tiny random
model, CPU fp32: the demonstrations an export writes train a policy whose answer loss falls (a
tiny model memorising eight short answers, with certainty), the held-out ones are scored and never
trained on, and a file that is no SFT data is refused naming its row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import ModelConfig, SFTConfig
from pipeline.train_sft import main, read_demonstrations, train_sft
from store.io import ExportOptions, export_dataset
from store.records import EditIn, RankingIn
from tests.fixtures_store import seed_items

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/fixtures_models.py


@pytest.fixture
def sft_model_cfg(tiny_model_dir):
    return ModelConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32", lora=True, lora_r=4, lora_alpha=8,
                       lora_targets="q_proj,v_proj,lm_head")


def exported_demonstrations(store, folder: Path, n: int = 10) -> Path:
    """n items ranked with an own answer each ("answer <i> is yes"), exported with a test split."""
    ann = store.add_annotator("ann", "ann-password-1")
    for i, item in enumerate(seed_items(store, n, 2)):
        first, second = item.response_ids
        store.save_ranking(RankingIn(ann.id, item.prompt_id, [[first], [second]],
                                     edit=EditIn(f"answer {i} is yes", made_from=first)))
    # holds out 2 of the 10
    snap = export_dataset(store, folder / "export", ExportOptions(format="jsonl", test_fraction=0.2, seed=2))
    assert snap.counts["demonstrations"] == n
    return folder / "export" / "demonstrations.jsonl"


def test_sft_learns_the_annotators_answers_and_holds_out_the_test_split(store, tmp_path, sft_model_cfg):
    data = exported_demonstrations(store, tmp_path)
    demos = read_demonstrations(data)
    held_out = [d for d in demos if d.held_out]
    assert 0 < len(held_out) < len(demos) and all(isinstance(d.prompt, list) for d in demos)
    cfg = SFTConfig(epochs=30, lr=2e-2, batch_size=4)
    report = train_sft(str(data), str(tmp_path / "run"), cfg, sft_model_cfg)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [s["train/loss"] for s in steps if "train/loss" in s and "train/lr" in s]
    assert len(losses) == report["steps"] == 30 * 2  # 8 training answers in batches of 4
    assert losses[-1] < 0.25 * losses[0]  # the answers are learned
    assert report["train/loss"] < 0.25 * losses[0] and report["train/token_accuracy"] > 0.8
    assert report["train/demonstrations"] + report["eval/demonstrations"] == len(demos)
    assert "eval/loss" in report and report["eval/demonstrations"] == len(held_out)
    meta = json.loads((tmp_path / "run" / "policy" / "model_meta.json").read_text())
    assert meta["method"] == "sft" and meta["parent"] == meta["base_model"]


def test_a_file_that_is_not_sft_data_is_refused_naming_the_row(tmp_path, sft_model_cfg, capsys):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
                   + "\n" + json.dumps({"prompt": "hi", "chosen": "a", "rejected": "b"}) + "\n")
    assert main(["--data", str(bad), "--out", str(tmp_path / "run"), "--model", sft_model_cfg.model]) == 2
    assert "row 2: neither 'messages' ending with the assistant's answer nor 'prompt' and 'completion'" in capsys.readouterr().err
