"""Pure tensor functions for reward-model training and PPO.

No model, no optimiser, no state: every function maps tensors to tensors, so each one is tested
against numbers computed by hand (tests/test_losses.py), as OpenRLHF and TRL test theirs.

Shape letters: B = batch (rows), T = sequence positions, V = vocabulary.
Masks are 0/1 tensors of the same shape as the values they mask (1 = the position counts).

Conventions shared with pipeline/train_ppo.py:
- `logprobs_from_logits(logits, tokens)` does NOT shift: logits[:, t] scores tokens[:, t]. Callers
  pass the logits of the positions that *predict* the response tokens (i.e. already shifted by one).
- Response masks are right-padded: 1 for every real response token up to and including EOS, then 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------- masked statistics


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over positions where mask == 1 (over all of them, or along `dim`).

    An all-zero mask gives 0 (not NaN): the denominator is clamped, the numerator is already 0.
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1e-8)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over masked positions (scalar). Unbiased = Bessel's n/(n-1), as in TRL."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError(f"masked_var(unbiased=True) needs at least 2 masked values, got {int(n)}")
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over masked positions; shift_mean=False adds the mean back (TRL's option,
    used for rewards so their sign survives). Masked-out positions are whitened too: multiply by
    the mask afterwards if they must be 0."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# --------------------------------------------------------------------------- reward-model losses


def pairwise_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Bradley-Terry loss: mean of -log sigmoid(r_c - r_r - margin).

    r_chosen, r_rejected, margin: (B,). The margin (Llama 2, Touvron et al. 2023, sec. 3.2.2) asks
    pairs with a clearer preference to be separated by more. logsigmoid is the stable form of
    log(sigmoid(.)) (no overflow for large negative differences).
    """
    diff = r_chosen - r_rejected  # (B,)
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def plackett_luce_loss(scores: torch.Tensor, tiers: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of one ranking under Plackett-Luce (Plackett 1975; Luce 1959): the
    best response is chosen from all K with probability softmax(scores), the next from the rest,
    and so on. scores (K,) the reward model's; tiers (K,) each response's tie group, 0 = best.

    Ties, Efron's approximation (Efron 1977, as Cox regression's): a tie group G of d members
    leaving the set R (G and every group below it) costs
        -sum_{i in G} s_i + sum_{l=0}^{d-1} log(sum_R e^s - (l / d) sum_G e^s),
    the expected denominators of G's d choices over their orders. It is O(K), exact without ties,
    and it asks tied responses to score alike (a tie group at the bottom costs 0 only when its
    scores are equal), where Breslow's form would reward any split. With K = 2 and no tie it is
    -log sigmoid(s_best - s_worst), Bradley-Terry's loss on the pair."""
    scores = scores.float()
    loss = scores.new_zeros(())
    for g in sorted(set(tiers.tolist())):  # best group first
        members = tiers == g
        rest = tiers >= g  # G and everything below it
        d = int(members.sum())
        lse_rest = torch.logsumexp(scores[rest], 0)
        lse_group = torch.logsumexp(scores[members], 0)
        share = torch.exp(lse_group - lse_rest)  # sum_G e^s / sum_R e^s, in (0, 1]
        l = torch.arange(d, dtype=scores.dtype, device=scores.device)
        loss = loss - scores[members].sum() + (lse_rest + torch.log1p(-(l / d) * share)).sum()
    return loss


def center_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """Reward-centering term: mean((r_c + r_r)^2), pulling rewards towards mean 0.

    Exactly TRL's form (trl/trainer/reward_trainer.py, `center_rewards_coefficient *
    torch.mean((rewards_chosen + rewards_rejected) ** 2)`), from Eisenstein et al. 2023, "Helping or
    Herding? Reward Model Ensembles Mitigate but do not Eliminate Reward Hacking" (arXiv 2312.09244).
    The caller multiplies by the coefficient.
    """
    return ((r_chosen + r_rejected) ** 2).mean()


