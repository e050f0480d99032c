"""Train-tab handlers: train a reward model, run PPO, run a loop round, and watch any job.

Plain functions `(ctx, inputs..., request) -> updates` that annotate/ui_train.py wires to
components; tests call them directly. Each starts with `admin(ctx, request)`, so an annotator
reaching them through the HTTP API gets `Refused` before anything is read or written.

Every model-touching step is a subprocess job of the app's job runner (`ctx.jobs`, a
pipeline.orchestrate.jobs.JobRunner: DESIGN.md, Process model). The handlers only build command lines from
the form and the app's settings (`ctx.train_settings`, a pipeline.orchestrate.loop.LoopSettings: base model,
device, LoRA rank ...) and submit them; the runner records the run, tails its metrics into the
store and registers the model version it produced. A round ("Run a full round", "Start the next
round") waits for several jobs in turn, so it runs in a background task (annotate/tasks.py) using
pipeline/orchestrate/loop.py, the same code as the headless `python -m pipeline loop`.

The job monitor follows one run (or "latest", the newest): a progress bar from its status.json,
plots of its metrics from the store, the tail of its log, and Cancel.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import math
from pathlib import Path

import gradio as gr
import pandas as pd

from annotate import render
from annotate.context import AppContext, admin
from annotate.tasks import start_task, task_status
from pipeline.config import ModelConfig, to_cli_args, to_dict
from pipeline.orchestrate.loop import (LoopSettings, current_round, ensure_base_policy, finish_round, latest_reward,
                           start_round, write_prompts)
from pipeline.rundir import read_status
from store.errors import StoreError

NO_JOBS = ("This app runs without a job runner, so training cannot start here. Train from the "
           "command line instead (`python -m pipeline train-reward --help`, `python -m pipeline ppo "
           "--help`, `python -m pipeline loop --help`) while the app is stopped.")
LATEST = "latest"
KL_CONTROLS = ("adaptive", "x1.5", "fixed")
ROUND_TASK = "round"

# Plots of the job monitor: title -> metric keys (flat, namespaced, as the training scripts write them).
PLOTS = {
    "Reward / score": ["objective/score", "objective/rlhf_reward", "train/margin", "eval/margin"],
    "KL to the reference (nats)": ["objective/kl"],
    "β (KL coefficient)": ["kl/beta"],
    "Losses": ["train/loss", "eval/loss", "policy/loss", "val/loss"],
    "Accuracy": ["train/accuracy", "eval/accuracy"],
}


def settings_of(ctx: AppContext) -> LoopSettings:
    """A private copy of the app's training settings (the forms change fields of it)."""
    settings = ctx.train_settings
    if settings is None:  # the app's own model and generation settings, else the defaults
        settings, d = LoopSettings(), ctx.generate_defaults
        model_cfg = getattr(ctx.generator, "model_cfg", None)
        if model_cfg is not None:
            settings.model.model, settings.model.device = model_cfg.model, model_cfg.device
        settings.generate.k = int(d.get("k", settings.generate.k))
        settings.generate.max_new_tokens = int(d.get("max_new_tokens", settings.generate.max_new_tokens))
    return copy.deepcopy(settings)


def _jobs(ctx: AppContext):
    if ctx.jobs is None:
        raise gr.Error(NO_JOBS)
    return ctx.jobs


# ------------------------------------------------------------------------- form values


