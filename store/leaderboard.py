"""What people's rankings say about model versions: pairwise win rates and a Bradley-Terry leaderboard.

The input is a list of `Comparison`s: one per pair of responses from two different versions in one
ranking (store/evaluations.py reads them from the rankings of evaluation items), with the outcome
for the first version: 1 it was ranked above, 0 below, 0.5 a tie. A prompt ranked by several
annotators gives several comparisons; they are not independent, so every interval here is a
bootstrap over **prompts** (the unit that was sampled), as Chatbot Arena bootstraps its battles:

- win rate of A over B: the mean outcome of A's comparisons with B (ties half), with the 2.5 and
  97.5 percentiles of that mean over BOOTSTRAP resamples of the prompts;
- the leaderboard: Bradley-Terry strengths, P(A above B) = sigmoid(theta_A - theta_B), fitted by
  Hunter's MM algorithm (2004) with one virtual tie per compared pair (a weak prior that keeps a
  version that won every comparison finite), centred at mean 0 and shown on the Elo-like scale
  Chatbot Arena uses, rating = 1000 + 400 * theta / ln 10 (400 points = 10:1 odds); intervals are
  the percentiles of each version's rating over bootstrap resamples of the prompts.

Every resample is drawn from random.Random(seed): the same rankings give the same intervals.
Pure Python: no model, no database.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import dataclass

BOOTSTRAP = 1000
"""Resamples of the prompts behind every interval."""
SCALE = 400.0 / math.log(10.0)
"""Rating points per unit of Bradley-Terry strength (Elo's: 400 points = odds of 10 to 1)."""
BASE_RATING = 1000.0


@dataclass(frozen=True)
class Comparison:
    prompt_id: int
    a: str  # version names; the outcome is a's
    b: str
    outcome: float  # 1 a ranked above b, 0.5 tie, 0 below


def win_rates(comparisons: list[Comparison], *, seed: int = 0, resamples: int = BOOTSTRAP) -> list[dict]:
    """Per pair of versions compared (names in sorted order, A first): {a, b, comparisons, prompts,
    win_rate (of A), low, high (the 95% bootstrap interval over prompts)}."""
    by_pair: dict[tuple[str, str], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in comparisons:
        a, b, x = (c.a, c.b, c.outcome) if c.a < c.b else (c.b, c.a, 1.0 - c.outcome)
        by_pair[(a, b)][c.prompt_id].append(x)
    rng = random.Random(seed)
    out = []
    for (a, b), per_prompt in sorted(by_pair.items()):
        groups = list(per_prompt.values())
        rate = _mean_of(groups)
        draws = sorted(_mean_of([groups[rng.randrange(len(groups))] for _ in groups]) for _ in range(resamples))
        out.append({"a": a, "b": b, "comparisons": sum(len(g) for g in groups), "prompts": len(groups),
                    "win_rate": rate, "low": _percentile(draws, 0.025), "high": _percentile(draws, 0.975)})
    return out


def leaderboard(comparisons: list[Comparison], *, seed: int = 0, resamples: int = BOOTSTRAP) -> list[dict]:
    """Every version compared, best first: {version, rating, low, high (95% bootstrap interval over
    prompts), comparisons, prompts, wins (ties half)}."""
    if not comparisons:
        return []
    by_prompt: dict[int, list[Comparison]] = defaultdict(list)
    for c in comparisons:
        by_prompt[c.prompt_id].append(c)
    groups = list(by_prompt.values())
    versions = sorted({v for c in comparisons for v in (c.a, c.b)})
    ratings = _ratings(comparisons, versions)
    rng = random.Random(seed)
    draws: dict[str, list[float]] = {v: [] for v in versions}
    for _ in range(resamples):
        sample = [c for _ in groups for c in groups[rng.randrange(len(groups))]]
        for v, r in _ratings(sample, versions).items():
            draws[v].append(r)
    rows = []
    for v in versions:
        mine = [c for c in comparisons if v in (c.a, c.b)]
        d = sorted(draws[v])
        rows.append({"version": v, "rating": ratings[v], "low": _percentile(d, 0.025), "high": _percentile(d, 0.975),
                     "comparisons": len(mine), "prompts": len({c.prompt_id for c in mine}),
                     "wins": sum(c.outcome if c.a == v else 1.0 - c.outcome for c in mine)})
    return sorted(rows, key=lambda r: -r["rating"])


def bradley_terry(comparisons: list[Comparison], versions: list[str], *, iterations: int = 500,
                  tol: float = 1e-10) -> dict[str, float]:
    """Bradley-Terry strengths theta (geometric mean of exp(theta) 1) by Hunter's MM updates, with
    one virtual tie per compared pair. A version absent from `comparisons` (a bootstrap resample
    can miss one) gets 0. Versions never linked through comparisons, directly or via others, get
    numbers that cannot be compared with each other."""
    wins: dict[str, float] = defaultdict(float)
    games: dict[tuple[str, str], float] = defaultdict(float)
    for c in comparisons:
        wins[c.a] += c.outcome
        wins[c.b] += 1.0 - c.outcome
        games[_key(c.a, c.b)] += 1.0
    for pair in list(games):  # the prior: a virtual tie
        games[pair] += 1.0
        wins[pair[0]] += 0.5
        wins[pair[1]] += 0.5
    present = sorted({v for pair in games for v in pair})
    if not present:
        return {v: 0.0 for v in versions}
    opponents: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for (a, b), n in games.items():
        opponents[a].append((b, n))
        opponents[b].append((a, n))
    pi = {v: 1.0 for v in present}
    for _ in range(iterations):
        new = {v: wins[v] / sum(n / (pi[v] + pi[o]) for o, n in opponents[v]) for v in present}
        log_mean = sum(math.log(x) for x in new.values()) / len(new)
        new = {v: x / math.exp(log_mean) for v, x in new.items()}
        done = max(abs(math.log(new[v] / pi[v])) for v in present) < tol
        pi = new
        if done:
            break
    theta = {v: math.log(pi[v]) for v in present}
    return {v: theta.get(v, 0.0) for v in versions}


def _ratings(comparisons: list[Comparison], versions: list[str]) -> dict[str, float]:
    return {v: BASE_RATING + SCALE * t for v, t in bradley_terry(comparisons, versions).items()}


def _key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


def _mean_of(groups: list[list[float]]) -> float:
    n = sum(len(g) for g in groups)
    return sum(sum(g) for g in groups) / n if n else float("nan")


def _percentile(sorted_values: list[float], q: float) -> float:
    """The q-quantile of sorted values, linearly interpolated between order statistics."""
    if not sorted_values:
        return float("nan")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
