"""Export preference pairs and the rankings behind them as a versioned snapshot, with a dataset
card; read snapshots back without a Store.

`export_pairs` writes every pair that passes the filters as one of TRL's preference datasets:

    prompt, chosen, rejected             trl_format 'conversational' (the default): the prompt
                                         as chat messages [{role, content}] (formats/chat.py), chosen
                                         and rejected as one assistant message each, their text
                                         exactly as stored; 'text': the stored texts (chat prompts
                                         as HH-style transcripts)
    rank_gap                             distance of the two responses' tie groups in the ranking
                                         (1 = adjacent), or the margin an imported pair came with
                                         (1 when none); a name no trainer reads
    strength                             how much better the annotator said the best response is than
                                         the second (records.STRENGTHS), on that top pair of a ranking
                                         that has one; None on every other pair
    rationale                            the comment the annotator wrote with the ranking (None if none)
    margin                               only with margin_column=True: the pair's strength as Llama 2's
                                         margin (records.STRENGTHS: 1, 2/3, 1/3, 0) where it has one,
                                         else rank_gap, under the name TRL's RewardTrainer reads, which
                                         makes its loss -log sigmoid(r_c - r_r - margin) (train-reward
                                         --margin reads it too); DPOTrainer ignores it
    weight                               only with quality_weights=True: the pair's annotator's
                                         weight (below); train-reward weighs its loss by it
    annotator                            annotator name (None for imported pairs)
    prompt_id, chosen_id, rejected_id    store ids
    chosen_model_version, rejected_model_version   ids of the model versions that wrote them
    chosen_model, rejected_model         their names (an imported response's model or source name:
                                         a version of kind 'external', store/import_items.py)
    pair_id, ranking_id, all_bad, agreement, source, round, created_at, split

`agreement` is the share of the item's rankings that put `chosen` strictly above `rejected`
(1.0 when one annotator ranked it, and for imported pairs). `split` is 'train' or 'test': with
test_fraction > 0, whole prompts go to the test split (no prompt is in both). A prompt is held out
when the hash of (seed, prompt id), read as a number in [0, 1), is below test_fraction: its side
depends on nothing else, so as data grows a held-out prompt stays held out and a training prompt
stays in training (the loop relies on this: each round's reward model is scored on the same
prompts as the last one's, and none of them was ever trained on). About test_fraction of the
prompts are held out, not exactly: a handful of prompts may have none held out. Should every
prompt fall below the line (one or two prompts), nothing is held out: there would be nothing to
train on.

include_empty=False leaves out the pairs with a blank side (an empty or whitespace-only response:
a tiny policy can write one, and train-reward refuses such pairs) and counts them in
counts['left_out_empty']; the store keeps them, and the rankings file keeps their rankings.

Beside the pairs, the rankings that pass the same filters (min_agreement, include_imported and
include_empty concern pairs only), one row each (RANKING_COLUMNS): the prompt (in the pairs' TRL format),
the item's responses with their model versions (ids and names), the full order best -> worst as tie groups of
response ids, the display order the annotator saw, all_bad, strength, annotator, duration, comment, round,
created_at, and the split of its prompt. A ranking whose responses are all tied has no pair but
is there. An annotator's own answer (records.EditIn) is in the pairs (source 'edit',
`chosen_model` 'human edit' where it won; agreement 1: only its author ranked it) and, when any
ranking has one, in the demonstrations: one row per answer, in TRL's SFT format (conversational
`messages`, the prompt's then the answer's; text: `prompt`, `completion`), with annotator,
prompt_id, response_id, edit_of (the response it was written from), edit_of_model, ranking_id,
round, created_at and split. And a dataset card (store/card.py): counts, annotators, agreement,
license, snapshot hash, model versions, and how to load it.

Where it goes (export_layout): `out` ending in .jsonl (format 'jsonl') or .parquet ('parquet')
is the pairs file, with `<stem>.rankings.<ext>`, `<stem>.demonstrations.jsonl`, `<out>.README.md`
(the card) and `<out>.snapshot.json` (the manifest) beside it. Any other `out` is a folder:
`pairs.<ext>` (or, for 'datasets', the `DatasetDict.save_to_disk` files, splits 'train' and maybe
'test'), `rankings/`, `demonstrations.jsonl`, `README.md` and `snapshot.json`. The snapshot is the pairs file or the folder:
train-reward reads either, and its SHA-256 (formats/hashing.py) is recorded in the store
(Store.record_snapshot). Data is written (store/export_write.py) under temporary names and
renamed, so a crash never leaves half an export. An export that matches no pair is refused (InvalidRequest).

Annotator quality: min_quality leaves out the pairs and rankings of annotators measured below it
(the unmeasured are kept); quality_weights adds each pair's annotator's `weight` (store/quality.py,
which says how quality and weight are measured). Both are recorded in the filters, and the card
lists each annotator's quality, its source and weight.

`load_pairs_snapshot(path)` reads any of them back as a list of dicts; training jobs use it and
never open the DuckDB file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from formats.hashing import snapshot_sha256
from store import card
from store.errors import DataError, InvalidRequest
from store.export_select import filters_sql, quality_filter, select
from store.export_write import prompts_table, remove, write_data, write_demonstrations, write_text
from store.quality import MIN_COMPARISONS, MIN_WEIGHT
from store.records import EXPORT_FORMATS, Snapshot

TRL_FORMATS = ("conversational", "text")
COLUMNS = ["prompt", "chosen", "rejected", "rank_gap", "strength", "rationale", "annotator", "prompt_id", "chosen_id",
           "rejected_id", "chosen_model_version", "rejected_model_version", "chosen_model", "rejected_model",
           "pair_id", "ranking_id", "all_bad", "agreement", "source", "round", "created_at", "split"]
"""Columns of the pairs, in order (`margin` with margin_column=True, then `weight` with
quality_weights=True, follow `rank_gap`; `strength` and `rationale` follow those)."""
RANKING_COLUMNS = ["ranking_id", "item_id", "prompt_id", "prompt", "responses", "order", "display_order",
                   "all_bad", "strength", "annotator", "duration_s", "comment", "round", "created_at", "split"]
"""Columns of the rankings; `responses` is a list of {response_id, text, model_version, model}
(`model`: the version's name)."""
_SUFFIX = {"jsonl": ".jsonl", "parquet": ".parquet"}


@dataclass(frozen=True)
class Layout:
    """Where each part of one export goes."""

    snapshot: Path  # what the store records and train-reward reads: the pairs file, or the folder
    pairs: Path  # the pairs file (or the datasets folder)
    rankings: Path
    demonstrations: Path  # JSON Lines in every format; written only when there are some
    card: Path
    manifest: Path
    folder: bool  # True: everything is inside `snapshot`, written whole under a temporary name


def export_layout(out, fmt: str) -> Layout:
    """The paths of an export to `out` in `fmt` (see the module docstring)."""
    out = Path(out)
    if fmt in _SUFFIX and out.suffix.lower() == _SUFFIX[fmt]:
        return Layout(out, out, out.with_name(f"{out.stem}.rankings{out.suffix}"),
                      out.with_name(f"{out.stem}.demonstrations.jsonl"), out.with_name(out.name + ".README.md"),
                      out.with_name(out.name + ".snapshot.json"), False)
    pairs = out if fmt == "datasets" else out / f"pairs{_SUFFIX[fmt]}"
    rankings = out / "rankings" if fmt == "datasets" else out / "rankings" / f"rankings{_SUFFIX[fmt]}"
    return Layout(out, pairs, rankings, out / "demonstrations.jsonl", out / "README.md", out / "snapshot.json", True)


def export_pairs(store, out_path, fmt: str = "jsonl", *, rounds=None, annotators=None,
                 min_agreement: float | None = None, since=None, until=None,
                 include_all_bad: bool = False, include_imported: bool = True, include_evaluations: bool = False,
                 test_fraction: float = 0.0, seed: int = 0, trl_format: str = "conversational",
                 margin_column: bool = False, license: str = "unknown",  # noqa: A002 (the card's field)
                 min_quality: float | None = None, quality_weights: bool = False,
                 include_empty: bool = True, overwrite: bool = False) -> Snapshot:
    """Write the pairs (and rankings, and card) that pass the filters and record the snapshot.

    rounds: round id(s) whose items to take; annotators: names or ids; min_agreement: in [0, 1];
    since/until: creation time range [since, until) (datetime, date or ISO string, UTC);
    include_all_bad: also "all bad" rankings and their pairs; include_imported: also imported
    pairs; include_evaluations: also the rankings of blind evaluation items (store/evaluations.py),
    which are left out so that no model trains on the prompts it is judged on; trl_format: 'conversational' or 'text'; margin_column: add TRL's `margin` column;
    license: the card's license field (an SPDX-like id, e.g. 'cc-by-4.0'); min_quality: in [0, 1],
    leave out annotators measured below it; quality_weights: add the `weight` column (annotator
    quality, see the module docstring); include_empty: False leaves out pairs with a blank side.
    """
    if fmt not in EXPORT_FORMATS:
        raise InvalidRequest(f"format must be one of {EXPORT_FORMATS}, not {fmt!r}")
    if trl_format not in TRL_FORMATS:
        raise InvalidRequest(f"trl_format must be one of {TRL_FORMATS}, not {trl_format!r}")
    if not 0.0 <= float(test_fraction) < 1.0:
        raise InvalidRequest(f"test_fraction must be in [0, 1), not {test_fraction}")
    if not isinstance(license, str) or not license.strip() or "\n" in license:
        raise InvalidRequest(f"license must be a one-line name such as 'cc-by-4.0', not {license!r}")
    layout = export_layout(out_path, fmt)
    parts = [layout.snapshot] if layout.folder else [layout.pairs, layout.rankings, layout.demonstrations,
                                                      layout.card, layout.manifest]
    existing = [str(p) for p in parts if p.exists()]
    if existing and not overwrite:
        raise InvalidRequest(f"{', '.join(existing)} already exists (pass overwrite=True to replace it)")
    cond, recorded = filters_sql(store, rounds, annotators, min_agreement, since, until,
                                  include_all_bad, include_imported, include_evaluations)
    quality = quality_filter(store, cond, recorded, min_quality, quality_weights)
    recorded.update(test_fraction=float(test_fraction), seed=int(seed), trl_format=trl_format,
                    margin_column=bool(margin_column), quality_weights=bool(quality_weights))
    if not include_empty:
        recorded["include_empty"] = False
    layout.snapshot.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging(layout)
    for tmp in staging.values():
        remove(tmp)

    cur = store.cursor()
    try:
        # 1. select the pairs and rankings (ids and metadata only) into temporary tables, with their split
        counts = select(cur, cond, float(test_fraction), int(seed), include_empty,
                         quality if quality_weights else None)
        if counts["pairs"] == 0:
            raise InvalidRequest(f"no pairs match these filters ({recorded}): nothing was exported")
        prompts_table(cur, trl_format)
        # 2. write the data under temporary names (DuckDB streams COPY; datasets go through Arrow)
        counts["demonstrations"] = _write_all(cur, layout, staging, fmt, trl_format, bool(margin_column),
                                              bool(quality_weights), counts["test"] > 0)
        facts = card.gather(store, cur)
    except BaseException:
        for tmp in staging.values():
            remove(tmp)
        raise
    finally:
        for table in ("_export", "_export_sel", "_export_rankings", "_export_rankings_sel", "_export_prompts",
                      "_test_ids"):
            cur.execute(f"DROP TABLE IF EXISTS {table}")
    # 3. move into place, hash, record; then the card and the manifest
    for final, tmp in staging.items():
        remove(final)
        if tmp.exists():  # (no demonstrations file when there are none)
            os.replace(tmp, final)
    digest = snapshot_sha256(layout.snapshot)
    snap = store.record_snapshot(str(layout.snapshot), fmt, counts, recorded, digest)
    columns = COLUMNS[:4] + ["margin"] * bool(margin_column) + ["weight"] * bool(quality_weights) + COLUMNS[4:]
    manifest = {"snapshot_id": snap.id, "format": fmt, "trl_format": trl_format, "counts": counts,
                "filters": recorded, "sha256": digest, "license": license.strip(), "columns": columns,
                "ranking_columns": RANKING_COLUMNS, "files": _relative_files(layout),
                "created_at": snap.created_at.isoformat()}
    if quality is not None:
        manifest["annotator_quality"] = [{k: v for k, v in q.items() if k != "annotator_id"} for q in quality]
        manifest["min_weight"] = MIN_WEIGHT
        manifest["min_comparisons"] = MIN_COMPARISONS
    write_text(layout.card, card.render(manifest, facts, fmt))
    write_text(layout.manifest, json.dumps(manifest, indent=2) + "\n")
    return snap


def _staging(layout: Layout) -> dict[Path, Path]:
    """{final path: temporary path} of the data: the whole folder, or the files."""
    finals = [layout.snapshot] if layout.folder else [layout.pairs, layout.rankings, layout.demonstrations]
    return {p: p.with_name(f".{p.name}.tmp-{os.getpid()}") for p in finals}


def _relative_files(layout: Layout) -> dict[str, str]:
    base = layout.snapshot if layout.folder else layout.snapshot.parent
    names = ("pairs", "rankings", "demonstrations", "card", "manifest")
    return {name: os.path.relpath(getattr(layout, name), base) for name in names
            if name != "demonstrations" or layout.demonstrations.exists()}


def _write_all(cur, layout: Layout, staging: dict[Path, Path], fmt: str, trl_format: str,
               margin_column: bool, weight_column: bool, has_test: bool) -> int:
    """Pairs, rankings and demonstrations into their temporary paths; returns how many
    demonstrations."""
    if layout.folder:
        root = staging[layout.snapshot]
        pairs = root / layout.pairs.relative_to(layout.snapshot)
        rankings = root / layout.rankings.relative_to(layout.snapshot)
        demonstrations = root / layout.demonstrations.relative_to(layout.snapshot)
        if fmt != "datasets":
            rankings.parent.mkdir(parents=True)
    else:
        pairs, rankings, demonstrations = (staging[p] for p in (layout.pairs, layout.rankings, layout.demonstrations))
    write_data(cur, pairs, rankings, fmt, trl_format, margin_column, weight_column, has_test)
    return write_demonstrations(cur, demonstrations, trl_format)


def load_pairs_snapshot(path, split: str | None = None) -> list[dict]:
    """Rows of an exported snapshot (JSONL or Parquet file, an export folder, or a datasets
    folder) as dicts.

    split: 'train' or 'test' to keep one split, None for all rows. Pure: needs no Store. Raises
    DataError when the data lacks prompt/chosen/rejected.
    """
    path = Path(path)
    saved = path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "dataset_info.json"))
    if path.is_dir() and not saved:
        inside = [path / f"pairs{s}" for s in _SUFFIX.values() if (path / f"pairs{s}").is_file()]
        if not inside:
            raise DataError(str(path), [(None, "a folder with neither pairs.jsonl, pairs.parquet nor a datasets export")])
        path = inside[0]
    if path.is_dir():
        import datasets

        loaded = datasets.load_from_disk(str(path))
        parts = loaded.values() if isinstance(loaded, datasets.DatasetDict) else [loaded]
        rows = [row for part in parts for row in part.to_list()]
    elif path.suffix.lower() in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.is_file():
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        raise DataError(str(path), [(None, "no such file or folder")])
    if rows:
        missing = {"prompt", "chosen", "rejected"} - set(rows[0])
        if missing:
            raise DataError(str(path), [(None, f"missing columns {sorted(missing)}")])
    if split is not None:
        rows = [r for r in rows if r.get("split", "train") == split]
    return rows
