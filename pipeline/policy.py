"""The policy and its reference: loading a causal LM (+LoRA), its logits, its log-probs of responses.

- policy: a causal LM, a LoRA adapter on it by default (peft), full fine-tuning as an option;
  `load_policy` reloads a folder saved by `pipeline.saving.save_policy` exactly;
  `sampling_policy` loads one to sample from (no fresh adapter, a saved one merged: the generate
  stage and the chat sampler).
- reference: the frozen base model, one convention for PPO and DPO in every training mode, so KL
  is measured against the same model in every round (as InstructGPT keeps the SFT model). With
  LoRA it is the same model with the adapter disabled (peft's `disable_adapter()` context: no
  second copy); with full fine-tuning frozen full weights: a copy of the policy when it starts
  from the base, else the base model loaded (`make_reference(policy, base=...)`).
- responses, for every trainer and evaluation alike: `response_logits` / `response_logprobs` at
  the cells of a packed batch that predict the response tokens (pipeline/packing.pack_responses);
  `sampled_kl`, the one KL of sampled responses to the reference outside PPO's rollout (DPO's
  held-out KL, the gold experiment's evaluation); `merged_lora`, the LoRA deltas merged for
  sampling, the reference left bit for bit the base model.
- a training run's start, the same for PPO and DPO: `load_starting_policy` (a saved policy or the
  base model), `starting_reference` (the reference above), `load_policy_weights` (a checkpoint's
  weights into the built policy, on --resume), `trainable`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from pipeline import packing
from pipeline.config import ModelConfig
from pipeline.losses import logprobs_from_logits
from pipeline.models import (
    META_FILE, _canonical_base, _fp32_trainables, _lora_config, attn_ratio, enable_checkpointing, is_peft,
    load_tokenizer, lora_settings, pick_device, pick_dtype, position_ids_from_mask, read_meta, resolve_model_path,
)


def load_policy(cfg: ModelConfig, adapter_path: str | os.PathLike | None = None):
    """(policy, tokenizer): a causal LM on cfg's device/dtype, LoRA-wrapped when cfg.lora.

    With adapter_path (a folder from save_policy; cfg.model may also name one) the saved policy is
    reloaded exactly: its model_meta.json decides the base model and the LoRA settings, not cfg.
    Returned in eval mode (Llama has no dropout); trainable parameters have requires_grad=True.
    """
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    if adapter_path is None and (Path(cfg.model).expanduser() / META_FILE).is_file():
        adapter_path = cfg.model  # --model given a saved policy folder: reload it
    meta = read_meta(adapter_path) if adapter_path else None
    if meta is not None and meta.get("kind") != "policy":
        raise ValueError(f"{adapter_path}: a {meta.get('kind')} checkpoint, not a policy")
    base = meta["base_model"] if meta else _canonical_base(cfg.model)
    lora = (meta["lora"] if meta else (lora_settings(cfg) if cfg.lora else None))
    weights = str(adapter_path) if meta and not lora else resolve_model_path(base, cfg.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype).to(device)
    tokenizer = load_tokenizer(adapter_path if meta else weights)
    if lora:
        if meta:
            model = PeftModel.from_pretrained(model, str(adapter_path), is_trainable=True)
        else:
            model = get_peft_model(model, _lora_config(model, lora, "CAUSAL_LM"))
        _fp32_trainables(model)
    else:
        model.requires_grad_(True)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
    model.eval()
    model.rlhf_meta = {"kind": "policy", "base_model": base, "lora": lora}
    return model, tokenizer


def sampling_policy(adapter: str, model_cfg: ModelConfig):
    """(policy, tokenizer, the name its responses record) for sampling. Sampling never trains: no
    fresh (all-zero) adapter without an adapter folder, and a saved adapter is merged into the
    weights so each step runs plain matmuls."""
    policy, tokenizer = load_policy(dataclasses.replace(model_cfg, lora=False) if not adapter else model_cfg,
                                    adapter_path=adapter)
    meta = policy.rlhf_meta
    if adapter and meta["lora"]:
        policy = policy.merge_and_unload()
    return policy, tokenizer, str(Path(adapter).resolve()) if adapter else meta["base_model"]


def causal_lm_logits(model, input_ids, attention_mask, logits_to_keep: int = 0) -> torch.Tensor:
    """Logits (B, T, V) of a causal LM with pad-aware positions; logits_to_keep=N keeps the last N."""
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask),
                use_cache=False, logits_to_keep=logits_to_keep)
    return out.logits


def packed_lm_logits(model, packed, cells: torch.Tensor, frozen: str | None = None) -> torch.Tensor:
    """(N, V) logits at N cells of a packed batch (pipeline/packing.py): the LM head runs on
    those cells only. The same as `causal_lm_logits` at those cells up to float rounding, for
    models whose logits are lm_head(decoder output), as Llama-style models' are. frozen: see
    packing.hidden_states."""
    base = model.get_base_model() if is_peft(model) else model
    if getattr(base.config, "final_logit_softcapping", None) or getattr(base.config, "logit_scale", None):
        raise ValueError(f"{type(base).__name__}: logits are post-processed after the LM head; "
                         "packed forwards support plain lm_head(hidden) models only")
    hidden = packing.hidden_states(base.get_decoder(), packed, frozen)[cells]  # (N, H)
    return base.get_output_embeddings()(hidden)  # (N, V)


class Reference(nn.Module):
    """The frozen base model: `reference(input_ids, attention_mask, logits_to_keep=0) -> logits`.

    With LoRA this holds no weights of its own: it runs the policy with the adapter disabled. The
    policy is kept outside the module tree so it is never counted, saved or moved twice. With full
    fine-tuning it holds frozen weights: `base` when given, else a copy of the policy made now.
    """

    def __init__(self, policy: nn.Module, base: nn.Module | None = None):
        super().__init__()
        if is_peft(policy):
            self.__dict__["policy"] = policy  # not registered as a submodule
            self.frozen = None
        else:
            self.__dict__["policy"] = None
            self.frozen = (base if base is not None else copy.deepcopy(policy)).eval().requires_grad_(False)

    @torch.no_grad()
    def forward(self, input_ids, attention_mask, logits_to_keep: int = 0) -> torch.Tensor:
        if self.frozen is not None:
            return causal_lm_logits(self.frozen, input_ids, attention_mask, logits_to_keep)
        with self.policy.disable_adapter():
            return causal_lm_logits(self.policy, input_ids, attention_mask, logits_to_keep)

    @torch.no_grad()
    def packed_logits(self, packed, cells: torch.Tensor) -> torch.Tensor:
        """(N, V) reference logits at N cells of a packed batch (see packed_lm_logits)."""
        if self.frozen is not None:
            return packed_lm_logits(self.frozen, packed, cells, frozen="reference")
        with self.policy.disable_adapter():  # the base weights: never trained, so a prefix's KV is kept
            return packed_lm_logits(self.policy, packed, cells, frozen="reference")


def make_reference(policy: nn.Module, base: nn.Module | None = None) -> Reference:
    """The reference for KL: the adapter disabled (LoRA), or with full fine-tuning `base` (the base
    model, loaded by the caller when the policy's weights are an earlier round's) or a frozen copy
    of the policy made now (it is the base)."""
    return Reference(policy, base)


# --------------------------------------------------------------------------- responses: log-probs, KL, sampling


def response_logits(model, pr: packing.PackedResponses, reference: bool = False) -> torch.Tensor:
    """(N, V) logits predicting the N real response tokens; the LM head runs on those cells only
    (a 49k-vocabulary head is ~20% of a SmolLM2 forward per position)."""
    if reference:  # a Reference: adapter disabled, or the frozen copy
        return model.packed_logits(pr.packed, pr.index)
    return packed_lm_logits(model, pr.packed, pr.index)


def response_logprobs(logits: torch.Tensor, pr: packing.PackedResponses, temperature: float) -> torch.Tensor:
    """(b, R) log-probs of the response tokens under logits / temperature, 0 past EOS."""
    return pr.scatter(logprobs_from_logits(logits[None], pr.tokens[None], temperature)[0])


def sampled_kl(policy, reference, sb, temperature: float, *, logprobs: torch.Tensor | None = None,
               share_prefix: bool = True) -> torch.Tensor:
    """(B,) k1 estimate of KL(pi || pi_ref) of each sampled response (a pipeline.sampling
    SampleBatch), in nats: the sum over its tokens of log pi - log pi_ref, both of logits /
    temperature, the reference's from one packed forward. log pi: `logprobs` when given (the
    sampling pass's, sb.logprobs), else one forward of the policy."""
    mask = sb.response_mask.float()
    pr = packing.pack_responses(sb.sequences, sb.attention_mask, sb.response_ids, mask, sb.prompt_length,
                                attn_ratio(policy), share_prefix=share_prefix)
    ref = response_logprobs(response_logits(reference, pr, reference=True), pr, temperature)
    logp = logprobs if logprobs is not None else response_logprobs(response_logits(policy, pr), pr, temperature)
    return ((logp - ref) * mask).sum(1)