def group_mean(values: torch.Tensor, group_of_pair: torch.Tensor) -> torch.Tensor:
    """Mean over groups of each group's mean: values (P,) one per pair, group_of_pair (P,) each
    pair's group id in 0..G-1 (every id in that range has at least one pair). A group counts once
    whatever its number of pairs; with one pair per group, or G groups of equal size, it is
    values.mean()."""
    counts = torch.bincount(group_of_pair)  # (G,)
    if (counts == 0).any():
        raise ValueError(f"group_mean: group ids must run 0..G-1 with a pair each, got counts {counts.tolist()}")
    sums = torch.zeros(len(counts), dtype=values.dtype, device=values.device).index_add(0, group_of_pair, values)
    return (sums / counts.to(values.dtype)).mean()


def grouped_pairwise_loss(scores: torch.Tensor, chosen_idx: torch.Tensor, rejected_idx: torch.Tensor,
                          group_of_pair: torch.Tensor, weights: torch.Tensor | None = None,
                          margin: torch.Tensor | None = None) -> torch.Tensor:
    """Bradley-Terry over every pair of each ranking, each ranking one batch element (Ouyang et al.
    2022, eq. 1 and sec. 3.5: "all (K choose 2) comparisons from each prompt as a single batch
    element"): the loss of group g is (1 / n_g) sum_{pairs of g} w * -log sigmoid(s_c - s_r - margin),
    the batch's the mean over groups.

    scores (N,): one per distinct response of the batch; chosen_idx, rejected_idx (P,): indices
    into scores; group_of_pair (P,): group ids 0..G-1 (`group_mean`); weights, margin (P,) or None.
    With one pair per group it is `weighted_pairwise_loss`."""
    diff = scores[chosen_idx] - scores[rejected_idx]  # (P,)
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff)  # (P,)
    if weights is not None:
        loss = loss * weights
    return group_mean(loss, group_of_pair)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over the masked label positions.

    logits: (B, T, V) at every position of `labels`; labels: (B, T); mask: (B, T), 1 where
    labels[:, t] is a target (e.g. the chosen response). Position t-1 predicts token t, so the
    shift happens here: logits[:, :-1] against labels[:, 1:], weighted by mask[:, 1:].
    Used for the LM term on chosen responses (Askell et al. 2021, "A General Language Assistant as a
    Laboratory for Alignment") and for PPO-ptx (Ouyang et al. 2022).
    """
    logits = logits[:, :-1]  # (B, T-1, V)
    targets = labels[:, 1:]  # (B, T-1)
    weights = mask[:, 1:].to(logits.dtype)  # (B, T-1)
    ce = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), reduction="none"
    ).view_as(targets)  # (B, T-1)
    return masked_mean(ce, weights)


# --------------------------------------------------------------------------- log-probs and entropy


# fp32 elements of one chunk of rows: 2^24 = 64 MiB, e.g. 111 positions of a 150k vocabulary
CHUNK_ELEMENTS = 1 << 24


def _row_chunks(T: int, V: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(V, 1)) if T else 1


def _chunked(fn, logits: torch.Tensor, *others: torch.Tensor, chunk_elements: int) -> torch.Tensor:
    """fn(logits[b, rows], *others[b, rows]) -> (rows,), over each batch row b and chunks of
    positions, stacked to (B, T). fn makes fp32 copies of its (rows, V) input; with gradients the
    chunk is recomputed in the backward pass (torch.utils.checkpoint, non-reentrant), so autograd
    keeps the (low-precision) logits only, never a whole (T, V) fp32 tensor."""
    from torch.utils.checkpoint import checkpoint

    B, T, V = logits.shape
    step = _row_chunks(T, V, chunk_elements)
    recompute = torch.is_grad_enabled() and logits.requires_grad and T > step
    out = []
    for b in range(B):
        parts = []
        for start in range(0, T, step):
            args = (logits[b, start:start + step], *(o[b, start:start + step] for o in others))
            parts.append(checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args))
        out.append(torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32))
    return torch.stack(out)  # (B, T)


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at `tokens`: (B, T, V), (B, T) -> (B, T).

    No shift: logits[:, t] scores tokens[:, t]. Memory: log_softmax makes a second (B, T, V)
    tensor, in fp32 (for a 49k-150k vocabulary that dominates memory), so this computes
    logit[token] - logsumexp(logits), as TRL's `selective_log_softmax` does, on chunks of at most
    chunk_elements fp32 values (callers pass all N response tokens of a batch as one row).
    The temperature must be the one used for sampling, or the PPO ratio is off from the start.
    """

    def chunk(row_logits: torch.Tensor, row_tokens: torch.Tensor) -> torch.Tensor:  # (t, V), (t,) -> (t,)
        row = row_logits.float()
        if temperature != 1.0:
            row = row / temperature
        picked = row.gather(-1, row_tokens.unsqueeze(-1)).squeeze(-1)  # (t,)
        return picked - torch.logsumexp(row, dim=-1)

    return _chunked(chunk, logits, tokens, chunk_elements=chunk_elements)


def entropy_from_logits(logits: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Entropy of softmax(logits) at every position: (B, T, V) -> (B, T).

    H = logsumexp(z) - sum softmax(z) * z (the form TRL uses), in chunks of rows to bound memory.
    """

    def chunk(row_logits: torch.Tensor) -> torch.Tensor:  # (t, V) -> (t,)
        row = row_logits.float()
        probs = torch.softmax(row, dim=-1)  # (t, V)
        return torch.logsumexp(row, dim=-1) - (probs * row).sum(-1)

    return _chunked(chunk, logits, chunk_elements=chunk_elements)


# --------------------------------------------------------------------------- KL and shaped rewards


def kl_per_token(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi: (B, T).

    Estimators from Schulman, "Approximating KL Divergence" (2020, joschu.net/blog/kl-approx.html):
    - k1 = log pi - log pi_ref: unbiased, high variance, can be negative per token.
    - k3 = (r - 1) - log r with r = pi_ref / pi: unbiased, low variance, always >= 0.
    """
    log_ratio = logp - logp_ref  # (B, T)
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        # r = exp(logp_ref - logp) = exp(-log_ratio); log r = -log_ratio
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}: use 'k1' or 'k3'")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position with mask == 1 in each row: (B, T) -> (B,). 0 for empty rows."""
    positions = torch.arange(mask.size(1), device=mask.device)  # (T,)
    return (mask.long() * positions).argmax(dim=1)  # (B,)


def shaped_rewards(
    score: torch.Tensor, kl: torch.Tensor, beta: float, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token RLHF reward: r_t = -beta * kl_t on response tokens, plus the sequence score on the
    last real token (Ziegler et al. 2019; Ouyang et al. 2022).

    score: (B,) reward-model score (already normalised, penalised for a missing EOS, clipped);
    kl: (B, T); mask: (B, T), 1 for real response tokens including EOS, 0 after. Rows with no real
    token get no score (there is no token to put it on).
    """
    mask_f = mask.to(kl.dtype)
    rewards = -beta * kl * mask_f  # (B, T)
    rows = torch.arange(rewards.size(0), device=rewards.device)
    has_tokens = mask_f.sum(1) > 0  # (B,)
    rewards[rows, last_token_index(mask)] += score.to(rewards.dtype) * has_tokens  # (B,)
    return rewards


# --------------------------------------------------------------------------- advantages


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) over response tokens.

    rewards, values, mask: (B, T), mask right-padded. Rewards and values past the end are zeroed, so
    the value after the last real token is 0 (the episode ends there) and padded positions
    contribute nothing; their advantages are 0. Returns (advantages, returns), both (B, T), with
    returns = advantages + values (the critic's regression target). Whitening is the caller's.

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
    """
    mask_f = mask.to(values.dtype)
    values = values * mask_f  # (B, T)
    rewards = rewards * mask_f  # (B, T)
    T = rewards.size(1)
    last = torch.zeros_like(rewards[:, 0])  # (B,) A_{t+1}
    reversed_adv = []
    for t in reversed(range(T)):
        next_values = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)  # (B,)
        delta = rewards[:, t] + gamma * next_values - values[:, t]  # (B,)
        last = delta + gamma * lam * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1) * mask_f  # (B, T)
    returns = advantages + values  # (B, T)
    return advantages, returns


