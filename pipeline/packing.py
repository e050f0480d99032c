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
the index of each real token in the packed rows, flattened. `pack_responses` packs episodes (a
left-padded prompt, then a right-padded response) and locates the cells that predict their response
tokens: PPO's rollout and update, and the KL of sampled responses (pipeline/policy.py), read there.

Shared prefix. Chat prompts start with the same tokens (SmolLM2's template puts a 24-token system
prompt before every question: a third of a PPO episode's tokens). When every sequence starts with
the same L >= 8 tokens, they are taken out of the rows and run once: their keys and values are
computed by a forward over the L tokens alone and handed to the rows' forward as a KV cache, with
positions starting at L and a mask that lets each token see the prefix plus its own segment,
causally (prefix caching, as vLLM and SGLang do for inference). The outputs are again those of
the padded batch, and gradients flow back through the prefix's keys and values. A frozen model
(the reference, the reward model) computes a prefix's keys and values once per process.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch

MIN_PREFIX = 8
"""Shorter common prefixes stay in the rows: the extra forward would cost more than it saves."""


@dataclass
class Packed:
    input_ids: torch.Tensor  # (n, W) real tokens of several sequences per row, pad token after them
    position_ids: torch.Tensor  # (n, W) 0.. per sequence (L.. with a prefix); trailing padding restarts
    flat: torch.Tensor  # (b, T) index into the flattened (n * W) packed cells of each real token, -1 for pad
    prefix: torch.Tensor | None = None  # (L,) the tokens every sequence starts with, run once ahead of the rows
    mask: torch.Tensor | None = None  # (n, 1, W, L + W) bool, with a prefix: who each cell attends to


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
        cost = len(first_fit(lengths, width)) * width * (1 + width * attn_per_linear)
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


def first_fit(lengths: list[int], width: int) -> list[list[int]]:
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


def common_prefix(input_ids: torch.Tensor, real: torch.Tensor, limit: int) -> int:
    """Number of leading real tokens (at most `limit`) that every row of (b, T) input_ids shares."""
    if limit <= 0:
        return 0
    start = real.int().argmax(1)  # (b,) first real column (real tokens are contiguous)
    cols = (start[:, None] + torch.arange(limit, device=input_ids.device)).clamp(max=input_ids.shape[1] - 1)
    heads = input_ids.gather(1, cols)  # (b, limit) the first `limit` real tokens of each row
    same = (heads == heads[:1]).all(0).int()  # (limit,)
    return int(same.cumprod(0).sum())


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, attn_per_linear: float,
         pad_token_id: int = 0, max_prefix: int | None = None, min_prefix: int = MIN_PREFIX) -> Packed:
    """Pack the real tokens of each row of (b, T) input_ids into fewer, shorter rows.

    The real tokens of a row must be contiguous (left-padded prompt + right-padded response, as a
    rollout is); they keep their order, and positions count real tokens from 0, as
    `position_ids_from_mask` gives them in the padded layout. Padding cells form segments of
    their own, so any pad_token_id does.

    A prefix of at least min_prefix tokens that every row starts with is taken out and run once
    (module docstring); its cells are not in `flat`. max_prefix caps its length (default: all but
    each row's last token), so that the cells a caller reads stay in the rows.
    """
    b, T = input_ids.shape
    device = input_ids.device
    real = attention_mask.bool()  # (b, T)
    lengths = real.sum(1).tolist()
    if min(lengths) < 1:
        raise ValueError("pack: a row without any real token")
    limit = min(lengths) - 1 if max_prefix is None else min(max_prefix, min(lengths) - 1)
    L = common_prefix(input_ids, real, limit) if b > 1 else 0
    L = L if L >= min_prefix else 0
    rest = [n - L for n in lengths]  # tokens of each sequence that go into the rows
    width = choose_width(rest, attn_per_linear)
    bins = first_fit(rest, width)
    ids = torch.full((len(bins), width), pad_token_id, dtype=input_ids.dtype, device=device)
    pos = torch.empty((len(bins), width), dtype=torch.long, device=device)
    segment = torch.empty((len(bins), width), dtype=torch.long, device=device)  # who may attend to whom
    flat = torch.full((b, T), -1, dtype=torch.long, device=device)
    for k, members in enumerate(bins):
        offset = 0
        for i in members:
            n = rest[i]
            cells = real[i].nonzero().squeeze(1)[L:]  # (n,) padded-layout columns of the row's tokens
            ids[k, offset : offset + n] = input_ids[i, cells]
            pos[k, offset : offset + n] = torch.arange(L, L + n, device=device)
            segment[k, offset : offset + n] = i
            flat[i, cells] = torch.arange(k * width + offset, k * width + offset + n, device=device)
            offset += n
        pos[k, offset:] = torch.arange(width - offset, device=device)  # padding: a segment of its own
        segment[k, offset:] = b + k
    if L == 0:  # transformers builds the block-diagonal mask from the restarting positions
        return Packed(input_ids=ids, position_ids=pos, flat=flat)
    n = len(bins)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # (W, W)
    own = (segment[:, :, None] == segment[:, None, :]) & causal  # (n, W, W) own segment, causally
    sees_prefix = torch.ones(n, width, L, dtype=torch.bool, device=device)  # every cell sees the prefix
    mask = torch.cat([sees_prefix, own], dim=2)[:, None]  # (n, 1, W, L + W)
    first = real[0].nonzero()[0, 0]
    return Packed(input_ids=ids, position_ids=pos, flat=flat, prefix=input_ids[0, first : first + L], mask=mask)


