"""Models-tab handlers: every model version with its lineage, metrics and samples; the active
policy; comparing two policies on held-out prompts; downloading a version as a Hugging Face
folder.

Plain functions `(ctx, inputs..., request) -> updates`, wired by annotate/ui_train.py and called
directly by tests. Each starts with `admin(ctx, request)` (annotate/context.py).

Lineage comes from the store's model versions: a policy names its parent policy, the reward model
PPO used and its run; a reward model names the snapshot (export) it was trained on, its run, and
the reward model it was warm-started from. A comparison is a `compare` job (pipeline/compare.py):
both policies sample, a reward model judges, and the result lands on policy A's version. A
download is an `export-model` job (pipeline/export_model.py: merging weights needs torch, which
the app process never loads); when it is done its zip is offered as a file.
"""

from __future__ import annotations

import json
from pathlib import Path

import gradio as gr
import pandas as pd

from annotate import monitor, render
from annotate.context import AppContext, admin, served_copy
from annotate.train import settings_of
from pipeline.model_card import REWARD_LOSSES
from pipeline.orchestrate.steps import held_out_prompts, submit_compare, submit_export
from pipeline.rundir import read_status

SIDE_BY_SIDE = 8
"""Prompts shown side by side after a comparison."""
SAMPLE_COLUMNS = ["prompt", "response", "score", "kl", "tokens", "finish_reason"]


def _names(store) -> dict[int, str]:
    return {mv.id: mv.name for mv in store.list_model_versions()}


def trained_by(mv) -> str:
    """How a version was trained, from what its run recorded (ingest.py): a policy's method (PPO,
    RLOO, GRPO or DPO with its loss), a reward model's loss; '' for the base model."""
    meta = mv.meta or {}
    if mv.kind == "policy" and meta.get("method"):
        method = str(meta["method"]).upper()
        return f"{method} ({meta['loss']})" if method == "DPO" and meta.get("loss") else method
    if mv.kind == "reward" and mv.path:
        return REWARD_LOSSES.get(meta.get("loss") or "bt", str(meta.get("loss")))
    return ""



def _summary(mv) -> str:
    """A version's headline numbers: held-out accuracy of a reward model; the last PPO step's
    score and KL of a policy; its latest comparison."""
    meta = mv.meta or {}
    ev, final = meta.get("eval") or {}, meta.get("final") or {}
    parts = []
    if "eval/accuracy" in ev:
        parts.append(f"acc {ev['eval/accuracy']:.3f}")
    if "objective/score" in final:
        parts.append(f"score {final['objective/score']:.3f}")
    if "objective/kl" in final:
        parts.append(f"KL {final['objective/kl']:.3f}")
    for key, value in meta.items():
        if key.startswith("compare/") and isinstance(value, dict) and "win_rate" in value:
            parts.append(f"wins {value['win_rate']:.0%} vs {key.split('/', 1)[1]}")
    return ", ".join(parts)


# ------------------------------------------------------------------------- the table and details


def models_table(ctx: AppContext, request: gr.Request) -> pd.DataFrame:
    """Every model version with its lineage and headline metrics; ● marks the active policy."""
    admin(ctx, request)
    store = ctx.store
    active = store.active_policy()
    names = _names(store)
    runs = {r.id: r for r in store.list_runs()}
    snapshots = {s.id: s for s in store.list_snapshots()}
    rows = []
    for mv in store.list_model_versions():
        run, snap = runs.get(mv.run_id), snapshots.get(mv.snapshot_id)
        rows.append({
            "id": mv.id, "name": mv.name, "kind": mv.kind,
            "active": "●" if active is not None and mv.id == active.id else "",
            "trained by": trained_by(mv),
            "parent": names.get(mv.parent_id, ""), "reward model": names.get(mv.reward_version_id, ""),
            "snapshot": f"#{snap.id} ({snap.counts.get('pairs', 0)} pairs)" if snap else "",
            "run": f"#{run.id} {run.kind}" if run else "", "metrics": _summary(mv),
            "base model": mv.base_model or "", "created": mv.created_at.strftime("%Y-%m-%d %H:%M"),
        })
    return pd.DataFrame(rows, columns=["id", "name", "kind", "active", "trained by", "parent", "reward model",
                                       "snapshot", "run", "metrics", "base model", "created"])


