"""The no-grad half of a PPO step: prompts in, a `Rollout` of per-token tensors out.

    Rollout, rollout_forwards      the rollout record; its reference log-probs, pi_old log-probs and
                                   critic values (phase 3)
    critic_values                  the critic's values at the response tokens (rollout and update)
    gather_rollout                 every rank's rollout as one batch
    kl_shaped_advantages           scores -> shaped rewards -> advantages and returns (phases 5-6)
    StepRollout                    phases 1-6's results together: what the update, the metrics and
                                   the sample table read

pipeline/train_ppo.py calls these in its numbered phases; the update phase (pipeline/ppo_update.py)
reuses `critic_values`, with `pack_responses` (pipeline/packing.py) and `response_logits` /
`response_logprobs` (pipeline/policy.py), so the training forward pass computes log-probs and values
exactly as the rollout did (same positions, same temperature). Every forward pass over episodes is
packed without padding. Which prompts a step's episodes get, and their sampling numbers:
pipeline/ppo_data.py.

Layout of one rollout (B episodes): `sequences` (B, P+R) is the left-padded prompt followed by the
right-padded response; every per-token tensor is (B, R), aligned with the response tokens:
`mask[:, t]` is 1 for real tokens up to and including EOS, 0 after (post-EOS tokens are masked
everywhere). A critic value at t is read at the position *before* token t (the state the token
was chosen in), as in TRL's `full_value[:, context_length - 1 : -1]`.

Rewards (phase 4) come from pipeline/scoring.py: a reward model's normalised score of the rollout's
token ids, or a scripted reward for tests and benches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.config import CRITIC_FREE, PPOConfig, group_size
from pipeline.losses import gae, group_advantages, kl_per_token, masked_whiten, shaped_rewards
from pipeline.models import attn_ratio
from pipeline.packing import PackedResponses, hidden_states, pack_responses
from pipeline.policy import response_logits, response_logprobs
from pipeline.sampling import SampleBatch

# --------------------------------------------------------------------------- the rollout record


@dataclass
class Rollout:
    prompts: list  # B prompts as given (text or messages)
    sequences: torch.Tensor  # (B, P+R) prompt (left-padded) then response (right-padded)
    attention_mask: torch.Tensor  # (B, P+R)
    response_ids: torch.Tensor  # (B, R)
    mask: torch.Tensor  # (B, R) float, 1 up to and including EOS
    prompt_length: int  # P
    logprobs: torch.Tensor  # (B, R) pi_old log-probs (logits / temperature)
    ref_logprobs: torch.Tensor  # (B, R) reference log-probs (logits / temperature)
    values: torch.Tensor  # (B, R) critic values at rollout time (0 without a critic)
    eos: torch.Tensor  # (B,) bool: the response ended with EOS

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(1).long()  # (B,)


# --------------------------------------------------------------------------- packed forwards over episodes


def critic_values(critic, pr: PackedResponses) -> torch.Tensor:
    """(b, R) values at the positions before each response token, 0 past EOS; the same as
    ScalarModel.forward at those positions (the head on the last hidden state). The head runs in
    fp32 outside any autocast, as the reward head does (pipeline/scoring.py, reward_eval.py): under
    bf16 autocast a Linear would compute in bf16, whose 8-bit mantissa rounds values of size 10 to
    steps of 0.06, the size of the advantages being estimated."""
    hidden = hidden_states(critic.backbone, pr.packed)[pr.index]  # (N, H)
    with torch.autocast(hidden.device.type, enabled=False):
        values = critic.head(hidden.float()).squeeze(-1)  # (N,)
    return pr.scatter(values)


@dataclass
class StepRollout:
    """Phases 1-6 of one step: the rollout, its raw scores, advantages and KL terms, the KL
    coefficient that shaped them, and each phase's seconds (sample, forwards, score, rollout)."""
    ro: Rollout
    raw_score: torch.Tensor  # (B,)
    adv: Advantages
    beta: float
    times: dict