def group_advantages(rewards: torch.Tensor, k: int, estimator: str) -> torch.Tensor:
    """Critic-free sequence advantages: rewards (B,) holds B / k groups of k consecutive responses
    to one prompt. 'rloo': each reward minus the mean of the other k - 1 of its group (the
    leave-one-out baseline, Kool et al. 2019, Ahmadian et al. 2024; unbiased, as no response is its
    own baseline); 'grpo': (r - group mean) / (group s.d. + 1e-4) (Shao et al. 2024, the s.d. with
    Bessel's correction, as TRL's). Returns (B,)."""
    if k < 2 or rewards.numel() % k:
        raise ValueError(f"{estimator} needs groups of k >= 2 responses per prompt; got {rewards.numel()} for k={k}")
    groups = rewards.view(-1, k)  # (B / k, k)
    if estimator == "rloo":
        baseline = (groups.sum(1, keepdim=True) - groups) / (k - 1)
        return (groups - baseline).reshape(-1)
    if estimator == "grpo":
        return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).reshape(-1)
    raise ValueError(f"unknown group estimator {estimator!r}: 'rloo' or 'grpo'")


# --------------------------------------------------------------------------- PPO losses


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective (Schulman et al. 2017), as a loss to minimise.

    All inputs (B, T). The ratio is pi_theta / pi_old (log-probs recorded at rollout time), never
    pi_theta / pi_ref. Loss = masked mean of max(-A * ratio, -A * clip(ratio, 1 +- eps)).
    Stats (detached 0-dim tensors, .item() them when logging):
    - clipfrac: fraction of tokens where the clipped term was the larger (TRL's pg_clipfrac);
    - approxkl: 0.5 * mean((logp - old_logp)^2), TRL's estimate of KL(pi_old || pi_theta);
    - ratio_mean: mean ratio over tokens (1.0 on the first minibatch of each rollout).
    """
    log_ratio = logp - old_logp  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    losses1 = -advantages * ratio  # (B, T)
    losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)  # (B, T)
    loss = masked_mean(torch.max(losses1, losses2), mask)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((losses2 > losses1).to(logp.dtype), mask),
            "approxkl": 0.5 * masked_mean(log_ratio**2, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss, 0.5 * masked mean of max((V - R)^2, (V_clip - R)^2), as TRL and OpenRLHF.

    All inputs (B, T). V_clip = V_old + clip(V - V_old, +-cliprange_value) keeps the critic from
    moving far from its rollout-time predictions in one update. Returns (loss, clipfrac), clipfrac
    = fraction of tokens where the clipped term was the larger (detached). cliprange_value None:
    the plain 0.5 * masked mean of (V - R)^2, clipfrac 0.
    """
    if cliprange_value is None:
        return 0.5 * masked_mean((values - returns) ** 2, mask), torch.zeros((), device=values.device)
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    losses1 = (values - returns) ** 2  # (B, T)
    losses2 = (clipped - returns) ** 2  # (B, T)
    loss = 0.5 * masked_mean(torch.max(losses1, losses2), mask)
    with torch.no_grad():
        clipfrac = masked_mean((losses2 > losses1).to(values.dtype), mask)
    return loss, clipfrac


# --------------------------------------------------------------------------- preference optimisation (DPO, IPO)


def dpo_loss(
    logp_chosen: torch.Tensor, logp_rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
    beta: float, weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """DPO loss (Rafailov et al. 2023, eq. 7): mean of -log sigmoid(beta * ((pc - rc) - (pr - rr))).

    All inputs (B,): each response's log-prob summed over its tokens, under the policy (pc, pr) and
    the reference (rc, rr). beta * (logp - ref) is the response's implicit reward, so this is the
    Bradley-Terry loss on implicit rewards; TRL's loss_type="sigmoid" (trl/trainer/dpo_trainer.py,
    `-F.logsigmoid(self.beta * delta_score)`). weight (B,): each pair's term counts w times, mean of
    w * loss, with the weights normalised by the caller to mean 1 over the training pairs, as
    weighted_pairwise_loss's are; None is the plain mean, bit for bit.
    """
    logits = (logp_chosen - ref_chosen) - (logp_rejected - ref_rejected)  # (B,)
    losses = -F.logsigmoid(beta * logits)  # (B,)
    return losses.mean() if weight is None else (weight.to(losses.dtype) * losses).mean()


def ipo_loss(
    logp_chosen: torch.Tensor, logp_rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
    beta: float, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """IPO loss (Azar et al. 2023, eq. 17, beta = their tau): mean of (h - 1 / (2 beta))^2 with
    h = (pc - rc) / nc - (pr - rr) / nr, the log-ratios averaged per response token.

    Inputs as dpo_loss, plus the token counts nc, nr (B,) of each response. The per-token average is
    TRL's (loss_type="ipo", confirmed with the IPO authors there): summed log-ratios would make the
    squared loss grow with response length. IPO regresses the margin to 1 / (2 beta) instead of
    pushing it to infinity, so it does not overfit deterministic preferences. weight (B,): as dpo_loss's.
    """
    chosen = (logp_chosen - ref_chosen) / chosen_tokens.clamp_min(1)  # (B,) per-token log-ratio
    rejected = (logp_rejected - ref_rejected) / rejected_tokens.clamp_min(1)  # (B,)
    losses = (chosen - rejected - 1.0 / (2.0 * beta)) ** 2  # (B,)
    return losses.mean() if weight is None else (weight.to(losses.dtype) * losses).mean()


def weighted_pairwise_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, weight: torch.Tensor | None,
    margin: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bradley-Terry loss with a weight per pair: mean of w * -log sigmoid(r_c - r_r - margin).

    r_chosen, r_rejected, weight, margin: (B,); weights > 0, normalised by the caller to mean 1
    over the training pairs (pipeline/train_reward.py), so the loss keeps the plain loss's scale
    and a batch of down-weighted pairs moves the model less than a batch of trusted ones (a
    per-batch sum(w * l) / sum(w) would give every batch the same pull). weight None is
    pairwise_loss itself, so unweighted data trains exactly as before. A weight is how far the
    pair's label is trusted, e.g. its annotator's quality (store/export.py quality_weights):
    per-annotator reliability weights, the simplest form of learning from crowds (Raykar et al.
    2010, "Learning From Crowds", JMLR, estimate such reliabilities jointly with the model; here
    they come from gold items and agreement).
    """
    if weight is None:
        return pairwise_loss(r_chosen, r_rejected, margin)
    diff = r_chosen - r_rejected  # (B,)
    if margin is not None:
        diff = diff - margin
    return -(weight.to(diff.dtype) * F.logsigmoid(diff)).mean()


__all__ = [
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "pairwise_loss",
    "plackett_luce_loss",
    "center_loss",
    "lm_loss",
    "logprobs_from_logits",
    "entropy_from_logits",
    "kl_per_token",
    "last_token_index",
    "shaped_rewards",
    "gae",
    "group_advantages",
    "policy_loss",
    "value_loss",
    "dpo_loss",
    "ipo_loss",
    "weighted_pairwise_loss",
]
