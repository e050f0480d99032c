"""Reward-model training: reading pairs, bad input, tokenising, batching, and end-to-end runs on a
tiny model (a synthetic preference: chosen responses contain a marker word)."""

import dataclasses
import json
import os
import random
import signal

import pytest
import torch

from pipeline.config import RewardConfig
from pipeline.text import prompt_token_ids
from pipeline.models import checkpointing, load_scalar_model
from pipeline.pairs_data import (
    PairsError, collate, collate_shared, encode_pairs, length_grouped_batches, prompt_key, read_pairs,
    split_by_prompt,
)
from pipeline.reward_eval import forward_pairs
from pipeline.train_reward import main, train_reward

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/fixtures_models.py

WORDS = ("the quick brown fox jumps over lazy dog bread flour water salt guitar chords "
         "practise daily coupons stores onions relish chili").split()


def marker_pairs(n: int, seed: int = 0, marker: str = "Paris") -> list[dict]:
    """Chosen responses contain the marker word somewhere; rejected ones never do. Lengths are
    random on both sides, so 'longer wins' is near chance."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        chosen = [rng.choice(WORDS) for _ in range(rng.randint(3, 10))]
        chosen.insert(rng.randint(0, len(chosen)), marker)
        rejected = [rng.choice(WORDS) for _ in range(rng.randint(4, 11))]
        rows.append({"prompt": prompt, "chosen": " ".join(chosen), "rejected": " ".join(rejected)})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


FAST = RewardConfig(epochs=2, lr=1e-2, batch_size=8, norm_samples=0, eval_fraction=0.25)


# --------------------------------------------------------------------------- reading pairs


def test_reads_jsonl_parquet_datasets_and_hh(tmp_path):
    rows = marker_pairs(6)
    jsonl = write_jsonl(tmp_path / "p.jsonl", rows)
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    for source in (jsonl, tmp_path / "p.parquet", tmp_path / "ds"):
        pairs, report = read_pairs(source)
        assert [p.chosen for p in pairs] == [r["chosen"] for r in rows] and report["pairs"] == 6

    hh = {"chosen": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: bye?\n\nAssistant: Bye now.",
          "rejected": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: bye?\n\nAssistant: No."}
    conv = {"prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "assistant", "content": "go away"}], "margin": 2}
    pairs, _ = read_pairs(write_jsonl(tmp_path / "mixed.jsonl", [hh, conv]))
    assert pairs[0].prompt == "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: bye?\n\nAssistant:"
    assert (pairs[0].chosen, pairs[0].rejected) == (" Bye now.", " No.")
    assert pairs[1].prompt == conv["prompt"] and pairs[1].rejected == "go away" and pairs[1].margin == 2.0


def test_bad_input_names_file_row_and_field(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PairsError, match="empty.jsonl: no pairs"):
        read_pairs(empty)
    rows = marker_pairs(3)
    del rows[2]["rejected"]
    with pytest.raises(PairsError, match=r"bad.jsonl, row 3: missing field 'rejected'"):
        read_pairs(write_jsonl(tmp_path / "bad.jsonl", rows))
    rows = marker_pairs(2)
    rows[1]["margin"] = "high"
    with pytest.raises(PairsError, match=r"row 2, field 'margin'"):
        read_pairs(write_jsonl(tmp_path / "margin.jsonl", rows))
    bad_prompt = [{"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"}]
    with pytest.raises(PairsError, match=r"row 1, field 'prompt': message 0"):
        read_pairs(write_jsonl(tmp_path / "conv.jsonl", bad_prompt))
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{oops\n')
    with pytest.raises(PairsError, match="broken.jsonl: row 2: not valid JSON"):
        read_pairs(tmp_path / "broken.jsonl")
    with pytest.raises(PairsError, match="no such file"):
        read_pairs(tmp_path / "missing.jsonl")


def test_pairs_files_are_read_as_the_store_imports_read_them(tmp_path):
    """One reader (formats/rows.py): a CSV the Data tab imports also trains, rows numbered alike."""
    import csv

    path = tmp_path / "pairs.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "chosen", "rejected"])
        w.writerows([["q1", "good, with a comma", "bad"], ["q2", "yes", ""]])
    with pytest.raises(PairsError, match=r"pairs.csv, row 2, field 'rejected': empty response"):
        read_pairs(path)
    path.write_bytes(path.read_bytes().replace(b"yes,\r\n", b"yes,no\r\n"))
    pairs, report = read_pairs(path)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [("q1", "good, with a comma", "bad"),
                                                                  ("q2", "yes", "no")]
    with pytest.raises(PairsError, match=r"pairs.txt: unknown file type"):
        read_pairs(path.rename(tmp_path / "pairs.txt"))


def test_identical_pairs_are_dropped_and_counted_or_refused(tmp_path):
    rows = marker_pairs(4)
    rows[1]["rejected"] = rows[1]["chosen"] + "  "
    pairs, report = read_pairs(write_jsonl(tmp_path / "p.jsonl", rows))
    assert len(pairs) == 3 and report["dropped_identical"] == 1 and report["dropped_identical_rows"] == [2]
    same = [{"prompt": "q", "chosen": "a", "rejected": "a"}] * 2
    with pytest.raises(PairsError, match="all 2 pairs have chosen == rejected"):
        read_pairs(write_jsonl(tmp_path / "same.jsonl", same))


def test_split_by_prompt_never_shares_a_prompt(tmp_path):
    rows = marker_pairs(40) + [dict(r, prompt=r["prompt"].upper()) for r in marker_pairs(40)]
    pairs, _ = read_pairs(write_jsonl(tmp_path / "p.jsonl", rows))
    train, held = split_by_prompt(pairs, 0.25, seed=0)
    assert len(train) + len(held) == 80 and len(held) == 20  # 10 of 40 distinct prompts, 2 pairs each
    assert not {prompt_key(p.prompt) for p in train} & {prompt_key(p.prompt) for p in held}
    assert split_by_prompt(pairs, 0.0, 0)[1] == []


# --------------------------------------------------------------------------- tokenising and batching


def test_encoding_matches_generation_and_truncates_from_the_left(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    pairs, _ = read_pairs(write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "the quick brown fox " * 10, "chosen": "bread", "rejected": "salt water"},
        {"prompt": "the lazy dog", "chosen": "bread", "rejected": "salt water " * 30}]))
    prompt_ids = prompt_token_ids(tok, pairs[0].prompt)
    bread = tok("bread", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    salt = tok("salt water", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    full, report = encode_pairs(pairs[:1], tok, max_length=1000)
    assert full[0].chosen_ids == prompt_ids + bread and full[0].rejected_ids == prompt_ids + salt
    assert full[0].prompt_len == len(prompt_ids) and report.prompt_truncated == 0

    # the prompt loses its start until it fits beside the longer response; both keep one prompt
    limit = max(len(bread), len(salt)) + 5
    short, report = encode_pairs(pairs, tok, max_length=limit)
    assert short[0].chosen_ids == prompt_ids[-5:] + bread and short[0].rejected_ids == prompt_ids[-5:] + salt
    # a response longer than the limit keeps its last tokens after a 1-token prompt
    assert short[1].prompt_len == 1 and len(short[1].rejected_ids) == limit
    assert short[1].rejected_ids[-1] == tok.eos_token_id and short[1].chosen_response == bread
    assert (report.prompt_truncated, report.response_truncated) == (2, 1)
    assert short[1].rejected_response_tokens > limit  # the length baseline sees the real length


def test_length_grouped_batches_cover_everything_once_and_pad_little():
    rng = random.Random(0)
    lengths = [rng.randint(5, 500) for _ in range(1000)]
    batches = length_grouped_batches(lengths, 8, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(1000))
    assert batches == length_grouped_batches(lengths, 8, seed=3)  # --resume relies on this
    assert batches != length_grouped_batches(lengths, 8, seed=4)
    padded = sum(8 * max(lengths[i] for i in b) for b in batches)
    shuffled = list(range(1000))
    rng.shuffle(shuffled)
    padded_random = sum(8 * max(lengths[i] for i in shuffled[k:k + 8]) for k in range(0, 1000, 8))
    assert padded < 0.6 * padded_random


def test_collate_puts_chosen_then_rejected(tmp_path, tiny_tokenizer):
    pairs, _ = read_pairs(write_jsonl(tmp_path / "p.jsonl", marker_pairs(3)))
    items, _ = encode_pairs(pairs, tiny_tokenizer, 512)
    batch = collate(items, pad_id=0, with_lm_mask=True)
    longest = max(max(len(it.chosen_ids), len(it.rejected_ids)) for it in items)
    assert batch["input_ids"].shape == (6, longest) and batch["lm_mask"].shape == (3, longest)
    assert batch["input_ids"][4, : len(items[1].rejected_ids)].tolist() == items[1].rejected_ids
    assert batch["attention_mask"][1].sum() == len(items[1].chosen_ids)
    assert batch["lm_mask"][0].sum() == len(items[0].chosen_response)
    assert batch["lm_mask"][0, items[0].prompt_len] == 1 and batch["lm_mask"][0, items[0].prompt_len - 1] == 0

    shared = collate_shared(items, pad_id=0)
    p_width = max(it.prompt_len for it in items)
    assert shared["prompt_ids"].shape == (3, p_width) and shared["response_ids"].shape[0] == 6
    assert shared["prompt_ids"][2, p_width - items[2].prompt_len:].tolist() == items[2].prompt_ids  # left-padded
    assert shared["response_ids"][5, : len(items[2].rejected_response)].tolist() == items[2].rejected_response


def test_shared_prompt_pass_gives_the_same_scores_and_gradients(tiny_model_cfg, tmp_path):
    """Prefix sharing is an optimisation only: same scores as ScalarModel.score on whole
    sequences, same LM term, same gradients, fewer tokens."""
    model, tok = load_scalar_model(tiny_model_cfg.model, "reward", tiny_model_cfg)
    pairs, _ = read_pairs(write_jsonl(tmp_path / "p.jsonl", marker_pairs(5)))
    items = encode_pairs(pairs, tok, 512)[0]
    lm_weight = torch.randn(len(tok), model.backbone.config.hidden_size)
    model.train()
    results = {}
    for share in (True, False):
        model.zero_grad()
        r_c, r_r, lm, _, tokens = forward_pairs(model, items, tok.pad_token_id, torch.device("cpu"), share, lm_weight)
        (r_c.sum() - 2 * r_r.sum() + lm).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[share] = (r_c.detach(), r_r.detach(), lm.detach(), grads, tokens)
    batch = collate(items, tok.pad_token_id)
    with torch.no_grad():
        whole = model.score(batch["input_ids"], batch["attention_mask"])
    shared, plain = results[True], results[False]
    assert torch.allclose(shared[0], whole[:5], atol=1e-5) and torch.allclose(shared[1], whole[5:], atol=1e-5)
    assert torch.allclose(plain[0], whole[:5], atol=1e-5)
    assert torch.allclose(shared[2], plain[2], atol=1e-5)
    assert torch.allclose(shared[3], plain[3], atol=1e-4 * plain[3].abs().max().item())
    assert shared[4] == plain[4] - sum(it.prompt_len for it in items)  # each prompt once, not twice


def test_calibration_and_length_baseline_hand_values():
    from pipeline.pairs_data import EncodedPair
    from pipeline.reward_eval import calibration, length_baseline

    # |diff| sorted: .1 (wrong), .2, 3 | 4 (wrong), 5 -> buckets of 3 and 2
    rows = calibration(torch.tensor([-0.1, 0.2, 3.0, -4.0, 5.0]), buckets=2)
    assert [(r["count"], r["accuracy"]) for r in rows] == [(3, 0.6667), (2, 0.5)]
    # predicted = mean sigmoid(|diff|): (.524979 + .549834 + .952574) / 3, (.982014 + .993307) / 2
    assert rows[0]["predicted"] == pytest.approx(0.6758, abs=1e-4)
    assert rows[1]["predicted"] == pytest.approx(0.9877, abs=1e-4)
    assert (rows[0]["abs_diff_min"], rows[1]["abs_diff_max"]) == (0.1, 5.0)
    items = [EncodedPair([1], [2], [3], c, r) for c, r in ((5, 3), (2, 2), (1, 4))]
    assert length_baseline(items) == 0.5  # longer chosen: 1, tie: 1/2, shorter: 0


# --------------------------------------------------------------------------- end to end


def test_learns_the_marker_word(tmp_path, tiny_model_cfg):
    """> 95% held-out accuracy within seconds, run directory complete."""
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(240))
    out = tmp_path / "run"
    report = train_reward(str(data), str(out), dataclasses.replace(FAST, norm_samples=4, norm_max_new_tokens=3),
                          tiny_model_cfg)
    assert report["eval/accuracy"] > 0.95 and report["eval/pairs"] == 60
    assert 0.3 < report["eval/length_baseline_accuracy"] < 0.7
    assert json.loads((out / "status.json").read_text())["state"] == "done"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 1 and {"train/loss", "train/accuracy", "train/lr"} <= set(lines[0])
    assert any("eval/accuracy" in line for line in lines)
    saved = json.loads((out / "eval_report.json").read_text())
    assert len(saved["calibration"]) == 5 and saved["truncation"]["prompt_truncated"] == 0
    # the normalisation samples are cut where PPO's rollouts are (norm_max_new_tokens)
    assert saved["normalisation"]["max_new_tokens"] == 3 and 1 <= saved["normalisation"]["tokens_max"] <= 3
    assert json.loads((out / "config.json").read_text())["data_sha256"]
    # the checkpoint reloads with its normalisation, and scores like the trained model
    model, tok = load_scalar_model(str(out / "checkpoint"), "reward", tiny_model_cfg)
    assert model.reward_std == pytest.approx(saved["normalisation"]["reward_std"]) and model.reward_std != 1.0
    items = encode_pairs(read_pairs(data)[0][:8], tok, 512)[0]
    batch = collate(items, tok.pad_token_id)
    with torch.no_grad():
        scores = model.score(batch["input_ids"], batch["attention_mask"])
    assert (scores[:8] > scores[8:]).float().mean() > 0.8


def test_sigterm_saves_a_checkpoint_and_resume_matches_an_uninterrupted_run(tmp_path, tiny_model_cfg):
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(80))
    cfg = dataclasses.replace(FAST, lr=3e-3)
    full = train_reward(str(data), str(tmp_path / "full"), cfg, tiny_model_cfg)

    def cancel_at_3(step, metrics):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # what the job runner's cancel sends

    out = tmp_path / "cut"
    result = train_reward(str(data), str(out), cfg, tiny_model_cfg, on_step=cancel_at_3)
    status = json.loads((out / "status.json").read_text())
    assert result["state"] == "cancelled" and status["state"] == "cancelled" and status["step"] == 3
    load_scalar_model(str(out / "checkpoint"), "reward", tiny_model_cfg)  # usable as is

    resumed = train_reward(str(data), str(out), cfg, tiny_model_cfg, resume=True)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert steps == list(range(1, resumed["steps"] + 1)) and resumed["steps"] == full["steps"]
    assert resumed["eval/margin"] == pytest.approx(full["eval/margin"], rel=1e-4)
    with pytest.raises(ValueError, match="already finished"):
        train_reward(str(data), str(out), cfg, tiny_model_cfg, resume=True)


def test_a_stop_while_normalising_keeps_the_training_and_resume_only_evaluates(tmp_path, tiny_model_cfg, monkeypatch):
    """The steps are done when a SIGTERM arrives in the normalisation phase: the trained weights are
    already saved, the run is 'cancelled', and --resume runs only the phases after training, to the
    report an uninterrupted run gives."""
    import pipeline.train_reward as train_reward_module

    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(80))
    cfg = dataclasses.replace(FAST, lr=3e-3, norm_samples=4, norm_max_new_tokens=3)
    full = train_reward(str(data), str(tmp_path / "full"), cfg, tiny_model_cfg)

    real = train_reward_module.normalisation_stats

    def stopped_as_it_starts(*args, **kwargs):  # the signal a job's cancel sends, as this phase begins
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    out = tmp_path / "cut"
    monkeypatch.setattr(train_reward_module, "normalisation_stats", stopped_as_it_starts)
    result = train_reward(str(data), str(out), cfg, tiny_model_cfg)
    monkeypatch.undo()
    status = json.loads((out / "status.json").read_text())
    assert result == {"state": "cancelled", "step": full["steps"], "total": full["steps"]}
    assert status["state"] == "cancelled" and "--resume" in status["error"]
    assert torch.load(out / "trainer_state.pt", weights_only=False)["step"] == full["steps"]
    assert not (out / "eval_report.json").exists()

    resumed = train_reward(str(data), str(out), cfg, tiny_model_cfg, resume=True)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "train/loss" in line] == list(range(1, full["steps"] + 1))
    assert sum("eval/accuracy" in line for line in lines) == 1  # the figures logged once, by the resumed run
    assert resumed["eval/accuracy"] == full["eval/accuracy"]
    assert resumed["eval/margin"] == pytest.approx(full["eval/margin"], rel=1e-4)
    assert resumed["normalisation"]["reward_mean"] == pytest.approx(full["normalisation"]["reward_mean"], rel=1e-4)
    assert json.loads((out / "status.json").read_text())["state"] == "done"


def test_ctrl_c_also_stops_cleanly(tmp_path, tiny_model_cfg):
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(40))
    result = train_reward(str(data), str(tmp_path / "run"), FAST, tiny_model_cfg,
                          on_step=lambda step, m: os.kill(os.getpid(), signal.SIGINT))
    assert result == {"state": "cancelled", "step": 1, "total": result["total"]}
    assert (tmp_path / "run" / "checkpoint" / "model_meta.json").is_file()


def test_margin_centering_and_lm_terms_train(tmp_path, tiny_model_cfg):
    rows = [dict(r, margin=1.0) for r in marker_pairs(32)]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    cfg = dataclasses.replace(FAST, epochs=1, margin=True, center_coef=0.01, lm_coef=0.5, max_steps=2)
    report = train_reward(str(data), str(tmp_path / "run"), cfg, tiny_model_cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert report["steps"] == 2 and all(torch.isfinite(torch.tensor(l.get("train/loss", 0.0))) for l in lines)
    # the LM term (CE over ~320 tokens, about log 320 = 5.8) dominates the pairwise loss (<= ~1.3)
    assert lines[0]["train/loss"] > 2.0


def test_cli_errors_and_refusals(tmp_path, tiny_model_dir, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    base = ["--model", str(tiny_model_dir), "--device", "cpu", "--norm-samples", "0"]
    assert main(["--data", str(empty), "--out", str(tmp_path / "a"), *base]) == 2
    assert "empty.jsonl: no pairs" in capsys.readouterr().err
    assert json.loads((tmp_path / "a" / "status.json").read_text())["state"] == "failed"
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(24))
    # a failed start holds nothing of value: the folder is reused
    assert main(["--data", str(data), "--out", str(tmp_path / "a"), "--lr", "1e-2", "--max-steps", "2", *base]) == 0
    assert "held-out accuracy" in capsys.readouterr().out
    # a finished run is never overwritten
    assert main(["--data", str(data), "--out", str(tmp_path / "a"), *base]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_separate_eval_file(tmp_path, tiny_model_cfg):
    rows = marker_pairs(40)
    train, held = write_jsonl(tmp_path / "t.jsonl", rows[:30]), write_jsonl(tmp_path / "e.jsonl", rows[25:])
    cfg = dataclasses.replace(FAST, epochs=1, eval_data=str(held), grad_accum=2, share_prompt=False)
    report = train_reward(str(train), str(tmp_path / "run"), cfg, tiny_model_cfg)
    assert report["train/pairs"] == 30 and report["eval/pairs"] == 15
    assert report["steps"] == 2  # 4 batches of <= 8 pairs, 2 accumulated per optimiser step
    assert report["data"]["eval_file"]["prompts_also_in_train"] == 5


@pytest.mark.slow
def test_default_model_trains_on_hh_pairs(tmp_path, default_model_path, test_data):
    """SmolLM2-135M on a few real HH pairs: chat template, pad == EOS, tied LM head, normalisation.
    (The 1,600 / 400 pair measurement is a documented command in pipeline/train_reward.py.)"""
    from pipeline.config import ModelConfig

    source = test_data / "hh_dev_pairs.jsonl"
    rows = [json.loads(line) for line in source.read_text().splitlines()[:200]]
    short = [r for r in rows if len(r["prompt"]) < 200 and max(len(r["chosen"]), len(r["rejected"])) < 200][:6]
    data = write_jsonl(tmp_path / "hh.jsonl", short)
    cfg = RewardConfig(batch_size=2, lr=1e-4, max_length=96, max_steps=2, eval_fraction=0.34,
                       norm_samples=2, lm_coef=0.1)
    model_cfg = ModelConfig(model=str(default_model_path), device="cpu")
    report = train_reward(str(data), str(tmp_path / "run"), cfg, model_cfg)
    assert report["steps"] == 2 and report["eval/pairs"] == 2
    assert report["normalisation"]["samples"] == 2 and report["truncation"]["max_length"] == 96
    model, tok = load_scalar_model(str(tmp_path / "run" / "checkpoint"), "reward", model_cfg)
    assert model.reward_mean == pytest.approx(report["normalisation"]["reward_mean"])
    # the shared-prompt pass scores exactly what ScalarModel.score (PPO's scorer) reads
    items = encode_pairs(read_pairs(data)[0][:3], tok, 96)[0]
    batch = collate(items, tok.pad_token_id)
    with torch.no_grad():
        r_c, r_r, _, _, _ = forward_pairs(model, items, tok.pad_token_id, torch.device("cpu"))
        whole = model.score(batch["input_ids"], batch["attention_mask"])
    assert torch.allclose(torch.cat([r_c, r_r]), whole, atol=1e-3)


def test_snapshot_test_split_is_the_held_out_set(tmp_path, tiny_model_cfg):
    from datasets import Dataset, DatasetDict

    rows = marker_pairs(30)
    DatasetDict({"train": Dataset.from_list(rows[:24]), "test": Dataset.from_list(rows[24:])}).save_to_disk(
        str(tmp_path / "snap"))
    pairs, _ = read_pairs(tmp_path / "snap")
    assert [p.split for p in pairs].count("test") == 6
    report = train_reward(str(tmp_path / "snap"), str(tmp_path / "run"), dataclasses.replace(FAST, epochs=1),
                          tiny_model_cfg)
    assert (report["train/pairs"], report["eval/pairs"], report["data"]["split"]) == (24, 6, "snapshot")


def test_token_chunks():
    from pipeline.train_reward import token_chunks

    lengths = [10, 50, 20, 40, 300]
    assert token_chunks([0, 1, 2, 3], lengths, 0) == [[0, 1, 2, 3]]
    # longest first; 2 rows per pair: [50, 40] -> 2*2*50 = 200 <= 200, adding 20 would be 300
    assert token_chunks([0, 1, 2, 3], lengths, 200) == [[1, 3], [2, 0]]
    assert token_chunks([4, 0], lengths, 200) == [[4], [0]]  # too long for any chunk: alone


def test_chunked_batches_give_the_same_training(tmp_path, tiny_model_cfg):
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(48))
    cfg = dataclasses.replace(FAST, epochs=1, lr=3e-3, center_coef=0.1)
    whole = train_reward(str(data), str(tmp_path / "a"), cfg, tiny_model_cfg)
    chunked = train_reward(str(data), str(tmp_path / "b"), dataclasses.replace(cfg, max_tokens=120), tiny_model_cfg)
    assert chunked["eval/margin"] == pytest.approx(whole["eval/margin"], rel=1e-4)
    assert chunked["eval/accuracy"] == whole["eval/accuracy"]


def test_gradient_checkpointing_changes_memory_not_numbers(tmp_path, tiny_model_cfg):
    """--gradient-checkpointing true recomputes activations in the backward pass (whole sequences:
    checkpointed layers keep no KV cache); the losses are the run's without it."""
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(24))
    cfg = dataclasses.replace(FAST, epochs=1)
    plain = train_reward(str(data), str(tmp_path / "plain"), dataclasses.replace(cfg, share_prompt=False),
                         tiny_model_cfg)
    gc_cfg = dataclasses.replace(tiny_model_cfg, gradient_checkpointing=True)
    recomputed = train_reward(str(data), str(tmp_path / "gc"), cfg, gc_cfg)
    model, _ = load_scalar_model(str(tmp_path / "gc" / "checkpoint"), "reward", gc_cfg)
    assert checkpointing(model)
    lines = [[json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
             for name in ("plain", "gc")]
    assert [m["train/loss"] for m in lines[1] if "train/loss" in m] == pytest.approx(
        [m["train/loss"] for m in lines[0] if "train/loss" in m], rel=1e-5)
    assert recomputed["eval/accuracy"] == plain["eval/accuracy"]


# --------------------------------------------------------------------------- pair weights


def test_weight_column_is_read_and_checked(tmp_path, tiny_tokenizer):
    rows = marker_pairs(4)
    rows[0]["weight"], rows[1]["weight"], rows[2]["weight"] = 0.05, 2, None  # None: 1.0, as a missing one
    pairs, report = read_pairs(write_jsonl(tmp_path / "w.jsonl", rows))
    assert [p.weight for p in pairs] == [0.05, 2.0, 1.0, 1.0]
    assert report["weights"] == {"min": 0.05, "max": 2.0, "mean": pytest.approx(4.05 / 4)}
    assert "weights" not in read_pairs(write_jsonl(tmp_path / "plain.jsonl", marker_pairs(2)))[1]
    items, _ = encode_pairs(pairs, tiny_tokenizer, 512)
    assert [it.weight for it in items] == [0.05, 2.0, 1.0, 1.0]
    for bad in (0, -1.0, "high", True, float("nan"), float("inf")):
        rows = marker_pairs(2)
        rows[1]["weight"] = bad
        path = tmp_path / "bad.jsonl"
        path.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows))
        with pytest.raises(PairsError, match=r"bad.jsonl, row 2, field 'weight': expected a positive finite number"):
            read_pairs(path)


