"""Export preference pairs, the rankings behind them and the annotators' own answers as a versioned
snapshot, with a dataset card and a manifest; read snapshots back without a Store.

`export_dataset(store, out, options)` takes what to select and how to write it as one
ExportOptions (store/export_options.py: its fields, checked when it is built; the names below are
its fields). It writes every pair that passes the filters as one of TRL's preference datasets:

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
    conversation_id, turn                a turn of a conversation held in the Chat tab
                                         (store/conversations.py): its conversation's id and the
                                         turn's number (1 = first), the prompt being the
                                         conversation up to that turn; None for every other item

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
conversation_id, turn, created_at, and the split of its prompt. A ranking whose responses are all tied has no pair but
is there. An annotator's own answer (records.EditIn) is in the pairs (source 'edit',
`chosen_model` 'human edit' where it won; agreement 1: only its author ranked it) and, when any
ranking has one, in the demonstrations: one row per answer, in TRL's SFT format (conversational
`messages`, the prompt's then the answer's; text: `prompt`, `completion`), with annotator,
prompt_id, response_id, edit_of (the response it was written from), edit_of_model, ranking_id,
round, conversation_id, turn, created_at and split. And a dataset card (store/card.py): counts, annotators, agreement,
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
from store.export_options import ExportOptions
from store.export_select import filters_sql, quality_filter, select
from store.export_write import prompts_table, remove, write_data, write_demonstrations, write_text
from store.quality import MIN_COMPARISONS, MIN_WEIGHT
from store.records import Snapshot

COLUMNS = ["prompt", "chosen", "rejected", "rank_gap", "strength", "rationale", "annotator", "prompt_id", "chosen_id",
           "rejected_id", "chosen_model_version", "rejected_model_version", "chosen_model", "rejected_model",
           "pair_id", "ranking_id", "all_bad", "agreement", "source", "round", "conversation_id", "turn", "created_at",
           "split"]
"""Columns of the pairs, in order (`margin` with margin_column=True, then `weight` with
quality_weights=True, follow `rank_gap`; `strength` and `rationale` follow those)."""
RANKING_COLUMNS = ["ranking_id", "item_id", "prompt_id", "prompt", "responses", "order", "display_order",
                   "all_bad", "strength", "annotator", "duration_s", "comment", "round", "conversation_id", "turn",
                   "created_at", "split"]
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


def export_dataset(store, out, options: ExportOptions = ExportOptions()) -> Snapshot:
    """Write the pairs, rankings and demonstrations that pass the options' filters to `out` (see
    export_layout), with the dataset card and the manifest, and record the snapshot. The options
    are checked when they are built (store/export_options.py); an existing export at `out` is
    refused unless options.overwrite, and so is an export that matches no pair (InvalidRequest)."""
    layout = export_layout(out, options.format)
    _refuse_existing(layout, options.overwrite)
    cond, recorded = filters_sql(store, options)
    quality = quality_filter(store, cond, recorded, options)
    recorded.update(test_fraction=options.test_fraction, seed=options.seed, trl_format=options.trl_format,
                    margin_column=options.margin_column, quality_weights=options.quality_weights)
    if not options.include_empty:
        recorded["include_empty"] = False
    layout.snapshot.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging(layout)
    for tmp in staging.values():
        remove(tmp)

    cur = store.cursor()
    try:
        # 1. select the pairs and rankings (ids and metadata only) into temporary tables, with their split
        counts = select(cur, cond, options, quality if options.quality_weights else None)
        if counts["pairs"] == 0:
            raise InvalidRequest(f"no pairs match these filters ({recorded}): nothing was exported")
        prompts_table(cur, options.trl_format)
        # 2. write the data under temporary names (DuckDB streams COPY; datasets go through Arrow)
        counts["demonstrations"] = _write_all(cur, layout, staging, options, counts["test"] > 0)
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
    snap = store.record_snapshot(str(layout.snapshot), options.format, counts, recorded,
                                 snapshot_sha256(layout.snapshot))
    manifest = _manifest(snap, options, layout, counts, recorded, quality)
    write_text(layout.card, card.render(manifest, facts, options.format))
    write_text(layout.manifest, json.dumps(manifest, indent=2) + "\n")
    return snap


def _refuse_existing(layout: Layout, overwrite: bool) -> None:
    parts = [layout.snapshot] if layout.folder else [layout.pairs, layout.rankings, layout.demonstrations,
                                                      layout.card, layout.manifest]
    existing = [str(p) for p in parts if p.exists()]
    if existing and not overwrite:
        raise InvalidRequest(f"{', '.join(existing)} already exists (pass overwrite=True to replace it)")


def _manifest(snap: Snapshot, options: ExportOptions, layout: Layout, counts: dict, recorded: dict,
              quality: list[dict] | None) -> dict:
    """snapshot.json: what was exported, how, and where its files are (the card says it in prose)."""
    columns = (COLUMNS[:4] + ["margin"] * options.margin_column + ["weight"] * options.quality_weights
               + COLUMNS[4:])
    manifest = {"snapshot_id": snap.id, "format": options.format, "trl_format": options.trl_format, "counts": counts,
                "filters": recorded, "sha256": snap.sha256, "license": options.license, "columns": columns,
                "ranking_columns": RANKING_COLUMNS, "files": _relative_files(layout),
                "created_at": snap.created_at.isoformat()}
    if quality is not None:
        manifest["annotator_quality"] = [{k: v for k, v in q.items() if k != "annotator_id"} for q in quality]
        manifest["min_weight"] = MIN_WEIGHT
        manifest["min_comparisons"] = MIN_COMPARISONS
    return manifest


def _staging(layout: Layout) -> dict[Path, Path]:
    """{final path: temporary path} of the data: the whole folder, or the files."""
    finals = [layout.snapshot] if layout.folder else [layout.pairs, layout.rankings, layout.demonstrations]
    return {p: p.with_name(f".{p.name}.tmp-{os.getpid()}") for p in finals}


def _relative_files(layout: Layout) -> dict[str, str]:
    base = layout.snapshot if layout.folder else layout.snapshot.parent
    names = ("pairs", "rankings", "demonstrations", "card", "manifest")
    return {name: os.path.relpath(getattr(layout, name), base) for name in names
            if name != "demonstrations" or layout.demonstrations.exists()}


def _write_all(cur, layout: Layout, staging: dict[Path, Path], options: ExportOptions, has_test: bool) -> int:
    """Pairs, rankings and demonstrations into their temporary paths; returns how many
    demonstrations."""
    if layout.folder:
        root = staging[layout.snapshot]
        pairs = root / layout.pairs.relative_to(layout.snapshot)
        rankings = root / layout.rankings.relative_to(layout.snapshot)
        demonstrations = root / layout.demonstrations.relative_to(layout.snapshot)
        if options.format != "datasets":
            rankings.parent.mkdir(parents=True)
    else:
        pairs, rankings, demonstrations = (staging[p] for p in (layout.pairs, layout.rankings, layout.demonstrations))
    write_data(cur, pairs, rankings, options, has_test)
    return write_demonstrations(cur, demonstrations, options.trl_format)


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

