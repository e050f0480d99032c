"""K sampled responses for each prompt of a list, beside the sampler (pipeline/sampling.py).

`generate_responses(policy, tokenizer, prompts, k, cfg)`: prompts in, K `Generation`s per prompt
out, through `pipeline.sampling.sample`; chat template (pipeline/text.py), length-sorted batching
(at the device's decode batch unless GenerateConfig.batch_size names one), seeding, and
re-sampling of duplicates so annotators never rank two identical responses. The `generate` stage
(pipeline/generate.py), comparisons (pipeline/compare.py), blind evaluations and reward
normalisation (pipeline/reward_eval.py) all sample through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.config import GenerateConfig
from pipeline.sampling import decode_batch_size, sample
from pipeline.text import pad_rows, prompt_token_ids


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


@torch.no_grad()
def generate_responses(policy, tokenizer, prompts: list, k: int, cfg: GenerateConfig,
                       on_progress: Callable[[int, int], None] | None = None) -> list[list[Generation]]:
    """K sampled responses per prompt, in prompt order, in batches of cfg.batch_size sequences (0: the
    device's decode_batch_size). on_progress(done, total) after each batch."""
    if k < 1:
        raise ValueError(f"k={k}: need at least one response per prompt")
    device = next(policy.parameters()).device
    batch_size = cfg.batch_size or decode_batch_size(device)
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
    pad = tokenizer.pad_token_id
    results: list[list[Generation]] = [[] for _ in prompts]
    total, done = len(prompts) * k, 0

    def run(need: dict[int, int]) -> dict[int, list[Generation]]:
        nonlocal done
        fresh: dict[int, list[Generation]] = {p: [] for p in need}
        for batch in _batches(order, need, batch_size):
            input_ids, mask = pad_rows([ids[p] for p, _ in batch], pad, left=True, device=device)
            out = sample(policy, input_ids, mask, cfg, tokenizer, num_samples=[n for _, n in batch], draws=generator)
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