def _number(value, name: str, *, minimum: float, integer: bool = False) -> float:
    """A form number, checked: gr.Error names the field when it is missing or out of range."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise gr.Error(f"{name}: enter a number (got {value!r}).") from None
    if not math.isfinite(x) or x < minimum or (integer and x != int(x)):
        kind = "a whole number" if integer else "a number"
        raise gr.Error(f"{name}: must be {kind} >= {minimum:g} (got {value!r}).")
    return int(x) if integer else x


def reward_settings(settings: LoopSettings, lora, epochs, lr, batch_size) -> LoopSettings:
    """The reward form's values on top of the app's settings."""
    settings.model.lora = bool(lora)
    settings.reward.epochs = _number(epochs, "Epochs", minimum=1, integer=True)
    settings.reward.lr = _number(lr, "Reward learning rate", minimum=1e-12)
    settings.reward.batch_size = _number(batch_size, "Batch size", minimum=1, integer=True)
    return settings


def ppo_settings(settings: LoopSettings, lora, n_prompts, steps, kl_control, beta, kl_target, lr,
                 critic_lr) -> LoopSettings:
    """The PPO form's values on top of the app's settings."""
    if kl_control not in KL_CONTROLS:
        raise gr.Error(f"KL control: choose one of {', '.join(KL_CONTROLS)} (got {kl_control!r}).")
    settings.model.lora = bool(lora)
    settings.ppo_prompts = _number(n_prompts, "PPO prompts", minimum=1, integer=True)
    settings.ppo.steps = _number(steps, "Steps", minimum=1, integer=True)
    settings.ppo.kl_control = kl_control
    settings.ppo.init_kl_coef = _number(beta, "β (initial KL coefficient)", minimum=0)
    settings.ppo.kl_target = _number(kl_target, "KL target", minimum=1e-6)
    settings.ppo.lr = _number(lr, "Policy learning rate", minimum=1e-12)
    settings.ppo.critic_lr = _number(critic_lr, "Critic learning rate", minimum=1e-12)
    return settings


def round_settings(settings: LoopSettings, prompts_per_round, k, strategy) -> LoopSettings:
    if strategy not in ("random", "uncertain"):
        raise gr.Error(f"Prompt selection: choose random or uncertain (got {strategy!r}).")
    settings.loop.prompts_per_round = _number(prompts_per_round, "Prompts per round", minimum=1, integer=True)
    settings.generate.k = _number(k, "K responses per prompt", minimum=2, integer=True)
    settings.loop.strategy = strategy
    return settings


def model_args(model_cfg: ModelConfig, base_model: str | None) -> list[str]:
    """The ModelConfig options of a job, with `base_model` as its --model."""
    return to_cli_args(dataclasses.replace(model_cfg, model=base_model or model_cfg.model))


def _base_model(ctx: AppContext, settings: LoopSettings) -> str:
    active = ctx.store.active_policy()
    return active.base_model if active is not None and active.base_model else settings.model.model


# ------------------------------------------------------------------------- starting jobs


def train_reward(ctx: AppContext, lora: bool, epochs, lr, batch_size, warm_start: bool, request: gr.Request):
    """Export a snapshot of every pair (Parquet, recorded in the store), then queue a
    `train-reward` job on it. Returns (message, run choice, timer)."""
    admin(ctx, request)
    jobs = _jobs(ctx)
    settings = reward_settings(settings_of(ctx), lora, epochs, lr, batch_size)
    from store.export import export_pairs

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    try:
        snapshot = export_pairs(ctx.store, ctx.runs_dir / "snapshots" / f"pairs-{stamp}.parquet", "parquet")
    except StoreError as exc:
        raise gr.Error(f"Cannot train a reward model yet: {exc}") from None
    previous = latest_reward(ctx.store) if warm_start else None
    previous = previous if previous is not None and previous.path else None
    args = ["--data", snapshot.path, *to_cli_args(settings.reward),
            *model_args(settings.model, _base_model(ctx, settings))]
    if previous is not None:
        args += ["--init-from", previous.path]
    run = jobs.submit("train-reward", args,
                      config={"reward": to_dict(settings.reward), "model": to_dict(settings.model)},
                      inputs={"snapshot_id": snapshot.id, "parent_version_id": previous.id if previous else None})
    warm = f", warm-started from {previous.name}" if previous is not None else ""
    msg = (f"Queued **run #{run.id}** (train-reward) on snapshot #{snapshot.id}: "
           f"{snapshot.counts.get('pairs', 0)} pairs{warm}.")
    return msg, run_picker(ctx, LATEST), gr.update(active=True)


def run_ppo(ctx: AppContext, lora: bool, reward_name: str | None, n_prompts, steps, kl_control, beta, kl_target,
            lr, critic_lr, activate: bool, request: gr.Request):
    """Queue a `ppo` job from the active policy against the chosen reward model (default: the
    newest). With `activate`, the new policy becomes the active one when the job succeeds.
    Returns (message, run choice, timer)."""
    admin(ctx, request)
    jobs = _jobs(ctx)
    settings = ppo_settings(settings_of(ctx), lora, n_prompts, steps, kl_control, beta, kl_target, lr, critic_lr)
    reward = ctx.store.find_model_version(reward_name) if reward_name else latest_reward(ctx.store)
    if reward is None or reward.kind != "reward" or not reward.path:
        raise gr.Error(f"No trained reward model named {reward_name!r}." if reward_name else
                       "No reward model yet: train one first.")
    policy = ensure_base_policy(ctx.store, settings.model)
    prompts = ctx.store.list_prompts(limit=settings.ppo_prompts)  # as pipeline/orchestrate/loop.py: the first N
    if not prompts:
        raise gr.Error("No prompts to train on: import prompts in Data → Import first.")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    prompts_file = write_prompts(prompts, ctx.runs_dir / "inputs" / f"ppo-{stamp}-prompts.jsonl")
    args = ["--prompts", str(prompts_file), "--reward", reward.path, *to_cli_args(settings.ppo),
            *model_args(settings.model, policy.base_model)]
    if policy.path:
        args += ["--policy", policy.path]
    store = ctx.store

    def make_active(run):  # in the runner's thread, after the new version is registered
        if activate and run.status == "done":
            store.set_active_policy(run.outputs["model_version_id"])

    run = jobs.submit("ppo", args, config={"ppo": to_dict(settings.ppo), "model": to_dict(settings.model)},
                      inputs={"policy_version_id": policy.id, "reward_version_id": reward.id}, on_done=make_active)
    then = " It becomes the active policy when it finishes." if activate else ""
    msg = (f"Queued **run #{run.id}** (PPO): {policy.name} against {reward.name}, {settings.ppo.steps} steps "
           f"on {len(prompts)} prompts.{then}")
    return msg, run_picker(ctx, LATEST), gr.update(active=True)


# ------------------------------------------------------------------------- rounds


def _start_round(store, jobs, settings: LoopSettings):
    """pipeline.orchestrate.loop.start_round; a round it leaves half-made is marked failed."""
    try:
        return start_round(store, jobs, settings, len(store.list_rounds()))
    except Exception as exc:
        for rnd in store.list_rounds()[-1:]:
            if rnd.status == "generating":
                store.update_round(rnd.id, status="failed", meta={"error": str(exc)[:2000]})
        raise


def run_full_round(ctx: AppContext, lora: bool, epochs, rm_lr, rm_batch, n_prompts, steps, kl_control, beta,
                   kl_target, ppo_lr, critic_lr, prompts_per_round, k, strategy, request: gr.Request):
    """Finish the round being annotated (snapshot -> reward model -> PPO -> new active policy,
    pipeline.orchestrate.loop.finish_round) and start the next (generate with the new policy); with no open
    round, start the first. Runs in the background; if training fails (or is cancelled) the round
    stays open for another try. Returns (message, run choice, timer)."""
    admin(ctx, request)
    jobs = _jobs(ctx)
    settings = reward_settings(settings_of(ctx), lora, epochs, rm_lr, rm_batch)
    settings = ppo_settings(settings, lora, n_prompts, steps, kl_control, beta, kl_target, ppo_lr, critic_lr)
    settings = round_settings(settings, prompts_per_round, k, strategy)
    store = ctx.store
    open_round = current_round(store)

    def work(task):
        rnd = current_round(store)
        finished = None
        if rnd is not None:
            task.update(detail=f"round {rnd.id}: snapshot → reward model → PPO")
            try:
                finished = finish_round(store, jobs, rnd, settings)
            except Exception as exc:
                # the round stays open with its rankings, so the admin can fix the cause and retry
                store.update_round(rnd.id, status="annotating", meta={"last_error": str(exc)[:2000]})
                raise
        task.update(detail="next round: generating with the active policy")
        new = _start_round(store, jobs, settings)
        return {"finished": finished.id if finished else None, "started": new.id}

    label = f"Round {open_round.id} → next round" if open_round else "First round"
    _start(ctx, label, work)
    what = (f"Finishing round {open_round.id} (reward model, PPO), then starting the next one."
            if open_round else "Starting the first round: generating responses with the active policy.")
    return what, run_picker(ctx, LATEST), gr.update(active=True)


def start_next_round(ctx: AppContext, prompts_per_round, k, strategy, request: gr.Request):
    """Close the round being annotated without training in it (a policy trained from its policy,
    e.g. by Run PPO, is recorded as its outcome), then generate the next round with the active
    policy. Runs in the background. Returns (message, run choice, timer)."""
    admin(ctx, request)
    jobs = _jobs(ctx)
    settings = round_settings(settings_of(ctx), prompts_per_round, k, strategy)
    store = ctx.store

    def work(task):
        rnd = current_round(store)
        if rnd is not None:
            close_round(store, rnd)
        task.update(detail="generating with the active policy")
        return {"closed": rnd.id if rnd else None, "started": _start_round(store, jobs, settings).id}

    _start(ctx, "Next round", work)
    return ("Starting the next round: generating responses with the active policy.", run_picker(ctx, LATEST),
            gr.update(active=True))


def close_round(store, rnd):
    """Mark an annotating round done. If the active policy was trained from the round's policy,
    it (with its reward model and that model's snapshot) is recorded as the round's outcome."""
    active = store.active_policy()
    if active is not None and active.parent_id == rnd.policy_version_id:
        reward = store.get_model_version(active.reward_version_id) if active.reward_version_id else None
        return store.update_round(rnd.id, status="done", new_policy_version_id=active.id,
                                  reward_version_id=reward.id if reward else None,
                                  snapshot_id=reward.snapshot_id if reward else None,
                                  meta={"closed": "by 'Start the next round'; trained by separate runs"})
    return store.update_round(rnd.id, status="done", meta={"closed": "by 'Start the next round', no new policy"})


def _start(ctx: AppContext, label: str, work) -> None:
    try:
        start_task(ctx, ROUND_TASK, label, work)
    except RuntimeError as exc:
        raise gr.Error(str(exc)) from None


# ------------------------------------------------------------------------- the job monitor


def run_picker(ctx: AppContext, value: str | None):
    """The monitor's run picker: "latest" (follows new jobs), then the 50 newest runs."""
    runs = ctx.store.list_runs(limit=50)
    choices = [("Latest job (follows new jobs)", LATEST)] + [
        (f"#{r.id} {r.kind} · {r.created_at:%Y-%m-%d %H:%M}", str(r.id)) for r in runs]
    keep = value if value in {v for _, v in choices} else LATEST
    return gr.update(choices=choices, value=keep)


def reward_names(store) -> list[str]:
    """Reward model versions with a checkpoint, oldest first."""
    return [mv.name for mv in store.list_model_versions("reward") if mv.path]


def reward_picker(ctx: AppContext, value: str | None):
    """The PPO form's reward model picker: trained reward versions, the newest preselected."""
    names = reward_names(ctx.store)
    return gr.update(choices=names, value=value if value in names else (names[-1] if names else None))


def _resolve(ctx: AppContext, choice: str | None):
    if not choice or choice == LATEST:
        runs = ctx.store.list_runs(limit=1)
        return runs[0] if runs else None
    try:
        return ctx.store.get_run(int(choice))
    except (ValueError, StoreError):
        raise gr.Error(f"No run {choice!r}: pick one from the list.") from None


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


def poll(ctx: AppContext, choice: str | None, reward_value: str | None, request: gr.Request):
    """Everything the monitor shows for the chosen run: (progress bar, one update per plot,
    latest values, log tail, round status, run picker, reward picker, timer). The timer keeps
    ticking only while a job or a round task is in flight."""
    admin(ctx, request)
    run = _resolve(ctx, choice)
    metrics = ctx.store.metrics(run.id) if run is not None else []
    frames = metric_frames(metrics)
    plots = [gr.update(value=df, visible=len(df) > 0) for df in frames.values()]
    task = task_status(ctx, ROUND_TASK)
    in_flight = (run is not None and run.status in ("queued", "running") and ctx.jobs is not None
                 and ctx.jobs.busy()) or (task is not None and task.running)
    return (job_bar(ctx, run), *plots, latest_values(metrics), log_tail(run),
            round_status(ctx), run_picker(ctx, choice), reward_picker(ctx, reward_value),
            gr.update(active=in_flight))


def job_bar(ctx: AppContext, run) -> str:
    if run is None:
        return render.render_job("No jobs yet", 0, 0, "idle", "Start one above.")
    status = {} if not run.run_dir else (
        ctx.jobs.progress(run.id) if ctx.jobs is not None else read_status(Path(run.run_dir)))
    step, total = int(status.get("step") or 0), int(status.get("total") or 0)
    if run.status == "done" and total == 0:
        step = total = 1
    if run.status == "queued":
        detail = "waiting for the device (one job at a time)"
    elif run.error:
        detail = run.error.strip().splitlines()[0][:300]
    elif run.status == "done":
        detail = ", ".join(f"{k}: {v}" for k, v in run.outputs.items()) or "finished"
    else:
        detail = status.get("phase") or status.get("message") or ""
    return render.render_job(f"Run #{run.id} · {run.kind}", step, total, run.status, detail)


def latest_values(metrics) -> pd.DataFrame:
    """The last value of every metric of the run (the plots show their history)."""
    last: dict[str, tuple[int, float]] = {}
    for m in metrics:
        if not math.isnan(m.value):
            last[m.key] = (m.step, m.value)
    return pd.DataFrame([{"metric": k, "step": s, "value": round(v, 5)} for k, (s, v) in sorted(last.items())],
                        columns=["metric", "step", "value"])


def log_tail(run, lines: int = 40) -> str:
    """The last lines of the run's log.txt. tqdm redraws its line with carriage returns, so lines
    are split on newlines only and each shows its last state."""
    if run is None or not run.run_dir:
        return ""
    try:
        with open(Path(run.run_dir) / "log.txt", "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    rows = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.rstrip("\n").split("\n")]
    return "\n".join(rows[-lines:])


def round_status(ctx: AppContext) -> str:
    """A line about the newest round and the round task, if any."""
    parts = []
    rounds = ctx.store.list_rounds()
    if rounds:
        rnd = rounds[-1]
        c = ctx.store.round_counts(rnd.id)
        parts.append(f"**Round {rnd.id}** · {rnd.status} · {c['items']} items, {c['rankings']} rankings")
    else:
        parts.append("No rounds yet: **Run a full round** starts the first one.")
    task = task_status(ctx, ROUND_TASK)
    if task is not None:
        parts.append(f"{task.label}: {task.status}" + (f" ({task.error or task.detail})"
                                                       if task.error or task.detail else ""))
    return " · ".join(parts)


def cancel(ctx: AppContext, choice: str | None, request: gr.Request) -> str:
    """Cancel the chosen (or latest) run: queued never starts; running gets SIGTERM, then SIGKILL."""
    admin(ctx, request)
    jobs = _jobs(ctx)
    run = _resolve(ctx, choice)
    if run is None or run.status not in ("queued", "running"):
        raise gr.Error("Nothing to cancel: the chosen run is not queued or running.")
    try:
        jobs.cancel(run.id)
    except KeyError:
        raise gr.Error(f"Run #{run.id} was not started by this app, so it cannot be cancelled here.") from None
    return f"Cancelling run #{run.id} ({run.kind}): it saves a checkpoint and stops."


def fail_interrupted_jobs(store) -> int:
    """At app start: job runs left in flight by a previous app process are over (their
    subprocesses died with it): mark them failed. A round caught generating failed too; one caught
    training goes back to annotating (its rankings are kept) for another try. Returns how many
    runs were marked."""
    n = 0
    for status in ("queued", "running"):
        for run in store.list_runs(status=status):
            if run.kind in ("train-reward", "ppo", "generate"):
                store.update_run(run.id, status="failed", error="interrupted: the app stopped before it finished")
                n += 1
    for rnd in store.list_rounds():
        if rnd.status == "generating":
            store.update_round(rnd.id, status="failed", meta={"error": "interrupted: the app stopped"})
        elif rnd.status == "training":
            store.update_round(rnd.id, status="annotating", meta={"last_error": "interrupted: the app stopped"})
    return n