@contextmanager
def merged_lora(model):
    """Run the body with the LoRA deltas merged into the base weights (W + s * B @ A) and the
    adapter layers switched off, so sampling runs one plain linear per layer and decoding step
    instead of base + adapter.

    peft's merge_adapter() adds in place and unmerges by subtracting, which is not bit-exact in
    floats, and the reference (adapter disabled) must stay the starting model bit for bit. So the
    merged weights are new tensors and the original ones are put back afterwards: peak memory
    grows by one copy of the adapted weights while sampling. A model without LoRA is left as is.
    """
    if not is_peft(model):
        yield model
        return
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if any(any(layer.use_dora.values()) for layer in layers):  # DoRA's magnitude is not in the delta
        yield model
        return
    originals = [layer.get_base_layer().weight.data for layer in layers]
    with model.disable_adapter():  # the LoRA layers now run their base layer only
        try:
            for layer, weight in zip(layers, originals):
                names = [n for n in layer.active_adapters if n in layer.lora_A or n in layer.lora_embedding_A]
                if names:
                    delta = sum(layer.get_delta_weight(n) for n in names)  # scaling s included
                    layer.get_base_layer().weight.data = weight + delta.to(weight.dtype)
            yield model
        finally:
            for layer, weight in zip(layers, originals):
                layer.get_base_layer().weight.data = weight


