"""Export preference pairs as a versioned snapshot, and read snapshots back without a Store.

`export_pairs` writes every pair that passes the filters in TRL's explicit preference format:

    prompt, chosen, rejected             the texts (HH-style prompts keep their transcript form)
    margin                               rank-group distance (1 = adjacent), or the imported margin
    annotator                            annotator name (None for imported pairs)
    prompt_id, chosen_id, rejected_id    store ids
    chosen_model_version, rejected_model_version   ids of the model versions that wrote them
    pair_id, ranking_id, all_bad, agreement, source, round, created_at, split

`agreement` is the share of the item's rankings that put `chosen` strictly above `rejected`
(1.0 when one annotator ranked it, and for imported pairs). `split` is 'train' or 'test': with
test_fraction > 0, whole prompts go to the test split (no prompt is in both), chosen by a hash of
(seed, prompt id), so growing data keeps old prompts on the same side.

Formats: 'jsonl' (one file), 'parquet' (one file), 'datasets' (a folder written by
`DatasetDict.save_to_disk`, splits 'train' and, with a test split, 'test'). The file or folder is
written under a temporary name and renamed, so a crash never leaves half an export. The manifest
(counts, filters, SHA-256 of the data files) is recorded in the store (Store.record_snapshot) and
written beside the data: `<file>.snapshot.json`, or `snapshot.json` inside the datasets folder.
An export that matches no pair is refused (InvalidRequest): an empty snapshot cannot train anything.

`load_pairs_snapshot(path)` reads any of the three back as a list of dicts; training jobs use it
and never open the DuckDB file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa

from pipeline.hashing import snapshot_sha256
from store.db import registered, to_db_time
from store.errors import DataError, InvalidRequest
from store.records import EXPORT_FORMATS, Snapshot

COLUMNS = ["prompt", "chosen", "rejected", "margin", "annotator", "prompt_id", "chosen_id",
           "rejected_id", "chosen_model_version", "rejected_model_version", "pair_id", "ranking_id",
           "all_bad", "agreement", "source", "round", "created_at", "split"]

# Pair metadata with its agreement; texts are joined in only when writing.
_SELECTED = """
    WITH n_rank AS (SELECT item_id, count(*) AS n FROM rankings GROUP BY item_id),
    votes AS (SELECT item_id, chosen_id, rejected_id, count(*) AS v FROM pairs
              WHERE ranking_id IS NOT NULL GROUP BY ALL),
    scored AS (
        SELECT pr.id AS pair_id, pr.prompt_id, pr.chosen_id, pr.rejected_id, pr.margin, pr.annotator_id,
               pr.ranking_id, pr.all_bad, pr.source, pr.created_at, i.round_id,
               CASE WHEN pr.ranking_id IS NULL OR nr.n IS NULL THEN 1.0 ELSE v.v / nr.n END AS agreement
        FROM pairs pr
        JOIN items i ON i.id = pr.item_id
        LEFT JOIN n_rank nr ON nr.item_id = pr.item_id
        LEFT JOIN votes v ON v.item_id = pr.item_id AND v.chosen_id = pr.chosen_id
                         AND v.rejected_id = pr.rejected_id)
    SELECT * FROM scored
"""

_WRITE = """
    SELECT p.text AS prompt, c.text AS chosen, r.text AS rejected, s.margin, a.name AS annotator,
           s.prompt_id, s.chosen_id, s.rejected_id, c.model_version_id AS chosen_model_version,
           r.model_version_id AS rejected_model_version, s.pair_id, s.ranking_id, s.all_bad,
           s.agreement, s.source, s.round_id AS round,
           strftime(s.created_at, '%Y-%m-%dT%H:%M:%S.%fZ') AS created_at, s.split
    FROM _export s
    JOIN prompts p ON p.id = s.prompt_id
    JOIN responses c ON c.id = s.chosen_id
    JOIN responses r ON r.id = s.rejected_id
    LEFT JOIN annotators a ON a.id = s.annotator_id
    {where}
    ORDER BY s.pair_id
