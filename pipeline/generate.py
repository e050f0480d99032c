"""Batched sampling of K responses per prompt, and the `python -m pipeline generate` CLI.

Two levels:
- `sample(model, input_ids, attention_mask, cfg)`: one left-padded batch in, a `SampleBatch` of
  tensors out (response ids, mask up to and including EOS, log-probs of the sampled tokens). The
  PPO trainer uses it for rollouts. It is our own KV-cache loop rather than `model.generate`: it
  computes log-probs as it samples, runs the prompt once for its K samples (the cache is copied K
  times after the prefill), and drops finished rows from the batch (bench/generate_bench.py).
- `generate_responses(policy, tokenizer, prompts, k, cfg)`: prompts in, K `Generation`s per
  prompt out; chat template, HH-RLHF transcripts, length-sorted batching, seeding, and
  re-sampling of duplicates so annotators never rank two identical responses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pipeline.config import GenerateConfig, ModelConfig, add_arguments, from_args, to_dict
from pipeline.models import load_policy, position_ids_from_mask
from pipeline.packing import MIN_PREFIX, cache_kwarg, common_prefix
from pipeline.rundir import write_json, write_status
from pipeline.text import pad_rows, prompt_token_ids, read_prompts

# --------------------------------------------------------------------------- sampling


@dataclass
class SampleBatch:
    sequences: torch.Tensor  # (B, P+R) prompt (left-padded) then response (right-padded)
    attention_mask: torch.Tensor  # (B, P+R) prompt mask then response_mask
    response_ids: torch.Tensor  # (B, R) sampled tokens, pad after EOS
    response_mask: torch.Tensor  # (B, R) 1 up to and including EOS, 0 after
    logprobs: torch.Tensor  # (B, R) log p(token) under logits / temperature; 0 where masked
    finish_reason: list[str]  # per row: 'eos' or 'length'
    prompt_index: torch.Tensor  # (B,) which input row each sample came from
    prompt_length: int  # P


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k and outside the top-p nucleus (Holtzman et al. 2020)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _sample_categorical(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs (B, V) by inverse-CDF sampling: a single uniform per row.

    torch.multinomial draws one exponential per vocabulary entry, which on CPU costs about a quarter
    of a 135M-model decoding step; a cumulative sum and a binary search cost a few ms. The sum is in
    float64 so tokens with tiny probabilities keep their share; zero-probability (filtered) tokens
    are never chosen because the search returns the first cdf strictly above u.
    """
    cdf = probs.double().cumsum(-1)  # (B, V)
    total = cdf[:, -1:]  # (B, 1), 1 up to rounding
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=torch.float64) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total strictly
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def _eos_ids(model, eos_token_id) -> list[int]:
    eos = eos_token_id if eos_token_id is not None else model.generation_config.eos_token_id
    if eos is None:
        raise ValueError("sample: no eos_token_id given and the model's generation_config has none")
    return [eos] if isinstance(eos, int) else list(eos)


def _prefill_prefix(model, input_ids, attention_mask, cache, cache_kw):
    """Run the L >= MIN_PREFIX tokens that every left-padded prompt starts with once, into `cache`
    (repeated for every row), and return the rest of the batch to prefill after it:
    (ids (b, P - L) left-padded without the prefix, mask (b, L + P - L) in the cache's layout, L).
    With no such prefix: the batch as it is and 0."""
    real = attention_mask.bool()
    lengths = real.sum(1)  # (b,)
    b, P = input_ids.shape
    L = common_prefix(input_ids, real, int(lengths.min()) - 1) if b > 1 else 0
    if L < MIN_PREFIX:
        return input_ids, attention_mask, 0
    first = P - int(lengths[0])
    model(input_ids=input_ids[:1, first : first + L], position_ids=torch.arange(L, device=input_ids.device)[None],
          use_cache=True, logits_to_keep=1, **{cache_kw: cache})
    cache.batch_select_indices(torch.zeros(b, dtype=torch.long, device=input_ids.device))
    # row i is [pad][prefix][rest]: drop the L prefix columns that follow its padding
    col = torch.arange(P - L, device=input_ids.device)[None]  # (1, P - L)
    source = col + L * (col >= (P - lengths)[:, None])  # (b, P - L)
    rest_mask = attention_mask.gather(1, source)
    mask = torch.cat([rest_mask.new_ones(b, L), rest_mask], dim=1)  # (b, L + P - L)
    return input_ids.gather(1, source), mask, L


