"""Inter-annotator agreement on rankings. Pure functions, no database.

Input everywhere: {item_id: {annotator_id: order}}, where order is a list of tie groups of
response ids, best first (see store/pairs.py). Only items with two or more annotators count.
Every figure but position bias and gold is a sum over items: `item_stats` gives one item's share
(ItemStats), `Totals` adds them up and turns the sums into the figures, so the store can keep the
shares per item (store/agreement_table.py) and add up only the ones a question covers.

- Pairwise agreement: over every (annotator pair, item, response pair) where *both* annotators
  gave a strict preference, the share where they preferred the same response. Pairs that either
  annotator tied are left out (a tie is neither agreement nor disagreement).
- Kendall's tau-b between two annotators' orders of one item (ties corrected), averaged over
  (annotator pair, item). Undefined (skipped) when either annotator tied everything.
- Per annotator (annotator_agreement): pairwise agreement with the others, and agreement with
  the majority of the others; against a gold ranking (gold_agreement): the share of the gold's
  strict preferences the ranking keeps, ties counting half.
- Krippendorff's alpha, ordinal metric (Krippendorff 2011, "Computing Krippendorff's
  Alpha-Reliability", section on the ordinal metric): units are (item, response), each
  annotator's value is the response's mid-rank in their order (store.pairs.mid_ranks).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from store.pairs import mid_ranks


def coincidence(units: Sequence[Sequence[float]]) -> dict[tuple[float, float], float]:
    """Krippendorff's coincidence matrix o[(c, k)]: each ordered pair of values within a unit,
    weighted 1 / (m_u - 1). Units with fewer than two values are not pairable and add nothing.
    It is a sum over units, so the matrices of parts of the data add up to the whole's."""
    o: dict[tuple[float, float], float] = defaultdict(float)
    for unit in units:
        m = len(unit)
        if m < 2:
            continue
        for i, j in itertools.permutations(range(m), 2):
            o[(unit[i], unit[j])] += 1.0 / (m - 1)
    return dict(o)


def krippendorff_alpha_ordinal(units: Sequence[Sequence[float]]) -> float | None:
    """Krippendorff's alpha with the ordinal difference function.

    `units`: for each unit, the values the coders gave it (missing values simply left out).
    Returns None when alpha is undefined (fewer than two pairable values, or a single distinct value).
    """
    return alpha_from_coincidence(coincidence(units))


def alpha_from_coincidence(o: Mapping[tuple[float, float], float]) -> float | None:
    """Ordinal alpha from a coincidence matrix (see `coincidence`); None when undefined."""
    if not o:
        return None
    values = sorted({c for c, _ in o})
    n_c = {c: sum(w for (a, _), w in o.items() if a == c) for c in values}
    n = sum(n_c.values())
    if len(values) < 2 or n <= 1:
        return None
    # ordinal distance: delta^2(c, k) = (sum of n_g for g from c to k - (n_c + n_k) / 2)^2
    pos = {v: i for i, v in enumerate(values)}
    cum = list(itertools.accumulate(n_c[v] for v in values))

    def delta2(c: float, k: float) -> float:
        lo, hi = sorted((pos[c], pos[k]))
        between = cum[hi] - (cum[lo - 1] if lo > 0 else 0.0)
        return (between - (n_c[c] + n_c[k]) / 2) ** 2

    # alpha = 1 - D_o / D_e = 1 - (n - 1) * sum o_ck d2 / sum n_c n_k d2
    observed = sum(w * delta2(c, k) for (c, k), w in o.items())
    expected = sum(n_c[c] * n_c[k] * delta2(c, k) for c in values for k in values)
    if expected == 0:
        return None
    return 1.0 - (n - 1) * observed / expected


