"""Ranking -> pairs: ties, margins, K = 2..6, bad orders (pure functions)."""

import itertools
from math import comb

import pytest

from store.pairs import group_index, mid_ranks, normalize_order, ranking_to_pairs


def test_ties_give_no_pair_and_margins_are_group_distance():
    assert ranking_to_pairs([[3], [1, 2], [4]]) == [(3, 1, 1), (3, 2, 1), (3, 4, 2), (1, 4, 1), (2, 4, 1)]


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
def test_full_order_gives_k_choose_2_pairs(k):
    pairs = ranking_to_pairs(list(range(10, 10 + k)))  # flat list: no ties
    assert len(pairs) == comb(k, 2)
    # every pair points from the better to the worse response with margin = rank distance
    assert all(c < r and m == r - c for c, r, m in pairs)
    assert {(c, r) for c, r, _ in pairs} == set(itertools.combinations(range(10, 10 + k), 2))


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
def test_all_tied_gives_no_pairs(k):
    assert ranking_to_pairs([list(range(k))]) == []


def test_pairs_with_two_tie_groups():
    # K=5 in two groups of 2 and 3: 2*3 pairs, all margin 1
    assert sorted(ranking_to_pairs([[5, 1], [2, 3, 4]])) == sorted(
        (c, r, 1) for c in (5, 1) for r in (2, 3, 4))


@pytest.mark.parametrize("bad, message", [
    ([[1]], "at least 2"),
    ([[1], []], "empty tie group"),
    ([[1], [1]], "more than once"),
    ([[1], ["a"]], "integers"),
    ("12", "list of tie groups"),
    ([[True], [2]], "integers"),
])
def test_bad_orders_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        normalize_order(bad)


def test_mid_ranks_and_group_index():
    assert mid_ranks([[3], [1, 2], [4]]) == {3: 1.0, 1: 2.5, 2: 2.5, 4: 4.0}
    assert mid_ranks([[7, 8, 9]]) == {7: 2.0, 8: 2.0, 9: 2.0}
    assert group_index([[3], [1, 2], [4]]) == {3: 0, 1: 1, 2: 1, 4: 2}