"""


def _filters_sql(store, rounds, annotators, min_agreement, since, until, include_all_bad,
                 include_imported) -> tuple[str, list, dict]:
    """WHERE clause over _SELECTED's columns, its parameters, and the filters as recorded."""
    cond, params, recorded = [], [], {}
    if rounds is not None:
        rounds = [int(r) for r in ([rounds] if isinstance(rounds, int) else rounds)]
        cond.append("list_contains(?, round_id)")
        params.append(rounds)
        recorded["rounds"] = rounds
    if annotators is not None:
        names = [annotators] if isinstance(annotators, (str, int)) else list(annotators)
        ids = []
        for a in names:
            found = store.get_annotator(a) if isinstance(a, int) else store.find_annotator(a)
            if found is None:
                raise InvalidRequest(f"no annotator named {a!r}")
            ids.append(found.id)
        cond.append("list_contains(?, annotator_id)")
        params.append(ids)
        recorded["annotators"] = [store.get_annotator(i).name for i in ids]
    if min_agreement is not None:
        if not 0.0 <= float(min_agreement) <= 1.0:
            raise InvalidRequest(f"min_agreement must be between 0 and 1, not {min_agreement}")
        cond.append("agreement >= ?")
        params.append(float(min_agreement))
        recorded["min_agreement"] = float(min_agreement)
    for name, value, op in (("since", since, ">="), ("until", until, "<")):
        if value is not None:
            cond.append(f"created_at {op} ?")
            params.append(to_db_time(value))
            recorded[name] = to_db_time(value).isoformat() + "Z"
    if not include_all_bad:
        cond.append("NOT all_bad")
    if not include_imported:
        cond.append("ranking_id IS NOT NULL")
    recorded["include_all_bad"] = bool(include_all_bad)
    recorded["include_imported"] = bool(include_imported)
    return (" WHERE " + " AND ".join(cond)) if cond else "", params, recorded


def _test_prompts(prompt_ids: list[int], test_fraction: float, seed: int) -> list[int]:
    """round(test_fraction * n) prompts (at least 1 when the fraction is > 0 and n >= 2), the
    ones with the smallest sha256(seed:prompt_id): a fixed pseudo-random order per seed."""
    if test_fraction <= 0 or len(prompt_ids) < 2:
        return []
    n_test = min(len(prompt_ids) - 1, max(1, round(test_fraction * len(prompt_ids))))
    key = lambda pid: hashlib.sha256(f"{seed}:{pid}".encode()).hexdigest()  # noqa: E731
    return sorted(prompt_ids, key=key)[:n_test]