def version_choices(ctx: AppContext, request: gr.Request):
    """(details picker, policy A, policy B, reward model): B defaults to the active policy, A to
    its parent (what PPO improved on), the reward model to the newest."""
    admin(ctx, request)
    versions = ctx.store.list_model_versions()
    policies = [mv.name for mv in versions if mv.kind == "policy"]
    rewards = [mv.name for mv in versions if mv.kind == "reward" and mv.path]
    active = ctx.store.active_policy()
    parent = ctx.store.get_model_version(active.parent_id) if active and active.parent_id else None
    b = active.name if active else (policies[-1] if policies else None)
    a = parent.name if parent else next((n for n in policies if n != b), b)
    pick = active.name if active else (versions[-1].name if versions else None)
    return (gr.update(choices=[mv.name for mv in versions], value=pick),
            gr.update(choices=policies, value=a), gr.update(choices=policies, value=b),
            gr.update(choices=rewards, value=rewards[-1] if rewards else None))


def _version(ctx: AppContext, name: str | None, kind: str | None = None):
    mv = ctx.store.find_model_version(name) if name else None
    if mv is None or (kind is not None and mv.kind != kind):
        raise gr.Error(f"No {kind or 'model'} version named {name!r}: pick one from the list.")
    return mv


def open_tab(ctx: AppContext, request: gr.Request):
    """Everything the tab shows when opened: (table, details picker, policy A, policy B, reward
    model, then version_details of the preselected version)."""
    admin(ctx, request)
    table = models_table(ctx, request)
    pick, a, b, reward = version_choices(ctx, request)
    return (table, pick, a, b, reward, *version_details(ctx, pick["value"], request))


def version_details(ctx: AppContext, name: str | None, request: gr.Request):
    """(lineage markdown, metrics and meta as JSON, sample table, sample caption) of a version."""
    admin(ctx, request)
    if not name:
        return "No model versions yet.", {}, pd.DataFrame(columns=SAMPLE_COLUMNS), ""
    mv = _version(ctx, name)
    samples, caption = sample_table(ctx.store, mv)
    about = {"meta": mv.meta, "path": mv.path, "base_model": mv.base_model}
    return lineage_markdown(ctx.store, mv), about, samples, caption


def lineage_markdown(store, mv) -> str:
    """The version's ancestry, newest first: what trained each step and on what."""
    names = _names(store)
    lines = []
    for v in store.model_lineage(mv.id):
        facts = [f"**{v.name}** ({v.kind})"]
        if v.run_id is not None:
            run = store.get_run(v.run_id)
            facts.append(f"run #{run.id} {run.kind} ({run.status})")
        if v.reward_version_id is not None:
            reward = store.get_model_version(v.reward_version_id)
            facts.append(f"{trained_by(v) or 'PPO'} against **{reward.name}**" + _reward_origin(store, reward, names))
        if v.snapshot_id is not None:
            facts.append(_snapshot_text(store, v.snapshot_id))
        if v.parent_id is None:
            facts.append(f"base model `{v.base_model}`" if v.path is None else "no parent")
        lines.append("- " + " · ".join(facts) + (f" · from **{names[v.parent_id]}**" if v.parent_id else ""))
    users = [u.name for u in store.list_model_versions() if mv.id in (u.parent_id, u.reward_version_id)]
    if users:
        lines.append(f"\nUsed to train: {', '.join(f'**{n}**' for n in users)}")
    return "\n".join(lines)


def _snapshot_text(store, snapshot_id: int) -> str:
    snap = store.get_snapshot(snapshot_id)
    return f"trained on snapshot #{snap.id} ({snap.counts.get('pairs', 0)} pairs, `{Path(snap.path).name}`)"


def _reward_origin(store, reward, names) -> str:
    bits = [_snapshot_text(store, reward.snapshot_id)] if reward.snapshot_id is not None else []
    if reward.parent_id is not None:
        bits.append(f"warm-started from {names.get(reward.parent_id)}")
    return f" ({', '.join(bits)})" if bits else ""


