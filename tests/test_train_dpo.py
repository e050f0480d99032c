"""DPO trainer (pipeline/train_dpo.py, pipeline/dpo_data.py) on the tiny random model, CPU fp32.

The learnable task is train-reward's: chosen responses contain a marker word, rejected ones never
do. As in tests/test_train_ppo.py, LoRA also targets the tiny model's lm_head: its logits are
bounded by a random head of hidden size 32, which otherwise moves slowly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import DPOConfig, ModelConfig
from pipeline.dpo_data import Packing, pack_pairs, preference_loss, reference_logps, sequence_logps
from pipeline.losses import logprobs_from_logits
from pipeline.models import attn_ratio
from pipeline.policy import causal_lm_logits, load_policy, make_reference
from pipeline.pairs_data import encode_pairs, read_pairs
from pipeline.rundir import read_status
from pipeline.train_dpo import main, train_dpo
from tests.helpers import wait_for
from tests.test_train_reward import marker_pairs, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/fixtures_models.py

ROOT = Path(__file__).resolve().parents[1]
FAST = DPOConfig(epochs=2, lr=1e-2, batch_size=8, eval_fraction=0.25, kl_prompts=6, kl_samples=2, kl_max_new_tokens=8)


@pytest.fixture
def dpo_model_cfg(tiny_model_dir):
    return ModelConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32", lora=True, lora_r=4, lora_alpha=8,
                       lora_targets="q_proj,v_proj,lm_head")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def whole_sequence_logps(model, items) -> torch.Tensor:
    """(2B,) the same log-probs, each prompt + response run alone, in the packing's order: each
    pair's chosen, then its rejected."""
    out = []
    for it in items:
        for response in (it.chosen_response, it.rejected_response):
            ids = torch.tensor([it.prompt_ids + response])
            logits = causal_lm_logits(model, ids, torch.ones_like(ids))[:, it.prompt_len - 1:-1]  # predicts the response
            out.append(logprobs_from_logits(logits, torch.tensor([response]))[0].sum())
    return torch.stack(out)


# --------------------------------------------------------------------------- the packed layout


def test_packed_pairs_give_whole_sequence_logps_and_gradients(tmp_path, dpo_model_cfg):
    """Prompt once, several pairs per row, a shared system prompt: the same log-probs and gradients
    as every prompt + response run alone, and fewer tokens."""
    model, tok = load_policy(dpo_model_cfg)
    torch.manual_seed(0)
    with torch.no_grad():  # move the adapter off zero, so policy and reference differ
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    rows = marker_pairs(7)
    for row in rows[4:]:  # three pairs of one prompt, as a ranking of K responses gives
        row["prompt"] = rows[4]["prompt"]
    items = encode_pairs(read_pairs(write_jsonl(tmp_path / "p.jsonl", rows))[0], tok, 512)[0]
    params = [p for p in model.parameters() if p.requires_grad]

    model.zero_grad()
    want = whole_sequence_logps(model, items)
    (want * torch.linspace(-1, 1, len(want))).sum().backward()
    want_grads = [p.grad.clone() for p in params]
    whole_tokens = sum(len(it.chosen_ids) + len(it.rejected_ids) for it in items)
    # attention cost 0: every pair in one row; the tiny model's own cost model: a pair per row
    for share_prefix, attn_cost in ((True, 0.0), (False, attn_ratio(model))):
        model.zero_grad()
        pp = pack_pairs(items, Packing(attn_cost, tok.pad_token_id, share_prefix))
        assert (pp.prefix is not None) == share_prefix and pp.input_ids.shape[0] == (1 if attn_cost == 0 else 7)
        got = sequence_logps(model, pp)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
        (got * torch.linspace(-1, 1, len(got))).sum().backward()
        assert all((p.grad - g).abs().max() <= 1e-5 * g.abs().max() for p, g in zip(params, want_grads))
        assert pp.real_tokens < whole_tokens
        assert pp.response_tokens.tolist() == [len(r) for it in items for r in (it.chosen_response,
                                                                                 it.rejected_response)]
    # a batch of one prompt: all of it but its last token (which predicts each response's first) is shared
    same = pack_pairs(items[4:], Packing(attn_ratio(model), tok.pad_token_id))
    assert len(same.prefix) == items[4].prompt_len - 1
    with torch.no_grad():
        assert torch.allclose(sequence_logps(model, same), whole_sequence_logps(model, items[4:]), rtol=1e-5, atol=1e-4)
    # the reference is the base model: the adapter disabled
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(dpo_model_cfg.model).eval()
    with torch.no_grad():
        ref = reference_logps(make_reference(model), pp)
        assert torch.allclose(ref, whole_sequence_logps(base, items), rtol=1e-5, atol=1e-4)
        assert not torch.allclose(ref, got, atol=1e-2)


