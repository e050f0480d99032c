"""Statistics for the admin tab and `python -m store stats`: counts, per-annotator work,
inter-annotator agreement and position bias. The formulas are in store/agreement.py (pure)."""

from __future__ import annotations

from store.agreement import agreement_summary, position_bias
from store.queue import local_midnight
from store.records import Agreement, AnnotatorStats, PositionBias


class StatsMixin:
    """Statistics methods of Store."""

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
        sql = ("SELECT k.item_id, k.annotator_id, k.order_groups FROM rankings k "
               "WHERE k.item_id IN (SELECT item_id FROM rankings GROUP BY item_id "
               "                    HAVING count(DISTINCT annotator_id) >= 2)")
        params = []
        if round_id is not None:
            sql += " AND k.item_id IN (SELECT id FROM items WHERE round_id = ?)"
            params.append(round_id)
        out: dict[int, dict[int, list[list[int]]]] = {}
        for item_id, annotator_id, order in self._rows(sql + " ORDER BY k.id", params):
            out.setdefault(item_id, {})[annotator_id] = [list(g) for g in order]
        return out

    def agreement(self, *, round_id: int | None = None) -> Agreement:
        """Pairwise agreement, Krippendorff's alpha (ordinal) and mean Kendall tau-b on items that
        two or more annotators ranked."""
        return Agreement(**agreement_summary(self.overlapping_rankings(round_id=round_id)))

    def position_bias(self) -> PositionBias:
        """How often the response shown first was ranked best, against the no-bias rate."""
        rows = self._rows("SELECT order_groups, display_order FROM rankings")
        return PositionBias(**position_bias([(o, d) for o, d in rows]))
