"""Scoring pairs with a reward model, the held-out report, and reward normalisation.

- `forward_pairs`: a batch of pairs through the reward model, the score read at each sequence's
  last real token (exactly ScalarModel.score). Default: each prompt runs once and both responses
  continue from its KV cache in one pass (`shared_prefix_scores`); or whole sequences, chosen and
  rejected rows in one forward pass (`pair_scores`).
- `evaluate`: accuracy, mean margin, loss, calibration (accuracy by |r_c - r_r| bucket, beside
  the Bradley-Terry probability sigmoid(|r_c - r_r|) the model claims), and the "longer response
  wins" baseline, so a user sees whether the model learned more than length. Scoring shows a tqdm
  bar (pairs scored; rank 0 only) and calls `on_progress(done, total)` after each batch, so a
  trainer can put the phase in its status.json for the Train tab.
- `normalisation_stats`: mean and std of the scores of responses sampled from the reference
  policy, stored with the checkpoint so PPO sees rewards of mean 0, std 1 at its start
  (Ziegler et al. 2019 normalise on samples of the initial policy; InstructGPT instead centres
  the reward on labeler demonstrations).
"""

from __future__ import annotations

import math
import random

import torch
from tqdm.auto import tqdm

from pipeline.losses import last_token_index, lm_loss, pairwise_loss
from pipeline.models import autocast, position_ids_from_mask
from pipeline.packing import cache_kwarg
from pipeline.pairs_data import EncodedPair, EncodedRanking, Pair, collate, collate_shared
from pipeline.rundir import is_writer
from pipeline.text import encode_response, pad_rows, prompt_token_ids


def pair_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """(scores (N,), hidden (N, L, H)) for N = 2B rows, chosen first then rejected.

    Same value as ScalarModel.score (backbone with pad-aware positions, fp32 head at the last real
    token), with the head applied to the N last tokens only and the hidden states returned.
    """
    out = model.backbone(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    hidden = out.last_hidden_state  # (N, L, H)
    rows = torch.arange(hidden.size(0), device=hidden.device)
    last_hidden = hidden[rows, last_token_index(attention_mask)]  # (N, H)
    with torch.autocast(hidden.device.type, enabled=False):  # the head stays fp32 under bf16 autocast
        scores = model.head(last_hidden.float()).squeeze(-1)  # (N,)
    return scores, hidden


def shared_prefix_scores(model, prompt_ids, prompt_mask, response_ids, response_mask):
    """Scores of 2B sequences that share B prompts, running each prompt once.

    prompt_ids/mask: (B, P) left-padded; response_ids/mask: (2B, R), chosen rows then rejected,
    right-padded. The prompt pass fills a KV cache, its rows are repeated for the two responses,
    and the responses continue from it in one pass; gradients flow back through the cache into the
    prompt pass. Same scores as whole sequences, with the prompt's tokens computed once instead of
    twice (in HH-RLHF pairs the prompt is most of the tokens). The idea is the prefix sharing of
    Wang & Hegde 2024, "Accelerating Direct Preference Optimization with Prefix Sharing".
    Returns (scores (2B,), hidden at the last prompt token (B, H), response hidden (2B, R, H)).
    """
    from transformers import DynamicCache

    backbone, cache = model.backbone, DynamicCache()
    kw = cache_kwarg(backbone)
    b, width = prompt_ids.shape
    first = backbone(input_ids=prompt_ids, attention_mask=prompt_mask,
                     position_ids=position_ids_from_mask(prompt_mask), use_cache=True, **{kw: cache})
    cache.batch_select_indices(torch.arange(b, device=prompt_ids.device).repeat(2))  # (2B, P) cache rows
    full_mask = torch.cat([prompt_mask.repeat(2, 1), response_mask], dim=1)  # (2B, P + R)
    second = backbone(input_ids=response_ids, attention_mask=full_mask,
                      position_ids=position_ids_from_mask(full_mask)[:, width:], use_cache=True, **{kw: cache})
    hidden = second.last_hidden_state  # (2B, R, H)
    rows = torch.arange(hidden.size(0), device=hidden.device)
    last_hidden = hidden[rows, last_token_index(response_mask)]  # (2B, H)
    with torch.autocast(hidden.device.type, enabled=False):  # the head stays fp32 under bf16 autocast
        scores = model.head(last_hidden.float()).squeeze(-1)  # (2B,)
    return scores, first.last_hidden_state[:, -1], hidden


def forward_pairs(model, items: list[EncodedPair], pad_id: int, device, share_prompt: bool = True,
                  lm_weight: torch.Tensor | None = None):
    """One batch of pairs through the reward model: (r_chosen (B,), r_rejected (B,), LM loss on the
    chosen responses (or None), margin (B,), real tokens processed).

    share_prompt: prompt once, then both responses (shared_prefix_scores); else whole sequences,
    chosen and rejected rows in one forward pass (pair_scores). lm_weight (V, H): output embedding
    for the LM term; logits are made only where response tokens are predicted.
    """
    n, lm = len(items), None
    if share_prompt:
        batch = collate_shared(items, pad_id)
        p_ids, p_mask = batch["prompt_ids"].to(device), batch["prompt_mask"].to(device)  # (B, P)
        r_ids, r_mask = batch["response_ids"].to(device), batch["response_mask"].to(device)  # (2B, R)
        scores, prompt_last, hidden = shared_prefix_scores(model, p_ids, p_mask, r_ids, r_mask)
        tokens = int(p_mask.sum() + r_mask.sum())
        if lm_weight is not None:
            # position 0 (last prompt token) predicts response token 0, position t predicts t+1
            h = torch.cat([prompt_last[:, None], hidden[:n]], dim=1)  # (B, 1 + R, H)
            labels = torch.cat([r_ids[:n, :1], r_ids[:n]], dim=1)  # (B, 1 + R); column 0 is never a target
            mask = torch.cat([torch.zeros_like(r_mask[:n, :1]), r_mask[:n]], dim=1)  # (B, 1 + R)
            lm = lm_loss(h @ lm_weight.to(h.dtype).T, labels, mask)
    else:
        batch = collate(items, pad_id, with_lm_mask=lm_weight is not None)
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)  # (2B, L)
        scores, hidden = pair_scores(model, ids, mask)  # (2B,), (2B, L, H)
        tokens = int(mask.sum())
        if lm_weight is not None:
            start = max(min(it.prompt_len for it in items) - 1, 0)  # first position predicting a response token
            logits = hidden[:n, start:] @ lm_weight.to(hidden.dtype).T  # (B, L', V)
            lm = lm_loss(logits, ids[:n, start:], batch["lm_mask"][:, start:].to(device))
    return scores[:n], scores[n:], lm, batch["margin"].to(device), tokens