def test_packed_pair_weights_weigh_each_pairs_loss(tmp_path, dpo_model_cfg):
    """A batch's weights follow its pairs through the packing: the loss is mean(w * loss_i) of each
    pair's DPO (or IPO) loss computed from whole sequences."""
    torch.manual_seed(1)  # before load_policy: peft draws the LoRA A matrices from the global stream
    model, tok = load_policy(dpo_model_cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    items = encode_pairs(read_pairs(write_jsonl(tmp_path / "p.jsonl", marker_pairs(5)))[0], tok, 512)[0]
    weights = [0.2, 1.8, 0.5, 1.5, 1.0]
    pp = pack_pairs(items, Packing(0.0, tok.pad_token_id), weights=weights)  # one row: the pairs out of file order
    with torch.no_grad():
        logps, ref = sequence_logps(model, pp), reference_logps(make_reference(model), pp)
        ratio = whole_sequence_logps(model, items) - ref  # (10,) log pi - log ref of each response
    margin = ratio[0::2] - ratio[1::2]  # (5,) each pair's margin
    dpo = torch.nn.functional.softplus(-0.1 * margin)  # -log sigmoid(beta x), pair by pair
    n_c = torch.tensor([len(it.chosen_response) for it in items])
    n_r = torch.tensor([len(it.rejected_response) for it in items])
    ipo = (ratio[0::2] / n_c - ratio[1::2] / n_r - 1 / (2 * 0.1)) ** 2
    w = torch.tensor(weights)
    for loss, per_pair in (("sigmoid", dpo), ("ipo", ipo)):
        cfg = dataclasses.replace(FAST, loss=loss)
        got = preference_loss(cfg, logps, ref, pp)
        assert torch.allclose(got, (w * per_pair).mean(), rtol=1e-4)
        # the weights do change it, by far more than that tolerance (IPO's losses share a constant
        # (1 / 2 beta)^2 = 25, so its weighted and plain means differ by a fraction of a percent)
        assert abs(float(got - per_pair.mean())) > 20 * 1e-4 * abs(float(got)), (loss, got, per_pair.mean())
    with pytest.raises(ValueError, match="3 weights for 5 pairs"):
        pack_pairs(items, Packing(0.0, tok.pad_token_id), weights=[1.0] * 3)


# --------------------------------------------------------------------------- end to end


def test_learns_the_marker_word_and_the_reference_stays_the_start(tmp_path, dpo_model_cfg, tiny_model_dir):
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(160))
    out = tmp_path / "run"
    report = train_dpo(str(data), str(out), FAST, dpo_model_cfg)
    rows = [r for r in metrics(out) if "train/loss" in r]
    # at the start the policy is the reference: every implicit reward is 0 and the loss is log 2
    assert rows[0]["train/reward_accuracy"] == 0.0 and rows[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert sum(r["train/reward_accuracy"] for r in rows[-5:]) / 5 > 0.9
    assert rows[-1]["train/loss"] < 0.6 and rows[-1]["train/margin"] > 0
    assert report["eval/reward_accuracy"] > 0.9 and report["eval/pairs"] == 40 and report["eval/margin"] > 0.3
    assert report["kl/heldout"] > 0.1 and report["kl/samples"] == 12 and report["kl/heldout_se"] > 0
    assert json.loads((out / "status.json").read_text())["state"] == "done"
    last = metrics(out)[-1]
    assert {"eval/reward_accuracy", "eval/rewards_chosen", "kl/heldout"} <= set(last)
    assert json.loads((out / "eval_report.json").read_text())["steps"] == report["steps"] == 30

    # the policy's lineage, as PPO writes it (pipeline/orchestrate/ingest.py registers either)
    meta = json.loads((out / "policy" / "model_meta.json").read_text())
    assert meta["parent"] == str(Path(tiny_model_dir).resolve()) and meta["method"] == "dpo"
    assert (meta["loss"], meta["beta"], meta["kind"]) == ("sigmoid", 0.1, "policy")
    assert meta["data_sha256"] == json.loads((out / "config.json").read_text())["data_sha256"]

    # the reference of the trained policy is the starting model, bit for bit
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    trained, tok = load_policy(dpo_model_cfg, adapter_path=out / "policy")
    ids = torch.tensor([tok("the quick brown fox Paris")["input_ids"]])
    with torch.no_grad():
        ref_logits = make_reference(trained)(ids, torch.ones_like(ids))
        assert torch.equal(ref_logits, causal_lm_logits(start, ids, torch.ones_like(ids)))
        assert not torch.allclose(causal_lm_logits(trained, ids, torch.ones_like(ids)), ref_logits, atol=1e-3)


def test_ipo_with_full_fine_tuning_keeps_a_frozen_reference(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(48))
    cfg = ModelConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32", lora=False)
    report = train_dpo(str(data), str(tmp_path / "run"), dataclasses.replace(FAST, loss="ipo", lr=1e-3, max_steps=4),
                       cfg)
    rows = [r for r in metrics(tmp_path / "run") if "train/loss" in r]
    assert rows[0]["train/loss"] == pytest.approx((1 / (2 * 0.1)) ** 2)  # (0 - 1 / (2 beta))^2 at the start
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] and report["steps"] == 4
    # the policy moved, the reference did not: implicit rewards beta * log(pi / ref) are no longer 0
    assert report["eval/margin"] > 0 and report["eval/rewards_chosen"] != 0 and math.isfinite(report["kl/heldout"])
    assert (tmp_path / "run" / "policy" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "run" / "policy" / "model_meta.json").read_text())["loss"] == "ipo"
    # a second round from that fully trained policy keeps the base model as its reference (as PPO
    # does): the policy starts away from it, so the first loss is no longer IPO's loss at pi = ref
    train_dpo(str(data), str(tmp_path / "round2"), dataclasses.replace(FAST, loss="ipo", lr=1e-3, max_steps=1), cfg,
              policy=str(tmp_path / "run" / "policy"))
    first = [r for r in metrics(tmp_path / "round2") if "train/loss" in r][0]
    assert first["train/loss"] != pytest.approx((1 / (2 * 0.1)) ** 2, rel=1e-3)


