"""Scoring pairs with a reward model, the held-out report, and reward normalisation.

- `forward_groups`: a batch of groups (a ranking's pairs, pipeline/pairs_data.py `group_pairs`)
  through the reward model, each distinct response once, the score read at each sequence's last
  real token (exactly ScalarModel.score). Default: each prompt runs once and its K responses
  continue from its KV cache in one pass (`shared_prefix_scores`); or whole sequences, one row per
  response (`pair_scores`). `forward_pairs` does the same for a batch of pairs (two responses
  each, a prompt per pair).
- `evaluate` (of pairs, or of groups: each group's responses scored once, then every pair read
  from them): per pair, accuracy, mean margin, loss, calibration (accuracy by |r_c - r_r| bucket, beside
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

from pipeline.config import GenerateConfig
from pipeline.losses import last_token_index, lm_loss, pairwise_loss
from pipeline.models import autocast, position_ids_from_mask
from pipeline.packing import cache_kwarg
from pipeline.pairs_data import EncodedGroup, EncodedPair, EncodedRanking, Pair, collate, collate_groups, collate_shared
from pipeline.responses import generate_responses
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


def shared_prefix_scores(model, prompt_ids, prompt_mask, response_ids, response_mask, prompt_of_row=None):
    """Scores of N sequences that share B prompts, running each prompt once.

    prompt_ids/mask: (B, P) left-padded; response_ids/mask: (N, R) right-padded; prompt_of_row (N,):
    the prompt each response continues (None: a batch of pairs, N = 2B, chosen rows then rejected,
    i.e. 0..B-1 twice; a batch of groups passes each group's index repeated for its K_i responses).
    The prompt pass fills a KV cache, its rows are selected for the responses, and the responses
    continue from it in one pass; gradients flow back through the cache into the prompt pass. Same
    scores as whole sequences, with each prompt's tokens computed once instead of once per response
    (in HH-RLHF pairs the prompt is most of the tokens). The idea is the prefix sharing of Wang &
    Hegde 2024, "Accelerating Direct Preference Optimization with Prefix Sharing".
    Returns (scores (N,), hidden at the last prompt token (B, H), response hidden (N, R, H)).
    """
    from transformers import DynamicCache

    backbone, cache = model.backbone, DynamicCache()
    kw = cache_kwarg(backbone)
    b, width = prompt_ids.shape
    if prompt_of_row is None:
        prompt_of_row = torch.arange(b, device=prompt_ids.device).repeat(2)  # (2B,)
    first = backbone(input_ids=prompt_ids, attention_mask=prompt_mask,
                     position_ids=position_ids_from_mask(prompt_mask), use_cache=True, **{kw: cache})
    cache.batch_select_indices(prompt_of_row)  # (N, P) cache rows
    full_mask = torch.cat([prompt_mask[prompt_of_row], response_mask], dim=1)  # (N, P + R)
    second = backbone(input_ids=response_ids, attention_mask=full_mask,
                      position_ids=position_ids_from_mask(full_mask)[:, width:], use_cache=True, **{kw: cache})
    hidden = second.last_hidden_state  # (N, R, H)
    rows = torch.arange(hidden.size(0), device=hidden.device)
    last_hidden = hidden[rows, last_token_index(response_mask)]  # (N, H)
    with torch.autocast(hidden.device.type, enabled=False):  # the head stays fp32 under bf16 autocast
        scores = model.head(last_hidden.float()).squeeze(-1)  # (N,)
    return scores, first.last_hidden_state[:, -1], hidden


def lm_after_prompt(prompt_last, hidden, response_ids, response_mask, lm_weight: torch.Tensor) -> torch.Tensor:
    """The LM term of responses that continued a prompt's KV cache: prompt_last (M, H) each row's
    last prompt token, hidden (M, R, H), response_ids (M, R), response_mask (M, R) the weight of each
    target token (0/1, or the number of pairs the response is chosen in); lm_weight (V, H). Position 0
    (the last prompt token) predicts response token 0, position t predicts t + 1."""
    h = torch.cat([prompt_last[:, None], hidden], dim=1)  # (M, 1 + R, H)
    labels = torch.cat([response_ids[:, :1], response_ids], dim=1)  # (M, 1 + R); column 0 is never a target
    mask = torch.cat([torch.zeros_like(response_mask[:, :1]), response_mask], dim=1)  # (M, 1 + R)
    return lm_loss(h @ lm_weight.to(h.dtype).T, labels, mask)


def lm_whole(hidden, input_ids, lm_mask, prompt_lens: list[int], lm_weight: torch.Tensor) -> torch.Tensor:
    """The LM term of whole sequences: hidden (M, L, H), input_ids (M, L), lm_mask (M, L) the weight
    of each response token as a target (0 on prompts and padding); logits are made from the first
    position that predicts a response token (the shortest prompt's last token) on."""
    start = max(min(prompt_lens) - 1, 0)
    logits = hidden[:, start:] @ lm_weight.to(hidden.dtype).T  # (M, L', V)
    return lm_loss(logits, input_ids[:, start:], lm_mask[:, start:])


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
            lm = lm_after_prompt(prompt_last, hidden[:n], r_ids[:n], r_mask[:n], lm_weight)
    else:
        batch = collate(items, pad_id, with_lm_mask=lm_weight is not None)
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)  # (2B, L)
        scores, hidden = pair_scores(model, ids, mask)  # (2B,), (2B, L, H)
        tokens = int(mask.sum())
        if lm_weight is not None:
            lm = lm_whole(hidden[:n], ids[:n], batch["lm_mask"].to(device), [it.prompt_len for it in items], lm_weight)
    return scores[:n], scores[n:], lm, batch["margin"].to(device), tokens


def forward_groups(model, items: list[EncodedGroup], pad_id: int, device, share_prompt: bool = True,
                   lm_weight: torch.Tensor | None = None):
    """One batch of groups (a ranking's pairs each) through the reward model, every distinct
    response once: (scores (N,) of the N responses, group after group; the batch of
    `collate_groups` on `device`, whose chosen / rejected / group / margin (n,) read each pair from
    the scores; LM loss on the chosen responses or None; real tokens processed).

    share_prompt: each group's prompt once, its K_i responses continuing from its KV cache
    (shared_prefix_scores); else whole sequences, one row per response (as `forward_rankings`). The
    LM term weighs each response's tokens by the number of pairs it is chosen in, so on the same
    pairs it is the token mean `forward_pairs` takes over their chosen responses.
    """
    batch = {k: v.to(device) for k, v in collate_groups(items, pad_id, share_prompt).items()}
    lm, count = None, batch["chosen_count"]  # (N,)
    rows = count.nonzero().squeeze(-1)  # responses chosen in some pair: the LM term's rows
    if share_prompt:
        r_ids, r_mask = batch["response_ids"], batch["response_mask"]  # (N, R)
        scores, prompt_last, hidden = shared_prefix_scores(model, batch["prompt_ids"], batch["prompt_mask"],
                                                           r_ids, r_mask, batch["prompt_of_row"])
        tokens = int(batch["prompt_mask"].sum() + r_mask.sum())
        if lm_weight is not None:
            lm = lm_after_prompt(prompt_last[batch["prompt_of_row"][rows]], hidden[rows], r_ids[rows],
                                 r_mask[rows] * count[rows, None], lm_weight)
    else:
        ids, mask = batch["input_ids"], batch["attention_mask"]  # (N, L)
        scores, hidden = pair_scores(model, ids, mask)  # (N,), (N, L, H)
        tokens = int(mask.sum())
        if lm_weight is not None:
            prompt_len = batch["prompt_len"][rows]  # (M,)
            cols = torch.arange(ids.shape[1], device=ids.device)
            lm_mask = (cols >= prompt_len[:, None]) * mask[rows] * count[rows, None]  # (M, L): response tokens
            lm = lm_whole(hidden[rows], ids[rows], lm_mask, prompt_len.tolist(), lm_weight)
    return scores, batch, lm, tokens


def forward_rankings(model, items: list[EncodedRanking], pad_id: int, device):
    """One batch of rankings through the reward model, each response as a whole sequence (prompt +
    response, one row each): (scores per ranking [(K_i,)], real tokens processed)."""
    rows = [it.prompt_ids + response for it in items for response in it.responses]
    ids, mask = pad_rows(rows, pad_id, left=False, device=device)  # (N, L)
    scores, _ = pair_scores(model, ids, mask)  # (N,)
    return list(scores.split([len(it.responses) for it in items])), int(mask.sum())


def _pair_count(item) -> int:
    return item.n_pairs if isinstance(item, EncodedGroup) else 1


@torch.no_grad()
def score_pairs(model, items: list[EncodedPair] | list[EncodedGroup], pad_id: int, device, dtype,
                batch_size: int = 16, share_prompt: bool = True, on_progress=None):
    """(r_chosen, r_rejected), each (P,) on CPU, one per pair in the order of `items` (batched by
    length): items are pairs (`forward_pairs`), or groups, each group's responses scored once
    (`forward_groups`) and its pairs read in the order of EncodedGroup.pairs(), group after group.
    batch_size counts items. A tqdm bar counts the pairs scored; on_progress(done, total) is called
    after each batch with pairs."""
    was_training = model.training
    model.eval()
    grouped = bool(items) and isinstance(items[0], EncodedGroup)
    sizes = [_pair_count(it) for it in items]
    first = [sum(sizes[:i]) for i in range(len(items))]  # each item's first pair
    total = sum(sizes)
    order = sorted(range(len(items)), key=lambda i: items[i].length)
    r_c, r_r = torch.zeros(total), torch.zeros(total)
    bar = tqdm(total=total, desc="scoring held-out pairs", unit="pair", dynamic_ncols=True,
               disable=not is_writer())
    done = 0
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        with autocast(device, dtype):
            if grouped:
                scores, batch, _, _ = forward_groups(model, [items[i] for i in idx], pad_id, device, share_prompt)
                c, r = scores[batch["chosen"]], scores[batch["rejected"]]  # (n,) group after group
            else:
                c, r, _, _, _ = forward_pairs(model, [items[i] for i in idx], pad_id, device, share_prompt)
        at = [first[i] + k for i in idx for k in range(sizes[i])]
        r_c[at], r_r[at] = c.float().cpu(), r.float().cpu()
        done += len(at)
        bar.update(len(at))
        if on_progress is not None:
            on_progress(done, total)
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


def evaluate(model, items: list[EncodedPair] | list[EncodedGroup], pad_id: int, device, dtype, batch_size: int = 16,
             share_prompt: bool = True, dist=None, on_progress=None) -> dict:
    """Held-out metrics, flat keys under eval/, plus the calibration table; every figure is per pair,
    whether `items` are pairs or groups (`score_pairs`). dist (pipeline/distributed.py): each
    process scores its share of the items and every process gets all the scores.
    on_progress(done, total): pairs scored so far (by this process) after each batch."""
    if not items:
        return {}
    if dist is not None and dist.world > 1:
        idx = dist.shard(range(len(items)))
        c, r = score_pairs(model, [items[i] for i in idx], pad_id, device, dtype, batch_size, share_prompt,
                           on_progress)
        sizes = [_pair_count(items[i]) for i in idx]
        parts = dist.unshard(list(zip(c.split(sizes), r.split(sizes))), len(items))  # per item (c, r)
        r_c = torch.cat([part[0] for part in parts])
        r_r = torch.cat([part[1] for part in parts])
    else:
        r_c, r_r = score_pairs(model, items, pad_id, device, dtype, batch_size, share_prompt, on_progress)
    pairs = [p for it in items for p in it.pairs()] if isinstance(items[0], EncodedGroup) else items
    diff = r_c - r_r  # (P,)
    return {
        "eval/pairs": len(pairs),
        "eval/accuracy": (diff > 0).float().mean().item(),
        "eval/margin": diff.mean().item(),
        "eval/loss": pairwise_loss(r_c, r_r).item(),
        "eval/reward_chosen": r_c.mean().item(),
        "eval/reward_rejected": r_r.mean().item(),
        "eval/length_baseline_accuracy": length_baseline(pairs),
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
