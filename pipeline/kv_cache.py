"""A KV cache in tensors allocated once: each layer's keys and values for a batch of B rows are
(B, kv_heads, capacity, head_dim), filled column by column.

`ColumnCache.from_prefill(prefill, rows, extra)` takes a DynamicCache that has run the prompts,
copies the prompt rows each sample continues (`rows`) into tensors with `extra` free columns, and
is then passed to the model's forward in its place (transformers' Cache API). Each forward writes
its tokens into the next columns and attends to views of the columns written so far, so:

- no step concatenates: a DynamicCache grows every layer's keys and values by `torch.cat` each
  token, copying the whole cache (about an eighth of a SmolLM2-135M decode step on CPU);
- attention never reads an unwritten column, and the 2-D attention mask a forward takes is
  (B, columns written + new tokens), exactly as with a DynamicCache;
- dropping rows (`batch_select_indices`) copies the kept rows once per drop.

transformers' StaticCache is not used: its layers size their batch at the first forward (the
prefill runs a shared prefix at batch 1, then the prompts, then copies rows per sample), have no
`batch_select_indices`, and make the mask span every column, written or not.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class ColumnLayer(CacheLayerMixin):
    """One layer's keys and values: (B, kv_heads, capacity, head_dim) each, of which the first
    `length` columns hold the tokens seen so far, in order; the rest are unwritten (never read)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.keys, self.values, self.length = keys, values, length
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a ColumnLayer is allocated by ColumnCache.from_prefill, not by a forward pass")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write key_states / value_states (B, kv_heads, q, head_dim) into the next q columns; return
        views of the columns written so far (B, kv_heads, length, head_dim)."""
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            raise ValueError(f"ColumnCache: {end} tokens do not fit its {self.keys.shape[-2]} columns")
        self.keys[:, :, self.length:end] = key_states
        self.values[:, :, self.length:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(columns the next forward attends to, offset): the mask spans written + new columns."""
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.keys.shape[-2]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices` (a copy of those rows, every column)."""
        self.keys = self.keys.index_select(0, indices)
        self.values = self.values.index_select(0, indices)


class ColumnCache(Cache):
    """A Cache of ColumnLayers, one per model layer (module docstring)."""

    def __init__(self, layers: list[ColumnLayer]):
        super().__init__(layers=layers)

    @classmethod
    def from_prefill(cls, prefill: Cache, rows: torch.Tensor, extra: int) -> "ColumnCache":
        """The rows `rows` (B,) of a cache that has run the prompts (each layer's keys (b, kv_heads,
        n, head_dim)), in tensors of n + extra columns: room for `extra` more tokens per row."""
        layers = []
        for layer in prefill.layers:
            n = layer.keys.shape[-2]
            keys = layer.keys.new_empty((rows.numel(), layer.keys.shape[1], n + extra, layer.keys.shape[-1]))
            values = layer.values.new_empty((rows.numel(), layer.values.shape[1], n + extra, layer.values.shape[-1]))
            keys[:, :, :n] = layer.keys.index_select(0, rows)
            values[:, :, :n] = layer.values.index_select(0, rows)
            layers.append(ColumnLayer(keys, values, n))
        return cls(layers)
