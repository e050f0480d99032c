"""The PPO run directory: status.json, metrics.jsonl, checkpoints, and cancellation.

pipeline/train_ppo.py writes through these so a job runner tailing RUN_DIR never reads half a
file: JSON is written beside its target and renamed over it, and a checkpoint is written as a new
folder that replaces the old one in two renames. SIGTERM / Ctrl-C only set a flag that the loop
checks between phases and minibatches, so a cancel never interrupts a write.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import torch

from pipeline.models import save_policy, save_scalar_model

STATE_FILE = "trainer_state.pt"


# --------------------------------------------------------------------------- run directory


def write_json(path: Path, data: dict) -> None:
    """Write JSON beside `path`, then rename it over: readers see the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)  # readers never see half a file


class RunStatus:
    """status.json for the job runner: {state, step, total, progress, updated_at, error}."""

    def __init__(self, out: Path, total: int):
        self.path, self.total = out / "status.json", total

    def write(self, state: str, step: int, error: str | None = None) -> None:
        write_json(self.path, {"state": state, "step": step, "total": self.total,
                                "progress": round(step / self.total, 4), "updated_at": time.time(), "error": error})


def truncate_metrics(path: Path, step: int) -> None:
    """Keep metric lines up to `step` (a resumed run rewrites the steps after its checkpoint)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    os.replace(tmp, path)


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
    from pipeline.models import is_peft

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


# --------------------------------------------------------------------------- cancellation


class Cancelled(Exception):
    """SIGTERM or Ctrl-C arrived; the run stops at the next safe point."""


class StopFlag:
    """SIGTERM/SIGINT set a flag that the loop checks between phases and minibatches, so a
    cancel never interrupts a write. A second signal stops at once."""

    def __init__(self):
        self.signal: str | None = None
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def check(self) -> None:
        if self.signal is not None:
            raise Cancelled(f"cancelled by {self.signal}")


__all__ = ["RunStatus", "truncate_metrics", "save_checkpoint", "recover_checkpoint", "load_checkpoint",
           "Cancelled", "StopFlag", "write_json"]
