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

    python -m pipeline compare --prompts held_out.jsonl --reward RM_DIR --out RUN_DIR \
        --a-model default --a-adapter runs/ppo-2/policy --a-name v2 --b-model default --b-name base

runs it as a job: RUN_DIR gets config.json, status.json (step/total over the sampling batches of
both policies, then scoring) and result.json: {"a", "b" (the names), "win_rate", "stderr",
"mean_a", "mean_b", "prompts", "rows": [{prompt, response_a, response_b, score_a, score_b}]}.
Exit 0 when done; 1 with status 'failed' and the error; 130 with status 'cancelled' on SIGTERM or
Ctrl-C (checked after every batch). It never touches the store: the owner ingests result.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.config import GenerateConfig, ModelConfig, add_arguments, from_args, to_dict
from pipeline.models import pick_device
from pipeline.responses import generate_responses
from pipeline.rundir import run_job, write_json
from pipeline.sampling import decode_batch_size
from pipeline.scoring import load_reward_model, score_texts
from pipeline.text import read_prompts


@dataclass
class CompareConfig:
    max_new_tokens: int = 48
    """Response length limit for both policies."""
    temperature: float = 0.7
    """Sampling temperature for both policies."""
    batch_size: int = 0
    """Sequences per sampling batch (0 = the device's measured default, pipeline/sampling.py
    decode_batch_size)."""
    score_batch_size: int = 16
    """Sequences per reward-model scoring batch."""
    seed: int = 1234
    """The same seed for both policies."""


def sampling_batch(cfg: CompareConfig, model_cfg: ModelConfig) -> int:
    """Sequences per sampling batch: cfg.batch_size, else the decode default of model_cfg's device
    (what a policy loaded with model_cfg runs on); progress counts these batches."""
    return cfg.batch_size or decode_batch_size(pick_device(model_cfg.device))


@dataclass(frozen=True)
class PolicySpec:
    name: str
    base_model: str
    adapter: str | None = None


def sample_policy(spec: PolicySpec, prompts: list, model_cfg: ModelConfig, cfg: CompareConfig,
                  on_step: Callable[[], None]) -> list:
    """1. one response per prompt from `spec` (a pipeline.responses.Generation each), then free the
    model. Also the sampler of blind evaluations (pipeline/sample_versions.py)."""
    from pipeline.policy import load_policy

    # lora=False: a base policy is sampled as it is (no fresh zero adapter to wrap it in); a trained
    # one is reloaded from its folder, whose model_meta.json decides LoRA or full weights.
    policy, tokenizer = load_policy(dataclasses.replace(model_cfg, model=spec.base_model, lora=False),
                                    adapter_path=spec.adapter)
    gen_cfg = GenerateConfig(k=1, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                             batch_size=sampling_batch(cfg, model_cfg), seed=cfg.seed, max_resample=0)
    out = generate_responses(policy, tokenizer, prompts, 1, gen_cfg, on_progress=lambda done, total: on_step())
    del policy
    return [gens[0] for gens in out]


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
    batches = math.ceil(len(prompts) / sampling_batch(cfg, model_cfg))
    total, done = 2 * batches + 1, 0

    def step(detail: str):
        nonlocal done
        done = min(total, done + 1)
        if on_progress is not None:
            on_progress(done, total, detail)

    if on_progress is not None:
        on_progress(0, total, f"sampling with {a.name}")
    texts_a = [g.text for g in sample_policy(a, prompts, model_cfg, cfg, lambda: step(f"sampling with {a.name}"))]
    texts_b = [g.text for g in sample_policy(b, prompts, model_cfg, cfg, lambda: step(f"sampling with {b.name}"))]
    done = 2 * batches
    rm, tokenizer = load_reward_model(reward_path, model_cfg)
    scores_a = score_texts(rm, tokenizer, prompts, texts_a, cfg.score_batch_size)
    scores_b = score_texts(rm, tokenizer, prompts, texts_b, cfg.score_batch_size)
    del rm
    step("scored")
    rate, stderr = win_rate(scores_a, scores_b)
    rows = [{"prompt": p, "response_a": ta, "response_b": tb, "score_a": sa, "score_b": sb}
            for p, ta, tb, sa, sb in zip(prompts, texts_a, texts_b, scores_a, scores_b)]
    return {"win_rate": rate, "stderr": stderr, "mean_a": sum(scores_a) / len(scores_a),
            "mean_b": sum(scores_b) / len(scores_b), "prompts": len(prompts), "rows": rows}


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline compare",
                                     description="Win rate of policy A over policy B, judged by a reward model.")
    parser.add_argument("--prompts", required=True, help="JSONL with a 'prompt' field (and an optional 'id') per line")
    parser.add_argument("--reward", required=True, help="reward model folder (saved by train-reward)")
    parser.add_argument("--out", required=True, help="run directory (created)")
    for side in ("a", "b"):
        parser.add_argument(f"--{side}-model", required=True, help=f"policy {side.upper()}'s base model")
        parser.add_argument(f"--{side}-adapter", default=None,
                            help=f"policy {side.upper()}'s folder saved by save_policy (none = the base model)")
        parser.add_argument(f"--{side}-name", default=side.upper(), help=f"policy {side.upper()}'s name in the result")
    add_arguments(parser, CompareConfig)
    add_arguments(parser, ModelConfig)  # device, dtype, cache; each side names its own --x-model
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, model_cfg = from_args(CompareConfig, args), from_args(ModelConfig, args)
    a = PolicySpec(args.a_name, args.a_model, args.a_adapter)
    b = PolicySpec(args.b_name, args.b_model, args.b_adapter)
    out = Path(args.out)

    def body(on_progress) -> None:
        prompts = [row["prompt"] for row in read_prompts(args.prompts)]
        write_json(out / "config.json", {
            "stage": "compare", "prompts": str(args.prompts), "reward": args.reward,
            "a": dataclasses.asdict(a), "b": dataclasses.asdict(b), "compare": to_dict(cfg),
            "model": to_dict(model_cfg)})
        result = compare_policies(a, b, args.reward, prompts, model_cfg, cfg, on_progress)
        write_json(out / "result.json", {"a": a.name, "b": b.name, **result})
        print(f"{a.name} vs {b.name}: win rate {result['win_rate']:.3f} +- {result['stderr']:.3f} "
              f"on {result['prompts']} prompts (mean score {result['mean_a']:.3f} vs {result['mean_b']:.3f})")

    return run_job(out, body)