def test_sigterm_saves_a_checkpoint_and_resume_matches_an_uninterrupted_run(tmp_path, dpo_model_cfg):
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(64))
    cfg = dataclasses.replace(FAST, lr=3e-3, kl_prompts=0)
    full = train_dpo(str(data), str(tmp_path / "full"), cfg, dpo_model_cfg)

    def cancel_at_3(step, metrics):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # what the job runner's cancel sends

    out = tmp_path / "cut"
    result = train_dpo(str(data), str(out), cfg, dpo_model_cfg, on_step=cancel_at_3)
    status = json.loads((out / "status.json").read_text())
    assert result["state"] == "cancelled" and status["state"] == "cancelled" and status["step"] == 3
    assert "SIGTERM" in status["error"] and not (out / "policy").exists()
    assert (out / "checkpoint" / "model_meta.json").is_file() and (out / "trainer_state.pt").is_file()

    resumed = train_dpo(str(data), str(out), cfg, dpo_model_cfg, resume=True)
    steps = [r["step"] for r in metrics(out) if "train/loss" in r]
    assert steps == list(range(1, full["steps"] + 1)) and resumed["steps"] == full["steps"]
    assert resumed["eval/margin"] == pytest.approx(full["eval/margin"], rel=1e-4)
    with pytest.raises(ValueError, match="already finished"):
        train_dpo(str(data), str(out), cfg, dpo_model_cfg, resume=True)


