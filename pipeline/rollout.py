"""The no-grad half of a PPO step: prompts in, a `Rollout` of per-token tensors out.

pipeline/train_ppo.py calls these in its numbered phases; the update phase reuses
`pack_responses`, `response_logits`, `response_logprobs` and `critic_values`, so the training
forward pass computes log-probs and values exactly as the rollout did (same positions, same
temperature). Every forward pass over episodes is packed without padding (pipeline/packing.py).

Layout of one rollout (B episodes): `sequences` (B, P+R) is the left-padded prompt followed by the
right-padded response; every per-token tensor is (B, R), aligned with the response tokens:
`mask[:, t]` is 1 for real tokens up to and including EOS, 0 after (post-EOS tokens are masked
everywhere). A critic value at t is read at the position *before* token t (the state the token
was chosen in), as in TRL's `full_value[:, context_length - 1 : -1]`.

Rewards (phase 4) come from pipeline/scoring.py: a reward model's normalised score of the rollout's
token ids, or a scripted reward for tests and benches.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.losses import gae, kl_per_token, logprobs_from_logits, masked_whiten, shaped_rewards
from pipeline.models import ScalarModel, is_peft
from pipeline.packing import Packed, attn_cost_ratio, gather_cells, hidden_states, pack
from pipeline.policy import packed_lm_logits
from pipeline.rundir import read_jsonl
from pipeline.text import pad_rows

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
    values: torch.Tensor  # (B, R) critic values at rollout time
    eos: torch.Tensor  # (B,) bool: the response ended with EOS

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(1).long()  # (B,)


# --------------------------------------------------------------------------- packed forwards


@dataclass
class PackedResponses:
    """A batch of episodes packed without padding (pipeline/packing.py), with the N cells that
    predict its real response tokens: the position before response token t (prompt end, then
    the response so far) gives both its log-prob and the critic's value (state, then action)."""
    packed: Packed
    rows: torch.Tensor  # (N,) episode of each real response token
    cols: torch.Tensor  # (N,) its response column t
    index: torch.Tensor  # (N,) flat packed index of the position predicting it
    tokens: torch.Tensor  # (N,) the token
    shape: tuple[int, int]  # (b, R)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(N,) per-token values -> (b, R), 0 past each episode's EOS (differentiable)."""
        return values.new_zeros(self.shape).index_put((self.rows, self.cols), values)


def pack_responses(sequences, attention_mask, response_ids, mask, prompt_length: int,
                   attn_per_linear: float, share_prefix: bool = True) -> PackedResponses:
    """Pack b episodes (sequences (b, P+R), mask (b, R)) and locate their response tokens; a
    prefix every prompt starts with (the chat template's system prompt) runs once, unless
    share_prefix is False (gradient checkpointing: its layers drop a KV cache)."""
    last_prompt_token = int(attention_mask[:, :prompt_length].sum(1).min()) - 1  # must stay in the rows
    packed = pack(sequences, attention_mask, attn_per_linear, max_prefix=last_prompt_token if share_prefix else 0)
    rows, cols = mask.nonzero(as_tuple=True)  # (N,) each
    index = gather_cells(packed, rows, prompt_length - 1 + cols)
    return PackedResponses(packed=packed, rows=rows, cols=cols, index=index, tokens=response_ids[rows, cols],
                           shape=tuple(mask.shape))


def attn_ratio(model) -> float:
    """Attention cost per key relative to linear cost per token (choose_width's cost model)."""
    backbone = model.backbone if isinstance(model, ScalarModel) else model
    return attn_cost_ratio(backbone.config)


def response_logits(model, pr: PackedResponses, reference: bool = False) -> torch.Tensor:
    """(N, V) logits predicting the N real response tokens; the LM head runs on those cells only
    (a 49k-vocabulary head is ~20% of a SmolLM2 forward per position)."""
    if reference:  # pipeline.models.Reference: adapter disabled, or the frozen copy
        return model.packed_logits(pr.packed, pr.index)
    return packed_lm_logits(model, pr.packed, pr.index)


def response_logprobs(logits: torch.Tensor, pr: PackedResponses, temperature: float) -> torch.Tensor:
    """(b, R) log-probs of the response tokens under logits / temperature, 0 past EOS."""
    return pr.scatter(logprobs_from_logits(logits[None], pr.tokens[None], temperature)[0])


