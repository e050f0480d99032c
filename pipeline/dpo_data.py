"""Preference pairs for DPO: the held-out split, the packed layout, the log-probs read from it, and
the held-out measurements (implicit-reward accuracy and margins, KL to the reference).

DPO needs, for every pair, log pi(chosen | prompt) and log pi(rejected | prompt) summed over the
response tokens, under the policy (with gradients) and under the frozen reference. Both come from
one forward pass each over a *packed* batch (`pack_pairs`):

    row k:  [prompt 1][chosen 1][rejected 1][prompt 2][chosen 2][rejected 2] ... [pad]
    mask:    a prompt token sees its own prompt, causally; a chosen token sees its prompt and the
             chosen tokens before it; a rejected token its prompt and the rejected tokens before
             it (never the chosen ones); nothing crosses a pair.
    positions: prompt 0..p-1, chosen p.., rejected p.. (both continue the prompt)

So each prompt runs once and both responses continue from it (the prefix sharing of Wang & Hegde
2024, "Accelerating Direct Preference Optimization with Prefix Sharing"), and several pairs share a
row, which leaves padding only at the end of a row: every other cell is a real token. Rows are
filled first-fit decreasing at the width pipeline/packing.py's cost model picks. Tokens that every
prompt of the batch starts with (a chat template's system prompt) are taken out and run once for
the batch as a KV cache (pipeline/packing.py, "Shared prefix"); the reference keeps it, computed
once per process. Only the cells that predict a response token go through the LM head.

The values are those of each prompt + response run alone, up to float rounding
(tests/test_train_dpo.py checks log-probs and gradients against whole sequences).

KL to the reference (`heldout_kl`): responses sampled from the policy at temperature 1 for
held-out prompts, each scored as the sum over its tokens of log pi - log ref, computed by packed
forward passes of both models (pipeline/policy.py, `sampled_kl`), so sampling-time rounding does
not enter. Its mean is an unbiased estimate of KL(pi || ref) per response, in nats.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from pipeline.config import GenerateConfig
from pipeline.losses import dpo_loss, ipo_loss, logprobs_from_logits
from pipeline.models import is_peft
from pipeline.packing import MIN_PREFIX, attention_mask_for, cache_kwarg, choose_width, first_fit, prefix_kv
from pipeline.policy import merged_lora, sampled_kl
from pipeline.pairs_data import EncodedPair, prompt_key
from pipeline.sampling import Decoding, sample
from pipeline.text import encode_prompts

# --------------------------------------------------------------------------- packing


@dataclass(frozen=True)
class Packing:
    """How one model's batches of pairs are packed (pack_pairs): its attention cost per linear FLOP
    (pipeline/models.py, attn_ratio: the cost model's row width), its pad id, and whether a prefix
    common to a batch's prompts is taken out and run once (not under gradient checkpointing, which
    drops the KV cache it needs, nor under FSDP)."""
    attn_per_linear: float
    pad_id: int
    share_prefix: bool = True


@dataclass
class PackedPairs:
    input_ids: torch.Tensor  # (n, W) the rows: prompt, chosen, rejected of each pair, pad at the end
    position_ids: torch.Tensor  # (n, W)
    mask: torch.Tensor  # (n, 1, W, L + W) bool: who each cell attends to (the prefix, then the rows)
    prefix: torch.Tensor | None  # (L,) tokens every prompt starts with, run once ahead of the rows
    index: torch.Tensor  # (N,) flat index into the n * W cells of the cell predicting each response token
    tokens: torch.Tensor  # (N,) that response token
    sequence: torch.Tensor  # (N,) its sequence: pair i's chosen is i, its rejected B + i
    response_tokens: torch.Tensor  # (2B,) tokens per response, chosen then rejected (IPO's averages)
    pairs: int  # B
    real_tokens: int  # tokens a forward pass computes: the prefix once, the rows' real cells
    weight: torch.Tensor | None = None  # (B,) each pair's weight in the loss; None = all count once


def pack_pairs(items: list[EncodedPair], packing: Packing, device=None,
               weights: list[float] | None = None) -> PackedPairs:
    """The packed layout of B pairs (module docstring), as `packing` says. weights: one per item, as
    the loss should count it (normalised by the caller), or None."""
    attn_per_linear, pad_id, share_prefix = packing.attn_per_linear, packing.pad_id, packing.share_prefix
    b = len(items)
    if b == 0:
        raise ValueError("pack_pairs: no pairs")
    if weights is not None and len(weights) != b:
        raise ValueError(f"pack_pairs: {len(weights)} weights for {b} pairs")
    # a common prefix, leaving every prompt at least its last token in the rows (it predicts token 0)
    L = len(os.path.commonprefix([it.prompt_ids for it in items])) if share_prefix and b > 1 else 0
    L = min(L, min(it.prompt_len for it in items) - 1)
    L = L if L >= MIN_PREFIX else 0
    lengths = [it.prompt_len - L + len(it.chosen_response) + len(it.rejected_response) for it in items]
    width = choose_width(lengths, attn_per_linear)
    bins = first_fit(lengths, width)
    ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(bins), width), dtype=torch.long)
    pair = torch.empty((len(bins), width), dtype=torch.long)  # which pair a cell belongs to
    part = torch.zeros((len(bins), width), dtype=torch.long)  # 0 prompt (or pad), 1 chosen, 2 rejected
    index, tokens, sequence = [], [], []
    for k, members in enumerate(bins):
        o = 0  # the next free cell of row k
        for i in members:
            it = items[i]
            p, c, r = it.prompt_ids[L:], it.chosen_response, it.rejected_response
            n = len(p) + len(c) + len(r)
            ids[k, o:o + n] = torch.tensor(p + c + r)
            pos[k, o:o + n] = torch.cat([torch.arange(L, it.prompt_len), torch.arange(it.prompt_len, it.prompt_len + len(c)),
                                         torch.arange(it.prompt_len, it.prompt_len + len(r))])
            pair[k, o:o + n] = i
            part[k, o + len(p):o + len(p) + len(c)] = 1
            part[k, o + len(p) + len(c):o + n] = 2
            last_prompt = k * width + o + len(p) - 1
            for start, response, seq in ((o + len(p), c, i), (o + len(p) + len(c), r, b + i)):
                # token t is predicted by the cell before it: the last prompt token for t = 0
                index += [last_prompt] + list(range(k * width + start, k * width + start + len(response) - 1))
                tokens += response
                sequence += [seq] * len(response)
            o += n
        pair[k, o:] = b + k  # padding: a segment of its own (each cell sees at least itself)
        pos[k, o:] = torch.arange(width - o)
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # (W, W)
    same_pair = pair[:, :, None] == pair[:, None, :]  # (n, W, W)
    visible = (part[:, None, :] == 0) | (part[:, None, :] == part[:, :, None])  # the prompt, or its own response
    mask = (same_pair & causal & visible)[:, None]  # (n, 1, W, W)
    if L:
        mask = torch.cat([mask.new_ones(len(bins), 1, width, L), mask], dim=3)  # (n, 1, W, L + W)
    counts = [len(it.chosen_response) for it in items] + [len(it.rejected_response) for it in items]
    return PackedPairs(
        input_ids=ids.to(device), position_ids=pos.to(device), mask=mask.to(device),
        prefix=torch.tensor(items[0].prompt_ids[:L], device=device) if L else None,
        index=torch.tensor(index, device=device), tokens=torch.tensor(tokens, device=device),
        sequence=torch.tensor(sequence, device=device),
        response_tokens=torch.tensor(counts, dtype=torch.float32, device=device), pairs=b,
        real_tokens=L + sum(lengths),
        weight=None if weights is None else torch.tensor(weights, dtype=torch.float32, device=device))


# --------------------------------------------------------------------------- log-probs


def sequence_logps(model, pp: PackedPairs, frozen: str | None = None) -> torch.Tensor:
    """(2B,) log-prob of each response (chosen rows, then rejected), summed over its tokens, under a
    causal LM (LoRA-wrapped or not) whose logits are lm_head(decoder output), as Llama-style models'
    are. Gradients flow when grad is enabled. frozen: see packing.prefix_kv."""
    from transformers import DynamicCache

    base = model.get_base_model() if is_peft(model) else model
    if getattr(base.config, "final_logit_softcapping", None) or getattr(base.config, "logit_scale", None):
        raise ValueError(f"{type(base).__name__}: logits are post-processed after the LM head; "
                         "train-dpo supports plain lm_head(hidden) models only")
    decoder = base.get_decoder()
    extra = {}
    if pp.prefix is not None:
        n = pp.input_ids.shape[0]
        kv = prefix_kv(decoder, pp.prefix, frozen)
        extra[cache_kwarg(decoder)] = DynamicCache(
            ddp_cache_data=[(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in kv])
    out = decoder(input_ids=pp.input_ids, position_ids=pp.position_ids, attention_mask=attention_mask_for(decoder, pp.mask),
                  use_cache=False, **extra)
    hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])[pp.index]  # (N, H)
    logits = base.get_output_embeddings()(hidden)  # (N, V)
    logp = logprobs_from_logits(logits[None], pp.tokens[None])[0]  # (N,) fp32
    return logp.new_zeros(2 * pp.pairs).index_add(0, pp.sequence, logp)  # (2B,)


@torch.no_grad()
def reference_logps(reference, pp: PackedPairs) -> torch.Tensor:
    """(2B,) sequence_logps under the reference (pipeline.policy.Reference): the policy with its
    adapter disabled, or the frozen copy made at the start of a full fine-tuning run."""
    if reference.frozen is not None:
        return sequence_logps(reference.frozen, pp, frozen="reference")
    with reference.policy.disable_adapter():  # the base weights: never trained, so the prefix's KV is kept
        return sequence_logps(reference.policy, pp, frozen="reference")


# --------------------------------------------------------------------------- losses and measurements


def preference_loss(cfg, logps: torch.Tensor, ref: torch.Tensor, response_tokens: torch.Tensor,
                    weight: torch.Tensor | None = None) -> torch.Tensor:
    """cfg.loss ('sigmoid': DPO, 'ipo') with cfg.beta, from (2B,) policy and reference log-probs
    (chosen rows first), the (2B,) response token counts and the (B,) pair weights (or None)."""
    b = logps.shape[0] // 2
    if cfg.loss == "ipo":
        return ipo_loss(logps[:b], logps[b:], ref[:b], ref[b:], cfg.beta, response_tokens[:b], response_tokens[b:],
                        weight)
    return dpo_loss(logps[:b], logps[b:], ref[:b], ref[b:], cfg.beta, weight)


PAIR_STATS = ("reward_accuracy", "margin", "rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected")
"""pair_stats' keys: sums start with all of them, so every rank all-reduces the same keys (a rank
with no pairs in a step or in the held-out set contributes zeros)."""


def pair_stats(logps: torch.Tensor, ref: torch.Tensor, beta: float) -> dict[str, float]:
    """Sums over the B pairs of the implicit-reward figures TRL logs (rewards/accuracies, margins,
    chosen, rejected; logps/chosen, rejected): the implicit reward is beta * (log pi - log ref)."""
    b = logps.shape[0] // 2
    rewards = beta * (logps.float() - ref.float())  # (2B,)
    chosen, rejected = rewards[:b], rewards[b:]
    return {"reward_accuracy": float((chosen > rejected).sum()), "margin": float((chosen - rejected).sum()),
            "rewards_chosen": float(chosen.sum()), "rewards_rejected": float(rejected.sum()),
            "logps_chosen": float(logps[:b].sum()), "logps_rejected": float(logps[b:].sum())}


@torch.no_grad()
def evaluate_pairs(model, reference, items: list[EncodedPair], cfg, packing: Packing, amp, dist) -> dict:
    """Held-out metrics under eval/: the loss, implicit-reward accuracy, margin, mean rewards and
    log-probs, over batches of 2 x batch_size pairs of similar length; every pair counts once,
    whatever its weight. dist (pipeline/distributed.py): each process takes its share of the pairs;
    every process gets the totals. Under FSDP a process with fewer batches runs extra ones whose
    results it drops, so every process runs as many passes of the sharded models."""
    mine = dist.shard(sorted(range(len(items)), key=lambda i: items[i].length))
    size = 2 * cfg.batch_size
    sums: dict[str, float] = {"loss": 0.0, "pairs": 0, **dict.fromkeys(PAIR_STATS, 0.0)}
    batches = [mine[start:start + size] for start in range(0, len(mine), size)]
    spare = dist.passes(len(batches)) - len(batches)  # FSDP: as many passes as the busiest rank
    for batch in tqdm(batches + [None] * spare, desc="eval pairs", unit="batch", dynamic_ncols=True,
                      disable=not dist.is_main or not mine):
        pp = pack_pairs([items[i] for i in batch or [0]], packing, dist.device)
        with amp():
            logps, ref = sequence_logps(model, pp), reference_logps(reference, pp)
            loss = float(preference_loss(cfg, logps, ref, pp.response_tokens))
        if batch is None:  # a pass run only to match the other ranks' collectives
            continue
        sums["loss"] += loss * pp.pairs
        sums["pairs"] += pp.pairs
        for key, value in pair_stats(logps, ref, cfg.beta).items():
            sums[key] += value
    sums = dist.reduce_sum(sums)
    n = int(sums.pop("pairs"))
    return {"eval/pairs": n, **{f"eval/{key}": value / n for key, value in sums.items()}} if n else {}


@torch.no_grad()
def heldout_kl(model, reference, tokenizer, prompts: list, cfg, amp, dist, batch_prompts: int = 8) -> dict:
    """KL(pi || ref) per response on cfg.kl_prompts distinct held-out prompts (drawn with cfg.seed),
    cfg.kl_samples responses each of at most cfg.kl_max_new_tokens (module docstring): kl/heldout,
    its standard error kl/heldout_se, and what the samples were like."""
    distinct = list({prompt_key(p): p for p in prompts}.values())
    random.Random(cfg.seed).shuffle(distinct)
    mine = dist.shard(distinct[:cfg.kl_prompts])
    device = dist.device
    gen = GenerateConfig(temperature=1.0, max_new_tokens=cfg.kl_max_new_tokens)
    sums = {"kl": 0.0, "kl_sq": 0.0, "samples": 0, "tokens": 0, "eos": 0}
    was_training = model.training
    model.eval()  # sampling needs the KV cache, which checkpointed layers in training mode drop
    starts = list(range(0, len(mine), batch_prompts))
    spare = dist.passes(len(starts)) - len(starts)  # FSDP: every rank samples as many batches, in step
    for start in tqdm(starts + [None] * spare, desc="KL samples", unit="batch", dynamic_ncols=True,
                      disable=not dist.is_main or not mine):
        batch = mine[start:start + batch_prompts] if start is not None else distinct[:1]
        ids, prompt_mask = encode_prompts(tokenizer, batch, cfg.max_length, device)
        generator = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + (start or 0) + 7_919 * dist.rank)
        with amp(), merged_lora(model):
            sb = sample(model, ids, prompt_mask, gen, tokenizer, num_samples=cfg.kl_samples, draws=generator,
                        decoding=Decoding(synced=dist.sharded))
        with amp():  # log pi from a forward of the policy, as the reference's
            kl = sampled_kl(model, reference, sb, 1.0, share_prefix=not dist.sharded)  # (b,) nats per response
        if start is None:  # samples drawn only to match the other ranks' collectives
            continue
        mask = sb.response_mask.float()  # (b, R)
        sums["kl"] += float(kl.sum())
        sums["kl_sq"] += float((kl ** 2).sum())
        sums["samples"] += kl.numel()
        sums["tokens"] += float(mask.sum())
        sums["eos"] += sum(f == "eos" for f in sb.finish_reason)
    model.train(was_training)
    sums = dist.reduce_sum(sums)
    n = int(sums["samples"])
    if n == 0:
        return {}
    mean = sums["kl"] / n
    var = max(sums["kl_sq"] / n - mean ** 2, 0.0) * n / max(n - 1, 1)
    return {"kl/heldout": mean, "kl/heldout_se": math.sqrt(var / n), "kl/samples": n,
            "kl/prompts": min(len(distinct), cfg.kl_prompts), "kl/response_tokens": sums["tokens"] / n,
            "kl/eos_rate": sums["eos"] / n}


__all__ = ["Packing", "PackedPairs", "pack_pairs", "sequence_logps", "reference_logps", "preference_loss",
           "pair_stats", "evaluate_pairs", "heldout_kl"]
