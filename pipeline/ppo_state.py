"""PPO checkpoints: RUN_DIR/checkpoint holds everything `--resume` needs.

A checkpoint is written as a new folder that replaces the old one in two renames, so a kill
mid-save leaves the previous one (the rest of the run directory: pipeline/rundir.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from pipeline.models import is_peft, save_policy, save_scalar_model

STATE_FILE = "trainer_state.pt"


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
    _load_policy_weights(policy, ckpt / "policy")
    state = torch.load(state_path, map_location=device, weights_only=False)
    policy_opt.load_state_dict(state["policy_optim"])
    critic_opt.load_state_dict(state["critic_optim"])
    policy_sched.load_state_dict(state["policy_sched"])
    critic_sched.load_state_dict(state["critic_sched"])
    kl_ctl.load_state_dict(state["kl"])
    return int(state["step"])


def _load_policy_weights(policy, folder: Path) -> None:
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


__all__ = ["save_checkpoint", "recover_checkpoint", "load_checkpoint"]