def sampled_kl(policy, reference, sb, temperature: float, *, logprobs: torch.Tensor | None = None,
               share_prefix: bool = True) -> torch.Tensor:
    """(B,) k1 estimate of KL(pi || pi_ref) of each sampled response (a pipeline.sampling
    SampleBatch), in nats: the sum over its tokens of log pi - log pi_ref, both of logits /
    temperature, the reference's from one packed forward. log pi: `logprobs` when given (the
    sampling pass's, sb.logprobs), else one forward of the policy."""
    mask = sb.response_mask.float()
    pr = pack_responses(sb.sequences, sb.attention_mask, sb.response_ids, mask, sb.prompt_length,
                        attn_ratio(policy), share_prefix=share_prefix)
    ref = response_logprobs(response_logits(reference, pr, reference=True), pr, temperature)
    logp = logprobs if logprobs is not None else response_logprobs(response_logits(policy, pr), pr, temperature)
    return ((logp - ref) * mask).sum(1)


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


@torch.no_grad()
def rollout_forwards(policy, reference, critic, sequences, attention_mask, response_ids, mask,
                     prompt_length: int, temperature: float, chunk: int, need_old: bool,
                     autocast, share_prefix: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Reference log-probs, pi_old log-probs (only when need_old) and critic values, all (B, R),
    0 past each EOS. Runs in chunks of `chunk` episodes, each packed without padding.

    share_prefix False: no prefix pass (FSDP: whether a chunk has a common prefix, and whether a
    frozen model kept its keys and values, differs between processes, and every forward of a
    sharded model must run on all of them; with B / N episodes per process each runs the same
    number of chunks)."""
    B, R = response_ids.shape
    ref = torch.zeros(B, R, device=sequences.device)
    old = torch.zeros(B, R, device=sequences.device) if need_old else None
    values = torch.zeros(B, R, device=sequences.device)
    ratio = attn_ratio(policy)
    for rows in torch.arange(B, device=sequences.device).split(chunk):
        pr = pack_responses(sequences[rows], attention_mask[rows], response_ids[rows], mask[rows], prompt_length,
                            ratio, share_prefix)
        with autocast():
            ref[rows] = response_logprobs(response_logits(reference, pr, reference=True), pr, temperature)
            if need_old:
                old[rows] = response_logprobs(response_logits(policy, pr), pr, temperature)
            values[rows] = critic_values(critic, pr).float()
    return ref, old, values


@contextmanager
def merged_lora(model):
    """Run the body with the LoRA deltas merged into the base weights (W + s * B @ A) and the
    adapter layers switched off, so sampling runs one plain linear per layer and decoding step
    instead of base + adapter.

    peft's merge_adapter() adds in place and unmerges by subtracting, which is not bit-exact in
    floats, and the reference (adapter disabled) must stay the starting model bit for bit. So the
    merged weights are new tensors and the original ones are put back afterwards: peak memory
    grows by one copy of the adapted weights while sampling. A model without LoRA is left as is.
    """
    if not is_peft(model):
        yield model
        return
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if any(any(layer.use_dora.values()) for layer in layers):  # DoRA's magnitude is not in the delta
        yield model
        return
    originals = [layer.get_base_layer().weight.data for layer in layers]
    with model.disable_adapter():  # the LoRA layers now run their base layer only
        try:
            for layer, weight in zip(layers, originals):
                names = [n for n in layer.active_adapters if n in layer.lora_A or n in layer.lora_embedding_A]
                if names:
                    delta = sum(layer.get_delta_weight(n) for n in names)  # scaling s included
                    layer.get_base_layer().weight.data = weight + delta.to(weight.dtype)
            yield model
        finally:
            for layer, weight in zip(layers, originals):
                layer.get_base_layer().weight.data = weight


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
    - GAE over real response tokens, advantages whitened (masked), returns = advantages + values
      (the critic's targets with GAE at cfg.critic_lam when it differs from cfg.lam).
    Every position past EOS is 0 in kl, rewards and advantages, whatever the inputs hold there.
    """
    mask = ro.mask
    score = raw_score.clamp(-cfg.reward_clip, cfg.reward_clip) if cfg.reward_clip > 0 else raw_score
    score = score - cfg.missing_eos_penalty * (~ro.eos).float()  # (B,)
    kl = kl_per_token(ro.logprobs, ro.ref_logprobs, cfg.kl_estimator) * mask  # (B, R)
    rewards = shaped_rewards(score, kl, beta, mask)  # (B, R)
    if cfg.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False) * mask
    advantages, returns = gae(rewards, ro.values, mask, cfg.gamma, cfg.lam)  # (B, R) each
    if cfg.critic_lam != cfg.lam:  # decoupled GAE: the critic's targets at their own lambda
        _, returns = gae(rewards, ro.values, mask, cfg.gamma, cfg.critic_lam)
    advantages = masked_whiten(advantages, mask) * mask
    return Advantages(score=score, kl=kl, kl_seq=kl.sum(1), rewards=rewards, advantages=advantages,
                      returns=returns)