def forward_rankings(model, items: list[EncodedRanking], pad_id: int, device):
    """One batch of rankings through the reward model, each response as a whole sequence (prompt +
    response, one row each): (scores per ranking [(K_i,)], real tokens processed)."""
    rows = [it.prompt_ids + response for it in items for response in it.responses]
    ids, mask = pad_rows(rows, pad_id, left=False, device=device)  # (N, L)
    scores, _ = pair_scores(model, ids, mask)  # (N,)
    return list(scores.split([len(it.responses) for it in items])), int(mask.sum())


@torch.no_grad()
def score_pairs(model, items: list[EncodedPair], pad_id: int, device, dtype, batch_size: int = 16,
                share_prompt: bool = True, on_progress=None):
    """(r_chosen, r_rejected), each (P,) on CPU, in the order of `items` (batched by length).
    A tqdm bar counts the pairs scored; on_progress(done, total) is called after each batch."""
    was_training = model.training
    model.eval()
    order = sorted(range(len(items)), key=lambda i: items[i].length)
    r_c, r_r = torch.zeros(len(items)), torch.zeros(len(items))
    bar = tqdm(total=len(items), desc="scoring held-out pairs", unit="pair", dynamic_ncols=True,
               disable=not is_writer())
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        with autocast(device, dtype):
            c, r, _, _, _ = forward_pairs(model, [items[i] for i in idx], pad_id, device, share_prompt)
        r_c[idx], r_r[idx] = c.float().cpu(), r.float().cpu()
        bar.update(len(idx))
        if on_progress is not None:
            on_progress(start + len(idx), len(items))
    bar.close()
    model.train(was_training)
    return r_c, r_r


def calibration(diff: torch.Tensor, buckets: int = 5) -> list[dict]:
    """Accuracy per equal-count bucket of |r_c - r_r|: a calibrated model's accuracy rises with
    |diff| and matches sigmoid(|diff|), its own claimed probability of being right."""
    size = diff.abs()  # (P,)
    order = torch.argsort(size)
    out = []
    for chunk in torch.tensor_split(order, min(buckets, len(order))):
        if len(chunk) == 0:
            continue
        d, a = diff[chunk], size[chunk]
        out.append({
            "abs_diff_min": round(a.min().item(), 4), "abs_diff_max": round(a.max().item(), 4),
            "count": len(chunk), "accuracy": round((d > 0).float().mean().item(), 4),
            "predicted": round(torch.sigmoid(a).mean().item(), 4),
        })
    return out


def length_baseline(items: list[EncodedPair]) -> float:
    """Accuracy of 'the longer response (in tokens) is the chosen one'; ties count half."""
    if not items:
        return float("nan")
    score = 0.0
    for it in items:
        c, r = it.chosen_response_tokens, it.rejected_response_tokens
        score += 1.0 if c > r else 0.5 if c == r else 0.0
    return score / len(items)


