"""Compare two policies on held-out prompts with a reward model: win rate and side-by-side samples.

    result = compare_policies(policy_a, policy_b, reward_path, prompts, model_cfg, CompareConfig())

  1. each policy samples one response per prompt, with the same seed (so the two differ by their
     weights, not by the random stream), then is freed before the next one loads
  2. the reward model scores prompt + response, formatted exactly as in reward training
     (pipeline/scoring.score_texts), normalised with its stored mean/std
  3. win rate of A over B: the share of prompts where A's response scores higher, ties counting
     half (the "reward-model win rate" of AlpacaFarm and of TRL's judges, with the reward model
     as the judge), with its binomial standard error

A policy is given as (base model, adapter folder or None), what a store model version holds.
Used by the app's Models tab in a background thread; it never touches the store.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from pipeline.config import GenerateConfig, ModelConfig
from pipeline.scoring import load_reward_model, score_texts


@dataclass
class CompareConfig:
    max_new_tokens: int = 48
    """Response length limit for both policies."""
    temperature: float = 0.7
    """Sampling temperature for both policies."""
    batch_size: int = 16
    """Sequences per sampling / scoring batch."""
    seed: int = 1234
    """The same seed for both policies."""


@dataclass(frozen=True)
class PolicySpec:
    name: str
    base_model: str
    adapter: str | None = None


def _sample(spec: PolicySpec, prompts: list, model_cfg: ModelConfig, cfg: CompareConfig,
            on_step: Callable[[], None]) -> list[str]:
    """1. one response per prompt from `spec`, then free the model."""
    from pipeline.generate import generate_responses
    from pipeline.policy import load_policy

    # lora=False: a base policy is sampled as it is (no fresh zero adapter to wrap it in); a trained
    # one is reloaded from its folder, whose model_meta.json decides LoRA or full weights.
    policy, tokenizer = load_policy(dataclasses.replace(model_cfg, model=spec.base_model, lora=False),
                                    adapter_path=spec.adapter)
    gen_cfg = GenerateConfig(k=1, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                             batch_size=cfg.batch_size, seed=cfg.seed, max_resample=0)
    out = generate_responses(policy, tokenizer, prompts, 1, gen_cfg, on_progress=lambda done, total: on_step())
    del policy
    return [gens[0].text for gens in out]


def win_rate(a: list[float], b: list[float]) -> tuple[float, float]:
    """(share of a > b with ties as half, its binomial standard error)."""
    if len(a) != len(b) or not a:
        raise ValueError("win_rate needs two equally long, non-empty score lists")
    wins = [1.0 if x > y else 0.5 if x == y else 0.0 for x, y in zip(a, b)]
    p = sum(wins) / len(wins)
    return p, math.sqrt(p * (1 - p) / len(wins))


def compare_policies(a: PolicySpec, b: PolicySpec, reward_path: str, prompts: list, model_cfg: ModelConfig,
                     cfg: CompareConfig | None = None,
                     on_progress: Callable[[int, int, str], None] | None = None) -> dict:
    """Phases 1-3 of the module docstring. Returns {win_rate, stderr, mean_a, mean_b, prompts, rows}
    with one row per prompt: prompt, response_a, response_b, score_a, score_b."""
    if not prompts:
        raise ValueError("no prompts to compare on")
    cfg = cfg or CompareConfig()
    batches = math.ceil(len(prompts) / cfg.batch_size)
    total, done = 2 * batches + 1, 0

    def step(detail: str):
        nonlocal done
        done = min(total, done + 1)
        if on_progress is not None:
            on_progress(done, total, detail)

    if on_progress is not None:
        on_progress(0, total, f"sampling with {a.name}")
    texts_a = _sample(a, prompts, model_cfg, cfg, lambda: step(f"sampling with {a.name}"))
    texts_b = _sample(b, prompts, model_cfg, cfg, lambda: step(f"sampling with {b.name}"))
    done = 2 * batches
    rm, tokenizer = load_reward_model(reward_path, model_cfg)
    scores_a = score_texts(rm, tokenizer, prompts, texts_a, cfg.batch_size)
    scores_b = score_texts(rm, tokenizer, prompts, texts_b, cfg.batch_size)
    del rm
    step("scored")
    rate, stderr = win_rate(scores_a, scores_b)
    rows = [{"prompt": p, "response_a": ta, "response_b": tb, "score_a": sa, "score_b": sb}
            for p, ta, tb, sa, sb in zip(prompts, texts_a, texts_b, scores_a, scores_b)]
    return {"win_rate": rate, "stderr": stderr, "mean_a": sum(scores_a) / len(scores_a),
            "mean_b": sum(scores_b) / len(scores_b), "prompts": len(prompts), "rows": rows}