def export_pairs(store, out_path, fmt: str = "jsonl", *, rounds=None, annotators=None,
                 min_agreement: float | None = None, since=None, until=None,
                 include_all_bad: bool = False, include_imported: bool = True,
                 test_fraction: float = 0.0, seed: int = 0, overwrite: bool = False) -> Snapshot:
    """Write the pairs that pass the filters to `out_path` and record the snapshot.

    rounds: round id(s) whose items to take; annotators: names or ids; min_agreement: in [0, 1];
    since/until: pair creation time range [since, until) (datetime, date or ISO string, UTC);
    include_all_bad: also pairs from "all bad" rankings; include_imported: also imported pairs.
    """
    if fmt not in EXPORT_FORMATS:
        raise InvalidRequest(f"format must be one of {EXPORT_FORMATS}, not {fmt!r}")
    if not 0.0 <= float(test_fraction) < 1.0:
        raise InvalidRequest(f"test_fraction must be in [0, 1), not {test_fraction}")
    out = Path(out_path)
    if out.exists() and not overwrite:
        raise InvalidRequest(f"{out} already exists (pass overwrite=True to replace it)")
    where, params, recorded = _filters_sql(store, rounds, annotators, min_agreement, since, until,
                                           include_all_bad, include_imported)
    recorded.update(test_fraction=float(test_fraction), seed=int(seed))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    _remove(tmp)

    cur = store._cur()
    # 1. select the pairs (ids and metadata only) into a temporary table, with their split
    cur.execute("CREATE OR REPLACE TEMP TABLE _export_sel AS " + _SELECTED + where, params)
    prompt_ids = [r[0] for r in cur.execute("SELECT DISTINCT prompt_id FROM _export_sel").fetchall()]
    test = _test_prompts(prompt_ids, float(test_fraction), int(seed))
    try:
        with registered(cur, "_test_ids", pa.table({"prompt_id": pa.array(test, pa.int64())})):
            cur.execute("CREATE OR REPLACE TEMP TABLE _export AS SELECT s.*, CASE WHEN t.prompt_id IS NULL "
                        "THEN 'train' ELSE 'test' END AS split FROM _export_sel s "
                        "LEFT JOIN _test_ids t ON t.prompt_id = s.prompt_id")
        counts = dict(zip(
            ("pairs", "train", "test", "prompts", "annotators", "imported", "all_bad"),
            cur.execute("SELECT count(*), count(*) FILTER (WHERE split = 'train'), "
                        "count(*) FILTER (WHERE split = 'test'), count(DISTINCT prompt_id), "
                        "count(DISTINCT annotator_id), count(*) FILTER (WHERE ranking_id IS NULL), "
                        "count(*) FILTER (WHERE all_bad) FROM _export").fetchall()[0]))
        if counts["pairs"] == 0:
            raise InvalidRequest(f"no pairs match these filters ({recorded}): nothing was exported")
        # 2. write the texts (DuckDB streams COPY; the datasets format goes through Arrow)
        if fmt == "datasets":
            _write_datasets(cur, tmp, counts["test"] > 0)
        else:
            options = "FORMAT json" if fmt == "jsonl" else "FORMAT parquet, COMPRESSION zstd"
            cur.execute(f"COPY ({_WRITE.format(where='')}) TO '{_sql_path(tmp)}' ({options})")
    except BaseException:
        _remove(tmp)
        raise
    finally:
        cur.execute("DROP TABLE IF EXISTS _export")
        cur.execute("DROP TABLE IF EXISTS _export_sel")
    # 3. move into place, hash, record, and write the manifest beside the data
    _remove(out)
    os.replace(tmp, out)
    digest = snapshot_sha256(out)
    snap = store.record_snapshot(str(out), fmt, counts, recorded, digest)
    manifest = {"snapshot_id": snap.id, "format": fmt, "counts": counts, "filters": recorded,
                "sha256": digest, "columns": COLUMNS, "created_at": snap.created_at.isoformat()}
    # the manifest too goes under a temporary name first: a crash never leaves half of one
    manifest_path = _manifest_path(out, fmt)
    tmp_manifest = manifest_path.with_name(f".{manifest_path.name}.tmp-{os.getpid()}")
    tmp_manifest.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp_manifest, manifest_path)
    return snap


def _write_datasets(cur, folder: Path, has_test: bool) -> None:
    """Stream each split from DuckDB into an Arrow file, memory-map it as a `datasets.Dataset`,
    and `save_to_disk`: the rows never sit in RAM all at once."""
    import datasets  # imported here: it is slow to import and only this format needs it

    staging = folder.with_name(folder.name + ".arrow")
    staging.mkdir()
    try:
        parts = {}
        for split in ("train", "test") if has_test else ("train",):
            reader = cur.sql(_WRITE.format(where=f"WHERE s.split = '{split}'")).to_arrow_reader(50_000)
            # plain string types: DuckDB may hand out string views, which `datasets` does not take
            schema = pa.schema([pa.field(f.name, pa.string() if pa.types.is_string_view(f.type)
                                         or pa.types.is_large_string(f.type) else f.type)
                                for f in reader.schema])
            path = staging / f"{split}.arrow"
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
                for batch in reader:
                    writer.write_batch(batch if batch.schema == schema else batch.cast(schema))
            parts[split] = datasets.Dataset.from_file(str(path))
        datasets.DatasetDict(parts).save_to_disk(str(folder))
        del parts
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _manifest_path(out: Path, fmt: str) -> Path:
    return out / "snapshot.json" if fmt == "datasets" else out.with_name(out.name + ".snapshot.json")


def _sql_path(path: Path) -> str:
    return str(path).replace("'", "''")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def load_pairs_snapshot(path, split: str | None = None) -> list[dict]:
    """Rows of an exported snapshot (JSONL file, Parquet file, or datasets folder) as dicts.

    split: 'train' or 'test' to keep one split, None for all rows. Pure: needs no Store. Raises
    DataError when the data lacks prompt/chosen/rejected.
    """
    path = Path(path)
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