def kendall_tau_b(ranks_a: Mapping[int, float], ranks_b: Mapping[int, float]) -> float | None:
    """Kendall's tau-b between two rankings of the same ids (smaller rank = better)."""
    ids = sorted(set(ranks_a) & set(ranks_b))
    concordant = discordant = tied_a = tied_b = 0
    for i, j in itertools.combinations(ids, 2):
        da = ranks_a[i] - ranks_a[j]
        db = ranks_b[i] - ranks_b[j]
        if da == 0:
            tied_a += 1
        if db == 0:
            tied_b += 1
        if da and db:
            if (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    n0 = len(ids) * (len(ids) - 1) // 2
    denom = math.sqrt((n0 - tied_a) * (n0 - tied_b))
    return None if denom == 0 else (concordant - discordant) / denom


def _strict(ranks: Mapping[int, float], i: int, j: int) -> int:
    """+1 if response i is ranked above j, -1 if below, 0 if tied."""
    d = ranks[j] - ranks[i]
    return (d > 0) - (d < 0)


@dataclass
class ItemStats:
    """One item's share of every agreement figure, from the latest ranking of each of its (two or
    more) annotators. Every figure of the store is a sum of these over items (store/agreement_table.py
    keeps one per item in the database)."""

    agree: int = 0
    """Comparisons (annotator pair, response pair, both strict) where both preferred the same response."""
    comparisons: int = 0
    tau_sum: float = 0.0
    """Sum of Kendall's tau-b over the annotator pairs where it is defined ..."""
    tau_n: int = 0
    """... and how many there are."""
    coincidence: dict = field(default_factory=dict)
    """The item's Krippendorff coincidences {(c, k): weight}; units are its responses."""
    per_annotator: dict = field(default_factory=dict)
    """{annotator: (pairwise agreeing, pairwise compared, majority agreeing, majority compared)}
    (see annotator_agreement)."""


def item_stats(by_annotator: Mapping[int, Sequence]) -> ItemStats:
    """ItemStats of one item's rankings {annotator: order} by two or more annotators."""
    ranks = {a: mid_ranks(order) for a, order in by_annotator.items()}
    s = ItemStats()
    for a, b in itertools.combinations(sorted(ranks), 2):
        ra, rb = ranks[a], ranks[b]
        for i, j in itertools.combinations(sorted(set(ra) & set(rb)), 2):
            sa, sb = _strict(ra, i, j), _strict(rb, i, j)
            if sa and sb:
                s.comparisons += 1
                s.agree += sa == sb
        tau = kendall_tau_b(ra, rb)
        if tau is not None:
            s.tau_sum += tau
            s.tau_n += 1
    values_by_response: dict[int, list[float]] = defaultdict(list)
    for r in ranks.values():
        for rid, value in r.items():
            values_by_response[rid].append(value)
    s.coincidence = coincidence(list(values_by_response.values()))
    shared = sorted(set.intersection(*(set(r) for r in ranks.values())))
    for a, ra in ranks.items():
        pw_agree = pw_n = mj_agree = mj_n = 0
        for i, j in itertools.combinations(shared, 2):
            mine = _strict(ra, i, j)
            if not mine:
                continue
            others = [_strict(rb, i, j) for b, rb in ranks.items() if b != a]
            pw_n += sum(1 for o in others if o)
            pw_agree += sum(1 for o in others if o == mine)
            vote = sum(others)
            if vote:
                mj_n += 1
                mj_agree += (vote > 0) == (mine > 0)
        s.per_annotator[a] = (pw_agree, pw_n, mj_agree, mj_n)
    return s


@dataclass
class Totals:
    """Sums of ItemStats over items: what agreement_summary reports, from any mix of items."""

    items: int = 0
    agree: int = 0
    comparisons: int = 0
    tau_sum: float = 0.0
    tau_n: int = 0
    coincidence: dict = field(default_factory=lambda: defaultdict(float))

    def add(self, s: ItemStats) -> None:
        self.items += 1
        self.agree += s.agree
        self.comparisons += s.comparisons
        self.tau_sum += s.tau_sum
        self.tau_n += s.tau_n
        for ck, w in s.coincidence.items():
            self.coincidence[ck] += w

    def summary(self) -> dict:
        """{items, comparisons, pairwise_agreement, krippendorff_alpha, kendall_tau}."""
        return {
            "items": self.items,
            "comparisons": self.comparisons,
            "pairwise_agreement": self.agree / self.comparisons if self.comparisons else None,
            "krippendorff_alpha": alpha_from_coincidence(self.coincidence),
            "kendall_tau": self.tau_sum / self.tau_n if self.tau_n else None,
        }


def agreement_summary(rankings: Mapping[int, Mapping[int, Sequence]]) -> dict:
    """{items, comparisons, pairwise_agreement, krippendorff_alpha, kendall_tau} for
    {item_id: {annotator_id: order}}."""
    totals = Totals()
    for by_annotator in rankings.values():
        if len(by_annotator) >= 2:
            totals.add(item_stats(by_annotator))
    return totals.summary()


def item_agreement(by_annotator: Mapping[int, Sequence]) -> dict:
    """{annotators, comparisons, pairwise_agreement, kendall_tau} of one item's rankings
    {annotator_id: order} (None where fewer than two annotators or no comparison)."""
    s = item_stats(by_annotator) if len(by_annotator) >= 2 else ItemStats()
    return {"annotators": len(by_annotator), "comparisons": s.comparisons,
            "pairwise_agreement": s.agree / s.comparisons if s.comparisons else None,
            "kendall_tau": s.tau_sum / s.tau_n if s.tau_n else None}


def annotator_agreement(rankings: Mapping[int, Mapping[int, Sequence]]) -> dict[int, dict]:
    """Per annotator, over the items they share with others: {items, pairwise: (agreeing, compared),
    majority: (agreeing, compared)}.

    pairwise: the annotator's strict preferences against each other annotator's on the same
    response pair (ties left out, as in agreement_summary), over the responses every annotator of
    the item ranked. majority: against the majority of the *other* annotators of the item
    (leave-one-out, so the annotator does not vote on their own yardstick); pairs the others split
    evenly, or the annotator tied, are left out. With two annotators on an item the majority is
    the other one.
    """
    out: dict[int, dict] = {}
    for by_annotator in rankings.values():
        if len(by_annotator) < 2:
            continue
        for a, (pa, pn, ma, mn) in item_stats(by_annotator).per_annotator.items():
            row = out.setdefault(a, {"items": 0, "pairwise": (0, 0), "majority": (0, 0)})
            row["items"] += 1
            row["pairwise"] = (row["pairwise"][0] + pa, row["pairwise"][1] + pn)
            row["majority"] = (row["majority"][0] + ma, row["majority"][1] + mn)
    return out


def gold_agreement(order: Sequence, gold: Sequence) -> tuple[float, int]:
    """(credit, pairs) of a ranking against a gold ranking of the same responses: over the response
    pairs the gold orders strictly, 1 where the ranking prefers the same response, 1/2 where it ties
    them, 0 where it prefers the other (a tie is half right, so tying everything cannot score
    better than guessing)."""
    mine, ref = mid_ranks(order), mid_ranks(gold)
    credit, pairs = 0.0, 0
    for i, j in itertools.combinations(sorted(set(mine) & set(ref)), 2):
        want = _strict(ref, i, j)
        if want:
            pairs += 1
            got = _strict(mine, i, j)
            credit += 1.0 if got == want else 0.5 if got == 0 else 0.0
    return credit, pairs


def position_bias(rankings: Sequence[tuple[Sequence, Sequence[int]]]) -> dict:
    """How often the first-shown response lands in the top tie group.

    `rankings`: (order, display_order) per ranking. Returns {rankings, first_shown_best_rate,
    expected_rate, best_rate_by_position}; expected_rate is what the first position would score
    if annotators ignored position (|top group| / K, averaged).
    """
    n = 0
    first_best = 0
    expected = 0.0
    by_pos: Counter = Counter()
    seen_pos: Counter = Counter()
    for order, display in rankings:
        if not order or not display:
            continue
        top = set(order[0])
        k = sum(len(g) for g in order)
        n += 1
        first_best += display[0] in top
        expected += len(top) / k
        for p, rid in enumerate(display):
            seen_pos[p] += 1
            by_pos[p] += rid in top
    return {
        "rankings": n,
        "first_shown_best_rate": first_best / n if n else None,
        "expected_rate": expected / n if n else None,
        "best_rate_by_position": [by_pos[p] / seen_pos[p] for p in sorted(seen_pos)],
    }
