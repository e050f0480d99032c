"""Statistics for the admin tab and `python -m store stats`: counts, per-annotator work,
inter-annotator agreement and position bias, and a team's quality: agreement per item and per
annotator (with the others, their majority, the gold items). The formulas are in
store/agreement.py (pure); each method is a query or two, cheap enough to refresh live."""

from __future__ import annotations

from collections.abc import Callable

from store.agreement import agreement_summary, annotator_agreement, gold_agreement, item_agreement, position_bias
from store.queue_index import local_midnight
from store.records import Agreement, AnnotatorAgreement, AnnotatorStats, ItemAgreement, PositionBias


class StatsMixin:
    """Statistics methods of Store. Besides the core (store/db.py) they use, declared here, the
    queue's count of open items (store/queue.py)."""

    items_remaining: Callable[..., int]

    def counts(self, *, overlap: int | None = None) -> dict:
        """{prompts, prompts_in_pool, responses, items, rankings, pairs, items_remaining,
        flagged_prompts, annotators, model_versions, runs, snapshots}."""
        names = ("prompts", "prompts_in_pool", "responses", "items", "rankings", "pairs",
                 "flagged_prompts", "annotators", "model_versions", "runs", "snapshots")
        row = self._one(
            "SELECT (SELECT count(*) FROM prompts), "
            "(SELECT count(*) FROM prompts p WHERE NOT EXISTS (SELECT 1 FROM responses r WHERE r.prompt_id = p.id)), "
            "(SELECT count(*) FROM responses), (SELECT count(*) FROM items WHERE queued), "
            "(SELECT count(*) FROM rankings), (SELECT count(*) FROM pairs), "
            "(SELECT count(DISTINCT prompt_id) FROM flags), (SELECT count(*) FROM annotators), "
            "(SELECT count(*) FROM model_versions), (SELECT count(*) FROM runs), (SELECT count(*) FROM snapshots)")
        out = dict(zip(names, row))
        out["items_remaining"] = self.items_remaining(overlap=overlap)
        return out

    def round_rankable(self, round_id: int, overlap: int) -> dict:
        """A round's own rankable items, what the loop's threshold counts (pipeline/orchestrate/loop.py
        `coverage`): the round's queued items, less gold items (ranked by everyone, outside the
        overlap) and items of flagged prompts (out of the queue). {items, rankings (each item's
        distinct annotators, at most `overlap` counted), ranked_items (with at least one),
        reachable (the rankings they can get at most from the active accounts that have neither
        ranked nor skipped them: what the round can still reach without new annotators)}."""
        row = self._one(
            "WITH it AS (SELECT id FROM items WHERE round_id = $r AND queued "
            "            AND id NOT IN (SELECT item_id FROM gold) "
            "            AND prompt_id NOT IN (SELECT prompt_id FROM flags)), "
            "rk AS (SELECT item_id, count(DISTINCT annotator_id) AS n FROM rankings "
            "       WHERE item_id IN (SELECT id FROM it) GROUP BY item_id), "
            "seen AS (SELECT d.item_id, count(*) AS n FROM (SELECT item_id, annotator_id FROM rankings "
            "                                               UNION SELECT item_id, annotator_id FROM skips) d "
            "         JOIN annotators a ON a.id = d.annotator_id AND a.active "
            "         WHERE d.item_id IN (SELECT id FROM it) GROUP BY d.item_id), "
            "active AS (SELECT count(*) AS n FROM annotators WHERE active) "
            "SELECT count(*), coalesce(sum(least(coalesce(rk.n, 0), $o)), 0), count(rk.n), "
            "coalesce(sum(least(coalesce(rk.n, 0) + active.n - coalesce(seen.n, 0), $o)), 0) "
            "FROM it CROSS JOIN active LEFT JOIN rk ON rk.item_id = it.id LEFT JOIN seen ON seen.item_id = it.id",
            {"r": round_id, "o": int(overlap)})
        return dict(zip(("items", "rankings", "ranked_items", "reachable"), (int(x) for x in row)))

    def annotator_stats(self) -> list[AnnotatorStats]:
        """Per annotator: rankings (all, today), pairs, skips, all-bad rankings, median seconds."""
        rows = self._rows(
            "WITH r AS (SELECT annotator_id, count(*) AS n, count(*) FILTER (WHERE created_at >= ?) AS today, "
            "           count(*) FILTER (WHERE all_bad) AS bad, median(duration_s) AS med "
            "           FROM rankings GROUP BY annotator_id), "
            "p AS (SELECT annotator_id, count(*) AS n FROM pairs WHERE annotator_id IS NOT NULL "
            "      GROUP BY annotator_id), "
            "s AS (SELECT annotator_id, count(*) AS n FROM skips GROUP BY annotator_id) "
            "SELECT a.id, a.name, a.role, coalesce(r.n, 0), coalesce(r.today, 0), coalesce(p.n, 0), "
            "coalesce(s.n, 0), coalesce(r.bad, 0), r.med FROM annotators a "
            "LEFT JOIN r ON r.annotator_id = a.id LEFT JOIN p ON p.annotator_id = a.id "
            "LEFT JOIN s ON s.annotator_id = a.id ORDER BY a.id",
            [local_midnight()])
        return [AnnotatorStats(annotator_id=r[0], name=r[1], role=r[2], rankings=r[3], rankings_today=r[4],
                               pairs=r[5], skips=r[6], all_bad=r[7],
                               median_duration_s=None if r[8] is None else float(r[8])) for r in rows]

    def overlapping_rankings(self, *, round_id: int | None = None) -> dict[int, dict[int, list[list[int]]]]:
        """{item_id: {annotator_id: order}} for items ranked by >= 2 annotators (each annotator's
        latest ranking of the item)."""
        out: dict[int, dict[int, list[list[int]]]] = {}
        for _, item_id, annotator_id, order in self._overlap_rows(round_id):
            out.setdefault(item_id, {})[annotator_id] = order
        return out

    def _overlap_rows(self, round_id: int | None = None) -> list[tuple[int, int, int, list[list[int]]]]:
        """(ranking id, item, annotator, order) of the rankings of items ranked by >= 2 annotators,
        oldest first (so a dict keeps each annotator's latest)."""
        sql = ("SELECT k.id, k.item_id, k.annotator_id, k.order_groups FROM rankings k "
               "WHERE k.item_id IN (SELECT item_id FROM rankings GROUP BY item_id "
               "                    HAVING count(DISTINCT annotator_id) >= 2)")
        params = []
        if round_id is not None:
            sql += " AND k.item_id IN (SELECT id FROM items WHERE round_id = ?)"
            params.append(round_id)
        return [(r, i, a, [list(g) for g in o]) for r, i, a, o in self._rows(sql + " ORDER BY k.id", params)]

    def agreement(self, *, round_id: int | None = None) -> Agreement:
        """Pairwise agreement, Krippendorff's alpha (ordinal) and mean Kendall tau-b on items that
        two or more annotators ranked."""
        return Agreement(**agreement_summary(self.overlapping_rankings(round_id=round_id)))

    def position_bias(self) -> PositionBias:
        """How often the response shown first was ranked best, against the no-bias rate."""
        rows = self._rows("SELECT order_groups, display_order FROM rankings")
        return PositionBias(**position_bias([(o, d) for o, d in rows]))

    # -- a team's quality: per item, per annotator, against gold

    def item_agreement(self, *, round_id: int | None = None, limit: int | None = None) -> list[ItemAgreement]:
        """Per item ranked by >= 2 annotators: how they agree, least agreement first (the items an
        admin should look at); gold items are marked."""
        latest: dict[int, dict[int, tuple[int, list]]] = {}
        for ranking_id, item_id, annotator_id, order in self._overlap_rows(round_id):
            latest.setdefault(item_id, {})[annotator_id] = (ranking_id, order)
        if not latest:
            return []
        info = {i: (p, r) for i, p, r in self._rows(
            "SELECT id, prompt_id, round_id FROM items WHERE id IN (SELECT unnest(?))", [list(latest)])}
        gold = {r[0] for r in self._rows("SELECT item_id FROM gold")}
        out = []
        for item_id, by in latest.items():
            a = item_agreement({ann: order for ann, (_, order) in by.items()})
            out.append(ItemAgreement(item_id=item_id, prompt_id=info[item_id][0], round_id=info[item_id][1],
                                     annotators=a["annotators"], comparisons=a["comparisons"],
                                     pairwise_agreement=a["pairwise_agreement"], kendall_tau=a["kendall_tau"],
                                     rankings=sorted((rid, ann) for ann, (rid, _) in by.items()),
                                     gold=item_id in gold))
        out.sort(key=lambda x: (x.pairwise_agreement is None, x.pairwise_agreement or 0.0, -x.item_id))
        return out if limit is None else out[:limit]

    def annotator_agreement(self) -> list[AnnotatorAgreement]:
        """Every annotator with rankings: agreement with the others and with their majority,
        accuracy on gold items, and position bias (store/agreement.py has the definitions)."""
        return self._annotator_rows(annotator_agreement(self.overlapping_rankings()), self._gold_scores())

    def _annotator_rows(self, per: dict, gold: dict) -> list[AnnotatorAgreement]:
        """annotator_agreement's rows from the per-annotator agreement and the gold scores."""
        rows = self._rows(
            "SELECT a.id, a.name, count(k.id), "
            "avg(list_contains(k.order_groups[1], k.display_order[1])::INTEGER), "
            "avg(len(k.order_groups[1]) / len(k.display_order)) "
            "FROM annotators a JOIN rankings k ON k.annotator_id = a.id GROUP BY a.id, a.name ORDER BY a.id")
        out = []
        for annotator_id, name, n, first_best, expected in rows:
            mine = per.get(annotator_id, {"items": 0, "pairwise": (0, 0), "majority": (0, 0)})
            credit, pairs, n_gold = gold.get(annotator_id, (0.0, 0, 0))
            out.append(AnnotatorAgreement(
                annotator_id=annotator_id, name=name, rankings=n, shared_items=mine["items"],
                pairwise_agreement=_share(*mine["pairwise"]), majority_agreement=_share(*mine["majority"]),
                gold_items=n_gold, gold_accuracy=_share(credit, pairs),
                first_shown_best_rate=first_best, expected_first_rate=expected))
        return out

    def annotator_quality(self) -> dict[int, dict]:
        """{annotator_id: {gold_accuracy, majority_agreement, n_gold, n_ranked, gold_comparisons,
        majority_comparisons}} for every annotator with rankings (None where not measured yet):
        what exports and reward training can weight or filter annotators by. The comparisons are
        the response pairs each share is over (gold's strict pairs; pairs the others' majority
        decided), so a caller can tell a measure from a handful of answers (store/quality.py
        needs MIN_COMPARISONS)."""
        per, gold = annotator_agreement(self.overlapping_rankings()), self._gold_scores()
        return {a.annotator_id: {"gold_accuracy": a.gold_accuracy, "majority_agreement": a.majority_agreement,
                                 "n_gold": a.gold_items, "n_ranked": a.rankings,
                                 "gold_comparisons": gold.get(a.annotator_id, (0.0, 0, 0))[1],
                                 "majority_comparisons": per.get(a.annotator_id, {"majority": (0, 0)})["majority"][1]}
                for a in self._annotator_rows(per, gold)}

    def _gold_scores(self) -> dict[int, tuple[float, int, int]]:
        """{annotator: (credit, gold pairs, gold items)} over each annotator's latest ranking of
        each gold item, except the items whose reference is their own ranking."""
        latest: dict[tuple[int, int], tuple] = {}
        for annotator_id, item_id, order, ref in self._rows(
                "SELECT k.annotator_id, k.item_id, k.order_groups, g.order_groups FROM rankings k "
                "JOIN gold g ON g.item_id = k.item_id "
                "WHERE g.annotator_id IS NULL OR g.annotator_id <> k.annotator_id ORDER BY k.id"):
            latest[(annotator_id, item_id)] = (order, ref)
        out: dict[int, tuple[float, int, int]] = {}
        for (annotator_id, _), (order, ref) in latest.items():
            credit, pairs = gold_agreement(order, ref)
            c, p, n = out.get(annotator_id, (0.0, 0, 0))
            out[annotator_id] = (c + credit, p + pairs, n + 1)
        return out


def _share(part: float, whole: int) -> float | None:
    return part / whole if whole else None
