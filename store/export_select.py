"""Which pairs and rankings an export takes (store/export.py writes them): the filters of its
ExportOptions (store/export_options.py) as SQL over the pairs with their agreement, annotator
quality's exclusions and weights, and the split by prompt. `select` leaves them in the temporary
tables _export and _export_rankings of a cursor.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa

from store.db import registered
from store.errors import InvalidRequest
from store.export_options import ExportOptions
from store.quality import annotator_quality_table

BLANK = r"[\s\x{0b}\x{1c}-\x{1f}\x{85}\p{Z}]*"
"""A response text that is all whitespace, as a regular expression (RE2, DuckDB's): exactly the
texts whose Python str.strip() is empty, the test train-reward applies."""

# Pair metadata with its agreement; texts are joined in only when writing.
_SELECTED = """
    WITH n_rank AS (SELECT item_id, count(*) AS n FROM rankings GROUP BY item_id),
    votes AS (SELECT item_id, chosen_id, rejected_id, count(*) AS v FROM pairs
              WHERE ranking_id IS NOT NULL GROUP BY ALL),
    scored AS (
        SELECT pr.id AS pair_id, pr.prompt_id, pr.chosen_id, pr.rejected_id, pr.margin, pr.annotator_id,
               pr.ranking_id, pr.all_bad, pr.source, pr.created_at, i.round_id, i.evaluation_id,
               i.conversation_id, i.turn,
               CASE WHEN pr.ranking_id IS NULL OR nr.n IS NULL OR pr.source = 'edit' THEN 1.0
                    ELSE v.v / nr.n END AS agreement,
               CASE WHEN pr.chosen_id = k.order_groups[1][1] AND pr.rejected_id = k.order_groups[2][1]
                    THEN k.strength END AS strength,
               nullif(k.comment, '') AS rationale
        FROM pairs pr
        JOIN items i ON i.id = pr.item_id
        LEFT JOIN rankings k ON k.id = pr.ranking_id
        LEFT JOIN n_rank nr ON nr.item_id = pr.item_id
        LEFT JOIN votes v ON v.item_id = pr.item_id AND v.chosen_id = pr.chosen_id
                         AND v.rejected_id = pr.rejected_id)
    SELECT * FROM scored
"""
# Rankings with the same column names the filters use (round_id, annotator_id, created_at, all_bad).
_SELECTED_RANKINGS = """
    SELECT * FROM (
        SELECT k.id AS ranking_id, k.item_id, k.prompt_id, k.annotator_id, k.order_groups, k.display_order,
               k.all_bad, k.strength, k.duration_s, k.comment, k.created_at, i.round_id, i.evaluation_id,
               i.conversation_id, i.turn
        FROM rankings k JOIN items i ON i.id = k.item_id)
"""

def filters_sql(store, options: ExportOptions) -> tuple[list[tuple[str, list, bool]], dict]:
    """The options' filters as (SQL condition, parameters, concerns pairs only) over the columns of
    _SELECTED and _SELECTED_RANKINGS, and the filters as recorded."""
    cond, recorded = [], {}
    if options.rounds is not None:
        cond.append(("list_contains(?, round_id)", [list(options.rounds)], False))
        recorded["rounds"] = list(options.rounds)
    if options.annotators is not None:
        ids = [_annotator_id(store, a) for a in options.annotators]
        cond.append(("list_contains(?, annotator_id)", [ids], False))
        recorded["annotators"] = [store.get_annotator(i).name for i in ids]
    if options.min_agreement is not None:
        cond.append(("agreement >= ?", [options.min_agreement], True))
        recorded["min_agreement"] = options.min_agreement
    for name, op, value in (("since", ">=", options.since), ("until", "<", options.until)):
        if value is not None:
            cond.append((f"created_at {op} ?", [value], False))
            recorded[name] = value.isoformat() + "Z"
    if not options.include_all_bad:
        cond.append(("NOT all_bad", [], False))
    if not options.include_imported:
        cond.append(("ranking_id IS NOT NULL", [], True))
    if not options.include_evaluations:
        cond.append(("evaluation_id IS NULL", [], False))
    recorded["include_all_bad"] = options.include_all_bad
    recorded["include_imported"] = options.include_imported
    if options.include_evaluations:
        recorded["include_evaluations"] = True
    return cond, recorded


def _annotator_id(store, annotator: str | int) -> int:
    found = store.get_annotator(annotator) if isinstance(annotator, int) else store.find_annotator(annotator)
    if found is None:
        raise InvalidRequest(f"no annotator named {annotator!r}")
    return found.id


def _where(cond: list[tuple[str, list, bool]], rankings: bool) -> tuple[str, list]:
    kept = [(sql, params) for sql, params, pairs_only in cond if not (rankings and pairs_only)]
    if not kept:
        return "", []
    return " WHERE " + " AND ".join(sql for sql, _ in kept), [p for _, params in kept for p in params]


def held_out_hash(prompt_id: int, seed: int) -> float:
    """sha256(seed:prompt_id) as a number in [0, 1): uniform, and fixed for a prompt and seed."""
    return int(hashlib.sha256(f"{seed}:{prompt_id}".encode()).hexdigest()[:15], 16) / 16 ** 15


HELD_OUT_SQL = f"('0x' || sha256($seed::VARCHAR || ':' || prompt_id::VARCHAR)[1:15])::BIGINT / {16 ** 15}.0"
"""held_out_hash in DuckDB's SQL (of a column prompt_id and a parameter $seed), the same float:
the 60-bit integer rounds to a double as Python's true division by a power of two does."""


def quality_filter(store, cond: list, recorded: dict, options: ExportOptions) -> list[dict] | None:
    """The annotator quality table when the options' min_quality or quality_weights needs it
    (store/quality.py); min_quality's exclusion is added to `cond` and recorded."""
    if options.min_quality is None and not options.quality_weights:
        return None
    quality = annotator_quality_table(store, options.min_quality)
    if options.min_quality is not None:
        excluded = [q["annotator_id"] for q in quality if q["excluded"]]
        if excluded:
            cond.append(("(annotator_id IS NULL OR NOT list_contains(?, annotator_id))", [excluded], False))
        recorded.update(min_quality=options.min_quality,
                        excluded_annotators=[q["annotator"] for q in quality if q["excluded"]])
    return quality


def select(cur, cond: list, options: ExportOptions, weights: list[dict] | None) -> dict:
    """The pairs and rankings that pass `cond` into the temporary tables _export and
    _export_rankings, each row with its prompt's split (the options' test_fraction and seed; and
    with `weights`, the quality table, each pair's weight); the options' include_empty=False
    leaves out the pairs with a blank side. Returns the counts the manifest records."""
    where, params = _where(cond, rankings=False)
    cur.execute("CREATE OR REPLACE TEMP TABLE _export_sel AS " + _SELECTED + where, params)
    where, params = _where(cond, rankings=True)
    cur.execute("CREATE OR REPLACE TEMP TABLE _export_rankings_sel AS " + _SELECTED_RANKINGS + where, params)
    left_out_empty = 0 if options.include_empty else _drop_blank_pairs(cur)
    # whole prompts to the test split, each by its own hash; none when that would be every prompt
    cur.execute("CREATE OR REPLACE TEMP TABLE _test_ids AS SELECT prompt_id FROM "
                f"(SELECT DISTINCT prompt_id FROM _export_sel) WHERE {HELD_OUT_SQL} < $fraction",
                {"seed": options.seed, "fraction": options.test_fraction})
    if cur.execute("SELECT (SELECT count(*) FROM _test_ids) = (SELECT count(DISTINCT prompt_id) FROM _export_sel)"
                   ).fetchall()[0][0]:
        cur.execute("DELETE FROM _test_ids")
    for table in ("_export", "_export_rankings"):
        cur.execute(f"CREATE OR REPLACE TEMP TABLE {table} AS SELECT s.*, CASE WHEN t.prompt_id IS NULL "
                    f"THEN 'train' ELSE 'test' END AS split FROM {table}_sel s "
                    "LEFT JOIN _test_ids t ON t.prompt_id = s.prompt_id")
    if weights is not None:  # each pair its annotator's weight; imported pairs and the unmeasured 1
        _add_weights(cur, weights)
    counts = dict(zip(
        ("pairs", "train", "test", "prompts", "annotators", "imported", "all_bad"),
        cur.execute("SELECT count(*), count(*) FILTER (WHERE split = 'train'), "
                    "count(*) FILTER (WHERE split = 'test'), count(DISTINCT prompt_id), "
                    "count(DISTINCT annotator_id), count(*) FILTER (WHERE ranking_id IS NULL), "
                    "count(*) FILTER (WHERE all_bad) FROM _export").fetchall()[0]))
    counts["rankings"] = cur.execute("SELECT count(*) FROM _export_rankings").fetchall()[0][0]
    if not options.include_empty:
        counts["left_out_empty"] = left_out_empty
    return counts


def _drop_blank_pairs(cur) -> int:
    """Delete from _export_sel the pairs whose chosen or rejected text is blank; how many."""
    blank = "SELECT id FROM responses WHERE regexp_full_match(text, ?)"
    where = f" WHERE chosen_id IN ({blank}) OR rejected_id IN ({blank})"
    n = cur.execute("SELECT count(*) FROM _export_sel" + where, [BLANK, BLANK]).fetchall()[0][0]
    if n:
        cur.execute("DELETE FROM _export_sel" + where, [BLANK, BLANK])
    return n


def _add_weights(cur, quality: list[dict]) -> None:
    """A `weight` column on _export: the pair's annotator's weight, 1 where none applies."""
    table = pa.table({"annotator_id": pa.array([q["annotator_id"] for q in quality], pa.int64()),
                      "weight": pa.array([q["weight"] for q in quality], pa.float64())})
    cur.execute("ALTER TABLE _export ADD COLUMN weight DOUBLE DEFAULT 1.0")
    with registered(cur, "_weights", table):
        cur.execute("UPDATE _export SET weight = w.weight FROM _weights w WHERE w.annotator_id = _export.annotator_id")
