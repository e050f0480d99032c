"""GPU tests: PPO and reward training on a tiny model in bf16 on CUDA, through the stages' own
entry points (their run directories' metrics.jsonl and status.json), LoRA and full fine-tuning,
resume, and the scalar heads kept in fp32 under bf16.

Skipped without CUDA (tests/conftest.py). bench/gpu_check.py runs them on the GPU machine with
`pytest --noconftest -p tests.fixtures_models -m gpu` (conftest imports the store, which is not
installed there), and in its dry run on the CPU with RLHF_TEST_DEVICE=cpu, so their code is
exercised wherever the check is.
"""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

from pipeline.config import ModelConfig
from pipeline.models import load_scalar_model
from pipeline.saving import save_scalar_model

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("RLHF_TEST_DEVICE", "cuda")
PROMPTS = ["How can I shop?", "What is the capital of France?", "Tell me about bread.", "Guitar tips?"]
WORDS = "the a of bread shop guitar chords rise flour water salt price store daily simple".split()


def read(run_dir, name="metrics.jsonl"):
    text = (run_dir / name).read_text()
    return [json.loads(line) for line in text.splitlines()] if name.endswith(".jsonl") else json.loads(text)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture
def reward_dir(tmp_path, tiny_model_dir):
    """A reward model on the device in bf16 (backbone bf16, head fp32), saved like a trained one."""
    cfg = ModelConfig(model=str(tiny_model_dir), device=DEVICE, dtype="bf16", lora=False)
    torch.manual_seed(0)
    rm, tok = load_scalar_model(str(tiny_model_dir), kind="reward", cfg=cfg)
    return save_scalar_model(rm, tok, tmp_path / "rm")


