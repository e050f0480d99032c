"""Reward-model scores of (prompt, response): one scoring function for every caller.

    packed_score(rm, input_ids, attention_mask)     (b,) token ids in, the score at each row's last
                                                    real token, computed packed without padding
    score_rows(rm, rows, pad_id)                    lists of token ids (prompt + response) in batches
    score_texts(rm, tokenizer, prompts, responses)  texts, encoded exactly as reward training encodes
                                                    a pair (pipeline/text.py: the prompt through the
                                                    chat template, then response + EOS)
    make_reward(spec, tokenizer, model_cfg)         PPO's score_fn: a reward model on the rollout's
                                                    prompts and decoded responses, encoded as
                                                    score_texts does; a simulated annotator's
                                                    scorer (oracle:); or a scripted reward for tests

Every path ends in `packed_score`: the same positions and fp32 head as ScalarModel.score, the head
read at the last real token. Scores are normalised with the model's stored mean/std unless the
caller measures those statistics itself (reward_eval.normalisation_stats).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Callable

import torch

from formats.chat import messages_to_text
from pipeline.models import attn_ratio, load_scalar_model, read_meta
from pipeline.packing import gather_cells, hidden_states, pack
from pipeline.text import decode_responses, encode_response, pad_rows, prompt_token_ids

ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def packed_score(rm, input_ids: torch.Tensor, attention_mask: torch.Tensor, normalised: bool = True,
                 frozen: bool = True) -> torch.Tensor:
    """(b,) the reward model's score of each row (padded on either side), computed on the rows
    packed without padding. The head runs in fp32 outside any autocast, as in reward training.
    frozen: the model's weights never change in this process, so a prefix common to all rows
    keeps its keys and values between calls (pipeline/packing.py, prefix_kv)."""
    packed = pack(input_ids, attention_mask, attn_ratio(rm))
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
    last = (attention_mask.long() * positions).argmax(-1)  # (b,) highest position with mask 1
    index = gather_cells(packed, torch.arange(input_ids.shape[0], device=input_ids.device), last)
    hidden = hidden_states(rm.backbone, packed, frozen="reward" if frozen else None)[index]  # (b, H)
    with torch.autocast(hidden.device.type, enabled=False):
        scores = rm.head(hidden.float()).squeeze(-1)  # (b,)
    return (scores - rm.reward_mean) / rm.reward_std if normalised else scores


@torch.no_grad()
def score_rows(rm, rows: list[list[int]], pad_id: int, batch_size: int = 16, normalised: bool = True,
               frozen: bool = True, autocast=contextlib.nullcontext) -> list[float]:
    """Scores of token-id rows (prompt + response each), batch_size rows per forward pass."""
    device = next(rm.parameters()).device
    scores: list[float] = []
    for start in range(0, len(rows), batch_size):
        ids, mask = pad_rows(rows[start:start + batch_size], pad_id, left=False, device=device)  # (b, T)
        with autocast():
            scores += packed_score(rm, ids, mask, normalised, frozen).float().tolist()
    return scores


def score_texts(rm, tokenizer, prompts: list, responses: list[str], batch_size: int = 16) -> list[float]:
    """Normalised scores of prompt + response texts, formatted exactly as reward training does."""
    if len(prompts) != len(responses):
        raise ValueError(f"score_texts: {len(prompts)} prompts but {len(responses)} responses")
    rows = [prompt_token_ids(tokenizer, p) + encode_response(tokenizer, r) for p, r in zip(prompts, responses)]
    return score_rows(rm, rows, tokenizer.pad_token_id, batch_size)


def load_reward_model(path: str, model_cfg):
    """(reward model, tokenizer): a folder saved by train-reward, frozen, in eval mode."""
    if not Path(path).is_dir():
        raise ValueError(f"--reward {path}: no such folder (expected a reward model saved by train-reward)")
    kind = read_meta(path).get("kind")
    if kind != "reward":
        raise ValueError(f"--reward {path}: a {kind} checkpoint, not a reward model")
    rm, tokenizer = load_scalar_model(path, kind="reward", cfg=model_cfg)
    return rm.requires_grad_(False).eval(), tokenizer


def make_reward(spec: str, tokenizer, model_cfg, chunk: int = 16,
                autocast=contextlib.nullcontext) -> tuple[ScoreFn, object | None]:
    """(score_fn, reward_model or None) for PPO's --reward.

    score_fn(sequences, attention_mask, response_ids, response_mask, prompts=None) -> (B,) float scores;
    prompts (the rollout's, text or messages) are needed by a reward model: it scores each prompt
    and decoded response as `score_texts` does (`retokenise`), whatever the policy's tokenizer.
    - 'script:count:<text>': occurrences of <text> in the decoded response (special tokens dropped);
    - 'script:length': response tokens, EOS excluded;
    - 'oracle:[norm=MEAN,STD:]ORACLE': a simulated annotator's scorer (`oracle_reward`);
    - a folder saved by save_scalar_model(kind='reward'): its normalised score of prompt + response
      + EOS, the encoding it was trained on, for responses that ended and responses cut at the
      length limit alike. The reward model is frozen.
    """
    if spec.startswith("script:"):
        kind, _, arg = spec[len("script:"):].partition(":")
        if kind == "count":
            if not arg:
                raise ValueError(f"--reward {spec!r}: give the text to count, e.g. 'script:count: the'")

            def count(sequences, attention_mask, response_ids, response_mask, prompts=None):
                texts = decode_responses(tokenizer, response_ids, response_mask)
                return torch.tensor([float(t.count(arg)) for t in texts], device=sequences.device)

            return count, None
        if kind == "length":
            eos = tokenizer.eos_token_id

            def length(sequences, attention_mask, response_ids, response_mask, prompts=None):
                real = response_mask.bool() & (response_ids != eos)  # (B, R)
                return real.sum(1).float()

            return length, None
        raise ValueError(f"--reward {spec!r}: unknown script; use 'script:count:<text>' or 'script:length'")
    if spec.startswith("oracle:"):
        return oracle_reward(spec, tokenizer), None

    if not Path(spec).is_dir():
        raise ValueError(f"--reward {spec}: no such folder (expected a reward model saved by "
                         "train-reward, or 'script:count:<text>' / 'script:length')")
    rm, rm_tokenizer = load_reward_model(spec, model_cfg)

    @torch.no_grad()
    def score(sequences, attention_mask, response_ids, response_mask, prompts=None):
        if prompts is None:
            raise ValueError(f"--reward {spec}: a reward model scores the prompts and the decoded responses "
                             "encoded as in reward training; pass prompts")
        ids, mask = retokenise(tokenizer, rm_tokenizer, prompts, response_ids, response_mask)
        ids, mask = ids.to(sequences.device), mask.to(sequences.device)
        out = []
        for rows in torch.arange(ids.shape[0], device=ids.device).split(chunk):
            with autocast():
                out.append(packed_score(rm, ids[rows], mask[rows]).float())
        return torch.cat(out)  # (B,)

    return score, rm


def oracle_reward(spec: str, tokenizer) -> ScoreFn:
    """'oracle:[norm=MEAN,STD:]ORACLE': the scorer simulated annotators rank with
    (pipeline/oracle.py `make_oracle`: 'embedding', 'rule:length', ...) of each prompt
    and decoded response, as (score - MEAN) / STD (default 0 and 1: its own units). The gold
    experiment's control arm trains PPO against its judge itself, normalised on the start policy's
    samples as a reward model is, to tell how fast PPO optimises a reward it can learn from how
    fast it optimises a proxy of that reward."""
    from pipeline.oracle import make_oracle

    body = spec[len("oracle:"):]
    mean, std = 0.0, 1.0
    if body.startswith("norm="):
        norm, _, body = body[len("norm="):].partition(":")
        try:
            mean, std = (float(x) for x in norm.split(","))
        except ValueError:
            raise ValueError(f"--reward {spec!r}: norm= takes MEAN,STD, e.g. 'oracle:norm=0.3,0.1:embedding'") from None
        if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
            raise ValueError(f"--reward {spec!r}: the normalisation's MEAN must be a number and its STD > 0")
    if not body:
        raise ValueError(f"--reward {spec!r}: name the oracle, e.g. 'oracle:embedding'")
    oracle = make_oracle(body)

    def score(sequences, attention_mask, response_ids, response_mask, prompts=None):
        if prompts is None:
            raise ValueError(f"--reward {spec}: an oracle scores the prompts and the decoded responses; pass prompts")
        texts = [p if isinstance(p, str) else messages_to_text(p) for p in prompts]
        raw = oracle.score(texts, decode_responses(tokenizer, response_ids, response_mask))
        return (torch.tensor(raw, dtype=torch.float32, device=sequences.device) - mean) / std  # (B,)

    return score


def retokenise(policy_tokenizer, rm_tokenizer, prompts: list, response_ids: torch.Tensor,
               response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) (B, T), right-padded, in the reward model's tokenizer: each
    prompt and decoded response encoded exactly as reward training encodes a pair and
    `score_texts` scores one (pipeline/text.py: the prompt through the chat template, then the
    response + EOS).

    The reward model reads its score at the EOS it was trained with, so every response gets one,
    also a response cut at the length limit: reward training appends EOS to cut responses too,
    and a head read at a content token gives a number the reward model never learned (on the
    gold experiment's cut responses the two scores ordered 45 of 96 pairs alike: chance). Being
    cut is priced separately, by PPO's missing-EOS penalty. Decoding drops the response's special
    tokens; decoding the whole rollout sequence instead would hand the reward model the policy's
    chat markup (e.g. ChatML's '<|im_start|>assistant') as plain text. Scoring the same text as
    `score_texts` costs one decode and encode per response, nothing next to a forward pass."""
    if len(prompts) != response_ids.shape[0]:
        raise ValueError(f"retokenise: {len(prompts)} prompts for {response_ids.shape[0]} responses")
    texts = decode_responses(policy_tokenizer, response_ids, response_mask)
    rows = [prompt_token_ids(rm_tokenizer, prompt) + encode_response(rm_tokenizer, text)
            for prompt, text in zip(prompts, texts)]
    return pad_rows(rows, rm_tokenizer.pad_token_id, left=False)
