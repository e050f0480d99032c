"""Linear layers at a few rows, computed the way this machine multiplies them fastest.

A decode step of K replies sends K rows through every linear layer. `F.linear(x, W)` runs that
as x @ W^T; the same product as (W @ x^T)^T is another matrix-multiply call with the small
dimension on the other side, and on some CPUs it is much faster. Measured on an idle 2-core AMD
EPYC (fp32, MKL, 2 threads; docs/results/chat/rows_first_check.txt), at 4 rows: SmolLM2-135M's
tied LM head [49,152 x 576] 11.3 ms against 38.8, its MLP down-projection [576 x 1536] 0.23 ms
against 0.33, its attention's key projection about the same either way; at 1 row neither way
wins. Which way wins depends on the CPU, the shape and the row count, so nothing is assumed:
`rows_first(model)` makes each nn.Linear time both ways the first time it sees a row count (up
to `max_rows`, without autograd, on a CPU) and keep the faster one for that shape and count (a
near tie keeps F.linear). Both ways are the same products up to float rounding: on that machine
K = 4 replies to 3 prompts came out the same either way, in 32.0 s against 39.2 (1.22x).

For serving replies (pipeline/chat_server.py) only: the round's samplers and trainers keep
F.linear, so that a seed draws the same tokens there whatever a timing chose.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

MIN_GAIN = 1.2
"""How much faster (W @ x^T)^T must be to be chosen: below it, timing noise could flip a choice."""
REPS = 5


class _Choices:
    """Per (weight shape, dtype, rows): whether (W @ x^T)^T is the faster way, timed once."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.faster: dict[tuple, bool] = {}

    def wins(self, weight: torch.Tensor, rows: int) -> bool:
        key = (tuple(weight.shape), weight.dtype, rows)
        if key not in self.faster:
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, generator=torch.Generator().manual_seed(0))
            self.faster[key] = _seconds(lambda: F.linear(x, weight)) > MIN_GAIN * _seconds(lambda: weight @ x.T)
        return self.faster[key]


def _seconds(product) -> float:
    """The fastest of REPS calls, after one to warm up."""
    product()
    best = float("inf")
    for _ in range(REPS):
        t0 = time.perf_counter()
        product()
        best = min(best, time.perf_counter() - t0)
    return best


def rows_first(model: nn.Module, max_rows: int = 16) -> dict[tuple, bool]:
    """Make every nn.Linear of `model` (on a CPU) take the faster way at up to `max_rows` rows
    without autograd (module docstring); returns the choices as they are made, keyed by (weight
    shape, dtype, rows)."""
    choices = _Choices(max_rows)
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu":
            module.forward = _forward(module, choices)
    return choices.faster


def _forward(linear: nn.Linear, choices: _Choices):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        if 0 < rows <= choices.max_rows and not torch.is_grad_enabled() and x.dtype == linear.weight.dtype \
                and choices.wins(linear.weight, rows):
            y = (linear.weight @ x.reshape(rows, x.shape[-1]).T).T
            y = y if linear.bias is None else y + linear.bias
            return y.reshape(*x.shape[:-1], linear.out_features)
        return F.linear(x, linear.weight, linear.bias)
    return forward