# --------------------------------------------------------------------------- a run's starting policy


def load_starting_policy(policy: str, model_cfg: ModelConfig, device, dtype):
    """(policy, tokenizer, parent): --policy is a folder saved by save_policy (its adapter or its
    full weights keep training), or a base model. The reference is the base model either way
    (`starting_reference`)."""
    if policy and (Path(policy) / "model_meta.json").is_file():
        meta = read_meta(policy)
        cfg = master_cfg(model_cfg, policy, device, dtype, lora=bool(meta.get("lora")))
        model, tokenizer = load_policy(cfg, adapter_path=policy)
        return model, tokenizer, str(Path(policy).resolve())
    cfg = dataclasses.replace(model_cfg, model=policy or model_cfg.model)
    model, tokenizer = load_policy(master_cfg(cfg, "", device, dtype, lora=cfg.lora))
    return model, tokenizer, model.rlhf_meta["base_model"]


def starting_reference(policy_model, policy: str, model_cfg: ModelConfig, device, dtype):
    """The KL reference of PPO and DPO alike: the base model, in every training mode and round.
    With LoRA the adapter is disabled; with full fine-tuning from the base, a frozen copy of the
    starting weights; from an earlier round's fully trained --policy, the base model loaded (not
    that round's weights: KL stays measured against one model across rounds, as with LoRA)."""
    if is_peft(policy_model) or not (policy and (Path(policy) / META_FILE).is_file()):
        return make_reference(policy_model)
    base_cfg = dataclasses.replace(model_cfg, model=policy_model.rlhf_meta["base_model"], lora=False)
    base, _ = load_policy(master_cfg(base_cfg, "", device, dtype, lora=False))
    return make_reference(policy_model, base=base)


def master_cfg(model_cfg: ModelConfig, folder: str, device, dtype, lora: bool | None = None) -> ModelConfig:
    """Fully trained weights stay fp32 masters under bf16/fp16 autocast on CUDA; LoRA keeps a
    low-precision frozen base (models.py already keeps the LoRA parameters in fp32)."""
    if lora is None:
        lora = bool(read_meta(folder).get("lora")) if (Path(folder) / "model_meta.json").is_file() else model_cfg.lora
    if torch.device(device).type == "cuda" and dtype != torch.float32 and not lora:
        return dataclasses.replace(model_cfg, dtype="fp32")
    return model_cfg


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def load_policy_weights(policy, folder: Path) -> None:
    """Copy saved policy weights into the already-built policy (whose reference is the start)."""
    if is_peft(policy):
        from peft import load_peft_weights, set_peft_model_state_dict

        set_peft_model_state_dict(policy, load_peft_weights(str(folder), device=str(policy.device)))
    else:
        if (folder / "model.safetensors").is_file():
            from safetensors.torch import load_file

            weights = load_file(str(folder / "model.safetensors"), device=str(policy.device))
            missing, unexpected = policy.load_state_dict(weights, strict=False)
            missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings: not saved
            if missing or unexpected:
                raise ValueError(f"{folder}: the saved policy does not match the model "
                                 f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        else:  # a large model saved in shards
            from transformers.trainer_utils import load_sharded_checkpoint

            load_sharded_checkpoint(policy, str(folder))
