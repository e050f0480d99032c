"""Oracles (fixed scorers standing in for people) and the simulated ranking they feed."""

import random
from collections import Counter

import pytest

from pipeline.oracle import ContainsOracle, LengthOracle, make_oracle, simulated_ranking


def test_rule_oracles_score_by_hand():
    assert ContainsOracle("please").score(["p", "p"], ["Please, please help", "no"]) == [2.0, 0.0]
    assert LengthOracle().score(["p"], ["  " + "x" * 150 + " "]) == [1.5]


def test_make_oracle_rejects_unknown_spec():
    with pytest.raises(ValueError, match="unknown oracle 'vibes'"):
        make_oracle("vibes")


def test_noise_free_ranking_orders_by_score_and_groups_ties():
    assert simulated_ranking([0.1, 0.9, 0.5]) == [[1], [2], [0]]
    assert simulated_ranking([1.0, 0.0, 1.0], tie_eps=1e-9) == [[0, 2], [1]]


def test_noisy_ranking_is_bradley_terry_for_two_items():
    # P(worse wins) = sigmoid(-(1.0 - 0.0) / 0.5) = 1 / (1 + e^2) = 0.1192
    rng = random.Random(0)
    wins = Counter(simulated_ranking([1.0, 0.0], noise=0.5, rng=rng)[0][0] for _ in range(20000))
    assert abs(wins[1] / 20000 - 0.1192) < 0.01


@pytest.mark.slow
def test_embedding_oracle_prefers_a_helpful_answer():
    oracle = make_oracle("embedding")
    prompt = "How do I bake bread at home?"
    helpful = "Mix flour, water, yeast and salt, knead for ten minutes, let it rise, then bake at 220C."
    rude = "I don't know, go away."
    good, bad = oracle.score([prompt, prompt], [helpful, rude])
    assert good > bad + 0.1