# --------------------------------------------------------------------------- texts


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    return [tokenizer.decode(ids[m.bool()].tolist(), skip_special_tokens=True)
            for ids, m in zip(response_ids, response_mask)]


# --------------------------------------------------------------------------- prompts and PPO-ptx data


def episode_uniforms(seed: int, step: int, episodes: range, n_tokens: int, device) -> torch.Tensor:
    """(len(episodes), n_tokens) float64 uniforms, row i those of episode episodes[i] of the step
    (its index in the whole batch): each episode's numbers come from its own seeded stream, so a
    rank sampling episodes 4..7 draws exactly what one process sampling 0..7 draws for them."""
    rows = [torch.rand(n_tokens, dtype=torch.float64,
                       generator=torch.Generator().manual_seed((seed * 1_000_003 + step) * 100_003 + e))
            for e in episodes]
    return torch.stack(rows).to(device)



def prompt_order(n_prompts: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Indices of the prompts for PPO step `step` (0-based): consecutive slices of a fresh
    permutation per pass over the file, seeded by (seed, pass). Depends only on the step, so a
    resumed run sees the prompts it would have seen."""
    out, perms = [], {}
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(i, n_prompts)
        if epoch not in perms:
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            perms[epoch] = torch.randperm(n_prompts, generator=g).tolist()
        out.append(perms[epoch][pos])
    return out


def read_ptx_texts(path: str | os.PathLike) -> list[str]:
    """Texts for the PPO-ptx term: JSONL rows with a non-empty 'text' field."""
    texts = [row["text"] for row in read_jsonl(path, check=_check_ptx_row)]
    if not texts:
        raise ValueError(f"{path}: no texts for PPO-ptx")
    return texts


def _check_ptx_row(row) -> None:
    if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
        raise ValueError("field 'text' is missing or empty")


def ptx_batch(tokenizer, texts: list[str], max_length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) (b, T), right-padded, each text + EOS, cut to max_length."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"][: max_length - 1] + [tokenizer.eos_token_id]
            for t in texts]
    return pad_rows(rows, tokenizer.pad_token_id, left=False, device=device)


# --------------------------------------------------------------------------- sample table


def write_samples(path: Path, tokenizer, ro: Rollout, score: torch.Tensor, kl_seq: torch.Tensor,
                  n: int = 4) -> None:
    """A few prompts with the current policy's responses, their scores and KL, as JSONL."""
    texts = decode_responses(tokenizer, ro.response_ids[:n], ro.mask[:n])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({
                "prompt": ro.prompts[i], "response": text, "score": round(float(score[i]), 4),
                "kl": round(float(kl_seq[i]), 4), "tokens": int(ro.lengths[i]),
                "finish_reason": "eos" if bool(ro.eos[i]) else "length",
            }) + "\n")
    os.replace(tmp, path)


__all__ = [
    "Rollout", "Advantages", "kl_shaped_advantages", "gather_rollout", "PackedResponses", "pack_responses", "attn_ratio",
    "response_logits", "response_logprobs", "sampled_kl", "critic_values", "rollout_forwards", "merged_lora", "decode_responses",
    "prompt_order", "episode_uniforms", "read_ptx_texts", "ptx_batch", "write_samples",
]
