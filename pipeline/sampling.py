"""Batched sampling with a KV cache: one left-padded batch of prompts in, a `SampleBatch` out.

`sample` returns the response ids, a mask up to and including EOS, and the log-probs of the sampled
tokens. The PPO trainer uses it for rollouts and pipeline/responses.py for K responses per prompt.
It is our own KV-cache loop rather than `model.generate`: it computes log-probs as it samples, runs
the prompt once for its K samples (the cache is copied K times after the prefill), and drops
finished rows from the batch (bench/generate_bench.py). After the prefill the keys and values live
in tensors allocated once for the whole response (pipeline/kv_cache.py): a step writes one column
where a DynamicCache would concatenate every layer's keys and values anew.

`decode_batch_size` is the batch a sampler uses when its caller names none: the batch at which the
machine multiplies best, not the smallest that fills it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.models import position_ids_from_mask
from pipeline.packing import MIN_PREFIX, cache_kwarg, common_prefix


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


CPU_DECODE_BATCH = 64
GPU_DECODE_BATCH = 256


def decode_batch_size(device) -> int:
    """Sequences per sampling batch when the caller names none (GenerateConfig.batch_size 0): 64 on
    CPU, 256 on a GPU.

    A decode step is one row per sequence through every matrix product, so its cost per token
    falls as the batch grows until the products run at the machine's rate. Measured on a 2-core
    AMD EPYC (fp32, MKL) with SmolLM2-135M: at batch 16 a decode step takes ~167 ms and its linear
    layers run at 43-63 GFLOP/s (a [16 x 576] x [576 x 1536] product: 451 us); at batch 64 the
    same product runs at 129 GFLOP/s (879 us for 4x the rows), so per token a batch of 64 costs
    about half a batch of 16. 256 on a GPU is the same reasoning, not a measurement: a step reads
    every weight once whatever the batch, so a 135M model's step is bound by those reads and by
    kernel launches up to a few hundred rows (bench/generate_bench.py --batches measures it).
    Memory: the KV cache holds batch x (prompt + response) columns per layer (pipeline/kv_cache.py)."""
    return CPU_DECODE_BATCH if torch.device(device).type == "cpu" else GPU_DECODE_BATCH


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


def _sample_categorical(probs: torch.Tensor, generator: torch.Generator | None,
                        blocked: bool | None = None, block: int = 1024, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of probs (B, V) by inverse-CDF sampling: a single uniform per row (drawn
    from generator, or given: u (B,) in [0, 1)).

    torch.multinomial draws one exponential per vocabulary entry, which on CPU costs about a quarter
    of a 135M-model decoding step; a cumulative sum and a binary search cost a few ms. The sum must
    keep tokens with tiny probabilities their share: a float32 running sum over 150k entries near
    1.0 has a step of 6e-8, so it is done in float64 on CPU. GPUs other than the data-centre ones
    run float64 at 1/32-1/64 of the float32 rate, so there (`blocked`, the default off CPU) the sum
    is two-level: float64 only over the V/block block totals, float32 inside the chosen block (its
    running sum is relative to the block's start, so its rounding is relative to the block's mass).
    Both forms pick the same token unless u falls within float rounding of a boundary
    (tests/test_generate.py). Zero-probability (filtered) tokens are never chosen: the searches
    return the first cdf strictly above u, and u stays strictly below the total.
    """
    if u is None:
        u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=torch.float64)
    else:
        u = u.to(device=probs.device, dtype=torch.float64)[:, None]
    if blocked is None:
        blocked = probs.device.type != "cpu"
    if not blocked or probs.shape[-1] <= block:
        cdf = probs.double().cumsum(-1)  # (B, V)
        total = cdf[:, -1:]  # (B, 1), 1 up to rounding
        u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # u < total strictly
        return torch.searchsorted(cdf, u, right=True).squeeze(1)
    B, V = probs.shape
    nb = -(-V // block)
    blocks = torch.nn.functional.pad(probs.float(), (0, nb * block - V)).view(B, nb, block)  # (B, nb, K)
    block_cdf = blocks.sum(-1).double().cumsum(-1)  # (B, nb)
    total = block_cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # (B, 1)
    j = torch.searchsorted(block_cdf, target, right=True).clamp_max(nb - 1)  # (B, 1) block holding u
    start = torch.where(j > 0, block_cdf.gather(1, (j - 1).clamp_min(0)), torch.zeros_like(target))
    inner = blocks.gather(1, j[:, :, None].expand(B, 1, block)).squeeze(1).cumsum(-1)  # (B, K) float32
    last = inner[:, -1:]
    rest = torch.minimum((target - start).float(), torch.nextafter(last, torch.zeros_like(last)))
    return (j.squeeze(1) * block + torch.searchsorted(inner, rest, right=True).squeeze(1)).clamp_max(V - 1)


def _all_done(mine: bool, device) -> bool:
    """True on every process when every process's rows are done (one all-reduce)."""
    flag = torch.tensor([0.0 if mine else 1.0], device=device)
    torch.distributed.all_reduce(flag)
    return float(flag) == 0.0


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
def _prefill(model, input_ids, attention_mask, prompt_index, R: int, cache_kw: str, decoding: "Decoding"):
    """Run the prompts into a DynamicCache (a prefix common to all of them once when
    decoding.share_prefix, then each prompt's other tokens once) and copy each prompt's cache rows
    for its samples (prompt_index): into a ColumnCache with room for the R - 1 tokens fed back
    (decoding.preallocated_cache; the last sampled token is never run), else within the
    DynamicCache. Returns (the cache, the first token's logits (B, V), the attention mask of the
    cache's layout (B, n): n = the cache's length)."""
    from transformers import DynamicCache

    from pipeline.kv_cache import ColumnCache

    cache = DynamicCache()
    ids, mask, offset = input_ids, attention_mask, 0
    if decoding.share_prefix and not decoding.synced:
        ids, mask, offset = _prefill_prefix(model, input_ids, attention_mask, cache, cache_kw)
    out = model(input_ids=ids, attention_mask=mask, position_ids=offset + position_ids_from_mask(mask[:, offset:]),
                use_cache=True, logits_to_keep=1, **{cache_kw: cache})
    if decoding.preallocated_cache:
        cache = ColumnCache.from_prefill(cache, prompt_index, max(R - 1, 0))
    else:
        cache.batch_select_indices(prompt_index)
    return cache, out.logits[prompt_index, -1].float(), mask[prompt_index]


@dataclass(frozen=True)
class Decoding:
    """How `sample`'s loop runs; none of it changes what is sampled (beyond float rounding and, for
    check_every, which of the generator's numbers a row draws).

    share_prefix: tokens that every prompt starts with (a chat template's system prompt) are run
    once for the batch (pipeline/packing.py, "Shared prefix").
    check_every: finished rows leave the batch every this many tokens (None: 1 on CPU, 8 on GPUs:
    dropping rows needs their count on the host, one device->host synchronisation, which on a GPU
    stalls the queue of kernels once per token; on CPU there is no queue to stall, and dropping at
    once keeps the random stream of a 1-process CPU run as it was). Each row draws one of the
    generator's numbers per token it spends in the batch.
    synced: the model is sharded across the processes of a group (FSDP), so each of its forward
    passes is a collective that every process must run: the loop then steps until every process's
    rows are done (one all-reduce of "mine are done" at each check, as transformers' generate does
    with synced_gpus=True), a process whose rows all ended keeps stepping them (their tokens masked
    to pad), and no shared prefix runs (whether there is one depends on each process's prompts).
    preallocated_cache: after the prefill, keys and values live in tensors allocated once for the
    batch, (B, kv_heads, n + R - 1, head_dim) per layer, each step writing one column
    (pipeline/kv_cache.py); False: transformers' DynamicCache, which concatenates each step (the
    same tokens, log-probs equal up to float rounding: tests/test_generate.py)."""
    share_prefix: bool = True
    check_every: int | None = None
    synced: bool = False
    preallocated_cache: bool = True


def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cfg, tokenizer, num_samples=1,
           draws: torch.Generator | torch.Tensor | None = None, decoding: Decoding = Decoding()) -> SampleBatch:
    """Sample responses for a left-padded batch of prompts with the KV cache.

    cfg: anything with temperature and max_new_tokens, and optionally top_p and top_k
    (GenerateConfig has them; PPOConfig has neither: PPO samples the whole distribution).
    temperature 0 = greedy (log-probs then from the raw logits). tokenizer: its EOS ends a response
    (else the model's generation_config's) and its pad fills the rest (else the EOS).
    num_samples: samples per input row (an int, or one count per row); the prompt runs once and its
    cache is copied. Log-probs are from the unfiltered logits / temperature (what a training
    forward pass can reproduce), while sampling applies top-k / top-p. The model's train/eval mode
    is left as the caller set it.
    draws: where each token's uniform number comes from: a torch.Generator's stream (or the global
    one: None), or a (B, cfg.max_new_tokens) tensor in [0, 1), the number each row's token t is
    drawn with; a row's response then depends on its own numbers only, not on which other rows
    share its batch (PPO draws them per episode, so N processes sample the episodes one process
    would). decoding: how the loop runs (Decoding).
    """
    device = input_ids.device
    eos, pad = _special_ids(model, tokenizer, device)
    counts = torch.as_tensor(num_samples, device=device).expand(input_ids.shape[0])
    prompt_index = torch.arange(input_ids.shape[0], device=device).repeat_interleave(counts)  # (B,)
    R, synced = cfg.max_new_tokens, decoding.synced
    uniforms = draws if isinstance(draws, torch.Tensor) else None
    generator = None if uniforms is not None else draws
    check_every = decoding.check_every or (1 if device.type == "cpu" else 8)

    # 1. prefill: each distinct prompt once, its cache rows copied for its samples
    cache_kw = cache_kwarg(model)
    cache, logits, mask = _prefill(model, input_ids, attention_mask, prompt_index, R, cache_kw, decoding)
    rows = _Rows(prompt_index.shape[0], R, pad, mask)
    for t in range(R):
        # 2. choose the next token of every row in the batch; record it and its log-prob
        token, logp = _next_token(logits, cfg, generator, None if uniforms is None else uniforms[rows.active, t])
        token = rows.record(t, token, logp, eos)
        if t == R - 1:
            break
        # 3. every check_every tokens, rows that produced EOS leave the batch and the cache (the
        # only host synchronisation of the loop)
        if (t + 1) % check_every == 0:
            keep = (~rows.done).nonzero().squeeze(1)
            if (_all_done(keep.numel() == 0, device) if synced else keep.numel() == 0):
                break
            if 0 < keep.numel() < rows.done.numel():  # (synced: a process whose rows all ended keeps them)
                token = rows.keep(keep, token)
                cache.batch_select_indices(keep)
        # 4. one decoding step for the rows in the batch
        logits = rows.step(model, token, cache, cache_kw)
    return _batch(input_ids, attention_mask, prompt_index, rows)