def evaluate(model, items: list[EncodedPair], pad_id: int, device, dtype, batch_size: int = 16,
             share_prompt: bool = True, dist=None, on_progress=None) -> dict:
    """Held-out metrics, flat keys under eval/, plus the calibration table. dist (pipeline/distributed.py):
    each process scores its share of the pairs and every process gets all the scores.
    on_progress(done, total): pairs scored so far (by this process) after each batch."""
    if not items:
        return {}
    if dist is not None and dist.world > 1:
        idx = dist.shard(range(len(items)))
        c, r = score_pairs(model, [items[i] for i in idx], pad_id, device, dtype, batch_size, share_prompt,
                           on_progress)
        r_c = torch.tensor(dist.unshard(c.tolist(), len(items)))
        r_r = torch.tensor(dist.unshard(r.tolist(), len(items)))
    else:
        r_c, r_r = score_pairs(model, items, pad_id, device, dtype, batch_size, share_prompt, on_progress)
    diff = r_c - r_r  # (P,)
    return {
        "eval/pairs": len(items),
        "eval/accuracy": (diff > 0).float().mean().item(),
        "eval/margin": diff.mean().item(),
        "eval/loss": pairwise_loss(r_c, r_r).item(),
        "eval/reward_chosen": r_c.mean().item(),
        "eval/reward_rejected": r_r.mean().item(),
        "eval/length_baseline_accuracy": length_baseline(items),
        "calibration": calibration(diff),
    }


# --------------------------------------------------------------------------- normalisation


@torch.no_grad()
def normalisation_stats(model, prompts: list[Pair], cfg, model_cfg, amp, dist=None, on_progress=None) -> dict:
    """Sample one response for each of cfg.norm_samples prompts (drawn from the training pairs with
    cfg.seed) from the reference policy as PPO samples its rollouts (cfg.norm_max_new_tokens,
    cfg.norm_temperature: PPO's), score prompt + response exactly as PPO will (the decoded response
    + EOS, whether the policy stopped or was cut at the length limit: pipeline/scoring.py,
    retokenise) under `amp`, and return the scores' mean and std. (Samples of another length than
    PPO's would shift every normalised reward when the reward model scores length.)

    cfg: a RewardConfig. The reference policy is the base model (no adapter), or the policy folder
    cfg.norm_policy when PPO will start from an earlier round's policy. Sampled at the device's
    decode batch (pipeline/sampling.py decode_batch_size), scored in batches of 2 x cfg.batch_size.
    dist (pipeline/distributed.py): each process samples and scores its share of
    the prompts; the statistics are over all of them. A tqdm bar counts the responses sampled;
    on_progress(done, total) is called along the way.
    """
    n, seed, policy_path, batch_size = cfg.norm_samples, cfg.seed, cfg.norm_policy, 2 * cfg.batch_size
    max_new_tokens, temperature = cfg.norm_max_new_tokens, cfg.norm_temperature
    from pipeline.config import GenerateConfig
    from pipeline.generate import generate_responses
    from pipeline.policy import load_policy
    from pipeline.scoring import score_rows

    rng = random.Random(seed)
    picked = rng.sample(prompts, n) if n <= len(prompts) else [rng.choice(prompts) for _ in range(n)]
    picked = [p.prompt for p in picked]
    if dist is not None:
        picked = dist.shard(picked)
    ref_cfg = type(model_cfg)(**{**vars(model_cfg), "model": model.base_model or model_cfg.model, "lora": False})
    policy, tokenizer = load_policy(ref_cfg, adapter_path=policy_path or None)
    bar = tqdm(total=len(picked), desc="reward normalisation samples", unit="resp", dynamic_ncols=True,
               disable=not is_writer())

    def progress(done: int, total: int) -> None:
        bar.update(done - bar.n)
        if on_progress is not None:
            on_progress(done, total)

    sampling = GenerateConfig(k=1, seed=seed, max_new_tokens=max_new_tokens, temperature=temperature)
    gens = generate_responses(policy, tokenizer, picked, 1, sampling, on_progress=progress)
    progress(len(picked), len(picked))
    bar.close()
    del policy
    # scored as PPO and score_texts score a response: prompt + decoded text + EOS, cut or not
    seqs = [prompt_token_ids(tokenizer, p) + encode_response(tokenizer, g[0].text) for p, g in zip(picked, gens)]

    was_training = model.training
    model.eval()
    # raw scores (the statistics are what normalises them); not frozen: this model was just trained
    all_scores = torch.tensor(score_rows(model, seqs, tokenizer.pad_token_id, batch_size, normalised=False,
                                         frozen=False, autocast=amp))  # (n,)
    model.train(was_training)
    # per sample: (raw score, ended with EOS, tokens), over every process's samples
    rows = list(zip(all_scores.tolist(), [g[0].finish_reason == "eos" for g in gens],
                    [len(g[0].token_ids) for g in gens]))
    if dist is not None and dist.world > 1:
        rows = sum(dist.gather_objects(rows), [])
    scores, eos, tokens = zip(*rows)
    all_scores = torch.tensor(scores)
    std = all_scores.std().item() if n > 1 else 1.0
    if not math.isfinite(std) or std < 1e-6:
        std = 1.0  # constant scores: leave the scale alone rather than divide by ~0
    return {"reward_mean": all_scores.mean().item(), "reward_std": std, "samples": n,
            "policy": policy_path or "base model", "eos_rate": sum(eos) / n,
            "max_new_tokens": max_new_tokens, "temperature": temperature, "tokens_max": max(tokens)}