def ppo(tiny_model_dir, prompts, reward, out, *extra) -> int:
    from pipeline.train_ppo import main

    return main(["--model", str(tiny_model_dir), "--reward", str(reward), "--prompts", str(prompts),
                 "--out", str(out), "--device", DEVICE, "--dtype", "bf16", "--batch-size", "8",
                 "--mini-batch-size", "4", "--micro-batch-size", "4", "--max-new-tokens", "8", "--temperature",
                 "1.0", "--kl-control", "fixed", "--init-kl-coef", "0.1", "--sample-every", "0",
                 "--lora-r", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,lm_head", *extra])


def test_ppo_lora_bf16(tmp_path, tiny_model_dir, prompts_file, reward_dir):
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out = tmp_path / "run"
    assert ppo(tiny_model_dir, prompts_file, reward_dir, out, "--steps", "3", "--lr", "5e-2",
               "--critic-lr", "5e-2") == 0
    rows = read(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and read(out, "status.json")["state"] == "done"
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("objective/score", "objective/kl", "policy/loss", "val/loss"))
        # pi_theta == pi_old on the first minibatch: 1 up to bf16 rounding of the forward
        assert r["policy/ratio_first"] == pytest.approx(1.0, abs=2e-2)
    assert rows[0]["objective/kl"] == pytest.approx(0.0, abs=2e-2)  # the adapter starts as a no-op
    assert rows[-1]["objective/kl"] > rows[0]["objective/kl"] + 1e-3  # and the policy moved
    assert (out / "policy" / "adapter_model.safetensors").is_file()
    if DEVICE == "cuda":
        assert torch.cuda.max_memory_allocated() > 0  # the run's tensors were on the GPU


def test_ppo_full_fine_tuning_bf16_keeps_a_frozen_reference(tmp_path, tiny_model_dir, prompts_file, reward_dir):
    out = tmp_path / "full"
    assert ppo(tiny_model_dir, prompts_file, reward_dir, out, "--steps", "3", "--lr", "3e-2", "--lora", "false") == 0
    rows = read(out)
    assert rows[0]["objective/kl"] == pytest.approx(0.0, abs=2e-2)
    assert rows[-1]["objective/kl"] > 0.02  # the policy moved, the reference did not follow
    assert (out / "policy" / "model.safetensors").is_file()


def test_ppo_resume_on_the_device(tmp_path, tiny_model_dir, prompts_file, reward_dir):
    out = tmp_path / "resume"
    assert ppo(tiny_model_dir, prompts_file, reward_dir, out, "--steps", "2", "--kl-control", "adaptive",
               "--kl-target", "0.5", "--kl-horizon", "32") == 0
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False, map_location="cpu")
    assert state["step"] == 2 and all("exp_avg" in s for s in state["policy_optim"]["state"].values())
    beta = state["kl"]["value"]
    assert beta != 0.1  # the adaptive controller moved and was saved
    assert ppo(tiny_model_dir, prompts_file, reward_dir, out, "--steps", "3", "--kl-control", "adaptive",
               "--kl-target", "0.5", "--kl-horizon", "32", "--resume") == 0
    rows = read(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and read(out, "status.json")["state"] == "done"
    assert rows[2]["kl/beta"] == pytest.approx(beta, rel=1e-6)  # step 3 used the restored controller


def marker_pairs(n: int, seed: int = 0) -> list[dict]:
    """Chosen responses contain 'Paris', rejected ones never; lengths random on both sides."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        chosen = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        chosen.insert(rng.randint(0, len(chosen)), "Paris")
        rejected = [rng.choice(WORDS) for _ in range(rng.randint(4, 9))]
        rows.append({"prompt": f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(4)),
                     "chosen": " ".join(chosen), "rejected": " ".join(rejected)})
    return rows


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_reward_training_bf16_learns_and_reloads(tmp_path, tiny_model_dir, lora):
    from pipeline.train_reward import main

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in marker_pairs(160)))
    out = tmp_path / "rm"
    # lr 3e-3: held-out accuracy 0.95-1.00 over data and training seeds 0-5, LoRA and full, on a CPU
    # with native bf16 (AVX512-BF16); 1e-2 diverged there (LoRA: loss 5.3, accuracy 0.65)
    args = ["--data", str(data), "--out", str(out), "--model", str(tiny_model_dir), "--device", DEVICE,
            "--dtype", "bf16", "--epochs", "3", "--lr", "3e-3", "--batch-size", "8", "--norm-samples", "0",
            "--eval-fraction", "0.25", "--lora-r", "8", "--lora-alpha", "16"]
    assert main(args + ["--lora", str(lora).lower()]) == 0
    lines = read(out)
    assert all(math.isfinite(line["train/loss"]) for line in lines if "train/loss" in line)
    accuracy = [line["eval/accuracy"] for line in lines if "eval/accuracy" in line][-1]
    assert accuracy > 0.85  # the marker word is learnt in bf16 as in fp32 (tests/test_train_reward.py)
    rm, _ = load_scalar_model(str(out / "checkpoint"), kind="reward",
                              cfg=ModelConfig(model=str(tiny_model_dir), device=DEVICE, dtype="bf16"))
    assert (rm.lora is not None) == lora and rm.head.weight.dtype == torch.float32


def test_scalar_heads_stay_fp32_over_a_bf16_backbone(tiny_model_dir):
    """Backbone in bf16, LoRA and head weights fp32; the scores the reward trainer uses
    (reward_eval.pair_scores) come out of the head in fp32 under the run's bf16 autocast."""
    from pipeline.models import autocast, pick_device
    from pipeline.reward_eval import pair_scores

    cfg = ModelConfig(model=str(tiny_model_dir), device=DEVICE, dtype="bf16", lora=True, lora_r=4, lora_alpha=8)
    device = pick_device(DEVICE)
    for kind in ("reward", "critic"):
        model, tok = load_scalar_model(str(tiny_model_dir), kind=kind, cfg=cfg)
        frozen = [p for p in model.backbone.parameters() if not p.requires_grad]
        assert frozen and all(p.dtype == torch.bfloat16 and p.device.type == device.type for p in frozen)
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert trainable and all(p.dtype == torch.float32 for p in trainable)  # LoRA and head: fp32 masters
        assert model.head.weight.dtype == torch.float32
        enc = tok(["Tell me about bread.", "Guitar tips?"], return_tensors="pt", padding=True).to(device)
        with autocast(device, torch.bfloat16):
            scores, _ = pair_scores(model, enc["input_ids"], enc["attention_mask"])
        assert scores.dtype == torch.float32 and torch.isfinite(scores).all()
        with torch.no_grad():  # outside autocast: the same scores from ScalarModel.score, in fp32
            plain = model.score(enc["input_ids"], enc["attention_mask"])
        assert plain.dtype == torch.float32