def sample_table(store, mv) -> tuple[pd.DataFrame, str]:
    """The newest PPO sample table (run dir samples/step_N.jsonl) of the run that made `mv`."""
    cols = SAMPLE_COLUMNS
    run = store.get_run(mv.run_id) if mv.run_id is not None else None
    folder = Path(run.run_dir) / "samples" if run is not None and run.run_dir else None
    files = sorted(folder.glob("step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1])) \
        if folder is not None and folder.is_dir() else []
    if not files:
        why = {"reward": "a reward model has no PPO samples",
               "external": "an external model, whose responses were imported"}.get(
                   mv.kind, "no PPO run made this version")
        return pd.DataFrame(columns=cols), f"No sample table: {why}."
    rows = [json.loads(line) for line in files[-1].read_text(encoding="utf-8").splitlines() if line.strip()]
    for row in rows:
        if not isinstance(row.get("prompt"), str):
            row["prompt"] = json.dumps(row.get("prompt"), ensure_ascii=False)
    return pd.DataFrame(rows, columns=cols), f"PPO samples at step {files[-1].stem.split('_')[1]} of run #{run.id}."


def set_active(ctx: AppContext, name: str | None, request: gr.Request):
    """Make a policy version the one that generates new responses. Returns (message, table)."""
    admin(ctx, request)
    mv = _version(ctx, name, "policy")
    ctx.store.set_active_policy(mv.id)
    return f"**{mv.name}** is now the active policy: new responses come from it.", models_table(ctx, request)


# ------------------------------------------------------------------------- comparing two policies


def compare(ctx: AppContext, a_name: str | None, b_name: str | None, reward_name: str | None, n_prompts,
            request: gr.Request):
    """Queue a `compare` job: policy A against policy B on held-out prompts, judged by a reward
    model. Returns (progress bar, timer)."""
    admin(ctx, request)
    if ctx.jobs is None:
        raise gr.Error("This app runs without a job runner, so it cannot compare policies.")
    a, b = _version(ctx, a_name, "policy"), _version(ctx, b_name, "policy")
    reward = _version(ctx, reward_name, "reward")
    try:
        n = int(n_prompts)
    except (TypeError, ValueError):
        raise gr.Error(f"Prompts: enter a whole number (got {n_prompts!r}).") from None
    prompts = held_out_prompts(ctx.store, max(1, n))
    if not prompts:
        raise gr.Error("No held-out prompts left (every prompt has responses or trained a policy): "
                       "import more prompts in Data → Import.")
    try:
        submit_compare(ctx.store, ctx.jobs, a, b, reward, prompts, settings_of(ctx))
    except ValueError as exc:
        raise gr.Error(f"Cannot compare: {exc}.") from None
    bar, *_ = compare_poll(ctx, request)
    return bar, gr.update(active=True)


def compare_poll(ctx: AppContext, request: gr.Request):
    """(progress bar, result markdown, side-by-side table, timer) of the newest comparison."""
    admin(ctx, request)
    runs = ctx.store.list_runs(kind="compare", limit=1)
    empty = pd.DataFrame(columns=["prompt", "A", "A score", "B", "B score"])
    if not runs:
        return render.render_job("Compare", 0, 0, "idle", "Pick two policies and a reward model."), "", empty, \
            gr.update(active=False)
    run = runs[0]
    bar = monitor.job_bar(run, run.config.get("label"))
    if run.status != "done":
        return bar, "", empty, gr.update(active=run.status in ("queued", "running"))
    r, i = json.loads((Path(run.run_dir) / "result.json").read_text(encoding="utf-8")), run.inputs
    text = (f"**{i['a_name']}** vs **{i['b_name']}** on {r['prompts']} held-out prompts, judged by "
            f"**{i['reward_name']}**: {i['a_name']} wins **{r['win_rate']:.0%}** ± {r['stderr']:.0%} (ties count "
            f"half); mean normalised reward {r['mean_a']:+.3f} vs {r['mean_b']:+.3f}.")
    table = pd.DataFrame([{"prompt": row["prompt"] if isinstance(row["prompt"], str) else json.dumps(row["prompt"]),
                           "A": row["response_a"], "A score": round(row["score_a"], 3),
                           "B": row["response_b"], "B score": round(row["score_b"], 3)}
                          for row in r["rows"][:SIDE_BY_SIDE]], columns=empty.columns)
    return bar, text, table, gr.update(active=False)


# ------------------------------------------------------------------------- downloading a version


def export_model(ctx: AppContext, name: str | None, request: gr.Request):
    """Queue an `export-model` job for the picked version: a policy with its LoRA merged, or a
    reward model as a sequence classifier, each with a model card. Returns (bar, file, timer)."""
    admin(ctx, request)
    if ctx.jobs is None:
        raise gr.Error("This app runs without a job runner, so it cannot export models.")
    mv = _version(ctx, name)
    try:
        submit_export(ctx.store, ctx.jobs, mv)
    except ValueError as exc:
        raise gr.Error(f"Cannot export: {exc}.") from None
    bar, file, _ = export_poll(ctx, request)
    return bar, file, gr.update(active=True)


def export_poll(ctx: AppContext, request: gr.Request):
    """(progress bar, zip to download or None, timer) of the newest export."""
    admin(ctx, request)
    runs = ctx.store.list_runs(kind="export-model", limit=1)
    if not runs:
        return render.render_job("Download", 0, 0, "idle", "Pick a version, then Download."), None, \
            gr.update(active=False)
    run = runs[0]
    bar = monitor.job_bar(run, run.config.get("label"))
    if run.status != "done":
        return bar, None, gr.update(active=run.status in ("queued", "running"))
    archive = read_status(Path(run.run_dir)).get("archive")
    path = Path(run.run_dir) / archive if archive else None
    if path is None or not path.is_file():
        raise gr.Error(f"Run #{run.id} finished but its archive is missing from {run.run_dir}.")
    return bar, str(served_copy(path, "rlhf-loop-exports")), gr.update(active=False)
