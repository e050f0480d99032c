"""Annotator quality, and the weight of an annotator's pairs in an export (store/export.py).

An annotator's quality q (from Store.annotator_agreement's rows) is their accuracy on gold items when it
rests on at least MIN_COMPARISONS response pairs, else their agreement with the majority of the
others on shared items when that does; annotators with neither are not measured yet. Below
MIN_COMPARISONS a share says little (one gold item of two responses, right or wrong, is 1.0 or
0.0), so an annotator with only a few comparisons is "not enough data": reported with their
count, neither left out by an export's min_quality nor weighted.

An export's quality_weights gives each pair `weight` = quality_weight(q) = 2q - 1 clipped to
[MIN_WEIGHT, 1]: an annotator right with probability q gives labels whose mean (+1 right, -1
wrong) is 2q - 1 times the truth, so their pairs carry that share of the signal beside the same
noise, and someone ranking at random (q = 1/2) weighs MIN_WEIGHT. Unmeasured annotators and
imported pairs weigh 1.
"""

from __future__ import annotations

from store.errors import InvalidRequest

MIN_COMPARISONS = 10
"""Response pairs a quality must rest on before min_quality or quality_weights act on it: at 10,
an annotator right 80% of the time shows a share within about 0.13 (one standard error)."""
MIN_WEIGHT = 0.05
"""The weight of an annotator measured at or below chance (a weight must stay positive)."""


def quality_weight(quality: float | None) -> float:
    """An annotator's pair weight from their quality q (see the module docstring): 2q - 1 clipped
    to [MIN_WEIGHT, 1]; 1 when not measured."""
    if quality is None:
        return 1.0
    return min(1.0, max(MIN_WEIGHT, 2.0 * float(quality) - 1.0))


def annotator_quality_table(store, min_quality: float | None = None, agreement=None) -> list[dict]:
    """Every annotator with rankings: {annotator_id, annotator, quality, measured_by ('gold',
    'majority' or None), n_gold, comparisons, weight, excluded (measured below min_quality)}.
    `agreement`: the store's annotator_agreement() rows when the caller has them already.

    Gold measures first, the majority second, each only from MIN_COMPARISONS response pairs up;
    with fewer, quality and measured_by are None (kept, weight 1) and `comparisons` says how few
    there were (the gold's when they ranked any gold item, else the majority's)."""
    if min_quality is not None and not 0.0 <= float(min_quality) <= 1.0:
        raise InvalidRequest(f"min_quality must be between 0 and 1, not {min_quality}")
    rows = []
    for a in sorted(store.annotator_agreement() if agreement is None else agreement, key=lambda a: a.annotator_id):
        if a.gold_comparisons >= MIN_COMPARISONS:
            measured_by, quality, comparisons = "gold", a.gold_accuracy, a.gold_comparisons
        elif a.majority_comparisons >= MIN_COMPARISONS:
            measured_by, quality, comparisons = "majority", a.majority_agreement, a.majority_comparisons
        else:
            measured_by, quality = None, None
            comparisons = a.gold_comparisons if a.gold_items else a.majority_comparisons
        rows.append({"annotator_id": a.annotator_id, "annotator": a.name,
                     "quality": quality, "measured_by": measured_by, "n_gold": a.gold_items,
                     "comparisons": comparisons, "weight": quality_weight(quality),
                     "excluded": min_quality is not None and quality is not None and quality < float(min_quality)})
    return rows
