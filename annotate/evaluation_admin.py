"""Models-tab handlers of blind evaluations: people judge whether a new policy is better.

An admin picks two or more policies and a number of held-out prompts; a sample-versions job
(pipeline/sample_versions.py) writes one answer per policy per prompt and the owner queues one
item per prompt (store/evaluations.py). Annotators rank those items in the ordinary queue with no
names shown. The section shows every evaluation with its job and progress, and the results of
one evaluation or of all: each pair's win rate and a Bradley-Terry leaderboard, each with a 95%
bootstrap interval over prompts (store/leaderboard.py); Download writes them as JSON.

Plain functions `(ctx, inputs..., request) -> updates`, wired by annotate/ui_train.py; each starts
with `admin(ctx, request)` (annotate/context.py).
"""

from __future__ import annotations

import json
import re

import gradio as gr
import pandas as pd

from annotate.context import AppContext, admin, served_copy
from annotate.train import settings_of
from pipeline.orchestrate.steps import submit_evaluation
from store.errors import StoreError

ALL = "All evaluations"
EVALUATION_COLUMNS = ["id", "name", "versions", "prompts", "items", "rankings", "job"]
LEADERBOARD_COLUMNS = ["rank", "version", "rating", "95% interval", "comparisons", "prompts", "wins"]
WIN_RATE_COLUMNS = ["A", "B", "A wins", "95% interval", "comparisons", "prompts"]


def evaluations_table(ctx: AppContext) -> pd.DataFrame:
    store = ctx.store
    names = {mv.id: mv.name for mv in store.list_model_versions()}
    runs = {r.id: r for r in store.list_runs(kind="sample-versions")}
    rows = []
    for ev in store.list_evaluations():
        run = runs.get(ev.run_id)
        rows.append({"id": ev.id, "name": ev.name, "versions": ", ".join(names.get(v, str(v)) for v in ev.version_ids),
                     "prompts": len(ev.prompt_ids), "items": ev.items, "rankings": ev.rankings,
                     "job": f"#{run.id} {run.status}" if run else ""})
    return pd.DataFrame(rows, columns=EVALUATION_COLUMNS)


def choices(ctx: AppContext, request: gr.Request):
    """(the policies to pick from, preset to the active one and its parent or else the two newest;
    the evaluation picker; the evaluations table)."""
    admin(ctx, request)
    policies = [mv.name for mv in ctx.store.list_model_versions("policy")]
    active = ctx.store.active_policy()
    parent = ctx.store.get_model_version(active.parent_id) if active and active.parent_id else None
    # the active policy against what it was trained from; else the two newest policies
    preset = [parent.name, active.name] if parent is not None else policies[-2:]
    names = [ALL] + [ev.name for ev in ctx.store.list_evaluations()]
    return (gr.update(choices=policies, value=preset), gr.update(choices=names, value=ALL), evaluations_table(ctx))


def start(ctx: AppContext, names: list[str] | None, n_prompts, name: str | None, request: gr.Request):
    """Queue a blind evaluation of the picked policies. Returns (message, picker, table)."""
    admin(ctx, request)
    if ctx.jobs is None:
        raise gr.Error("This app runs without a job runner, so it cannot sample the policies.")
    picked = [ctx.store.find_model_version(n) for n in (names or [])]
    if len(picked) < 2 or any(v is None or v.kind != "policy" for v in picked):
        raise gr.Error("Pick at least two policies from the list.")
    try:
        n = int(n_prompts)
    except (TypeError, ValueError):
        raise gr.Error(f"Prompts: enter a whole number (got {n_prompts!r}).") from None
    name = (name or "").strip() or " vs ".join(v.name for v in picked)
    try:
        run, ev = submit_evaluation(ctx.store, ctx.jobs, name, picked, n, settings_of(ctx))
    except (ValueError, StoreError) as exc:
        raise gr.Error(f"Cannot start the evaluation: {exc}.") from None
    _, picker, table = choices(ctx, request)
    return (f"Evaluation **{ev.name}** queued (job #{run.id}): {len(ev.prompt_ids)} held-out prompts, one answer "
            f"from each of {', '.join(v.name for v in picked)}. Its items join the annotation queue when the job "
            "is done; annotators see no names.", gr.update(choices=picker["choices"], value=ev.name), table)


def results(ctx: AppContext, which: str | None, request: gr.Request):
    """(summary markdown, leaderboard table, win-rate table, evaluations table) of one
    evaluation, or of all of them."""
    admin(ctx, request)
    ev = _evaluation(ctx, which)
    r = ctx.store.evaluation_results(None if ev is None else ev.id)
    board = pd.DataFrame([{"rank": i + 1, "version": x["version"], "rating": round(x["rating"]),
                           "95% interval": f"{x['low']:.0f} to {x['high']:.0f}", "comparisons": x["comparisons"],
                           "prompts": x["prompts"], "wins": x["wins"]}
                          for i, x in enumerate(r["leaderboard"])], columns=LEADERBOARD_COLUMNS)
    rates = pd.DataFrame([{"A": x["a"], "B": x["b"], "A wins": f"{x['win_rate']:.0%}",
                           "95% interval": f"{x['low']:.0%} to {x['high']:.0%}", "comparisons": x["comparisons"],
                           "prompts": x["prompts"]} for x in r["win_rates"]], columns=WIN_RATE_COLUMNS)
    scope = "every evaluation" if ev is None else f"**{ev.name}**"
    if not r["comparisons"]:
        text = f"No rankings of {scope} yet: its items are in the annotation queue once its job is done."
    else:
        text = (f"People's rankings of {scope}: {r['comparisons']} comparisons on {r['prompts']} prompts. Rating: "
                "Bradley-Terry strength on the Elo scale (400 points = 10:1 odds, mean 1000); intervals are 95% "
                "bootstrap intervals over prompts.")
    return text, board, rates, evaluations_table(ctx)


def download(ctx: AppContext, which: str | None, request: gr.Request) -> str:
    """The results shown, as a JSON file written to the exports folder; returns the copy Gradio serves."""
    admin(ctx, request)
    ev = _evaluation(ctx, which)
    r = ctx.store.evaluation_results(None if ev is None else ev.id)
    slug = "all" if ev is None else re.sub(r"[^A-Za-z0-9._-]+", "-", ev.name).strip("-") or str(ev.id)
    path = ctx.export_dir / f"evaluation-{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"evaluation": None if ev is None else {"id": ev.id, "name": ev.name},
                                **r}, indent=2), encoding="utf-8")
    return str(served_copy(path, "rlhf-evaluations"))


def _evaluation(ctx: AppContext, which: str | None):
    if not which or which == ALL:
        return None
    ev = ctx.store.find_evaluation(which)
    if ev is None:
        raise gr.Error(f"No evaluation named {which!r}: pick one from the list.")
    return ev