@torch.no_grad()
def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cfg, num_samples=1,
           generator: torch.Generator | None = None, eos_token_id=None, pad_token_id=None,
           share_prefix: bool = True) -> SampleBatch:
    """Sample responses for a left-padded batch of prompts with the KV cache.

    cfg: anything with temperature, top_p, top_k, max_new_tokens (GenerateConfig, PPOConfig).
    temperature 0 = greedy (log-probs then from the raw logits). num_samples: samples per input
    row (an int, or one count per row); the prompt runs once and its cache is copied. Log-probs are
    from the unfiltered logits / temperature (what a training forward pass can reproduce), while
    sampling applies top-k / top-p. The model's train/eval mode is left as the caller set it.
    share_prefix: tokens that every prompt starts with (a chat template's system prompt) are run
    once for the batch (pipeline/packing.py, "Shared prefix").
    """
    from transformers import DynamicCache

    device = input_ids.device
    eos = torch.tensor(_eos_ids(model, eos_token_id), device=device)
    pad = pad_token_id if pad_token_id is not None else model.generation_config.pad_token_id
    pad = int(eos[0]) if pad is None else pad
    counts = torch.as_tensor(num_samples, device=device).expand(input_ids.shape[0])
    prompt_index = torch.arange(input_ids.shape[0], device=device).repeat_interleave(counts)  # (B,)
    B, P, R = prompt_index.shape[0], input_ids.shape[1], cfg.max_new_tokens
    greedy = cfg.temperature <= 0
    temperature = 1.0 if greedy else cfg.temperature

    # 1. prefill: a prefix common to all prompts once, then each distinct prompt's other tokens once,
    # then copy its cache rows for its samples
    cache, cache_kw = DynamicCache(), cache_kwarg(model)
    ids, mask, offset = input_ids, attention_mask, 0
    if share_prefix:
        ids, mask, offset = _prefill_prefix(model, input_ids, attention_mask, cache, cache_kw)
    out = model(input_ids=ids, attention_mask=mask, position_ids=offset + position_ids_from_mask(mask[:, offset:]),
                use_cache=True, logits_to_keep=1, **{cache_kw: cache})
    cache.batch_select_indices(prompt_index)
    logits = out.logits[prompt_index, -1].float()  # (B, V)
    mask = mask[prompt_index]  # (B, cache length + t): the cache's layout, not the returned one
    next_pos = mask.sum(-1)  # (B,) position of the next token: count of real tokens so far

    response_ids = torch.full((B, R), pad, dtype=torch.long, device=device)
    logprobs = torch.zeros((B, R), dtype=torch.float32, device=device)
    lengths = torch.full((B,), R, dtype=torch.long, device=device)
    ended = torch.zeros(B, dtype=torch.bool, device=device)
    active = torch.arange(B, device=device)  # rows still generating, as indices into the batch
    width = 0
    for t in range(R):
        # 2. choose the next token of every active row; record its log-prob
        logp = torch.log_softmax(logits / temperature, dim=-1)  # (A, V)
        if greedy:
            token = logits.argmax(-1)
        else:
            filtering = bool(cfg.top_k) or cfg.top_p < 1.0
            probs = _filter_logits(logp, cfg.top_k, cfg.top_p).softmax(-1) if filtering else logp.exp()
            token = _sample_categorical(probs, generator)  # (A,)
        response_ids[active, t] = token
        logprobs[active, t] = logp.gather(1, token[:, None]).squeeze(1)
        width = t + 1
        # 3. rows that produced EOS are done; drop them from the batch and the cache
        is_eos = torch.isin(token, eos)  # (A,)
        if is_eos.any():
            lengths[active[is_eos]] = t + 1
            ended[active[is_eos]] = True
            keep = (~is_eos).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            active, token, mask, next_pos = active[keep], token[keep], mask[keep], next_pos[keep]
            cache.batch_select_indices(keep)
        if t == R - 1:
            break
        # 4. one decoding step for the rows still running
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    use_cache=True, **{cache_kw: cache})
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1

    response_ids, logprobs = response_ids[:, :width], logprobs[:, :width]
    response_mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()  # (B, R)
    logprobs = logprobs * response_mask
    prompt_ids, prompt_mask = input_ids[prompt_index], attention_mask[prompt_index]
    return SampleBatch(
        sequences=torch.cat([prompt_ids, response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1),
        response_ids=response_ids, response_mask=response_mask, logprobs=logprobs,
        finish_reason=["eos" if e else "length" for e in ended.tolist()],
        prompt_index=prompt_index, prompt_length=P,
    )


# --------------------------------------------------------------------------- K responses per prompt


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # the response, including the final EOS when finish_reason is 'eos'
    finish_reason: str  # 'eos' | 'length'
    logprobs: list[float]  # one per token id


def _batches(order: list[int], need: dict[int, int], batch_size: int):
    """Pack (prompt, samples) groups into batches of at most batch_size sequences, in `order`."""
    batch, rows = [], 0
    for p in order:
        left = need.get(p, 0)
        while left:
            n = min(left, batch_size - rows)
            batch.append((p, n))
            rows, left = rows + n, left - n
            if rows == batch_size:
                yield batch
                batch, rows = [], 0
    if batch:
        yield batch


def generate_responses(policy, tokenizer, prompts: list, k: int, cfg: GenerateConfig,
                       on_progress: Callable[[int, int], None] | None = None) -> list[list[Generation]]:
    """K sampled responses per prompt, in prompt order. on_progress(done, total) after each batch."""
    if k < 1:
        raise ValueError(f"k={k}: need at least one response per prompt")
    device = next(policy.parameters()).device
    ids = []
    for i, prompt in enumerate(prompts):
        try:
            ids.append(prompt_token_ids(tokenizer, prompt, cfg.max_prompt_tokens))
        except ValueError as exc:
            raise ValueError(f"prompt {i}: {exc}") from None
    # longest first: the batch most likely to run out of memory runs first, and similar lengths
    # share a batch so little compute goes to padding
    order = sorted(range(len(prompts)), key=lambda i: -len(ids[i]))
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    results: list[list[Generation]] = [[] for _ in prompts]
    total, done = len(prompts) * k, 0

    def run(need: dict[int, int]) -> dict[int, list[Generation]]:
        nonlocal done
        fresh: dict[int, list[Generation]] = {p: [] for p in need}
        for batch in _batches(order, need, cfg.batch_size):
            input_ids, mask = pad_rows([ids[p] for p, _ in batch], pad, left=True, device=device)
            out = sample(policy, input_ids, mask, cfg, num_samples=[n for _, n in batch],
                         generator=generator, eos_token_id=eos, pad_token_id=pad)
            lengths = out.response_mask.sum(-1).tolist()
            for row, (src, n_tok) in enumerate(zip(out.prompt_index.tolist(), lengths)):
                token_ids = out.response_ids[row, :n_tok].tolist()
                fresh[batch[src][0]].append(Generation(
                    text=tokenizer.decode(token_ids, skip_special_tokens=True),
                    token_ids=token_ids, finish_reason=out.finish_reason[row],
                    logprobs=out.logprobs[row, :n_tok].tolist()))
            if on_progress is not None and done < total:
                done = min(total, done + len(lengths))
                on_progress(done, total)
        return fresh

    for p, gens in run({p: k for p in range(len(prompts))}).items():
        results[p] = gens
    # re-sample duplicates (same text after stripping) so annotators never rank two equal responses;
    # greedy decoding would only repeat itself
    for _ in range(cfg.max_resample if cfg.temperature > 0 else 0):
        dupes = {p: _duplicate_slots(g) for p, g in enumerate(results)}
        dupes = {p: slots for p, slots in dupes.items() if slots}
        if not dupes:
            break
        fresh = run({p: len(slots) for p, slots in dupes.items()})
        for p, slots in dupes.items():
            for slot, gen in zip(slots, fresh[p]):
                results[p][slot] = gen
    return results


def _duplicate_slots(gens: list[Generation]) -> list[int]:
    seen, slots = set(), []
    for i, g in enumerate(gens):
        key = g.text.strip()
        if key in seen:
            slots.append(i)
        seen.add(key)
    return slots


# --------------------------------------------------------------------------- CLI


def reward_spread(reward_path: str, prompts: list, results: list[list[Generation]], model_cfg: ModelConfig,
                  batch_size: int = 16) -> list[float]:
    """Per prompt, max - min of the reward model's (normalised) scores of its K responses: how
    clearly the reward model separates them."""
    from pipeline.scoring import load_reward_model, score_texts

    rm, tokenizer = load_reward_model(reward_path, model_cfg)
    pairs = [(prompt, g.text) for prompt, gens in zip(prompts, results) for g in gens]
    scores = score_texts(rm, tokenizer, [p for p, _ in pairs], [r for _, r in pairs], batch_size)
    k = len(results[0]) if results else 0
    return [max(scores[i:i + k]) - min(scores[i:i + k]) for i in range(0, len(scores), k)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline generate",
                                     description="Sample K responses per prompt into a run directory.")
    parser.add_argument("--prompts", required=True, help="JSONL with a 'prompt' field per line")
    parser.add_argument("--out", required=True, help="run directory (created) for responses.jsonl etc.")
    parser.add_argument("--adapter", default=None, help="a policy folder saved by save_policy")
    parser.add_argument("--limit", type=int, default=0, help="only the first N prompts (0 = all)")
    parser.add_argument("--select-uncertain", type=int, default=0, metavar="N",
                        help="keep only the N prompts whose K responses --reward separates least "
                             "(active learning: annotations where the reward model is least sure)")
    parser.add_argument("--reward", default="", help="reward model folder for --select-uncertain")
    add_arguments(parser, GenerateConfig)
    add_arguments(parser, ModelConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    gen_cfg, model_cfg = from_args(GenerateConfig, args), from_args(ModelConfig, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.select_uncertain and not args.reward:
        print("error: --select-uncertain needs --reward (a reward model folder)")
        return 2
    write_status(out, "running", 0, 0)
    try:
        rows = read_prompts(args.prompts)[: args.limit or None]
        # Sampling never trains: no fresh (all-zero) adapter without --adapter, and a saved adapter
        # is merged into the weights so each step runs plain matmuls.
        policy, tokenizer = load_policy(dataclasses.replace(model_cfg, lora=False) if not args.adapter
                                        else model_cfg, adapter_path=args.adapter)
        meta = policy.rlhf_meta
        if args.adapter and meta["lora"]:
            policy = policy.merge_and_unload()
        model_name = str(Path(args.adapter).resolve()) if args.adapter else meta["base_model"]
        write_json(out / "config.json", {
            "stage": "generate", "prompts": str(args.prompts), "adapter": args.adapter,
            "model": model_name, "num_prompts": len(rows),
            "generate": to_dict(gen_cfg), "model_config": to_dict(model_cfg)})
        torch.manual_seed(gen_cfg.seed)
        bar = tqdm(total=len(rows) * gen_cfg.k, desc="generate", unit="resp")

        def progress(done: int, total: int) -> None:
            bar.update(done - bar.n)
            write_status(out, "running", done, total)

        results = generate_responses(policy, tokenizer, [r["prompt"] for r in rows], gen_cfg.k, gen_cfg,
                                     on_progress=progress)
        bar.close()
        if args.select_uncertain:
            spread = reward_spread(args.reward, [r["prompt"] for r in rows], results, model_cfg)
            keep = sorted(sorted(range(len(rows)), key=lambda i: spread[i])[: args.select_uncertain])
            print(f"kept the {len(keep)} of {len(rows)} prompts the reward model separates least "
                  f"(score spread {min(spread):.3f}..{max(spread[i] for i in keep):.3f})")
            rows, results = [rows[i] for i in keep], [results[i] for i in keep]
        params = {key: getattr(gen_cfg, key) for key in
                  ("temperature", "top_p", "top_k", "max_new_tokens", "seed")}
        tmp = out / "responses.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for i, (row, gens) in enumerate(zip(rows, results)):
                for g in gens:
                    f.write(json.dumps({
                        "prompt": row["prompt"], "prompt_index": i, "prompt_id": row.get("id"),
                        "text": g.text, "token_count": len(g.token_ids), "finish_reason": g.finish_reason,
                        "sampling": params, "model": model_name}) + "\n")
        os.replace(tmp, out / "responses.jsonl")
        total = len(rows) * gen_cfg.k
        write_status(out, "done", total, total)
        print(f"wrote {total} responses to {out / 'responses.jsonl'}")
        return 0
    except (Exception, KeyboardInterrupt) as exc:
        error = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"
        write_status(out, "failed", 0, 0, error=error)
        if isinstance(exc, (ValueError, RuntimeError, FileNotFoundError)):
            print(f"error: {error}")
            return 1
        raise
