"""The reward gate: whether a round may run PPO against the reward model it just trained.

PPO optimises whatever the reward model scores. A reward model that ranks held-out pairs no
better than a coin gives PPO noise to climb, and the policy drifts for nothing (the gold
experiment measured it: docs/results/gold_methods/, PPO against a proxy at 0.44 held-out accuracy
lost gold score). The rule, on the figures the train-reward job measured and ingest.py stored on
the version (meta["eval"]: "eval/accuracy", "eval/pairs", "eval/length_baseline_accuracy",
"train/pairs", "train/prompts", "eval/prompts"):

    trusted  <=>  the 95% Wilson interval of its held-out pairwise accuracy lies above 0.5

A reward model with no held-out pairs has not been measured, so it is not trusted. The verdict
says, with the figures, how far the model is from the reference learning curve (USEFUL, FEW) and
about how many more prompts to rank.

Pure: reads a version's stored figures; no store, no torch. `wilson` is the one implementation of
the interval; the benchmarks use it too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

CHANCE = 0.5
"""Held-out accuracy of a reward model that learned nothing (each pair is a coin toss)."""


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion correct/n (Wilson 1927): honest at small n,
    where the normal approximation runs outside [0, 1]. (nan, nan) for n = 0."""
    if n == 0:
        return float("nan"), float("nan")
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return centre - half, centre + half


# ---------------------------------------------------------------------- the reference learning curve


@dataclass(frozen=True)
class Measured:
    """A reward model of the gold experiment (docs/results/gold_seeds*/): the default model
    (SmolLM2-135M-Instruct), simulated annotators (Bradley-Terry noise 0.05 on the embedding
    judge), responses of at most 24 tokens, the pairs of a quarter of the prompts held out."""

    prompts: int
    """Prompts ranked at K = 4 (training and held-out)."""
    train_pairs: int
    """Pairs the reward model trained on."""
    accuracy: tuple[float, float]
    """Held-out pairwise accuracy, lowest and highest over the runs."""


FEW = Measured(prompts=160, train_pairs=690, accuracy=(0.57, 0.64))
"""Round 1 of 160 prompts, six runs (docs/results/gold_seeds*/ at 160 prompts): 684-720 training
pairs, held-out accuracy 0.574-0.638 on 240-276 pairs, each interval just above chance."""

USEFUL = Measured(prompts=640, train_pairs=2838, accuracy=(0.754, 0.754))
"""Round 1 of 640 prompts (docs/results/gold_seeds_big_proxy/): 2,838 training pairs, held-out
accuracy 0.754 [0.727, 0.780] on 1,002 pairs; PPO against it raised the gold score at half of
best-of-n's KL efficiency. The amount of data the gate's advice aims at."""


def _about(n: float) -> str:
    """n rounded to two significant figures, with thousands separators: 2838 -> '2,800'."""
    if n < 100:
        return f"{round(n):,}"
    digits = 10 ** (int(math.log10(n)) - 1)
    return f"{round(n / digits) * digits:,}"


def reference() -> str:
    """The learning curve the advice is measured against, in one sentence."""
    return (f"on the default model with simulated annotators, a reward model needed about "
            f"{_about(USEFUL.train_pairs)} training pairs (about {USEFUL.prompts} prompts ranked at K = 4) for "
            f"{USEFUL.accuracy[0]:.2f} held-out accuracy; about {_about(FEW.train_pairs)} ({FEW.prompts} prompts) "
            f"gave {FEW.accuracy[0]:.2f}-{FEW.accuracy[1]:.2f}")


