"""Evaluate one policy version on held-out prompts: gold score, proxy score, KL, length, EOS, diversity.

Used by bench/gold/closed_loop.py, in its own process (a bench may load models directly; the app never
does). For a policy version (base model + LoRA adapter, or the base model alone):

  1. load it; the reference is the same model with the adapter disabled (pipeline/policy.py), so
     the KL is measured against the starting policy exactly as PPO measures it
  2. sample `samples` responses per held-out prompt (temperature as in the PPO rollouts)
  3. reference log-probs of the sampled tokens (one no-grad forward)
  4. score: the gold judge on the decoded text, and each given reward model (normalised, as PPO
     sees it) on each prompt and decoded response, encoded as in reward training (score_texts)
  5. metrics (flat dict, namespaced keys):
       eval/gold         mean gold-judge score
       eval/proxy:NAME   mean normalised score under reward model NAME
       eval/kl           mean over responses of sum_t [log pi(y_t) - log pi_ref(y_t)]: the k1
                         estimate of KL(pi || pi_ref) in nats per sequence, both at the sampling
                         temperature (what PPO's objective/kl reports)
       eval/length       mean response tokens (EOS included); eval/eos_rate: share ending in EOS
       eval/distinct_1, eval/distinct_2   distinct-n (Li et al. 2016, "A Diversity-Promoting
                         Objective Function for Neural Conversation Models"): unique word n-grams
                         / all word n-grams over every response of the evaluation
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pipeline.config import ModelConfig
from pipeline.policy import load_policy, make_reference, merged_lora, sampled_kl
from pipeline.sampling import sample
from pipeline.scoring import make_reward
from pipeline.text import decode_responses, encode_prompts


@dataclass
class EvalConfig:
    samples: int = 2
    """Responses sampled per held-out prompt."""
    max_new_tokens: int = 40
    """Response length limit (as in the annotation round and the PPO rollouts)."""
    temperature: float = 0.7
    """Sampling temperature (as in the PPO rollouts); log-probs are of logits / temperature."""
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 16
    """Prompts per sampling batch (each with `samples` responses)."""
    seed: int = 1234
    """The same seed for every policy: differences between versions are the policy's, not the RNG's."""
    max_prompt_tokens: int = 512


def distinct_n(texts: list[str], n: int) -> float:
    """Unique word n-grams / all word n-grams over all texts (0.0 when there are none)."""
    grams = []
    for text in texts:
        words = text.lower().split()
        grams.extend(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    return len(set(grams)) / len(grams) if grams else 0.0


@torch.no_grad()
def evaluate_policy(adapter: str | None, model_cfg: ModelConfig, prompts: list[str], judge,
                    rewards: dict[str, str], cfg: EvalConfig) -> tuple[dict, list[dict]]:
    """(metrics, rows) for the policy saved at `adapter` (None = the base model of model_cfg).

    rewards: {name: reward model folder}; rows: one dict per response (prompt, response, gold,
    proxy:NAME, kl, tokens, finish_reason) for the report's sample table.
    """
    # 1. the policy and its reference (a fresh zero LoRA delta for the base: policy == reference)
    policy, tokenizer = load_policy(dataclasses.replace(model_cfg, lora=True), adapter_path=adapter)
    policy.eval()
    reference = make_reference(policy)
    device = next(policy.parameters()).device
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    scorers = {name: make_reward(path, tokenizer, model_cfg)[0] for name, path in rewards.items()}

    rows: list[dict] = []
    for start in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[start:start + cfg.batch_size]
        input_ids, prompt_mask = encode_prompts(tokenizer, chunk, cfg.max_prompt_tokens, device)  # (b, P)
        # 2. sample (the LoRA deltas merged into a copy of the weights, as PPO samples: one matmul
        # per layer and token); sb.logprobs are the policy's log-probs of its tokens at cfg.temperature
        with merged_lora(policy):
            sb = sample(policy, input_ids, prompt_mask, cfg, tokenizer, num_samples=cfg.samples, draws=generator)
        mask = sb.response_mask.float()  # (B, R)
        lengths = mask.sum(1).long()  # (B,)
        # 3. reference log-probs of the same tokens: the k1 KL, nats per sequence (the base model is
        # its own reference: 0, without the forward pass)
        kl = sampled_kl(policy, reference, sb, cfg.temperature, logprobs=sb.logprobs) if adapter \
            else torch.zeros(len(lengths))  # (B,)
        # 4. gold judge on text, reward models on tokens
        texts = decode_responses(tokenizer, sb.response_ids, sb.response_mask)
        batch_prompts = [chunk[i] for i in sb.prompt_index.tolist()]
        gold = judge.score(batch_prompts, texts)
        proxies = {name: fn(sb.sequences, sb.attention_mask, sb.response_ids, mask, prompts=batch_prompts).tolist()
                   for name, fn in scorers.items()}
        for i, text in enumerate(texts):
            rows.append({"prompt": batch_prompts[i], "response": text, "gold": float(gold[i]),
                         **{f"proxy:{name}": float(v[i]) for name, v in proxies.items()},
                         "kl": float(kl[i]), "tokens": int(lengths[i]), "finish_reason": sb.finish_reason[i]})

    # 5. metrics over all responses
    def mean(key):
        return sum(row[key] for row in rows) / len(rows)

    texts = [row["response"] for row in rows]
    metrics = {"eval/gold": mean("gold"), "eval/kl": mean("kl"), "eval/length": mean("tokens"),
               "eval/eos_rate": sum(row["finish_reason"] == "eos" for row in rows) / len(rows),
               "eval/distinct_1": distinct_n(texts, 1), "eval/distinct_2": distinct_n(texts, 2),
               "eval/responses": len(rows)}
    metrics.update({f"eval/proxy:{name}": mean(f"proxy:{name}") for name in rewards})
    return metrics, rows
