"""The PPO run's state: built in phase 0 (`set_up`), saved in RUN_DIR/checkpoint, restored by --resume.

`set_up` loads the four roles (policy, reference, reward, critic), builds optimisers, schedules and
the KL controller, and restores a checkpoint when resuming. A checkpoint is written as a new folder
that replaces the old one in two renames, so a kill mid-save leaves the previous one (the rest of
the run directory: pipeline/rundir.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pipeline.config import ModelConfig, PPOConfig, to_dict
from pipeline.kl import make_kl_controller
from pipeline.models import (
    autocast, is_peft, load_scalar_model, pick_device, pick_dtype, read_meta,
)
from pipeline.saving import save_policy, save_scalar_model
from pipeline.policy import load_policy, make_reference
from pipeline.rollout import read_ptx_texts
from pipeline.rundir import truncate_metrics, write_json
from pipeline.scoring import make_reward
from pipeline.text import read_prompts

STATE_FILE = "trainer_state.pt"
CHECKPOINT = "checkpoint"


# --------------------------------------------------------------------------- phase 0: set-up




@dataclass
class RunParts:
    """What phase 0 builds: the four roles, optimisers, schedules, KL controller, inputs."""
    device: torch.device
    autocast: Callable[[], contextlib.AbstractContextManager]
    policy: torch.nn.Module
    tokenizer: object
    parent: str
    reference: torch.nn.Module
    score_fn: Callable
    critic: torch.nn.Module
    opts: tuple
    scheds: tuple
    kl: object
    start: int  # the step to continue from (0, or the checkpoint's)
    rows: list  # prompts file rows
    ptx_texts: list
    sample_logprobs: bool  # pi_old from the sampling pass (else one forward pass)


def set_up(cfg: PPOConfig, model_cfg: ModelConfig, *, prompts: str, reward: str, out: Path, policy: str,
           critic_init: str, resuming: bool) -> RunParts:
    """Phase 0: load the four roles, build optimisers and schedules, restore a checkpoint when
    resuming (metrics after its step are dropped), and write config.json."""
    ckpt = out / CHECKPOINT
    device = pick_device(model_cfg.device)
    dtype = pick_dtype(model_cfg.dtype, device)
    if dtype == torch.float16:
        raise ValueError("--dtype fp16: PPO here has no loss scaling; use bf16 (or fp32)")
    amp = functools.partial(autocast, device, dtype)
    torch.manual_seed(cfg.seed)
    rows = read_prompts(prompts)
    policy_model, tokenizer, parent = load_starting_policy(policy, model_cfg, device, dtype)
    reference = make_reference(policy_model)  # before any resume: the *starting* policy
    score_fn, rm = make_reward(reward, tokenizer, model_cfg, cfg.forward_batch_size, amp)
    critic_src = str(ckpt / "critic") if resuming else (
        critic_init or (reward if rm is not None else policy_model.rlhf_meta["base_model"]))
    critic, _ = load_scalar_model(critic_src, kind="critic", cfg=_master_cfg(model_cfg, critic_src, device, dtype))
    policy_opt = _adamw(trainable(policy_model), cfg.lr)
    critic_opt = _adamw(trainable(critic), cfg.critic_lr)
    # linear decay to 0 over the run (TRL's default schedule); stepped once per PPO iteration
    decay = (lambda s: max(0.0, 1.0 - s / cfg.steps)) if cfg.lr_decay else (lambda s: 1.0)
    policy_sched = torch.optim.lr_scheduler.LambdaLR(policy_opt, decay)
    critic_sched = torch.optim.lr_scheduler.LambdaLR(critic_opt, decay)
    kl_ctl = make_kl_controller(cfg.kl_control, cfg.init_kl_coef, cfg.kl_target, cfg.kl_horizon)
    start = 0
    if resuming:
        saved_base = read_meta(ckpt / "policy").get("base_model")
        if saved_base != policy_model.rlhf_meta["base_model"]:
            raise ValueError(f"{ckpt}: the checkpoint trains {saved_base}, but --policy starts from "
                             f"{policy_model.rlhf_meta['base_model']}; resume with the run's --policy")
        start = load_checkpoint(ckpt, policy_model, policy_opt, critic_opt, policy_sched, critic_sched, kl_ctl, device)
    truncate_metrics(out, start)
    ptx_texts = read_ptx_texts(cfg.ptx_data) if cfg.ptx_coef > 0 else []
    write_json(out / "config.json", {
        "stage": "ppo", "policy": policy or model_cfg.model, "parent": parent, "reward": reward,
        "critic_init": critic_src, "prompts": str(prompts), "resumed_from_step": start,
        "ppo": to_dict(cfg), "model": to_dict(model_cfg)})
    return RunParts(
        device=device, autocast=amp, policy=policy_model, tokenizer=tokenizer, parent=parent, reference=reference,
        score_fn=score_fn, critic=critic, opts=(policy_opt, critic_opt), scheds=(policy_sched, critic_sched),
        kl=kl_ctl, start=start, rows=rows, ptx_texts=ptx_texts,
        sample_logprobs=cfg.old_logprobs == "sample" or (cfg.old_logprobs == "auto" and dtype == torch.float32))


def load_starting_policy(policy: str, model_cfg: ModelConfig, device, dtype):
    """(policy, tokenizer, parent): --policy is a folder saved by save_policy (its adapter keeps
    training; the reference is then the base model, adapter disabled: KL stays measured against
    the original model across rounds, as InstructGPT keeps the SFT model), or a base model."""
    if policy and (Path(policy) / "model_meta.json").is_file():
        meta = read_meta(policy)
        cfg = _master_cfg(model_cfg, policy, device, dtype, lora=bool(meta.get("lora")))
        model, tokenizer = load_policy(cfg, adapter_path=policy)
        return model, tokenizer, str(Path(policy).resolve())
    cfg = dataclasses.replace(model_cfg, model=policy or model_cfg.model)
    model, tokenizer = load_policy(_master_cfg(cfg, "", device, dtype, lora=cfg.lora))
    return model, tokenizer, model.rlhf_meta["base_model"]


def _master_cfg(model_cfg: ModelConfig, folder: str, device, dtype, lora: bool | None = None) -> ModelConfig:
    """Fully trained weights stay fp32 masters under bf16/fp16 autocast on CUDA; LoRA keeps a
    low-precision frozen base (models.py already keeps the LoRA parameters in fp32)."""
    if lora is None:
        lora = bool(read_meta(folder).get("lora")) if (Path(folder) / "model_meta.json").is_file() else model_cfg.lora
    if torch.device(device).type == "cuda" and dtype != torch.float32 and not lora:
        return dataclasses.replace(model_cfg, dtype="fp32")
    return model_cfg


def _adamw(params: list, lr: float) -> torch.optim.AdamW:
    """AdamW without weight decay (TRL's PPO default); the fused kernel when the parameters allow
    it (about 6x faster than the per-tensor loop for a fully trained 135M critic on CPU)."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------- checkpoints


def save_checkpoint(ckpt: Path, state: dict) -> None:
    """checkpoint/: policy (adapter or full), critic, optimisers, schedulers, KL controller, step.
    Written beside the old one and swapped in, so a kill mid-save leaves the previous checkpoint."""
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_policy(state["policy"], state["tokenizer"], tmp / "policy")
    save_scalar_model(state["critic"], state["tokenizer"], tmp / "critic")
    torch.save({"step": state["step"], "policy_optim": state["opts"][0].state_dict(),
                "critic_optim": state["opts"][1].state_dict(), "policy_sched": state["scheds"][0].state_dict(),
                "critic_sched": state["scheds"][1].state_dict(), "kl": state["kl"].state_dict()},
               tmp / STATE_FILE)
    old = ckpt.with_name(ckpt.name + ".old")
    if ckpt.exists():
        os.replace(ckpt, old)
    os.replace(tmp, ckpt)
    if old.exists():
        shutil.rmtree(old)


def recover_checkpoint(ckpt: Path) -> None:
    """A kill between the two renames of save_checkpoint leaves only checkpoint.old: put it back."""
    old = ckpt.with_name(ckpt.name + ".old")
    if not ckpt.exists() and old.is_dir():
        os.replace(old, ckpt)


def load_checkpoint(ckpt: Path, policy, policy_opt, critic_opt, policy_sched, critic_sched, kl_ctl, device) -> int:
    """Restore the policy weights, optimisers, schedules and KL controller; returns the step."""
    state_path = ckpt / STATE_FILE
    if not state_path.is_file():
        raise ValueError(f"{ckpt}: no {STATE_FILE} (an incomplete checkpoint)")
    load_policy_weights(policy, ckpt / "policy")
    state = torch.load(state_path, map_location=device, weights_only=False)
    policy_opt.load_state_dict(state["policy_optim"])
    critic_opt.load_state_dict(state["critic_optim"])
    policy_sched.load_state_dict(state["policy_sched"])
    critic_sched.load_state_dict(state["critic_sched"])
    kl_ctl.load_state_dict(state["kl"])
    return int(state["step"])


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


__all__ = ["RunParts", "set_up", "load_starting_policy", "trainable", "save_checkpoint", "recover_checkpoint",
           "load_checkpoint", "CHECKPOINT"]
