"""Padding-free forward passes: several sequences packed into one row, each attending only to itself.

A PPO rollout is a left-padded prompt followed by a right-padded response; prompts of 35-90 tokens
padded to the batch's longest leave 20-45% of a batch's cells as padding, and every padding cell
costs as much as a real token in every linear layer. Packing puts the real tokens of several
sequences side by side in a row, with position ids restarting at 0 for each one and no attention
mask: transformers then reads the restarts as sequence boundaries and builds a block-diagonal
causal mask (`masking_utils.find_packed_sequence_indices`, the "packed sequence" format of
`DataCollatorWithFlattening`). Each token sees the same tokens at the same positions as in the
padded batch, so the outputs are equal up to float rounding (tests/test_packing.py checks it).

Rows are filled first-fit decreasing. Wider rows hold more sequences (less padding) but attention
cost grows with the square of the row width, so the width is chosen by a small cost model (see
`choose_width`).

Outputs are read at chosen (sequence, column) cells of the original padded layout, through `flat`:
the index of each real token in the packed rows, flattened.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor  # (n, W) real tokens of several sequences per row, pad token after them
    position_ids: torch.Tensor  # (n, W) 0.. per sequence; trailing padding restarts at 0 (its own segment)
    flat: torch.Tensor  # (b, T) index into the flattened (n * W) packed cells of each real token, -1 for pad


def choose_width(lengths: list[int], attn_per_linear: float) -> int:
    """Row width W minimising (cells) x (1 + W * attn_per_linear), over first-fit-decreasing packings.

    attn_per_linear: attention cost per token per unit of row width, relative to the cost of the
    linear layers per token. A decoder layer spends ~2 * params_per_layer flops per token in its
    linears and ~4 * W * hidden in attention (QK^T and AV over W keys), hence `attn_cost_ratio`.
    """
    longest, total = max(lengths), sum(lengths)
    candidates = {longest} | {max(longest, -(-total // n)) for n in range(1, len(lengths) + 1)}
    best = None
    for width in sorted(candidates):
        cost = len(_first_fit(lengths, width)) * width * (1 + width * attn_per_linear)
        if best is None or cost < best[0]:
            best = (cost, width)
    return best[1]


def attn_cost_ratio(config) -> float:
    """Attention flops per token per key, relative to linear flops per token, for a decoder config."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = getattr(config, "intermediate_size", None) or 4 * hidden
    linear = 2 * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter)
    return 4 * heads * head_dim / linear


def _first_fit(lengths: list[int], width: int) -> list[list[int]]:
    """Bins (lists of sequence indices) of total length <= width, longest sequences placed first."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for k, free in enumerate(room):
            if lengths[i] <= free:
                bins[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(width - lengths[i])
    return bins


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, attn_per_linear: float,
         pad_token_id: int = 0) -> Packed:
    """Pack the real tokens of each row of (b, T) input_ids into fewer, shorter rows.

    The real tokens of a row must be contiguous (left-padded prompt + right-padded response, as a
    rollout is); they keep their order, and positions count real tokens from 0, as
    `position_ids_from_mask` gives them in the padded layout. Padding cells form segments of
    their own, so any pad_token_id does.
    """
    b, T = input_ids.shape
    device = input_ids.device
    real = attention_mask.bool()  # (b, T)
    lengths = real.sum(1).tolist()
    if min(lengths) < 1:
        raise ValueError("pack: a row without any real token")
    width = choose_width(lengths, attn_per_linear)
    bins = _first_fit(lengths, width)
    ids = torch.full((len(bins), width), pad_token_id, dtype=input_ids.dtype, device=device)
    pos = torch.empty((len(bins), width), dtype=torch.long, device=device)
    flat = torch.full((b, T), -1, dtype=torch.long, device=device)
    for k, members in enumerate(bins):
        offset = 0
        for i in members:
            n = lengths[i]
            ids[k, offset : offset + n] = input_ids[i, real[i]]
            pos[k, offset : offset + n] = torch.arange(n, device=device)
            flat[i, real[i]] = torch.arange(k * width + offset, k * width + offset + n, device=device)
            offset += n
        pos[k, offset:] = torch.arange(width - offset, device=device)  # padding: a segment of its own
    return Packed(input_ids=ids, position_ids=pos, flat=flat)


def gather_cells(packed: Packed, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Flat packed indices (N,) of the cells (rows[j], cols[j]) of the padded layout; each must be real."""
    index = packed.flat[rows, cols]
    if bool((index < 0).any()):
        raise ValueError("gather_cells: a requested cell is padding")
    return index


def hidden_states(backbone, packed: Packed) -> torch.Tensor:
    """(n * W, H) last hidden states of a decoder backbone (no LM head) over the packed rows."""
    out = backbone(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                   use_cache=False)
    hidden = out.last_hidden_state  # (n, W, H)
    return hidden.reshape(-1, hidden.shape[-1])


__all__ = ["Packed", "pack", "choose_width", "attn_cost_ratio", "gather_cells", "hidden_states"]
