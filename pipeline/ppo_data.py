"""PPO's data: how the prompts file becomes each step's episodes, and the PPO-ptx texts.

    prompt_order(n_prompts, step, batch_size, seed)   the prompts of step `step`: slices of a seeded
                                                      permutation per pass over the file
    episode_uniforms(seed, step, episodes, n_tokens, device)
                                                      each episode's sampling numbers, from its own
                                                      seeded stream
    read_ptx_texts(path), ptx_batch(tokenizer, ...)   the PPO-ptx term's texts and their batches

The prompts and the numbers depend only on the seed, the step and the episode's index in the step's
batch, so a resumed run, and a run split over N processes, sees exactly what one uninterrupted
process would.
"""

from __future__ import annotations

import os

import torch

from pipeline.rundir import read_jsonl
from pipeline.text import pad_rows

# --------------------------------------------------------------------------- prompts -> episodes


def episode_uniforms(seed: int, step: int, episodes: range, n_tokens: int, device) -> torch.Tensor:
    """(len(episodes), n_tokens) float64 uniforms, row i those of episode episodes[i] of the step
    (its index in the whole batch): each episode's numbers come from its own seeded stream, so a
    rank sampling episodes 4..7 draws exactly what one process sampling 0..7 draws for them."""
    rows = [torch.rand(n_tokens, dtype=torch.float64,
                       generator=torch.Generator().manual_seed((seed * 1_000_003 + step) * 100_003 + e))
            for e in episodes]
    return torch.stack(rows).to(device)


def prompt_order(n_prompts: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Indices of the prompts for PPO step `step` (0-based): consecutive slices of a fresh
    permutation per pass over the file, seeded by (seed, pass). Depends only on the step, so a
    resumed run sees the prompts it would have seen."""
    out, perms = [], {}
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(i, n_prompts)
        if epoch not in perms:
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            perms[epoch] = torch.randperm(n_prompts, generator=g).tolist()
        out.append(perms[epoch][pos])
    return out


# --------------------------------------------------------------------------- PPO-ptx texts


def read_ptx_texts(path: str | os.PathLike) -> list[str]:
    """Texts for the PPO-ptx term: JSONL rows with a non-empty 'text' field."""
    texts = [row["text"] for row in read_jsonl(path, check=_check_ptx_row)]
    if not texts:
        raise ValueError(f"{path}: no texts for PPO-ptx")
    return texts


def _check_ptx_row(row) -> None:
    if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
        raise ValueError("field 'text' is missing or empty")


def ptx_batch(tokenizer, texts: list[str], max_length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) (b, T), right-padded, each text + EOS, cut to max_length."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"][: max_length - 1] + [tokenizer.eos_token_id]
            for t in texts]
    return pad_rows(rows, tokenizer.pad_token_id, left=False, device=device)


__all__ = ["prompt_order", "episode_uniforms", "read_ptx_texts", "ptx_batch"]