def _special_ids(model, tokenizer, device) -> tuple[torch.Tensor, int]:
    """(the EOS ids as a tensor, the pad id): the tokenizer's, else the model's generation_config's;
    the pad falls back to the first EOS."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.generation_config.eos_token_id
    if eos is None:
        raise ValueError("sample: neither the tokenizer nor the model's generation_config has an EOS token")
    eos = torch.tensor([eos] if isinstance(eos, int) else list(eos), device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else model.generation_config.pad_token_id
    return eos, int(eos[0]) if pad is None else pad


class _Rows:
    """`sample`'s record of its B rows (response ids, log-probs, lengths, whether each ended on EOS)
    and of the rows still in the batch: their indices (`active`), which of them are done (ended,
    not yet dropped), their attention mask in the cache's layout and the position of their next token.

    The mask is allocated once, (B, n + R - 1): the prefill's n columns, then ones for the tokens
    fed back (a row that is done still feeds pad tokens, attended as its others are: they only
    shape logits nobody records); a step passes its first `width` + 1 columns."""

    def __init__(self, B: int, R: int, pad: int, mask: torch.Tensor):
        device = mask.device
        self.pad = pad
        self.response_ids = torch.full((B, R), pad, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((B, R), dtype=torch.float32, device=device)
        self.lengths = torch.full((B,), R, dtype=torch.long, device=device)
        self.ended = torch.zeros(B, dtype=torch.bool, device=device)
        self.active = torch.arange(B, device=device)
        self.done = torch.zeros(B, dtype=torch.bool, device=device)
        self.mask = torch.cat([mask, mask.new_ones((B, max(R - 1, 0)))], dim=1)  # (B, n + R - 1)
        self.width = mask.shape[1]  # the cache's length: the mask's columns in use
        self.next_pos = mask.sum(-1)  # (B,) count of real tokens so far

    def record(self, t: int, token: torch.Tensor, logp: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
        """Token t of the rows in the batch (A,) and its log-prob (from logp (A, V)); a row that is
        done gets pad. Returns the tokens as recorded."""
        token = token.masked_fill(self.done, self.pad)  # a row that ended keeps pad after its EOS
        self.response_ids[self.active, t] = token
        self.logprobs[self.active, t] = logp.gather(1, token[:, None]).squeeze(1)  # masked where done (_batch)
        is_eos = torch.isin(token, eos) & ~self.done  # (A,)
        self.lengths[self.active] = torch.where(is_eos, t + 1, self.lengths[self.active])
        self.ended[self.active] |= is_eos
        self.done = self.done | is_eos
        return token

    def keep(self, keep: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Only the rows `keep` (indices into the batch) stay in the batch; returns their tokens."""
        self.active, self.mask, self.next_pos, self.done = (
            self.active[keep], self.mask[keep], self.next_pos[keep], self.done[keep])
        return token[keep]

    def step(self, model, token: torch.Tensor, cache, cache_kw: str) -> torch.Tensor:
        """One decoding step of the rows in the batch: the logits (A, V) of their next token."""
        self.width += 1
        out = model(input_ids=token[:, None], attention_mask=self.mask[:, :self.width],
                    position_ids=self.next_pos[:, None], use_cache=True, **{cache_kw: cache})
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1].float()


