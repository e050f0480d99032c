"""Exports on the tools users have: an export loaded with `datasets` trains TRL's (1.12, pinned in
the test extras) RewardTrainer and DPOTrainer for two steps on a tiny model, in the conversational
and the text format; and an export imported into a fresh store exports the same pairs again."""

from __future__ import annotations

import json
import math

import pytest

from store import RankingIn, Store
from store.export import load_pairs_snapshot
from store.io import ExportOptions, export_dataset, import_pairs
from tests.fixtures_store import seed_items

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture
def ranked(store, store_annotators, store_policy, tmp_path):
    """6 items of K=3 ranked by ann0 (one with a tie), a chat prompt with a system message ranked
    by ann1, and an imported HH-RLHF pair (a multi-turn transcript)."""
    a, b = store_annotators
    for i, it in enumerate(seed_items(store, 6, 3, model_version_id=store_policy.id)):
        r = it.response_ids
        store.save_ranking(RankingIn(a.id, it.prompt_id, [[r[0]], [r[1], r[2]]] if i == 0 else r, duration_s=2.0 + i))
    (pid,) = store.add_prompts([{"messages": CHAT}])
    responses = store.add_responses(pid, store_policy.id, ["Red.", "Blue, I think.", "Colours are hard."])
    store.save_ranking(RankingIn(b.id, pid, [r.id for r in responses]))
    hh = tmp_path / "hh.jsonl"
    hh.write_text(json.dumps({"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant: 4",
                              "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant: 5"}) + "\n")
    import_pairs(store, hh)
    return store


def _load(path, tmp_path):
    import datasets

    return datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf-cache"))


def _args(config_cls, tmp_path, name, **extra):
    return config_cls(output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
                      report_to="none", save_strategy="no", eval_strategy="no", logging_steps=1, bf16=False,
                      gradient_checkpointing=False, use_cpu=True, disable_tqdm=True, max_length=256, **extra)


@pytest.mark.parametrize("trl_format, margin_column", [("conversational", False), ("text", True)])
def test_reward_trainer_trains_on_an_export(ranked, tmp_path, tiny_model_dir, trl_format, margin_column):
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    snap = export_dataset(ranked, tmp_path / "export",
                          ExportOptions(format="jsonl", trl_format=trl_format, margin_column=margin_column))
    dataset = _load(tmp_path / "export" / "pairs.jsonl", tmp_path)
    assert len(dataset) == snap.counts["pairs"] == 6 * 3 - 1 + 3 + 1  # the tie gives no pair
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = RewardTrainer(model=str(tiny_model_dir), args=_args(RewardConfig, tmp_path, "rm"),
                            train_dataset=dataset, processing_class=tokenizer)
    # conversational: TRL put the rows through the chat template; text: it did not
    text = tokenizer.decode(trainer.train_dataset[0]["chosen_ids"])
    assert ("<|im_start|>user\n" in text) == (trl_format == "conversational")
    # the rank gap reaches the loss only as an explicit `margin` column
    batch = next(iter(trainer.get_train_dataloader()))
    assert ("margin" in batch) == margin_column and "rank_gap" not in batch
    if margin_column:
        assert set(batch["margin"].tolist()) <= {1.0, 2.0}
    # TRL read each row's chosen response as chosen and its rejected one as rejected, none dropped
    assert len(trainer.train_dataset) == len(dataset)
    for row, encoded in zip(dataset, trainer.train_dataset):
        assert _reply(row["chosen"]) in tokenizer.decode(encoded["chosen_ids"]), row
        assert _reply(row["rejected"]) in tokenizer.decode(encoded["rejected_ids"]), row
    result = trainer.train()
    assert trainer.state.global_step == 2 and math.isfinite(result.training_loss)


def _reply(response) -> str:
    """The response text of an exported pair's side: a string, or one assistant message."""
    return (response if isinstance(response, str) else response[-1]["content"]).strip()


@pytest.mark.parametrize("trl_format", ["conversational", "text"])
def test_dpo_trainer_trains_on_an_export(ranked, tmp_path, tiny_model_dir, trl_format):
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    export_dataset(ranked, tmp_path / "pairs.parquet", ExportOptions(format="parquet", trl_format=trl_format))
    import datasets

    dataset = datasets.load_dataset("parquet", data_files=str(tmp_path / "pairs.parquet"), split="train",
                                    cache_dir=str(tmp_path / "hf-cache"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = DPOTrainer(model=str(tiny_model_dir), args=_args(DPOConfig, tmp_path, "dpo"),
                         train_dataset=dataset, processing_class=tokenizer)
    chat_row = next(r for r in trainer.train_dataset if r["prompt_id"] == dataset[-1]["prompt_id"])  # the HH pair
    prompt = tokenizer.decode(chat_row["prompt_ids"])
    if trl_format == "conversational":  # the HH transcript became turns of the chat template
        assert prompt.startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>")
        assert prompt.endswith("<|im_start|>assistant\n")
    else:
        assert prompt.startswith("\n\nHuman: Hi\n\nAssistant: Hello!")
    assert len(trainer.train_dataset) == len(dataset)
    for row, encoded in zip(dataset, trainer.train_dataset):  # chosen as chosen, rejected as rejected
        assert _reply(row["chosen"]) in tokenizer.decode(encoded["chosen_ids"]), row
        assert _reply(row["rejected"]) in tokenizer.decode(encoded["rejected_ids"]), row
    result = trainer.train()
    assert trainer.state.global_step == 2 and math.isfinite(result.training_loss)


@pytest.mark.parametrize("fmt, out, trl_format", [("jsonl", "export", "conversational"),
                                                 ("parquet", "pairs.parquet", "text")])
def test_an_export_imported_into_a_fresh_store_exports_the_same_pairs(ranked, tmp_path, fmt, out, trl_format):
    first = export_dataset(ranked, tmp_path / out, ExportOptions(format=fmt, trl_format=trl_format))
    pairs_file = tmp_path / out / "pairs.jsonl" if fmt == "jsonl" else tmp_path / out
    fresh = Store(tmp_path / "fresh.duckdb")
    try:
        imported = import_pairs(fresh, pairs_file)
        assert imported["pairs"] == first.counts["pairs"]
        again = export_dataset(fresh, tmp_path / f"again-{out}", ExportOptions(format=fmt, trl_format=trl_format))
        keys = ("prompt", "chosen", "rejected", "rank_gap")

        def rows(snap):
            return sorted(json.dumps([r[k] for k in keys]) for r in load_pairs_snapshot(snap.path))

        assert rows(again) == rows(first)
    finally:
        fresh.close()
