"""What the store knows of a model version, as plain JSON: the lineage a model card shows.

`version_lineage(store, mv)` gathers names, the data snapshot and its hash, the run, evaluation
figures, comparisons and people's blind rankings (`human_evaluation`). The Models tab's Download
writes it to a file for its export-model job (a job never opens the database), and
`find_version(source, db)` is the export-model CLI's `--db`: a version named or numbered in the
store at that path, with its lineage. pipeline/export_model.py and pipeline/model_card.py turn it
into a Hugging Face folder and its README.md.
"""

from __future__ import annotations

from pathlib import Path

from store.db import default_db_path
from store.errors import StoreError
from store.repo import Store


def version_lineage(store, mv) -> dict:
    """What the store knows of model version `mv`. Plain JSON (a job gets it as a file)."""
    names = {v.id: v.name for v in store.list_model_versions()}
    reward = store.get_model_version(mv.reward_version_id) if mv.reward_version_id is not None else None
    # a reward model and a DPO policy name their data; a PPO policy's is its reward model's
    snapshot_id = mv.snapshot_id or (reward.snapshot_id if reward else None)
    snap = store.get_snapshot(snapshot_id) if snapshot_id is not None else None
    run = store.get_run(mv.run_id) if mv.run_id is not None else None
    meta = mv.meta or {}
    return {
        "name": mv.name, "kind": mv.kind, "created_at": mv.created_at.isoformat(), "base_model": mv.base_model,
        "path": mv.path, "parent": names.get(mv.parent_id), "reward_model": reward.name if reward else None,
        "snapshot": None if snap is None else {
            "id": snap.id, "file": Path(snap.path).name, "format": snap.format, "counts": snap.counts,
            "sha256": snap.sha256, "created_at": snap.created_at.isoformat()},
        "run": None if run is None else {"id": run.id, "kind": run.kind, "status": run.status},
        "eval": meta.get("eval") or {}, "final": meta.get("final") or {},
        "comparisons": {k.split("/", 1)[1]: v for k, v in meta.items() if k.startswith("compare/")},
        "human_evaluation": human_evaluation(store, mv.name),
    }


def human_evaluation(store, name: str) -> dict | None:
    """What people's blind rankings say of version `name` (store/evaluations.py, over every
    evaluation): the leaderboard it is on and its win rates; None if no one has compared it."""
    results = store.evaluation_results()
    if not any(row["version"] == name for row in results["leaderboard"]):
        return None
    return {"leaderboard": results["leaderboard"], "prompts": results["prompts"],
            "win_rates": [r for r in results["win_rates"] if name in (r["a"], r["b"])]}


def find_version(source: str, db: str | None) -> tuple[dict, object]:
    """(lineage, version) of the version named (or numbered) `source` in the store at `db`
    (default: the app's database), opened only for this and closed again."""
    path = Path(db) if db else default_db_path()
    if not path.is_file():
        raise FileNotFoundError(f"{source}: not a folder, and no store at {path} to find a model version in (--db)")
    try:
        store = Store(path)
    except StoreError as exc:
        raise ValueError(f"{exc}. Export from the app's Models tab (Download), or pass the version's folder") from None
    try:
        mv = store.find_model_version(source)
        if mv is None and source.isdigit():
            mv = next((v for v in store.list_model_versions() if v.id == int(source)), None)
        if mv is None:
            names = ", ".join(v.name for v in store.list_model_versions()) or "none yet"
            raise ValueError(f"{source}: not a folder, and no model version of that name or id in {path} "
                             f"(versions: {names})")
        return version_lineage(store, mv), mv
    finally:
        store.close()
