"""Packed forwards (pipeline/packing.py) equal padded ones; merged-LoRA sampling leaves the base intact."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import PPOConfig
from pipeline.models import load_scalar_model
from pipeline.packing import (
    _FROZEN_PREFIXES, choose_width, common_prefix, first_fit, gather_cells, pack, pack_responses,
)
from pipeline.policy import causal_lm_logits, load_policy, make_reference, merged_lora, packed_lm_logits
from pipeline.rollout import critic_values
from pipeline.sampling import Decoding, sample
from pipeline.scoring import packed_score
from pipeline.text import encode_prompts

PROMPTS = ["How can I shop?", "What is the capital of France?", "Tell me about bread.", "Guitar tips?", "Hi"]


def test_pack_layout_by_hand():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [0, 8, 9, 1, 2, 3], [0, 0, 0, 4, 0, 0]])
    am = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0]])
    p = pack(ids, am, attn_per_linear=0.0, pad_token_id=99)  # no attention cost: one row of all 9 tokens
    assert p.input_ids.tolist() == [[8, 9, 1, 2, 3, 5, 6, 7, 4]]  # longest first
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0]]
    assert p.flat[0].tolist() == [-1, -1, 5, 6, 7, -1] and p.flat[2, 3].item() == 8
    p = pack(ids, am, attn_per_linear=10.0, pad_token_id=99)  # attention dear: rows as wide as the longest
    assert p.input_ids.tolist() == [[8, 9, 1, 2, 3], [5, 6, 7, 4, 99]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]  # the pad is a segment of its own
    with pytest.raises(ValueError, match="padding"):
        gather_cells(p, torch.tensor([0]), torch.tensor([0]))
    assert first_fit([5, 3, 1], 5) == [[0], [1, 2]]  # first fit decreasing: 3 and 1 share a row
    assert choose_width([4, 4, 3], 0.0) == 11 and choose_width([4, 4, 3], 1.0) == 4  # 11 cells vs 3 x 4


def test_common_prefix_is_taken_out_of_the_rows_and_masked_by_hand():
    # three left-padded sequences that all start with 5 6 7 8; the prefix (capped at 3 here) runs once
    ids = torch.tensor([[0, 5, 6, 7, 8, 1], [5, 6, 7, 8, 2, 3], [0, 0, 5, 6, 7, 8]])
    am = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    assert common_prefix(ids, am.bool(), limit=6) == 4
    assert pack(ids, am, 0.0, min_prefix=5).prefix is None  # shorter than min_prefix: left in the rows
    p = pack(ids, am, attn_per_linear=0.0, pad_token_id=99, max_prefix=3, min_prefix=2)
    assert p.prefix.tolist() == [5, 6, 7]
    assert p.input_ids.tolist() == [[8, 2, 3], [8, 1, 8]]  # (8 2 3), then (8 1) and (8) share a row
    assert p.position_ids.tolist() == [[3, 4, 5], [3, 4, 3]]  # positions go on after the prefix
    assert p.flat[1].tolist() == [-1, -1, -1, 0, 1, 2] and p.flat[2].tolist() == [-1] * 5 + [5]
    # every cell sees the 3 prefix tokens, then its own segment causally
    assert p.mask.shape == (2, 1, 3, 3 + 3) and bool(p.mask[:, :, :, :3].all())
    assert p.mask[0, 0, :, 3:].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert p.mask[1, 0, :, 3:].int().tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]


@pytest.fixture
def episodes(tiny_model_cfg):
    """A LoRA policy moved off its start, a LoRA critic, and sampled episodes of several lengths."""
    return _episodes(tiny_model_cfg, PROMPTS)


SYSTEM = "You are a helpful assistant. Answer briefly and kindly, in plain words."
SYSTEM_PROMPTS = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}] for p in PROMPTS]


@pytest.fixture
def system_episodes(tiny_model_cfg):
    """The same, with one system prompt ahead of every question (as SmolLM2's chat template adds)."""
    return _episodes(tiny_model_cfg, SYSTEM_PROMPTS)


def _episodes(tiny_model_cfg, prompts):
    torch.manual_seed(0)
    cfg = tiny_model_cfg.__class__(**{**tiny_model_cfg.__dict__, "lora_targets": "q_proj,v_proj,lm_head"})
    policy, tok = load_policy(cfg)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    critic, _ = load_scalar_model(cfg.model, kind="critic", cfg=cfg)
    ids, am = encode_prompts(tok, prompts)
    sb = sample(policy, ids, am, PPOConfig(max_new_tokens=10, temperature=1.0), tok,
                draws=torch.Generator().manual_seed(1))
    return policy, critic, sb, cfg, tok


@pytest.mark.parametrize("ratio", [0.0, 1e9])  # one row for all, and one episode per row
def test_packed_forwards_equal_padded_forwards(episodes, ratio):
    # every chat prompt opens with the template's system turn: the path without a shared prefix
    pr = _check_packed_equals_padded(episodes, ratio, share_prefix=False)
    assert pr.packed.prefix is None


@pytest.mark.parametrize("ratio", [0.0, 1e9])
def test_packed_forwards_with_a_shared_system_prompt_equal_padded_forwards(system_episodes, ratio):
    pr = _check_packed_equals_padded(system_episodes, ratio)
    assert pr.packed.prefix is not None and len(pr.packed.prefix) >= 8  # the system prompt ran once
    # frozen roles keep the prefix's keys and values: a second pass reuses them, with the same result
    policy, _, sb, _, _ = system_episodes
    reference = make_reference(policy)
    with torch.no_grad():
        first = reference.packed_logits(pr.packed, pr.index)
        decoder = policy.get_base_model().get_decoder()
        kept = list(_FROZEN_PREFIXES[decoder].values())
        assert len(kept) == 1
        again = reference.packed_logits(pr.packed, pr.index)
        assert list(_FROZEN_PREFIXES[decoder].values())[0] is kept[0]
    assert torch.equal(first, again)


def test_shared_prefix_with_eager_attention_equals_padded(system_episodes):
    """Eager attention adds the mask to the scores: the prefix path hands it 0 / -inf there."""
    policy, _, sb, _, _ = system_episodes
    policy.get_base_model().set_attn_implementation("eager")
    try:
        P, mask = sb.prompt_length, sb.response_mask.float()
        pr = pack_responses(sb.sequences, sb.attention_mask, sb.response_ids, mask, P, 0.0)
        assert pr.packed.prefix is not None
        with torch.no_grad():
            packed = packed_lm_logits(policy, pr.packed, pr.index)
            padded = causal_lm_logits(policy, sb.sequences, sb.attention_mask)[:, P - 1 : -1][mask.bool()]
        assert torch.allclose(packed, padded, atol=1e-5)
    finally:
        policy.get_base_model().set_attn_implementation("sdpa")


def test_gradients_through_a_shared_prefix_equal_padded_gradients(system_episodes):
    """The training forward: LoRA gradients of policy and critic flow back through the prefix's KV."""
    policy, critic, sb, _, _ = system_episodes
    P, mask = sb.prompt_length, sb.response_mask.float()
    m = mask.bool()
    pr = pack_responses(sb.sequences, sb.attention_mask, sb.response_ids, mask, P, 0.0)
    assert pr.packed.prefix is not None

    def grads(loss_fn):
        policy.zero_grad(), critic.zero_grad()
        loss_fn().backward()
        return {n: p.grad.clone() for model in (policy, critic) for n, p in model.named_parameters()
                if p.requires_grad and p.grad is not None}

    weights = torch.linspace(-1, 1, int(m.sum()))  # any loss that reads every response position
    packed = grads(lambda: (packed_lm_logits(policy, pr.packed, pr.index).logsumexp(-1) * weights).sum()
                   + (critic_values(critic, pr)[m] * weights).sum())
    padded = grads(lambda: (causal_lm_logits(policy, sb.sequences, sb.attention_mask)[:, P - 1 : -1][m]
                            .logsumexp(-1) * weights).sum()
                   + (critic(sb.sequences, sb.attention_mask)[:, P - 1 : -1][m] * weights).sum())
    assert packed.keys() == padded.keys() and any("lora_A" in n for n in packed)
    for name in packed:
        assert torch.allclose(packed[name], padded[name], atol=1e-4, rtol=1e-4), name


def _check_packed_equals_padded(episodes, ratio, share_prefix: bool = True):
    policy, critic, sb, cfg, _ = episodes
    P, mask = sb.prompt_length, sb.response_mask.float()
    pr = pack_responses(sb.sequences, sb.attention_mask, sb.response_ids, mask, P, ratio, share_prefix)
    assert pr.packed.input_ids.shape[0] == (1 if ratio == 0 else len(PROMPTS))
    reference = make_reference(policy)
    m = mask.bool()
    with torch.no_grad():
        for logits, full in ((packed_lm_logits(policy, pr.packed, pr.index), causal_lm_logits(policy, sb.sequences,
                                                                                              sb.attention_mask)),
                             (reference.packed_logits(pr.packed, pr.index), reference(sb.sequences, sb.attention_mask))):
            assert torch.allclose(logits, full[:, P - 1 : -1][m], atol=1e-5)
        values = critic_values(critic, pr)
        assert torch.allclose(values[m], critic(sb.sequences, sb.attention_mask)[:, P - 1 : -1][m], atol=1e-5)
        assert torch.all(values[~m] == 0)
        rm, _ = load_scalar_model(cfg.model, kind="reward", cfg=cfg)
        rm.reward_mean, rm.reward_std = 0.3, 2.0
        assert torch.allclose(packed_score(rm, sb.sequences, sb.attention_mask),
                              rm.normalised_score(sb.sequences, sb.attention_mask), atol=1e-5)
    return pr


def test_sampling_with_merged_lora_matches_a_forward_and_restores_the_base_bit_for_bit(episodes):
    policy, _, _, _, tok = episodes
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n}
    ids, am = encode_prompts(tok, PROMPTS)
    with torch.no_grad():
        before = causal_lm_logits(policy, ids, am)
        with merged_lora(policy):
            merged = causal_lm_logits(policy, ids, am)
            sb = sample(policy, ids, am, PPOConfig(max_new_tokens=8, temperature=0.9), tok,
                        draws=torch.Generator().manual_seed(0))
        after = causal_lm_logits(policy, ids, am)
        P = sb.prompt_length
        full = torch.log_softmax(causal_lm_logits(policy, sb.sequences, sb.attention_mask)[:, P - 1 : -1] / 0.9, -1)
        full = full.gather(2, sb.response_ids[..., None]).squeeze(2)
    assert torch.allclose(merged, before, atol=1e-5)  # merged = base + adapter, up to rounding
    assert torch.equal(after, before)  # the adapter is active again, on the original weights
    m = sb.response_mask.bool()
    assert torch.allclose(sb.logprobs[m], full[m], atol=1e-4)  # pi_old from merged sampling = from a forward
    for n, p in policy.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base[n]), n  # the base (= the reference) is bit for bit the start


def test_sampling_runs_a_shared_system_prompt_once_with_the_same_result(system_episodes):
    policy, _, _, _, tok = system_episodes
    ids, am = encode_prompts(tok, SYSTEM_PROMPTS)
    widths = []  # tokens per row of each forward pass
    hook = policy.get_base_model().get_decoder().embed_tokens.register_forward_pre_hook(
        lambda module, args: widths.append(tuple(args[0].shape)))
    cfg = PPOConfig(max_new_tokens=8, temperature=0.9)
    try:
        with torch.no_grad():
            runs = [sample(policy, ids, am, cfg, tok, num_samples=2, draws=torch.Generator().manual_seed(3),
                           decoding=Decoding(share_prefix=share))
                    for share in (True, False)]
    finally:
        hook.remove()
    shared, plain = runs
    L = common_prefix(ids, am.bool(), ids.shape[1])
    assert L >= 8 and widths[0] == (1, L)  # the system prompt ran alone, once
    assert widths[1] == (len(PROMPTS), ids.shape[1] - L)  # then the rest of each prompt
    assert torch.equal(shared.sequences, plain.sequences) and torch.equal(shared.attention_mask, plain.attention_mask)
    assert torch.allclose(shared.logprobs, plain.logprobs, atol=1e-5)
