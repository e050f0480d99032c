"""Agreement kept per item in the database (table agreement_items), so that the Team tab, the
Overview and an export's card add up columns instead of recomputing every ranking.

One row per item with rankings: its rankings' signature (how many, the newest id), the latest
ranking of each annotator and, for an item two or more annotators ranked, the item's share of
every figure (store/agreement.py ItemStats: agreeing and compared response pairs, Kendall's tau,
Krippendorff's coincidences, each annotator's agreement with the others and their majority).

`refresh_agreement()` brings the table up to date, and every reader calls it first: the items
whose signature differs from their rankings' are recomputed. Ranking ids only grow, so any write
(a ranking added, replaced, undone or imported) changes an item's count or its newest id, and no
write path has to remember the table. The rankings are read outside the write lock and the rows
replaced in one short transaction per chunk of items; a ranking that arrives meanwhile leaves
its item's signature behind, and the next refresh recomputes it.
"""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa

from store.agreement import ItemStats, Totals, item_stats
from store.db import registered

CHUNK_ITEMS = 20_000
"""Items recomputed per transaction (bounds the memory of the first refresh of a big store)."""

_PER_ANNOTATOR = pa.struct([("annotator_id", pa.int64()), ("ranking_id", pa.int64()),
                            ("pairwise_agree", pa.int64()), ("pairwise_n", pa.int64()),
                            ("majority_agree", pa.int64()), ("majority_n", pa.int64())])
_COINCIDENCE = pa.struct([("c", pa.float64()), ("k", pa.float64()), ("w", pa.float64())])
_TYPES = {"item_id": pa.int64(), "n_rankings": pa.int64(), "last_ranking_id": pa.int64(),
          "annotators": pa.int32(), "agree": pa.int64(), "comparisons": pa.int64(), "tau_sum": pa.float64(),
          "tau_n": pa.int64(), "per_annotator": pa.list_(_PER_ANNOTATOR), "coincidence": pa.list_(_COINCIDENCE)}

_CHANGED = """
    WITH now AS (SELECT item_id, count(*) AS n, max(id) AS last FROM rankings GROUP BY item_id)
    SELECT coalesce(now.item_id, a.item_id) AS item_id
    FROM now FULL JOIN agreement_items a ON a.item_id = now.item_id
    WHERE a.item_id IS NULL OR now.item_id IS NULL OR a.n_rankings <> now.n OR a.last_ranking_id <> now.last
    ORDER BY 1
"""
# An export's items whose latest ranking per annotator are the ones agreement_items holds.
_EXPORTED_AS_STORED = """
    WITH e AS (SELECT item_id, annotator_id, max(ranking_id) AS rid FROM _export_rankings GROUP BY ALL),
    es AS (SELECT item_id, list(rid ORDER BY rid) AS ids FROM e GROUP BY item_id HAVING count(*) >= 2),
    st AS (SELECT item_id, list(x.ranking_id ORDER BY x.ranking_id) AS ids
           FROM (SELECT item_id, unnest(per_annotator) AS x FROM agreement_items WHERE annotators >= 2)
           GROUP BY item_id)
    SELECT es.item_id, st.ids IS NOT DISTINCT FROM es.ids FROM es LEFT JOIN st ON st.item_id = es.item_id
"""