def test_weights_train_as_their_share_of_the_mean(tmp_path, tiny_model_cfg):
    """Weights count relative to their mean: equal weights train exactly as none; mixed weights
    change the run unless --use-weights false."""
    rows = marker_pairs(32)
    cfg = dataclasses.replace(FAST, epochs=1, max_steps=3)

    def run(name, weights, **kw):
        data = write_jsonl(tmp_path / f"{name}.jsonl", [dict(r, weight=w) for r, w in zip(rows, weights)])
        report = train_reward(str(data), str(tmp_path / name), dataclasses.replace(cfg, **kw), tiny_model_cfg)
        losses = [json.loads(x)["train/loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                  if "train/loss" in x]
        return report, losses

    plain, plain_losses = run("plain", [None] * 32)
    equal, equal_losses = run("equal", [3.0] * 32)
    assert not plain["train/weighted"] and not equal["train/weighted"] and equal_losses == plain_losses
    mixed = [0.1 if i % 2 else 1.9 for i in range(32)]
    weighted, weighted_losses = run("mixed", mixed)
    ignored, ignored_losses = run("ignored", mixed, use_weights=False)
    assert weighted["train/weighted"] and weighted_losses != plain_losses
    assert not ignored["train/weighted"] and ignored_losses == plain_losses
