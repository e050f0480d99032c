"""Phase 7 of PPO (pipeline/train_ppo.py): `ppo_epochs` passes over a rollout in shuffled
minibatches, gradients accumulated over micro-batches, one optimiser step each for policy and
critic: the clipped policy loss on pi_theta / pi_old (never pi_theta / pi_ref), the entropy bonus
of the distribution sampled, PPO-ptx, the clipped value loss (the value loss alone during the
critic's warm-up). Without a critic ('rloo', 'grpo': ppo.critic is None) the policy's terms
alone."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from pipeline.distributed import clip_grad_norm
from pipeline.losses import entropy_from_logits, lm_loss, masked_mean, policy_loss, value_loss
from pipeline.models import attn_ratio, checkpointing
from pipeline.packing import pack_responses
from pipeline.policy import causal_lm_logits, response_logits, response_logprobs, trainable
from pipeline.ppo_data import ptx_batch
from pipeline.rollout import StepRollout, critic_values

if TYPE_CHECKING:
    from pipeline.ppo_state import PPORun


def ppo_update(ppo: PPORun, sr: StepRollout, stop, train_policy: bool = True) -> tuple[dict, int]:
    """Phase 7 of step ppo.step: cfg.ppo_epochs passes over the rollout in shuffled minibatches,
    one optimiser step each for policy and critic (the critic's only, without train_policy). Returns the update's sums (weighted by each micro-batch's token
    share; over N processes the per-rank sums, grad norms aside) and the number of minibatches."""
    cfg, dist, step = ppo.cfg, ppo.dist, ppo.step
    ro = sr.ro
    B, mask = len(ro.prompts), ro.mask
    stats = defaultdict(float)
    shuffle = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    lengths = ro.lengths.cpu()
    # gradient checkpointing acts in training mode only, and drops KV caches: no shared prefix
    # (nor under FSDP, whose backward fails on a prefix's keys and values reused by a batch)
    critic = ppo.critic
    recompute = checkpointing(ppo.policy) or (critic is not None and checkpointing(critic))
    ppo.policy.train(recompute)
    if critic is not None:
        critic.train(recompute)
    share_prefix = ppo.share_prefix and not recompute
    n_minibatches = 0
    total = cfg.ppo_epochs * -(-B // cfg.mini_batch_size)
    for epoch in range(cfg.ppo_epochs):
        for mb in torch.randperm(B, generator=shuffle).split(cfg.mini_batch_size):
            # sorting by length inside the minibatch groups similar rows into a micro-batch (packs
            # better); the summed gradient of the minibatch is unchanged. With N processes each rank
            # takes every N-th episode of the minibatch.
            mb = mb[torch.argsort(lengths[mb], descending=True)].to(ppo.device)
            mb_tokens = mask[mb].sum()
            micros = mb[dist.rank::dist.world].split(cfg.micro_batch_size)
            for j, micro in enumerate(micros):
                w = mask[micro].sum() / mb_tokens  # token share: accumulated loss = minibatch token mean
                last = j == len(micros) - 1  # the last backward of the step all-reduces
                with dist.sync(ppo.policy_w, last and cfg.ptx_coef <= 0), dist.sync(ppo.critic_w, last):
                    micro_batch_backward(ppo, sr, micro, w, share_prefix, stats,
                                         first=n_minibatches == 0, train_policy=train_policy)
            if cfg.ptx_coef > 0 and train_policy:
                ptx_backward(ppo, step * cfg.ppo_epochs * (B // cfg.mini_batch_size) + n_minibatches, stats)
            # policy and critic clipped separately (sharded: each norm is one all-reduce)
            if train_policy:
                stats["policy/grad_norm"] += clip_grad_norm(trainable(ppo.policy), cfg.max_grad_norm)
                ppo.policy_opt.step()
                ppo.policy_opt.zero_grad(set_to_none=True)
            if critic is not None:
                stats["val/grad_norm"] += clip_grad_norm(trainable(critic), cfg.max_grad_norm)
                ppo.critic_opt.step()
                ppo.critic_opt.zero_grad(set_to_none=True)
            n_minibatches += 1
            # a stop between minibatches, when what they changed can be put back (train_ppo: the
            # step's start is saved); else, and after the last, the next step's start sees it
            if ppo.before_update is not None and n_minibatches < total:
                dist.check_stop(stop)
    return stats, n_minibatches


def micro_batch_backward(ppo: PPORun, sr: StepRollout, micro: torch.Tensor, w: torch.Tensor, share_prefix: bool,
                         stats: dict, first: bool, train_policy: bool = True) -> None:
    """One micro-batch's clipped policy loss (pi_theta / pi_old), entropy bonus and clipped value
    loss, backward at its token share w; its figures added to stats (first: the step's first
    minibatch, where pi_theta == pi_old and the ratio must be 1). Without train_policy the value
    loss alone (the policy runs no forward: under DDP or FSDP every rank skips it alike)."""
    cfg, ro, adv = ppo.cfg, sr.ro, sr.adv
    m = ro.mask[micro]  # (b, R)
    # the micro-batch's episodes packed without padding, as in the rollout
    pr = pack_responses(ro.sequences[micro], ro.attention_mask[micro], ro.response_ids[micro], m, ro.prompt_length,
                        attn_ratio(ppo.policy), share_prefix=share_prefix)
    figures = {}
    with ppo.autocast():
        loss = 0.0
        if train_policy:
            logits = ppo.policy_w(response_logits, pr)  # (N, V) at the N real response tokens
            logp = response_logprobs(logits, pr, cfg.temperature)  # (b, R)
            loss, pg = policy_loss(logp, ro.logprobs[micro], adv.advantages[micro], m, cfg.cliprange)
            figures = {"policy/loss": loss, "policy/clipfrac": pg["clipfrac"], "policy/approxkl": pg["approxkl"],
                       "policy/ratio_mean": pg["ratio_mean"]}
            if cfg.entropy_coef > 0:  # of the distribution sampled: logits / T
                entropy = masked_mean(pr.scatter(entropy_from_logits(logits[None] / cfg.temperature)[0]), m)
                loss = loss - cfg.entropy_coef * entropy
                figures["policy/entropy"] = entropy
            del logits
            if first:
                stats["policy/ratio_first"] += float(w * pg["ratio_mean"])
        if ppo.critic is not None:
            v = ppo.critic_w(critic_values, pr)  # (b, R)
            # value clipping keeps the critic near its rollout-time values while the policy moves; in the
            # warm-up the policy stands still and the critic is fitted plainly (VC-PPO's value pretraining)
            clip = cfg.cliprange_value if train_policy else None
            vf_loss, vf_clipfrac = value_loss(v, ro.values[micro], adv.returns[micro], m, clip)
            loss = loss + cfg.vf_coef * vf_loss
            figures.update({"val/loss": vf_loss, "val/clipfrac": vf_clipfrac})
    (w * ppo.dist.loss_scale * loss).backward()
    for key, val in figures.items():
        stats[key] += float(w * val.detach())


def ptx_backward(ppo: PPORun, n_before: int, stats: dict) -> None:
    """PPO-ptx (Ouyang et al. 2022, eq. 2): the LM loss on a batch of pretraining/SFT texts, which
    follow from the number of minibatches before this one, so a resumed run uses the same ones."""
    cfg, dist = ppo.cfg, ppo.dist
    texts = [ppo.ptx_texts[(n_before * cfg.micro_batch_size + i) % len(ppo.ptx_texts)]
             for i in range(cfg.micro_batch_size)]
    mine = dist.shard(texts)
    share = len(mine) / len(texts)  # a rank with no text joins the all-reduce with 0
    p_ids, p_am = ptx_batch(ppo.tokenizer, mine or texts[:1], cfg.ptx_max_length, ppo.device)
    with ppo.autocast():
        ptx_loss = lm_loss(ppo.policy_w(causal_lm_logits, p_ids, p_am), p_ids, p_am)
    (cfg.ptx_coef * share * dist.loss_scale * ptx_loss).backward()
    stats["ptx/loss"] += float(share * ptx_loss.detach())


__all__ = ["ppo_update"]
