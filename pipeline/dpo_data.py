"""Preference pairs for DPO: the groups they are trained in, the packed layout, the log-probs read
from it, and the held-out measurements (implicit-reward accuracy and margins, KL to the reference).

DPO needs, for every pair, log pi(chosen | prompt) and log pi(rejected | prompt) summed over the
response tokens, under the policy (with gradients) and under the frozen reference. A ranking of K
responses gives K(K-1)/2 pairs but only K distinct responses, so the pairs are trained in *groups*
(`encode_dpo`, pipeline/pairs_data.py `group_pairs`): a ranking's prompt once, each distinct response
once, and its pairs as indices into them (InstructGPT's "all (K choose 2) comparisons from each
prompt as a single batch element"); with grouped False each pair is a group of its own (its two
responses, one pair). Both log-probs come from one forward pass each over a *packed* batch of
groups (`pack_pairs`):

    row k:  [prompt 1][r 1.1][r 1.2]...[r 1.K][prompt 2][r 2.1]...[r 2.K'] ... [pad]
    mask:    a prompt token sees its own prompt, causally; a response token sees its prompt and the
             tokens of its own response before it (never another response); nothing crosses a group.
    positions: prompt 0..p-1, every response p.. (each continues the prompt)

A pair is the case K = 2: [prompt][chosen][rejected]. So each prompt runs once and every response
continues from it (the prefix sharing of Wang & Hegde 2024, "Accelerating Direct Preference
Optimization with Prefix Sharing"), each response once per step however many pairs it is in, and
several groups share a row, which leaves padding only at the end of a row: every other cell is a
real token. Rows are filled first-fit decreasing at the width pipeline/packing.py's cost model
picks. Tokens that every prompt of the batch starts with (a chat template's system prompt) are
taken out and run once for the batch as a KV cache (pipeline/packing.py, "Shared prefix"); the
reference keeps it, computed once per process. Only the cells that predict a response token go
through the LM head.

The loss (`preference_loss`) is DPO's or IPO's over every pair of a group, read from the per-response
sums, each pair's term times its weight; a group's loss is the mean over its pairs and the batch's
the mean over its groups, as InstructGPT normalises its reward model's K choose 2 comparisons: a
ranking counts once, whatever its K (with one pair per group: the mean over pairs). The held-out
figures count every pair once (`evaluate_pairs`).

The values are those of each prompt + response run alone, up to float rounding
(tests/test_train_dpo.py and tests/test_dpo_groups.py check log-probs and gradients against whole
sequences).

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
from pipeline.pairs_data import (EncodedGroup, EncodedPair, EncodeReport, Pair, encode_groups, encode_pairs,
                                 group_pairs, prompt_key)
from pipeline.sampling import Decoding, sample
from pipeline.text import encode_prompts

# --------------------------------------------------------------------------- groups


def pair_group(pair: EncodedPair) -> EncodedGroup:
    """A pair as a group of its own: its two responses (chosen 0, rejected 1) and one pair."""
    return EncodedGroup(pair.prompt_ids, [pair.chosen_response, pair.rejected_response],
                        [pair.chosen_response_tokens, pair.rejected_response_tokens], [0], [1], [pair.margin],
                        [pair.weight])


def encode_dpo(pairs: list[Pair], tokenizer, max_length: int, grouped: bool) -> tuple[list[EncodedGroup],
                                                                                       EncodeReport]:
    """The pairs as train-dpo batches them (module docstring): grouped, a ranking's pairs as one
    group (pipeline/pairs_data.py `group_pairs`: by ranking id, else by prompt; its prompt truncated
    once for the group's longest response); else each pair a group of its own, tokenised as
    `encode_pairs` does."""
    if grouped:
        return encode_groups(group_pairs(pairs), tokenizer, max_length)
    items, report = encode_pairs(pairs, tokenizer, max_length)
    return [pair_group(it) for it in items], report


# --------------------------------------------------------------------------- packing


@dataclass(frozen=True)
class Packing:
    """How one model's batches of groups are packed (pack_pairs): its attention cost per linear FLOP
    (pipeline/models.py, attn_ratio: the cost model's row width), its pad id, and whether a prefix
    common to a batch's prompts is taken out and run once (not under gradient checkpointing, which
    drops the KV cache it needs, nor under FSDP)."""
    attn_per_linear: float
    pad_id: int
    share_prefix: bool = True


@dataclass
class PackedPairs:
    """G groups packed (module docstring): R responses in all, numbered group by group (group g's
    response j is its first response's number + j; a pair's chosen, then its rejected), and its P
    pairs as numbers of those responses."""
    input_ids: torch.Tensor  # (n, W) the rows: each group's prompt, then its responses; pad at the end
    position_ids: torch.Tensor  # (n, W)
    mask: torch.Tensor  # (n, 1, W, L + W) bool: who each cell attends to (the prefix, then the rows)
    prefix: torch.Tensor | None  # (L,) tokens every prompt starts with, run once ahead of the rows
    index: torch.Tensor  # (N,) flat index into the n * W cells of the cell predicting each response token
    tokens: torch.Tensor  # (N,) that response token
    sequence: torch.Tensor  # (N,) its response, 0..R-1
    response_tokens: torch.Tensor  # (R,) tokens per response (IPO's averages)
    chosen: torch.Tensor  # (P,) each pair's chosen response, 0..R-1
    rejected: torch.Tensor  # (P,) and its rejected one
    pairs_per_group: list[int]  # (G,) n_g, the pairs of each group (its pairs are consecutive)
    pairs: int  # P
    groups: int  # G
    real_tokens: int  # tokens a forward pass computes: the prefix once, the rows' real cells
    weight: torch.Tensor | None = None  # (P,) each pair's weight in the loss; None = all count once

    @property
    def responses(self) -> int:  # R
        return self.response_tokens.shape[0]


def pack_pairs(items: list[EncodedGroup | EncodedPair], packing: Packing, device=None,
               weights: list[float] | None = None) -> PackedPairs:
    """The packed layout of G groups (module docstring), as `packing` says; an EncodedPair is a
    group of its own (`pair_group`). weights: one per pair (the groups' pairs in order), as the loss
    should count it (normalised by the caller), or None."""
    attn_per_linear, pad_id, share_prefix = packing.attn_per_linear, packing.pad_id, packing.share_prefix
    groups = [pair_group(it) if isinstance(it, EncodedPair) else it for it in items]
    g_count = len(groups)
    if g_count == 0:
        raise ValueError("pack_pairs: no pairs")
    n_pairs = sum(g.n_pairs for g in groups)
    if weights is not None and len(weights) != n_pairs:
        raise ValueError(f"pack_pairs: {len(weights)} weights for {n_pairs} pairs")
    # a common prefix, leaving every prompt at least its last token in the rows (it predicts token 0)
    L = len(os.path.commonprefix([g.prompt_ids for g in groups])) if share_prefix and g_count > 1 else 0
    L = min(L, min(len(g.prompt_ids) for g in groups) - 1)
    L = L if L >= MIN_PREFIX else 0
    lengths = [len(g.prompt_ids) - L + sum(map(len, g.responses)) for g in groups]
    first = [0]  # each group's first response number
    for g in groups:
        first.append(first[-1] + len(g.responses))
    width = choose_width(lengths, attn_per_linear)
    bins = first_fit(lengths, width)
    ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(bins), width), dtype=torch.long)
    segment = torch.empty((len(bins), width), dtype=torch.long)  # which group a cell belongs to
    part = torch.zeros((len(bins), width), dtype=torch.long)  # 0 prompt (or pad), j + 1 its response j
    index, tokens, sequence = [], [], []
    for k, members in enumerate(bins):
        o = 0  # the next free cell of row k
        for gi in members:
            g = groups[gi]
            prompt, p = g.prompt_ids[L:], len(g.prompt_ids)
            n = lengths[gi]
            ids[k, o:o + n] = torch.tensor(prompt + [t for r in g.responses for t in r])
            pos[k, o:o + n] = torch.cat([torch.arange(L, p)] + [torch.arange(p, p + len(r)) for r in g.responses])
            segment[k, o:o + n] = gi
            last_prompt = k * width + o + len(prompt) - 1
            start = o + len(prompt)
            for j, response in enumerate(g.responses):
                part[k, start:start + len(response)] = j + 1
                # token t is predicted by the cell before it: the last prompt token for t = 0
                index += [last_prompt] + list(range(k * width + start, k * width + start + len(response) - 1))
                tokens += response
                sequence += [first[gi] + j] * len(response)
                start += len(response)
            o += n
        segment[k, o:] = g_count + k  # padding: a segment of its own (each cell sees at least itself)
        pos[k, o:] = torch.arange(width - o)
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # (W, W)
    same_group = segment[:, :, None] == segment[:, None, :]  # (n, W, W)
    visible = (part[:, None, :] == 0) | (part[:, None, :] == part[:, :, None])  # the prompt, or its own response
    mask = (same_group & causal & visible)[:, None]  # (n, 1, W, W)
    if L:
        mask = torch.cat([mask.new_ones(len(bins), 1, width, L), mask], dim=3)  # (n, 1, W, L + W)
    counts = [len(r) for g in groups for r in g.responses]
    chosen = [first[gi] + c for gi, g in enumerate(groups) for c in g.chosen]
    rejected = [first[gi] + r for gi, g in enumerate(groups) for r in g.rejected]
    return PackedPairs(
        input_ids=ids.to(device), position_ids=pos.to(device), mask=mask.to(device),
        prefix=torch.tensor(groups[0].prompt_ids[:L], device=device) if L else None,
        index=torch.tensor(index, device=device), tokens=torch.tensor(tokens, device=device),
        sequence=torch.tensor(sequence, device=device),
        response_tokens=torch.tensor(counts, dtype=torch.float32, device=device),
        chosen=torch.tensor(chosen, device=device), rejected=torch.tensor(rejected, device=device),
        pairs_per_group=[g.n_pairs for g in groups], pairs=n_pairs, groups=g_count, real_tokens=L + sum(lengths),
        weight=None if weights is None else torch.tensor(weights, dtype=torch.float32, device=device))


# --------------------------------------------------------------------------- log-probs


def sequence_logps(model, pp: PackedPairs, frozen: str | None = None) -> torch.Tensor:
    """(R,) log-prob of each response of the packing (in its numbering), summed over its tokens, under a
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
    return logp.new_zeros(pp.responses).index_add(0, pp.sequence, logp)  # (R,)


@torch.no_grad()
def reference_logps(reference, pp: PackedPairs) -> torch.Tensor:
    """(R,) sequence_logps under the reference (pipeline.policy.Reference): the policy with its
    adapter disabled, or the frozen copy made at the start of a full fine-tuning run."""
    if reference.frozen is not None:
        return sequence_logps(reference.frozen, pp, frozen="reference")
    with reference.policy.disable_adapter():  # the base weights: never trained, so the prefix's KV is kept
        return sequence_logps(reference.policy, pp, frozen="reference")


# --------------------------------------------------------------------------- losses and measurements


def pair_shares(pp: PackedPairs) -> torch.Tensor | None:
    """(P,) each pair's factor f in mean_P(f * loss) that makes it the mean over the G groups of each
    group's mean over its n_g pairs of w * loss: f = w * P / (G * n_g). None where f is 1 for every
    pair (no weights, and every group with as many pairs): the plain mean, bit for bit."""
    sizes = pp.pairs_per_group
    if pp.weight is None and len(set(sizes)) == 1:
        return None
    share = torch.tensor([pp.pairs / (pp.groups * n) for n in sizes for _ in range(n)],
                         device=pp.chosen.device)  # (P,) 1 where n_g = P / G
    return share if pp.weight is None else pp.weight * share


def preference_loss(cfg, logps: torch.Tensor, ref: torch.Tensor, pp: PackedPairs, per_group: bool = True
                    ) -> torch.Tensor:
    """cfg.loss ('sigmoid': DPO, 'ipo') with cfg.beta over the P pairs of `pp`, from the (R,) policy and
    reference log-probs of its responses. per_group (training): each pair's term times its weight,
    a group's loss the mean over its pairs, the batch's the mean over its groups (`pair_shares`; one
    pair per group: the weighted mean over pairs); False: the plain mean over the pairs (held out:
    every pair counts once)."""
    c, r = pp.chosen, pp.rejected
    weight = pair_shares(pp) if per_group else None
    if cfg.loss == "ipo":
        return ipo_loss(logps[c], logps[r], ref[c], ref[r], cfg.beta, pp.response_tokens[c], pp.response_tokens[r],
                        weight)
    return dpo_loss(logps[c], logps[r], ref[c], ref[r], cfg.beta, weight)


PAIR_STATS = ("reward_accuracy", "margin", "rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected")
"""pair_stats' keys: sums start with all of them, so every rank all-reduces the same keys (a rank
with no pairs in a step or in the held-out set contributes zeros)."""


def pair_stats(logps: torch.Tensor, ref: torch.Tensor, pp: PackedPairs, beta: float) -> dict[str, float]:
    """Sums over the P pairs of `pp` of the implicit-reward figures TRL logs (rewards/accuracies,
    margins, chosen, rejected; logps/chosen, rejected), from the (R,) log-probs of its responses: the
    implicit reward is beta * (log pi - log ref). A response in several pairs counts in each."""
    rewards = beta * (logps.float() - ref.float())  # (R,)
    chosen, rejected = rewards[pp.chosen], rewards[pp.rejected]  # (P,) each
    return {"reward_accuracy": float((chosen > rejected).sum()), "margin": float((chosen - rejected).sum()),
            "rewards_chosen": float(chosen.sum()), "rewards_rejected": float(rejected.sum()),
            "logps_chosen": float(logps[pp.chosen].sum()), "logps_rejected": float(logps[pp.rejected].sum())}


@torch.no_grad()
def evaluate_pairs(model, reference, items: list[EncodedGroup], cfg, packing: Packing, amp, dist) -> dict:
    """Held-out metrics under eval/, per pair: the loss, implicit-reward accuracy, margin, mean rewards
    and log-probs, over batches of 2 x batch_size groups of similar length (each response computed
    once); every pair counts once, whatever its weight or its group's size. dist
    (pipeline/distributed.py): each process takes its share of the groups; every process gets the
    totals. Under FSDP a process with fewer batches runs extra ones whose results it drops, so every
    process runs as many passes of the sharded models."""
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
            loss = float(preference_loss(cfg, logps, ref, pp, per_group=False))
        if batch is None:  # a pass run only to match the other ranks' collectives
            continue
        sums["loss"] += loss * pp.pairs
        sums["pairs"] += pp.pairs
        for key, value in pair_stats(logps, ref, pp, cfg.beta).items():
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


__all__ = ["pair_group", "encode_dpo", "Packing", "PackedPairs", "pack_pairs", "sequence_logps", "reference_logps",
           "pair_shares", "preference_loss", "pair_stats", "evaluate_pairs", "heldout_kl"]