# ---------------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class Verdict:
    """The gate's decision on one reward model version, with the figures it rests on.

    trusted is exactly `pairs > 0 and lo > CHANCE`; accuracy, lo and hi are None when the model
    has no held-out pairs. more_prompts: about how many more prompts to rank to reach USEFUL's
    training pairs (None when it has that many already, or when it is trusted)."""

    reward_version_id: int | None
    reward_name: str
    accuracy: float | None
    pairs: int
    """Held-out pairs the accuracy was measured on."""
    lo: float | None
    hi: float | None
    """The 95% Wilson interval of the accuracy."""
    length_baseline: float | None
    """Accuracy of 'the longer response wins' on the same pairs."""
    train_pairs: int | None
    more_prompts: int | None
    trusted: bool
    message: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def judge(version) -> Verdict:
    """The verdict on a reward model version (anything with .id, .name and .meta, meta["eval"]
    as pipeline/orchestrate/ingest.py stores it). ValueError on figures that cannot be a
    measurement (an accuracy outside [0, 1], a negative or fractional pair count)."""
    figures = (version.meta or {}).get("eval") or {}
    name = version.name
    pairs = _count(figures.get("eval/pairs"), "eval/pairs", name)
    accuracy = figures.get("eval/accuracy")
    train_pairs = _count(figures.get("train/pairs"), "train/pairs", name) if "train/pairs" in figures else None
    baseline = figures.get("eval/length_baseline_accuracy")
    if not pairs or accuracy is None:
        more = _more_prompts(figures, train_pairs)
        message = (f"Reward model {name}: there were no held-out pairs to measure it on, so the round does not "
                   f"run PPO against it (pairs are held out by whole prompts, the reward model's eval fraction of them; "
                   f"with few prompts ranked, that share can be empty). {_advice(train_pairs, more)}")
        return Verdict(version.id, name, None, pairs, None, None, None, train_pairs, more, False, message)
    accuracy = _fraction(accuracy, "eval/accuracy", name)
    lo, hi = wilson(round(accuracy * pairs), pairs)
    trusted = lo > CHANCE
    baseline = _fraction(baseline, "eval/length_baseline_accuracy", name) if baseline is not None else None
    figures_text = (f"Reward model {name}: held-out accuracy {accuracy:.2f} [{lo:.2f}, {hi:.2f}] on {pairs:,} pairs"
                    + (f" (longer-wins baseline {baseline:.2f})" if baseline is not None else ""))
    if trusted:
        return Verdict(version.id, name, accuracy, pairs, lo, hi, baseline, train_pairs, None, True,
                       f"{figures_text}: its interval lies above chance ({CHANCE:g}).")
    where = ("its interval lies below chance" if hi < CHANCE else "its interval does not exclude chance")
    more = _more_prompts(figures, train_pairs)
    message = (f"{figures_text}: {where} ({CHANCE:g}), so the round does not run PPO against it. "
               f"{_advice(train_pairs, more)}")
    return Verdict(version.id, name, accuracy, pairs, lo, hi, baseline, train_pairs, more, False, message)


def _count(value, key: str, name: str) -> int:
    """A stored pair count (None = not recorded = 0), checked."""
    if value is None:
        return 0
    try:
        whole = not isinstance(value, bool) and float(value) == int(value) >= 0
    except (TypeError, ValueError, OverflowError):
        whole = False
    if not whole:
        raise ValueError(f"reward model {name}: {key} must be a whole number >= 0, not {value!r}")
    return int(value)


def _fraction(value, key: str, name: str) -> float:
    """A stored accuracy, checked: a number in [0, 1]."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = float("nan")
    if isinstance(value, bool) or not 0.0 <= x <= 1.0:
        raise ValueError(f"reward model {name}: {key} must be a number in [0, 1], not {value!r}")
    return x


def _more_prompts(figures: dict, train_pairs: int | None) -> int | None:
    """Prompts still to rank for USEFUL.train_pairs training pairs, at this store's own yield of
    training pairs per ranked prompt (its K, ties and held-out share), else at USEFUL's. None
    when the model had that many pairs already."""
    if train_pairs is not None and train_pairs >= USEFUL.train_pairs:
        return None
    prompts = (figures.get("train/prompts") or 0) + (figures.get("eval/prompts") or 0)
    per_prompt = train_pairs / prompts if train_pairs and prompts else USEFUL.train_pairs / USEFUL.prompts
    return math.ceil((USEFUL.train_pairs - (train_pairs or 0)) / per_prompt)


def _advice(train_pairs: int | None, more: int | None) -> str:
    anyway = ("To run PPO against it anyway: \"Run PPO anyway\" in the Train tab, or `--reward-gate false` "
              "on the command line.")
    if train_pairs is None:
        return f"For reference, {reference()}: rank about {more:,} prompts in all, then run the round again. {anyway}"
    if more is None:
        return (f"For reference, {reference()}; this one had {train_pairs:,} training pairs, as many: more "
                f"rankings alone may not help (check the annotators' agreement in the Data tab, and the reward "
                f"model's settings). {anyway}")
    return (f"For reference, {reference()}; this one had {train_pairs:,} training pairs: rank about {more:,} more "
            f"prompts, then run the round again. {anyway}")