def _next_token(logits: torch.Tensor, cfg, generator, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 of `sample`: each row's next token (A,) and the log-probs it is recorded with (A, V):
    of logits / temperature, unfiltered (greedy at temperature 0: of the raw logits), while the
    token is drawn after top-k / top-p filtering (u: each row's uniform, or the generator's)."""
    greedy = cfg.temperature <= 0
    logp = torch.log_softmax(logits / (1.0 if greedy else cfg.temperature), dim=-1)
    if greedy:
        return logits.argmax(-1), logp
    top_k, top_p = getattr(cfg, "top_k", 0), getattr(cfg, "top_p", 1.0)
    filtering = bool(top_k) or top_p < 1.0
    probs = _filter_logits(logp, top_k, top_p).softmax(-1) if filtering else logp.exp()
    return _sample_categorical(probs, generator, u=u), logp


def _batch(input_ids, attention_mask, prompt_index, rows: _Rows) -> SampleBatch:
    """The samples as a SampleBatch: responses cut to the longest, masked after each row's end,
    each after a copy of its prompt."""
    lengths = rows.lengths
    width = int(lengths.max()) if lengths.numel() else 0  # the longest response: the loop ran at least that far
    response_ids, logprobs = rows.response_ids[:, :width], rows.logprobs[:, :width]
    response_mask = (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).long()  # (B, R)
    prompt_ids, prompt_mask = input_ids[prompt_index], attention_mask[prompt_index]
    return SampleBatch(
        sequences=torch.cat([prompt_ids, response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1),
        response_ids=response_ids, response_mask=response_mask, logprobs=logprobs * response_mask,
        finish_reason=["eos" if e else "length" for e in rows.ended.tolist()],
        prompt_index=prompt_index, prompt_length=input_ids.shape[1],
    )
