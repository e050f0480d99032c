"""pipeline/rows_first.py: the chat sampler's linear layers at a few rows, (W @ x^T)^T where the
machine runs it faster: the same logits as F.linear up to rounding, chosen per shape and row
count, never under autograd or past max_rows."""

from __future__ import annotations

import pytest
import torch

from pipeline import rows_first as rf
from tests.tiny import build_tiny_model, build_tiny_tokenizer


def tiny_model():
    torch.manual_seed(0)
    return build_tiny_model(build_tiny_tokenizer(), seed=0).eval()


def logits(model, rows: int, length: int = 1) -> torch.Tensor:
    ids = torch.randint(0, 300, (rows, length), generator=torch.Generator().manual_seed(1))
    return model(input_ids=ids).logits


@pytest.mark.parametrize("gain", [0.0, float("inf")])  # always the other way / never
def test_the_chosen_way_gives_f_linears_logits(monkeypatch, gain):
    monkeypatch.setattr(rf, "MIN_GAIN", gain)
    plain, fast = tiny_model(), tiny_model()
    choices = rf.rows_first(fast, max_rows=4)
    with torch.no_grad():
        for rows in (1, 3, 4):
            want, got = logits(plain, rows), logits(fast, rows)
            if gain == 0.0:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(got, want)
        # past max_rows (a prefill, or more replies than it was made for): F.linear, nothing timed
        assert torch.equal(logits(fast, 2, length=3), logits(plain, 2, length=3))
    linears = {tuple(m.weight.shape) for m in fast.modules() if type(m) is torch.nn.Linear}
    assert {(shape, rows) for shape, _, rows in choices} == {(s, r) for s in linears for r in (1, 3, 4)}
    assert set(choices.values()) == {gain == 0.0}


def test_under_autograd_it_is_f_linear(monkeypatch):
    monkeypatch.setattr(rf, "MIN_GAIN", 0.0)
    plain, fast = tiny_model(), tiny_model()
    choices = rf.rows_first(fast)
    assert torch.equal(logits(fast, 2), logits(plain, 2)) and choices == {}