def test_cli_help_errors_and_refusals(tmp_path, tiny_model_dir, capsys):
    done = subprocess.run([sys.executable, "-m", "pipeline", "train-dpo", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "--beta" in done.stdout and "--policy" in done.stdout and "--lora" in done.stdout
    base = ["--model", str(tiny_model_dir), "--device", "cpu", "--kl-prompts", "0"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["--data", str(empty), "--out", str(tmp_path / "a"), *base]) == 2
    assert "empty.jsonl: no pairs" in capsys.readouterr().err
    assert json.loads((tmp_path / "a" / "status.json").read_text())["state"] == "failed"
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(24))
    assert main(["--data", str(data), "--out", str(tmp_path / "b"), "--loss", "hinge", "--beta", "0", *base]) == 2
    err = capsys.readouterr().err
    assert "--loss 'hinge': use sigmoid or ipo" in err and "--beta must be > 0" in err
    assert main(["--data", str(data), "--out", str(tmp_path / "c"), "--policy", str(tmp_path / "nothing"), *base]) != 0
    # a failed start holds nothing of value: the folder is reused; a finished run is never overwritten
    assert main(["--data", str(data), "--out", str(tmp_path / "a"), "--max-steps", "1", *base]) == 0
    assert "held-out implicit-reward accuracy" in capsys.readouterr().out
    assert main(["--data", str(data), "--out", str(tmp_path / "a"), *base]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_sigterm_to_the_cli_exits_130_with_a_checkpoint(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(400))
    out = tmp_path / "job"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "train-dpo", "--data", str(data), "--out", str(out),
                             "--model", str(tiny_model_dir), "--device", "cpu", "--lora-r", "4", "--batch-size", "2",
                             "--epochs", "50"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    wait_for(lambda: read_status(out).get("step", 0) >= 1, what="a finished step")  # as a job runner sees it
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, output[-2000:]
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "cancelled" and "SIGTERM" in status["error"]
    step = torch.load(out / "trainer_state.pt", weights_only=False)["step"]
    assert 1 <= step < status["total"] and (out / "checkpoint" / "adapter_model.safetensors").is_file()


def test_pair_weights_count_as_their_share_of_the_mean(tmp_path, dpo_model_cfg):
    """No weight column, all-ones or all-equal weights train exactly as before; mixed weights change
    the run unless --use-weights false; config.json and the report say which."""
    rows = marker_pairs(32)
    cfg = dataclasses.replace(FAST, epochs=1, max_steps=3, kl_prompts=0)

    def run(name, weights, **kw):
        data = write_jsonl(tmp_path / f"{name}.jsonl", [dict(r, weight=w) for r, w in zip(rows, weights)])
        report = train_dpo(str(data), str(tmp_path / name), dataclasses.replace(cfg, **kw), dpo_model_cfg)
        assert json.loads((tmp_path / name / "config.json").read_text())["weighted"] == report["train/weighted"]
        return report, [r["train/loss"] for r in metrics(tmp_path / name) if "train/loss" in r]

    plain, plain_losses = run("plain", [None] * 32)
    assert not plain["train/weighted"] and len(plain_losses) == 3
    for name, weights in (("ones", [1.0] * 32), ("equal", [0.3] * 32)):
        report, losses = run(name, weights)
        assert not report["train/weighted"] and losses == plain_losses
    mixed = [0.1 if i % 3 else 2.0 for i in range(32)]
    weighted, weighted_losses = run("mixed", mixed)
    assert weighted["train/weighted"] and weighted_losses != plain_losses
    ignored, ignored_losses = run("ignored", mixed, use_weights=False)
    assert not ignored["train/weighted"] and ignored_losses == plain_losses


def test_down_weighted_label_noise_is_learned_through(tmp_path, dpo_model_cfg):
    """Half the pairs are label-flipped noise: unweighted, the marker's signal cancels out; with the
    noisy pairs down-weighted (as an annotator of low quality is), the policy learns the marker."""
    clean = [dict(r, weight=1.0) for r in marker_pairs(48)]
    noise = [dict(r, chosen=r["rejected"], rejected=r["chosen"], weight=0.05) for r in marker_pairs(48, seed=1)]
    data = write_jsonl(tmp_path / "pairs.jsonl", clean + noise)
    held_out = write_jsonl(tmp_path / "eval.jsonl", marker_pairs(24, seed=2))
    cfg = dataclasses.replace(FAST, epochs=3, kl_prompts=0, eval_data=str(held_out))
    weighted = train_dpo(str(data), str(tmp_path / "weighted"), cfg, dpo_model_cfg)
    plain = train_dpo(str(data), str(tmp_path / "plain"), dataclasses.replace(cfg, use_weights=False), dpo_model_cfg)
    assert weighted["train/weighted"] and not plain["train/weighted"]
    print(f"held-out accuracy {weighted['eval/reward_accuracy']:.3f} weighted, {plain['eval/reward_accuracy']:.3f} "
          f"plain; margin {weighted['eval/margin']:.3f}, {plain['eval/margin']:.3f}")
    # measured: accuracy 0.79 against 0.38, margin 0.75 against -0.04 (24 clean held-out pairs)
    assert weighted["eval/reward_accuracy"] > 0.7 and weighted["eval/margin"] > 0.3
    assert weighted["eval/reward_accuracy"] > plain["eval/reward_accuracy"] + 0.2
    assert weighted["eval/margin"] > plain["eval/margin"] + 0.3
