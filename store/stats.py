"""Statistics for the admin tab and `python -m store stats`: counts, per-annotator work,
inter-annotator agreement and position bias, and a team's quality: agreement per item and per
annotator (with the others, their majority, the gold items). The formulas are in
store/agreement.py (pure); the agreement figures are sums over the per-item table that
store/agreement_table.py keeps, so each method is a query or two, cheap enough to refresh live."""

from __future__ import annotations

from collections.abc import Callable

from store.agreement import gold_agreement
from store.queue_index import local_midnight
from store.records import Agreement, AnnotatorAgreement, AnnotatorStats, ItemAgreement, PositionBias


class StatsMixin:
    """Statistics methods of Store. Besides the core (store/db.py) they use, declared here, the
    queue's count of open items (store/queue.py) and the agreement table (store/agreement_table.py)."""

    items_remaining: Callable[..., int]
    refresh_agreement: Callable[[], int]
    agreement_totals: Callable[..., object]

    def counts(self, *, overlap: int | None = None) -> dict:
        """{prompts, prompts_in_pool, responses, items, rankings, pairs, items_remaining,
        flagged_prompts, annotators, model_versions, runs, snapshots, conversations,
        conversation_turns, flagged_conversations} (items: the queued ones; a conversation's
        turns are items of their own, store/conversations.py)."""
        names = ("prompts", "prompts_in_pool", "responses", "items", "rankings", "pairs",
                 "flagged_prompts", "annotators", "model_versions", "runs", "snapshots", "conversations",
                 "conversation_turns", "flagged_conversations")
        row = self._one(
            "SELECT (SELECT count(*) FROM prompts), "
            "(SELECT count(*) FROM prompts p WHERE NOT EXISTS (SELECT 1 FROM responses r WHERE r.prompt_id = p.id)), "
            "(SELECT count(*) FROM responses), (SELECT count(*) FROM items WHERE queued), "
            "(SELECT count(*) FROM rankings), (SELECT count(*) FROM pairs), "
            "(SELECT count(DISTINCT prompt_id) FROM flags), (SELECT count(*) FROM annotators), "
            "(SELECT count(*) FROM model_versions), (SELECT count(*) FROM runs), (SELECT count(*) FROM snapshots), "
            "(SELECT count(*) FROM conversations), (SELECT count(*) FROM items WHERE conversation_id IS NOT NULL), "
            "(SELECT count(*) FROM conversations WHERE status = 'flagged')")
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

    def agreement(self, *, round_id: int | None = None) -> Agreement:
        """Pairwise agreement, Krippendorff's alpha (ordinal) and mean Kendall tau-b on items that
        two or more annotators ranked (of one round, or all)."""
        self.refresh_agreement()
        where, params = ("AND a.item_id IN (SELECT id FROM items WHERE round_id = ?)", [round_id]) \
            if round_id is not None else ("", [])
        return Agreement(**self.agreement_totals(where, params).summary())

    def position_bias(self) -> PositionBias:
        """How often the response shown first was ranked best, against the no-bias rate (the
        definitions: store/agreement.py position_bias)."""
        shown = "FROM rankings WHERE len(order_groups) > 0 AND len(display_order) > 0"
        n, first, expected = self._one(
            "SELECT count(*), avg(list_contains(order_groups[1], display_order[1])::INTEGER), "
            f"avg(len(order_groups[1]) / len(flatten(order_groups))) {shown}")
        by_position = [r[1] for r in self._rows(
            "SELECT p, avg(list_contains(order_groups[1], display_order[p])::INTEGER) FROM "
            f"(SELECT order_groups, display_order, unnest(range(1, len(display_order) + 1)) AS p {shown}) "
            "GROUP BY p ORDER BY p")]
        return PositionBias(rankings=n, first_shown_best_rate=first, expected_rate=expected,
                            best_rate_by_position=by_position)

    # -- a team's quality: per item, per annotator, against gold

    def item_agreement(self, *, round_id: int | None = None, limit: int | None = None) -> list[ItemAgreement]:
        """Per item ranked by >= 2 annotators: how they agree, least agreement first (the items an
        admin should look at); gold items are marked."""
        self.refresh_agreement()
        rows = self._rows(
            "SELECT a.item_id, i.prompt_id, i.round_id, a.annotators, a.comparisons, "
            "CASE WHEN a.comparisons > 0 THEN a.agree / a.comparisons END AS pairwise, "
            "CASE WHEN a.tau_n > 0 THEN a.tau_sum / a.tau_n END, "
            "[(x.ranking_id, x.annotator_id) FOR x IN a.per_annotator], g.item_id IS NOT NULL "
            "FROM agreement_items a JOIN items i ON i.id = a.item_id LEFT JOIN gold g ON g.item_id = a.item_id "
            "WHERE a.annotators >= 2 AND (?::BIGINT IS NULL OR i.round_id = ?) "
            "ORDER BY pairwise IS NULL, coalesce(pairwise, 0), a.item_id DESC LIMIT ?",
            [round_id, round_id, limit])
        return [ItemAgreement(item_id=r[0], prompt_id=r[1], round_id=r[2], annotators=r[3], comparisons=r[4],
                              pairwise_agreement=r[5], kendall_tau=r[6], rankings=sorted(tuple(x) for x in r[7]),
                              gold=r[8]) for r in rows]

    def annotator_agreement(self) -> list[AnnotatorAgreement]:
        """Every annotator with rankings: agreement with the others and with their majority,
        accuracy on gold items, and position bias (store/agreement.py has the definitions)."""
        return self._annotator_rows(self._per_annotator(), self._gold_scores())

    def _per_annotator(self) -> dict[int, dict]:
        """store.agreement.annotator_agreement's dict, summed from agreement_items."""
        self.refresh_agreement()
        rows = self._rows(
            "SELECT x.annotator_id, count(*), sum(x.pairwise_agree), sum(x.pairwise_n), sum(x.majority_agree), "
            "sum(x.majority_n) FROM (SELECT unnest(per_annotator) AS x FROM agreement_items WHERE annotators >= 2) "
            "GROUP BY 1")
        return {a: {"items": n, "pairwise": (int(pa), int(pn)), "majority": (int(ma), int(mn))}
                for a, n, pa, pn, ma, mn in rows}

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
                first_shown_best_rate=first_best, expected_first_rate=expected,
                gold_comparisons=pairs, majority_comparisons=mine["majority"][1]))
        return out

    def annotator_quality(self) -> dict[int, dict]:
        """{annotator_id: {gold_accuracy, majority_agreement, n_gold, n_ranked, gold_comparisons,
        majority_comparisons}} for every annotator with rankings (None where not measured yet):
        what exports and reward training can weight or filter annotators by. The comparisons are
        the response pairs each share is over (gold's strict pairs; pairs the others' majority
        decided), so a caller can tell a measure from a handful of answers (store/quality.py
        needs MIN_COMPARISONS)."""
        return {a.annotator_id: {"gold_accuracy": a.gold_accuracy, "majority_agreement": a.majority_agreement,
                                 "n_gold": a.gold_items, "n_ranked": a.rankings,
                                 "gold_comparisons": a.gold_comparisons,
                                 "majority_comparisons": a.majority_comparisons}
                for a in self.annotator_agreement()}

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
