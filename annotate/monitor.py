"""What the app shows of a job: its progress bar, metric plots, latest values and log tail.

Plain functions of a store Run (and the job runner that reads its run directory); the Train tab's
monitor, the Data tab's generation bar and the Models tab's comparison bar all use them.
"""

from __future__ import annotations

import math
from pathlib import Path

import gradio as gr
import pandas as pd

from annotate import render
from annotate.context import AppContext
from pipeline.orchestrate.jobs import tail_text
from pipeline.rundir import read_status
from store.errors import StoreError

LATEST = "latest"

# Plots of the job monitor: title -> metric keys (flat, namespaced, as the training scripts write them).
PLOTS = {
    "Reward / score": ["objective/score", "objective/rlhf_reward", "train/margin", "eval/margin"],
    "KL to the reference (nats)": ["objective/kl", "kl/heldout"],
    "β (KL coefficient)": ["kl/beta"],
    "Losses": ["train/loss", "eval/loss", "policy/loss", "val/loss"],
    "Accuracy": ["train/accuracy", "eval/accuracy", "train/reward_accuracy", "eval/reward_accuracy"],  # RM; DPO
    "Response length (tokens)": ["gen/length_mean"],
    "EOS rate": ["gen/eos_rate"],
}


def run_picker(ctx: AppContext, value: str | None):
    """The monitor's run picker: "latest" (follows new jobs), then the 50 newest runs."""
    runs = ctx.store.list_runs(limit=50)
    choices = [("Latest job (follows new jobs)", LATEST)] + [
        (f"#{r.id} {r.kind} · {r.created_at:%Y-%m-%d %H:%M}", str(r.id)) for r in runs]
    keep = value if value in {v for _, v in choices} else LATEST
    return gr.update(choices=choices, value=keep)


def resolve_run(ctx: AppContext, choice: str | None, kind: str | None = None):
    """The run a picker value names; "latest" (or nothing) = the newest run (of `kind`)."""
    if not choice or choice == LATEST:
        runs = ctx.store.list_runs(kind=kind, limit=1)
        return runs[0] if runs else None
    try:
        return ctx.store.get_run(int(choice))
    except (ValueError, StoreError):
        raise gr.Error(f"No run {choice!r}: pick one from the list.") from None


def job_bar(run, label: str | None = None) -> str:
    """A run's progress bar: its status.json's step/total, and a line on how it stands."""
    if run is None:
        return render.render_job(label or "No jobs yet", 0, 0, "idle", "Start one above.")
    status = read_status(Path(run.run_dir)) if run.run_dir else {}
    step, total = int(status.get("step") or 0), int(status.get("total") or 0)
    if run.status == "done" and total == 0:
        step = total = 1
    if run.status == "queued":
        detail = "waiting for the devices (one job at a time)"
    elif run.error:
        detail = run.error.strip().splitlines()[0][:300]
    elif run.status == "done":
        detail = ", ".join(f"{k}: {v}" for k, v in run.outputs.items() if k not in ("pid", "start")) or "finished"
    else:
        detail = status.get("phase") or status.get("message") or ""
    title = f"Run #{run.id} · {run.kind}" + (f" · {label}" if label else "")
    return render.render_job(title, step, total, run.status, detail)


def metric_frames(metrics, max_points: int = 400) -> dict[str, pd.DataFrame]:
    """{plot title: long frame (step, value, metric)} of a run's metrics, one entry per PLOTS.
    A long run is thinned to about `max_points` steps per line (the last step always kept)."""
    df = pd.DataFrame([(m.step, m.key, m.value) for m in metrics], columns=["step", "metric", "value"])
    df = df[df["value"].notna()]
    if len(df):
        steps = sorted(df["step"].unique())
        stride = max(1, len(steps) // max_points)
        keep = set(steps[::stride]) | {steps[-1]}
        df = df[df["step"].isin(keep)]
    return {title: df[df["metric"].isin(keys)].reset_index(drop=True) for title, keys in PLOTS.items()}


def latest_values(metrics) -> pd.DataFrame:
    """The last value of every metric of the run (the plots show their history)."""
    last: dict[str, tuple[int, float]] = {}
    for m in metrics:
        if not math.isnan(m.value):
            last[m.key] = (m.step, m.value)
    return pd.DataFrame([{"metric": k, "step": s, "value": round(v, 5)} for k, (s, v) in sorted(last.items())],
                        columns=["metric", "step", "value"])


def log_tail(run, lines: int = 40) -> str:
    """The last lines of the run's log.txt."""
    if run is None or not run.run_dir:
        return ""
    return tail_text(Path(run.run_dir) / "log.txt", lines)


def round_status(ctx: AppContext, settings) -> str:
    """A line about the newest round: status, counts, and why its last step failed. An open round
    is counted as its threshold counts it (loop.coverage: its own rankable items, no gold or
    flagged ones), so the line and "finish anyway?" say the same numbers."""
    from pipeline.orchestrate.loop import coverage, generation_stopped

    rounds = ctx.store.list_rounds()
    if not rounds:
        return "No rounds yet: **Run a full round** starts the first one."
    rnd = rounds[-1]
    if rnd.status == "annotating":
        line = f"**Round {rnd.id}** · {rnd.status} · {coverage(ctx.store, rnd, settings).counts()}"
    else:
        c = ctx.store.round_counts(rnd.id)
        line = f"**Round {rnd.id}** · {rnd.status} · {c['items']} items, {c['rankings']} rankings"
    error = rnd.meta.get("last_error")
    if not error:
        return line
    retry = ("**Run a full round** generates the rest" if generation_stopped(rnd) else "retry with the same button")
    return line + f" · ✗ {error.splitlines()[0][:300]} ({retry})"