@torch.no_grad()
def rollout_forwards(policy, reference, critic, sb: SampleBatch, cfg: PPOConfig, need_old: bool, autocast,
                     share_prefix: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Reference log-probs, pi_old log-probs (only when need_old) and critic values of the sampled
    batch, all (B, R), 0 past each EOS, at cfg.temperature. Runs in chunks of
    cfg.forward_batch_size episodes, each packed without padding. Without a critic (None: 'rloo',
    'grpo') the values are 0.

    share_prefix False: no prefix pass (FSDP: whether a chunk has a common prefix, and whether a
    frozen model kept its keys and values, differs between processes, and every forward of a
    sharded model must run on all of them; with B / N episodes per process each runs the same
    number of chunks)."""
    sequences, attention_mask, response_ids = sb.sequences, sb.attention_mask, sb.response_ids
    mask, temperature = sb.response_mask.float(), cfg.temperature
    B, R = response_ids.shape
    ref = torch.zeros(B, R, device=sequences.device)
    old = torch.zeros(B, R, device=sequences.device) if need_old else None
    values = torch.zeros(B, R, device=sequences.device)
    ratio = attn_ratio(policy)
    for rows in torch.arange(B, device=sequences.device).split(cfg.forward_batch_size):
        pr = pack_responses(sequences[rows], attention_mask[rows], response_ids[rows], mask[rows], sb.prompt_length,
                            ratio, share_prefix)
        with autocast():
            ref[rows] = response_logprobs(response_logits(reference, pr, reference=True), pr, temperature)
            if need_old:
                old[rows] = response_logprobs(response_logits(policy, pr), pr, temperature)
            if critic is not None:
                values[rows] = critic_values(critic, pr).float()
    return ref, old, values


def gather_rollout(ro: Rollout, score: torch.Tensor, dist, pad_id: int) -> tuple[Rollout, torch.Tensor]:
    """Every rank's rollout and scores as one batch, rank 0's episodes first, on every rank
    (pipeline/distributed.py). Prompts are re-padded on the left to the longest prompt width and
    responses on the right to the longest response, so the layout stays (B, P+R) as one process
    would have it. One process: returned as is."""
    if dist.world == 1:
        return ro, score
    names = ("sequences", "attention_mask", "response_ids", "mask", "logprobs", "ref_logprobs", "values", "eos")
    mine = {name: getattr(ro, name).cpu() for name in names}
    parts = dist.gather_objects({**mine, "score": score.cpu(), "prompts": ro.prompts, "P": ro.prompt_length})
    P = max(part["P"] for part in parts)
    R = max(part["response_ids"].shape[1] for part in parts)

    def widen(x: torch.Tensor, left: int, right: int, fill) -> torch.Tensor:
        return torch.nn.functional.pad(x, (left, right), value=fill)

    out = {name: [] for name in names}
    for part in parts:
        p, r = part["P"], part["response_ids"].shape[1]
        for name in ("sequences", "attention_mask"):
            fill = pad_id if name == "sequences" else 0
            x = part[name]
            out[name].append(torch.cat([widen(x[:, :p], P - p, 0, fill), widen(x[:, p:], 0, R - r, fill)], dim=1))
        out["response_ids"].append(widen(part["response_ids"], 0, R - r, pad_id))
        for name in ("mask", "logprobs", "ref_logprobs", "values"):
            out[name].append(widen(part[name], 0, R - r, 0.0))
        out["eos"].append(part["eos"])
    device = ro.sequences.device
    whole = {name: torch.cat(out[name]).to(device) for name in names}
    prompts = [prompt for part in parts for prompt in part["prompts"]]
    return (Rollout(prompts=prompts, prompt_length=P, **whole),
            torch.cat([part["score"] for part in parts]).to(device))


# --------------------------------------------------------------------------- rewards -> advantages


@dataclass
class Advantages:
    score: torch.Tensor  # (B,) score after clipping and the missing-EOS penalty
    kl: torch.Tensor  # (B, R) per-token KL estimate, 0 past EOS
    kl_seq: torch.Tensor  # (B,) summed over the response: nats per sequence
    rewards: torch.Tensor  # (B, R) shaped rewards
    advantages: torch.Tensor  # (B, R) GAE, whitened over real tokens, 0 past EOS
    returns: torch.Tensor  # (B, R) advantages (before whitening) + values: the critic's target


@torch.no_grad()
def kl_shaped_advantages(ro: Rollout, raw_score: torch.Tensor, cfg, beta: float) -> Advantages:
    """From a rollout and its scores to advantages (phases 5-6 of pipeline/train_ppo.py).

    - score: clipped to +-cfg.reward_clip (when > 0), minus cfg.missing_eos_penalty for responses cut
      off at the length limit (TRL's missing_eos_penalty);
    - kl_t = k1 or k3 of pi_old vs the reference, r_t = -beta * kl_t with the score added on the last
      real token (Ziegler et al. 2019), optionally whitened (TRL's whiten_rewards: scale only);
    - 'gae': GAE over real response tokens, advantages whitened (masked), returns = advantages +
      values (the critic's targets with GAE at cfg.critic_lam when it differs from cfg.lam);
    - 'rloo' / 'grpo' (no critic): each episode's sequence reward, the sum of its shaped rewards
      (score - beta * summed KL), against the other responses to its prompt (`group_advantages`;
      the batch holds each prompt's k responses consecutively), the same advantage on every token;
      returns are 0 (nothing learns them).
    Every position past EOS is 0 in kl, rewards and advantages, whatever the inputs hold there.
    """
    mask = ro.mask
    score = raw_score.clamp(-cfg.reward_clip, cfg.reward_clip) if cfg.reward_clip > 0 else raw_score
    score = score - cfg.missing_eos_penalty * (~ro.eos).float()  # (B,)
    kl = kl_per_token(ro.logprobs, ro.ref_logprobs, cfg.kl_estimator) * mask  # (B, R)
    rewards = shaped_rewards(score, kl, beta, mask)  # (B, R)
    if cfg.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False) * mask
    if cfg.advantage_estimator in CRITIC_FREE:
        per_episode = group_advantages(rewards.sum(1), group_size(cfg), cfg.advantage_estimator)  # (B,)
        advantages, returns = per_episode[:, None] * mask, torch.zeros_like(rewards)
    else:
        advantages, returns = gae(rewards, ro.values, mask, cfg.gamma, cfg.lam)  # (B, R) each
        if cfg.critic_lam != cfg.lam:  # decoupled GAE: the critic's targets at their own lambda
            _, returns = gae(rewards, ro.values, mask, cfg.gamma, cfg.critic_lam)
        advantages = masked_whiten(advantages, mask) * mask
    return Advantages(score=score, kl=kl, kl_seq=kl.sum(1), rewards=rewards, advantages=advantages,
                      returns=returns)


__all__ = ["Rollout", "Advantages", "StepRollout", "kl_shaped_advantages", "gather_rollout", "critic_values",
           "rollout_forwards"]
