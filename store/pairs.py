"""Ranking -> pairwise preference triples. Pure functions, no database.

A ranking is a list of tie groups of response ids, best first: [[3], [1, 2], [4]] says 3 is best,
1 and 2 tie, 4 is worst. Every pair (i, j) with i in a strictly better group than j becomes
(chosen=i, rejected=j) with margin = group index of j - group index of i, so adjacent groups give
margin 1 and the best-vs-worst pair of a full K=4 order gives 3 (the "rank distance" that a margin
loss can use, as in Llama 2's margin term). Tied responses give no pair. A full order of K
responses gives C(K, 2) pairs, as in InstructGPT (Ouyang et al. 2022, section 3.5).

"All bad" does not change which pairs are produced: the relative order still carries information,
but every pair of such a ranking is stored with all_bad=True and export leaves them out unless
asked (`include_all_bad=True`), because an annotator who finds every answer bad may have ordered
them carelessly.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

MAX_K = 64


def normalize_order(order: Sequence) -> list[list[int]]:
    """Accept [[3], [1, 2], [4]] or a flat [3, 1, 2, 4] (no ties); return tie groups of ints.

    Raises ValueError naming the problem: empty group, repeated id, fewer than 2 responses.
    """
    if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
        raise ValueError(f"order must be a list of tie groups of response ids, not {order!r}")
    groups: list[list[int]] = []
    for group in order:
        if isinstance(group, Sequence) and not isinstance(group, (str, bytes)):
            ids = list(group)
        else:
            ids = [group]
        if not ids:
            raise ValueError("order has an empty tie group")
        for rid in ids:
            if isinstance(rid, bool) or not isinstance(rid, numbers.Integral):
                raise ValueError(f"response ids must be integers, got {rid!r}")
        groups.append([int(r) for r in ids])
    flat = [r for g in groups for r in g]
    if len(flat) < 2:
        raise ValueError(f"a ranking needs at least 2 responses, got {len(flat)}")
    if len(flat) > MAX_K:
        raise ValueError(f"a ranking holds at most {MAX_K} responses, got {len(flat)}")
    if len(set(flat)) != len(flat):
        dup = sorted({r for r in flat if flat.count(r) > 1})
        raise ValueError(f"response ids appear more than once in the order: {dup}")
    return groups


def ranking_to_pairs(order: Sequence) -> list[tuple[int, int, int]]:
    """[(chosen_id, rejected_id, margin), ...] for every strictly ordered pair; ties give none.

    >>> ranking_to_pairs([[3], [1, 2], [4]])
    [(3, 1, 1), (3, 2, 1), (3, 4, 2), (1, 4, 1), (2, 4, 1)]
    """
    groups = normalize_order(order)
    pairs = []
    for gi, better in enumerate(groups):
        for gj in range(gi + 1, len(groups)):
            for chosen in better:
                for rejected in groups[gj]:
                    pairs.append((chosen, rejected, gj - gi))
    return pairs


def mid_ranks(order: Sequence) -> dict[int, float]:
    """Response id -> fractional rank (1 = best); tied responses share the mean of their places.

    >>> mid_ranks([[3], [1, 2], [4]])
    {3: 1.0, 1: 2.5, 2: 2.5, 4: 4.0}
    """
    ranks: dict[int, float] = {}
    place = 1
    for group in normalize_order(order):
        mid = place + (len(group) - 1) / 2
        for rid in group:
            ranks[rid] = mid
        place += len(group)
    return ranks


def group_index(order: Sequence) -> dict[int, int]:
    """Response id -> index of its tie group (0 = best)."""
    return {rid: gi for gi, group in enumerate(normalize_order(order)) for rid in group}