class AgreementTableMixin:
    """Store methods that keep agreement_items and add it up."""

    def refresh_agreement(self) -> int:
        """Recompute the rows of the items whose rankings changed since the last refresh (all of
        them the first time); returns how many items were recomputed. The whole table's signature
        (count, newest id) says first whether anything changed at all: a page that reads the
        agreement four times pays for one comparison per item, not four."""
        with self._shared.agreement_lock:
            whole = self._one("SELECT count(*), max(id) FROM rankings")
            if whole == self._shared.agreement_signature:
                return 0
            changed = [r[0] for r in self._rows(_CHANGED)]
            for start in range(0, len(changed), CHUNK_ITEMS):
                self._recompute(changed[start:start + CHUNK_ITEMS])
            self._shared.agreement_signature = whole  # the table holds at least this state
        return len(changed)

    def _recompute(self, item_ids: list[int]) -> None:
        rankings: dict[int, list] = defaultdict(list)
        for item_id, annotator_id, ranking_id, order in self._rows(
                "SELECT item_id, annotator_id, id, order_groups FROM rankings "
                "WHERE item_id IN (SELECT unnest(?)) ORDER BY id", [item_ids]):
            rankings[item_id].append((annotator_id, ranking_id, order))
        rows = [_item_row(item_id, ranked) for item_id, ranked in rankings.items()]
        table = pa.table({name: pa.array([r[i] for r in rows], t) for i, (name, t) in enumerate(_TYPES.items())})
        with self._tx() as cur:
            cur.execute("DELETE FROM agreement_items WHERE item_id IN (SELECT unnest(?))", [item_ids])
            with registered(cur, "_agreement_rows", table):
                cur.execute("INSERT INTO agreement_items SELECT * FROM _agreement_rows")

    def agreement_totals(self, where: str = "", params=None, cur=None) -> Totals:
        """The sums over the rows of agreement_items of items ranked by two or more annotators that
        `where` also keeps (SQL on the alias `a`, starting with AND), in one statement (one
        snapshot). Refresh first."""
        cur = cur or self._cur()
        items, agree, comparisons, tau_sum, tau_n, o = cur.execute(
            f"WITH a AS (SELECT * FROM agreement_items a WHERE a.annotators >= 2 {where}), "
            "o AS (SELECT x.c, x.k, sum(x.w) AS w FROM (SELECT unnest(coincidence) AS x FROM a) GROUP BY ALL) "
            "SELECT count(*), coalesce(sum(agree), 0), coalesce(sum(comparisons), 0), coalesce(sum(tau_sum), 0), "
            "coalesce(sum(tau_n), 0), (SELECT list((c, k, w)) FROM o) FROM a", params or []).fetchall()[0]
        return Totals(int(items), int(agree), int(comparisons), float(tau_sum), int(tau_n),
                      defaultdict(float, {(c, k): w for c, k, w in o or []}))

    def export_agreement(self, cur) -> dict:
        """agreement_summary of the rankings in an export's _export_rankings (on `cur`): from
        agreement_items for the items whose exported rankings are the ones it holds (an export of
        whole items, the usual case), computed from the rankings for the others."""
        self.refresh_agreement()
        cur.execute("BEGIN TRANSACTION")  # which items are whole and their sums: one snapshot
        try:
            stored, computed = [], []
            for item_id, same in cur.execute(_EXPORTED_AS_STORED).fetchall():
                (stored if same else computed).append(item_id)
            with registered(cur, "_stored_items", pa.table({"item_id": pa.array(stored, pa.int64())})):
                totals = self.agreement_totals("AND a.item_id IN (SELECT item_id FROM _stored_items)", cur=cur)
        finally:
            cur.execute("COMMIT")
        latest: dict[int, dict] = defaultdict(dict)
        for item_id, annotator_id, order in cur.execute(
                "SELECT item_id, annotator_id, order_groups FROM _export_rankings "
                "WHERE item_id IN (SELECT unnest(?)) ORDER BY ranking_id", [computed]).fetchall():
            latest[item_id][annotator_id] = [list(g) for g in order]
        for by_annotator in latest.values():
            if len(by_annotator) >= 2:
                totals.add(item_stats(by_annotator))
        return totals.summary()

def _item_row(item_id: int, ranked: list[tuple[int, int, list]]) -> tuple:
    """agreement_items' row of an item from its rankings (annotator, ranking id, order), oldest first."""
    latest = {annotator_id: (ranking_id, order) for annotator_id, ranking_id, order in ranked}
    s = item_stats({a: [list(g) for g in order] for a, (_, order) in latest.items()}) if len(latest) >= 2 \
        else ItemStats()
    per = [{"annotator_id": a, "ranking_id": latest[a][0], "pairwise_agree": v[0], "pairwise_n": v[1],
            "majority_agree": v[2], "majority_n": v[3]} for a, v in sorted(s.per_annotator.items())]
    coincidence = [{"c": c, "k": k, "w": w} for (c, k), w in sorted(s.coincidence.items())]
    return (item_id, len(ranked), ranked[-1][1], len(latest), s.agree, s.comparisons, s.tau_sum, s.tau_n,
            per, coincidence)