def gather_cells(packed: Packed, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Flat packed indices (N,) of the cells (rows[j], cols[j]) of the padded layout; each must be real."""
    index = packed.flat[rows, cols]
    if bool((index < 0).any()):
        raise ValueError("gather_cells: a requested cell is padding")
    return index


@dataclass
class PackedResponses:
    """A batch of episodes (a prompt, then its response) packed without padding, with the N cells
    that predict its real response tokens: the position before response token t (prompt end, then
    the response so far) gives both its log-prob and the critic's value (state, then action)."""
    packed: Packed
    rows: torch.Tensor  # (N,) episode of each real response token
    cols: torch.Tensor  # (N,) its response column t
    index: torch.Tensor  # (N,) flat packed index of the position predicting it
    tokens: torch.Tensor  # (N,) the token
    shape: tuple[int, int]  # (b, R)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(N,) per-token values -> (b, R), 0 past each episode's EOS (differentiable)."""
        return values.new_zeros(self.shape).index_put((self.rows, self.cols), values)


def pack_responses(sequences, attention_mask, response_ids, mask, prompt_length: int,
                   attn_per_linear: float, share_prefix: bool = True) -> PackedResponses:
    """Pack b episodes (sequences (b, P+R), mask (b, R)) and locate their response tokens; a
    prefix every prompt starts with (the chat template's system prompt) runs once, unless
    share_prefix is False (gradient checkpointing: its layers drop a KV cache)."""
    last_prompt_token = int(attention_mask[:, :prompt_length].sum(1).min()) - 1  # must stay in the rows
    packed = pack(sequences, attention_mask, attn_per_linear, max_prefix=last_prompt_token if share_prefix else 0)
    rows, cols = mask.nonzero(as_tuple=True)  # (N,) each
    index = gather_cells(packed, rows, prompt_length - 1 + cols)
    return PackedResponses(packed=packed, rows=rows, cols=cols, index=index, tokens=response_ids[rows, cols],
                           shape=tuple(mask.shape))


def hidden_states(backbone, packed: Packed, frozen: str | None = None) -> torch.Tensor:
    """(n * W, H) last hidden states of a decoder backbone (no LM head) over the packed rows.

    frozen: a name for a role whose weights never change during the process ("reference",
    "reward"): its prefix keys and values are computed once and kept (see prefix_kv).
    """
    if packed.prefix is None:
        out = backbone(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                       use_cache=False)
    else:
        from transformers import DynamicCache

        n = packed.input_ids.shape[0]
        kv = prefix_kv(backbone, packed.prefix, frozen)
        cache = DynamicCache(ddp_cache_data=[(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in kv])
        out = backbone(input_ids=packed.input_ids, position_ids=packed.position_ids,
                       attention_mask=attention_mask_for(backbone, packed.mask), use_cache=False,
                       **{cache_kwarg(backbone): cache})
    hidden = out.last_hidden_state  # (n, W, H)
    return hidden.reshape(-1, hidden.shape[-1])


def attention_mask_for(backbone, mask: torch.Tensor) -> torch.Tensor:
    """The (n, 1, W, L + W) bool mask as the model's attention takes a ready 4D mask: as it is for
    sdpa (True = attend); eager attention adds its mask to the scores, so there it is 0 / -inf."""
    implementation = getattr(backbone.config, "_attn_implementation", None) or "sdpa"
    if implementation == "sdpa":
        return mask
    if implementation == "eager":
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)
    raise ValueError(f"attention implementation {implementation!r}: packed forwards with a shared prefix "
                     "need 'sdpa' or 'eager'")


# backbone -> {(role, autocast, prefix tokens): keys and values}; entries go with their model
_FROZEN_PREFIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prefix_kv(backbone, prefix: torch.Tensor, frozen: str | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), each (1, kv_heads, L, head_dim), of the L prefix tokens.

    Computed in the caller's grad mode (a training forward backpropagates through them), or, for a
    frozen role, once without grad and then reused: a rollout's reference and reward-model passes
    then never run the system prompt again.
    """
    from transformers import DynamicCache

    key = (frozen, torch.is_autocast_enabled(), tuple(prefix.tolist())) if frozen else None
    if key is not None:
        kept = _FROZEN_PREFIXES.setdefault(backbone, {})
        if key in kept:
            return kept[key]
    cache = DynamicCache()
    positions = torch.arange(prefix.shape[0], device=prefix.device)[None]
    with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
        backbone(input_ids=prefix[None], position_ids=positions, use_cache=True, **{cache_kwarg(backbone): cache})
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    if key is not None:
        if len(kept) >= 8:  # a handful of system prompts at most; never grow without bound
            kept.clear()
        kept[key] = kv
    return kv


def cache_kwarg(model) -> str:
    """Recent transformers renamed forward(past_key_values=) to forward(cache=)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(type(inner).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


__all__ = ["Packed", "pack", "common_prefix", "choose_width", "attn_cost_ratio", "gather_cells", "PackedResponses",
           "pack_responses", "hidden_states", "prefix_kv", "cache_kwarg", "MIN_PREFIX"]
