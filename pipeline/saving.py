"""Saving the roles: each is a folder written whole or not at all.

A folder is written under a temporary name beside its target and renamed over it, so a reader
(the job runner, a resumed run, the app) sees the old folder or the new one, never half of one;
`recover_folder` undoes what a kill between the two renames leaves. Every saved role holds
`model_meta.json` (kind, base model, LoRA, reward normalisation), the tokenizer, and the LoRA
adapter only or the full weights; `pipeline.models.load_scalar_model` and
`pipeline.policy.load_policy` reload them exactly. Under FSDP `save_whole_policy` gathers a
sharded policy's whole weights (every rank calls it) and rank 0 saves them (`GatheredPolicy`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from torch import nn

from pipeline.distributed import Dist, full_state_dict
from pipeline.models import HEAD_FILE, META_FILE, ScalarModel, make_tmp_dir


def recover_folder(out_dir: Path) -> None:
    """Undo what a kill in the middle of `atomic_folder` left: the old folder renamed aside but
    the new one not yet in place is put back; half-written temporary folders are removed. One
    writer per run directory, so whatever is there is stale."""
    out_dir = Path(out_dir)
    olds = sorted(out_dir.parent.glob(f".{out_dir.name}-old-*"))
    if not out_dir.exists() and olds:
        olds.pop().rename(out_dir)
    for stale in [*olds, *out_dir.parent.glob(f".{out_dir.name}-tmp-*")]:
        shutil.rmtree(stale, ignore_errors=True)


def atomic_folder(out_dir: Path, write) -> Path:
    """Run write(tmp) then rename tmp over out_dir: readers see the old or the new, never half."""
    out_dir = Path(out_dir)
    recover_folder(out_dir)
    tmp = make_tmp_dir(out_dir)
    try:
        write(tmp)
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}-old-{os.getpid()}")
            out_dir.rename(old)
        tmp.rename(out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def save_policy(policy: nn.Module, tokenizer, out_dir: str | os.PathLike) -> Path:
    """Save a policy: the LoRA adapter only (plus base model recorded), or the full weights."""
    meta = dict(getattr(policy, "rlhf_meta", None) or {})
    if not meta:
        raise ValueError("save_policy: the model was not loaded with load_policy (no base model recorded)")

    def write(tmp: Path) -> None:
        policy.save_pretrained(tmp)  # peft writes the adapter only
        tokenizer.save_pretrained(tmp)
        (tmp / META_FILE).write_text(json.dumps(
            {**meta, "kind": "policy", "weights": "adapter" if meta["lora"] else "full"}, indent=2))

    return atomic_folder(Path(out_dir), write)


def save_scalar_model(model: ScalarModel, tokenizer, out_dir: str | os.PathLike, state_dict: dict | None = None) -> Path:
    """Save a reward model or critic: adapter (or full backbone) + head + normalisation stats.
    state_dict: the model's whole weights when its own are sharded (pipeline.distributed.full_state_dict)."""
    from safetensors.torch import save_file

    def part(prefix: str) -> dict | None:
        if state_dict is None:
            return None
        return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}

    def write(tmp: Path) -> None:
        model.backbone.save_pretrained(tmp, state_dict=part("backbone."))
        head = part("head.") if state_dict is not None else model.head.state_dict()
        save_file({k: v.detach().contiguous().cpu() for k, v in head.items()}, str(tmp / HEAD_FILE))
        tokenizer.save_pretrained(tmp)
        (tmp / META_FILE).write_text(json.dumps({
            "kind": model.kind, "base_model": model.base_model, "lora": model.lora,
            "weights": "adapter" if model.lora else "full",
            "reward_mean": model.reward_mean, "reward_std": model.reward_std,
        }, indent=2))

    return atomic_folder(Path(out_dir), write)


class GatheredPolicy:
    """A sharded policy as save_policy sees it: the same metadata, and save_pretrained writing the
    whole weights gathered on rank 0 (the model's own state_dict holds only this rank's shards).
    A weight tied to another (the LM head to the embeddings) is written once, under its first name,
    as save_pretrained does for a model's own tied tensors (the gathered copies share no storage)."""

    def __init__(self, model, weights: dict):
        first = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            first.setdefault(id(param), name)
        tied = {name for name, param in model.named_parameters(remove_duplicate=False) if first[id(param)] != name}
        self.model, self.rlhf_meta = model, model.rlhf_meta
        self.weights = {k: v for k, v in weights.items() if k not in tied}

    def save_pretrained(self, folder) -> None:
        self.model.save_pretrained(folder, state_dict=self.weights)


def save_whole_policy(policy, tokenizer, folder: Path, dist: Dist) -> None:
    """save_policy on rank 0, with whole weights: every rank calls it (a sharded policy is gathered)."""
    weights = full_state_dict(policy) if dist.sharded else None
    if dist.is_main:
        save_policy(GatheredPolicy(policy, weights) if dist.sharded else policy, tokenizer, folder)
