"""Train-tab handlers: train a reward model, run PPO, fine-tune on the annotators' own answers
(SFT), run a loop round (policy step PPO or DPO), and watch any job.

Plain functions `(ctx, inputs..., request) -> updates` that annotate/ui_train.py wires to
components; tests call them directly. Each starts with `admin(ctx, request)`, so an annotator
reaching them through the HTTP API gets `Refused` before anything is read or written.

They are thin: they read the form into the app's settings (`ctx.train_settings`, a LoopSettings:
base model, device, LoRA rank ...) and hand over to the orchestration side, which the CLI uses
too: pipeline/orchestrate/steps.py builds and queues each job, pipeline/orchestrate/loop.py is the
round state machine (a round advances by itself as its jobs end, and survives a restart). The job
monitor (annotate/monitor.py) follows one run: progress, plots, log tail, and Cancel.

"Run a full round" on a round with fewer rankings than its threshold does not train: it returns
the confirmation ("Round N has R of M items ranked (threshold T): finish anyway?") for the tab to
show; Confirm sends the same form again with `confirmed`.

The reward gate (pipeline/orchestrate/gate.py) stops a round before PPO when its new reward model
is no better than chance on held-out pairs; the round's jobs decide that after the click, so the
monitor's poll shows it: the gate's message with the figures, and "Run PPO anyway", which runs
the round's PPO against that reward model without training another (`run_ppo_anyway`). Before a
round, the same line says how much data a useful reward model needed, beside the store's pairs.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import gradio as gr

from annotate import monitor
from annotate.context import AppContext, admin
from pipeline.config import default_ppo_lr, with_ppo_lrs
from pipeline.model_card import REWARD_LOSSES as LOSS_NAMES
from pipeline.orchestrate import estimate, gate, loop
from pipeline.orchestrate.steps import (POLICY_STEPS, LoopSettings, ensure_base_policy, latest_reward, submit_ppo,
                                        submit_reward, submit_sft)

NO_JOBS = ("This app runs without a job runner, so training cannot start here. Train from the "
           "command line instead (`python -m pipeline train-reward --help`, `python -m pipeline ppo "
           "--help`, `python -m pipeline loop --help`) while the app is stopped.")
KL_CONTROLS = ("adaptive", "x1.5", "fixed")
DPO_LOSSES = ("sigmoid", "ipo")


def settings_of(ctx: AppContext) -> LoopSettings:
    """A private copy of the app's training settings (the forms change fields of it)."""
    settings = ctx.train_settings
    if settings is None:  # the defaults, with the app's generation settings
        settings, d = LoopSettings(), ctx.generate_defaults
        settings.generate.k = int(d.get("k", settings.generate.k))
        settings.generate.max_new_tokens = int(d.get("max_new_tokens", settings.generate.max_new_tokens))
    settings = copy.deepcopy(settings)
    settings.ppo = with_ppo_lrs(settings.ppo, settings.model.lora)  # the form shows the rates a job gets
    return settings


def _jobs(ctx: AppContext):
    if ctx.jobs is None:
        raise gr.Error(NO_JOBS)
    return ctx.jobs


def _queued(ctx: AppContext, message: str):
    """(message, run picker following the newest job, the monitor's timer on)."""
    return message, monitor.run_picker(ctx, monitor.LATEST), gr.update(active=True)


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


REWARD_LOSSES = {key: f"{name} ({what})" for (key, name), what in zip(LOSS_NAMES.items(), ("pairs", "whole rankings"))}
"""The reward model's losses (RewardConfig.loss) as the Train tab names them."""


def job_settings(settings: LoopSettings, lora, processes) -> LoopSettings:
    """The settings every job's form has (LoRA, processes per job) on top of the app's settings."""
    settings.model.lora = bool(lora)
    settings.processes = _number(processes, "Processes", minimum=1, integer=True)
    return settings


def reward_settings(settings: LoopSettings, epochs, lr, batch_size, loss) -> LoopSettings:
    """The reward form's values on top of the app's settings."""
    if loss not in REWARD_LOSSES:
        raise gr.Error(f"Reward loss: choose Bradley-Terry or Plackett-Luce (got {loss!r}).")
    settings.reward.loss = loss
    settings.reward.epochs = _number(epochs, "Epochs", minimum=1, integer=True)
    settings.reward.lr = _number(lr, "Reward learning rate", minimum=1e-12)
    settings.reward.batch_size = _number(batch_size, "Batch size", minimum=1, integer=True)
    return settings


def ppo_settings(settings: LoopSettings, n_prompts, steps, kl_control, beta, kl_target, lr, critic_lr) -> LoopSettings:
    """The PPO form's values on top of the app's settings."""
    if kl_control not in KL_CONTROLS:
        raise gr.Error(f"KL control: choose one of {', '.join(KL_CONTROLS)} (got {kl_control!r}).")
    settings.ppo_prompts = _number(n_prompts, "PPO prompts", minimum=1, integer=True)
    settings.ppo.steps = _number(steps, "Steps", minimum=1, integer=True)
    settings.ppo.kl_control = kl_control
    settings.ppo.init_kl_coef = _number(beta, "β (initial KL coefficient)", minimum=0)
    settings.ppo.kl_target = _number(kl_target, "KL target", minimum=1e-6)
    settings.ppo.lr = _number(lr, "Policy learning rate", minimum=1e-12)
    settings.ppo.critic_lr = _number(critic_lr, "Critic learning rate", minimum=1e-12)
    return settings


def dpo_settings(settings: LoopSettings, policy_step, loss, beta, epochs, lr) -> LoopSettings:
    """The policy-step choice and the DPO form's values on top of the app's settings."""
    if policy_step not in POLICY_STEPS:
        raise gr.Error(f"Policy step: choose PPO, RLOO, GRPO or DPO (got {policy_step!r}).")
    if loss not in DPO_LOSSES:
        raise gr.Error(f"DPO loss: choose one of {', '.join(DPO_LOSSES)} (got {loss!r}).")
    settings.policy_step = policy_step
    settings.dpo.loss = loss
    settings.dpo.beta = _number(beta, "DPO β", minimum=1e-12)
    settings.dpo.epochs = _number(epochs, "DPO epochs", minimum=1, integer=True)
    settings.dpo.lr = _number(lr, "DPO learning rate", minimum=1e-12)
    return settings


def round_settings(settings: LoopSettings, prompts_per_round, k, strategy) -> LoopSettings:
    if strategy not in ("random", "uncertain"):
        raise gr.Error(f"Prompt selection: choose random or uncertain (got {strategy!r}).")
    settings.loop.prompts_per_round = _number(prompts_per_round, "Prompts per round", minimum=1, integer=True)
    settings.generate.k = _number(k, "K responses per prompt", minimum=2, integer=True)
    settings.loop.strategy = strategy
    return settings


@dataclass(frozen=True)
class RoundForm:
    """Every setting of the tab that "Run a full round" trains with, by name. The field order is
    the order the tab passes its components in (annotate/ui_train.py builds that list from these
    fields, annotate/bind.py `bind_form` turns it back into this record): a setting is added here
    and where its component is made, nowhere else."""

    lora: bool
    processes: float
    epochs: float
    rm_lr: float
    rm_batch: float
    rm_loss: str
    n_prompts: float
    steps: float
    kl_control: str
    beta: float
    kl_target: float
    ppo_lr: float
    critic_lr: float
    policy_step: str
    dpo_loss: str
    dpo_beta: float
    dpo_epochs: float
    dpo_lr: float
    prompts_per_round: float
    k: float
    strategy: str

    def settings(self, settings: LoopSettings) -> LoopSettings:
        """The form on top of the app's settings (each field checked: gr.Error names a bad one)."""
        settings = job_settings(settings, self.lora, self.processes)
        settings = reward_settings(settings, self.epochs, self.rm_lr, self.rm_batch, self.rm_loss)
        settings = ppo_settings(settings, self.n_prompts, self.steps, self.kl_control, self.beta, self.kl_target,
                                self.ppo_lr, self.critic_lr)
        settings = dpo_settings(settings, self.policy_step, self.dpo_loss, self.dpo_beta, self.dpo_epochs, self.dpo_lr)
        return round_settings(settings, self.prompts_per_round, self.k, self.strategy)


@dataclass(frozen=True)
class RewardForm:
    """The reward panel's "Train reward model", by name (its components in this order: ui_train.py)."""

    lora: bool
    processes: float
    epochs: float
    lr: float
    batch_size: float
    loss: str
    warm_start: bool

    def settings(self, settings: LoopSettings) -> LoopSettings:
        return reward_settings(job_settings(settings, self.lora, self.processes), self.epochs, self.lr,
                               self.batch_size, self.loss)


@dataclass(frozen=True)
class PPOForm:
    """The PPO panel's "Run PPO", by name (its components in this order: ui_train.py)."""

    lora: bool
    processes: float
    reward_name: str | None
    n_prompts: float
    steps: float
    kl_control: str
    beta: float
    kl_target: float
    lr: float
    critic_lr: float
    activate: bool

    def settings(self, settings: LoopSettings) -> LoopSettings:
        return ppo_settings(job_settings(settings, self.lora, self.processes), self.n_prompts, self.steps,
                            self.kl_control, self.beta, self.kl_target, self.lr, self.critic_lr)


# ------------------------------------------------------------------------- defaults and the round's duration


def measured_defaults_note() -> str:
    """What the default round did when measured (pipeline/orchestrate/estimate.py MEASURED_ROUND,
    from docs/results/round_defaults.md): shown next to the PPO settings."""
    m = estimate.MEASURED_ROUND
    return (f"Default round measured on SmolLM2-135M (one thread of a 2-core CPU, LoRA, policy LR {m['lr']:g}): KL "
            f"{m['kl_final']:.1f} of target {m['kl_target']:g} nats in {m['steps']} steps of {m['batch']} episodes "
            f"(β {m['beta_final']:.3g} at the end), about {m['minutes']:.0f} min for the PPO step. "
            "LoRA needs a far larger learning rate than full fine-tuning: switching LoRA off sets the LRs "
            f"to {default_ppo_lr(False):g}.")


def lora_lrs(ctx: AppContext, lora: bool, lr, critic_lr, request: gr.Request):
    """The LoRA checkbox changed: the PPO learning rates follow it (LoRA's defaults or full
    fine-tuning's, pipeline/config.py default_ppo_lr) where they still hold the other mode's
    default; a value the admin typed is kept. Returns (policy LR, critic LR) updates."""
    admin(ctx, request)
    out = []
    for value, critic in ((lr, False), (critic_lr, True)):
        other = default_ppo_lr(not lora, critic=critic)
        try:
            untouched = math.isclose(float(value), other)
        except (TypeError, ValueError):
            untouched = False
        out.append(gr.update(value=default_ppo_lr(bool(lora), critic=critic)) if untouched else gr.update())
    return tuple(out)


def round_duration(ctx: AppContext, form: RoundForm, request: gr.Request) -> str:
    """The expected duration of "Run a full round" with the tab's current settings (the same form
    as run_full_round) on this machine: pipeline/orchestrate/estimate.py, from this store's
    finished runs, else the 2-core reference measurement."""
    admin(ctx, request)
    try:
        settings = form.settings(settings_of(ctx))
    except gr.Error as exc:  # a field being typed: say what is wrong instead of a popup
        return f"**Expected round duration:** fix the settings first ({exc.message})"
    return estimate.round_estimate(ctx.store, settings).markdown()


# ------------------------------------------------------------------------- starting jobs


def train_reward(ctx: AppContext, form: RewardForm, request: gr.Request):
    """Export a snapshot of every pair (Parquet, recorded in the store), then queue a
    `train-reward` job on it. Returns (message, run choice, timer)."""
    admin(ctx, request)
    jobs = _jobs(ctx)
    settings = form.settings(settings_of(ctx))
    try:
        run, snapshot = submit_reward(ctx.store, jobs, settings, warm_start=bool(form.warm_start))
    except ValueError as exc:
        raise gr.Error(f"Cannot train a reward model yet: {exc}") from None
    parent = run.inputs.get("parent_version_id")
    warm = f", warm-started from {ctx.store.get_model_version(parent).name}" if parent else ""
    return _queued(ctx, f"Queued **run #{run.id}** (train-reward) on snapshot #{snapshot.id}: "
                        f"{snapshot.counts.get('pairs', 0)} pairs{warm}.")


def run_ppo(ctx: AppContext, form: PPOForm, request: gr.Request):
    """Queue a `ppo` job from the active policy against the chosen reward model (default: the
    newest). With `activate`, the new policy becomes the active one when the job succeeds.
    Returns (message, run choice, timer)."""
    admin(ctx, request)
    jobs = _jobs(ctx)
    settings = form.settings(settings_of(ctx))
    reward_name = form.reward_name
    reward = ctx.store.find_model_version(reward_name) if reward_name else latest_reward(ctx.store)
    if reward is None or reward.kind != "reward" or not reward.path:
        raise gr.Error(f"No trained reward model named {reward_name!r}." if reward_name else
                       "No reward model yet: train one first.")
    policy = ensure_base_policy(ctx.store, settings.model)
    try:
        run = submit_ppo(ctx.store, jobs, settings, reward, policy, activate=bool(form.activate))
    except ValueError as exc:
        raise gr.Error(f"Cannot run PPO: {exc}.") from None
    then = " It becomes the active policy when it finishes." if form.activate else ""
    return _queued(ctx, f"Queued **run #{run.id}** (PPO): {policy.name} against {reward.name}, "
                        f"{settings.ppo.steps} steps on {run.inputs['prompts']} prompts.{then}")


def run_sft(ctx: AppContext, lora: bool, processes, epochs, lr, request: gr.Request):
    """Queue an `sft` job: the active policy fine-tuned on every demonstration so far (the answers
    annotators wrote with ✎ Edit), which becomes the active policy when it finishes, so the next
    round samples from it. Returns (message, run choice, timer)."""
    admin(ctx, request)
    jobs = _jobs(ctx)
    settings = job_settings(settings_of(ctx), lora, processes)
    settings.sft.epochs = _number(epochs, "SFT epochs", minimum=1, integer=True)
    settings.sft.lr = _number(lr, "SFT learning rate", minimum=1e-12)
    try:
        run, snapshot = submit_sft(ctx.store, jobs, settings)
    except ValueError as exc:
        raise gr.Error(f"Cannot fine-tune: {exc}.") from None
    policy = ctx.store.get_model_version(run.inputs["policy_version_id"])
    return _queued(ctx, f"Queued **run #{run.id}** (SFT): {policy.name} on {snapshot.counts['demonstrations']} "
                        "demonstrations; it becomes the active policy when it finishes.")


# ------------------------------------------------------------------------- rounds


def run_full_round(ctx: AppContext, form: RoundForm, confirmed: bool, request: gr.Request):
    """Train on the round being annotated (snapshot -> reward model -> PPO, or snapshot -> DPO ->
    new active policy) and then start the next one; with no open round, start the first. The
    round advances as its jobs end (pipeline/orchestrate/loop.py); a failed step leaves it open,
    saying why, for another try (a stopped generation is finished first, `_finish_generating`).
    An under-ranked round trains only when `confirmed`; before, nothing starts and the
    confirmation shows. Returns (message, run choice, timer, confirmation row, confirmation text)."""
    admin(ctx, request)
    jobs = _jobs(ctx)
    settings = form.settings(settings_of(ctx))
    _no_round_in_flight(ctx)
    rnd = loop.current_round(ctx.store)
    if rnd is not None and loop.generation_stopped(rnd):
        return (*_finish_generating(ctx, jobs, rnd, settings), gr.update(visible=False), "")
    try:
        if rnd is not None:
            loop.finish_round(ctx.store, jobs, rnd, settings, next_round=True, wait=False, anyway=bool(confirmed))
        else:
            rnd = loop.start_round(ctx.store, jobs, settings, wait=False)
    except loop.UnderRanked as exc:
        return gr.update(), gr.update(), gr.update(), gr.update(visible=True), f"**{exc}**"
    except loop.RoundFailed as exc:
        raise gr.Error(str(exc)) from None
    rl = settings.policy_step.upper()
    how = ("DPO on its pairs, no reward model" if settings.policy_step == "dpo" else
           f"reward model, then {rl} if the reward model beats chance" if settings.loop.reward_gate else
           f"reward model, then {rl}")
    what = (f"Training on round {rnd.id} ({how}), then starting the next round."
            if rnd.status != "generating" else f"Started round {rnd.id}: generating responses with the active policy.")
    return *_queued(ctx, what), gr.update(visible=False), ""


def _finish_generating(ctx: AppContext, jobs, rnd, settings: LoopSettings):
    """The retry of a round whose generation stopped (its job failed, or the app stopped while it
    ran): the prompts its jobs were given that have no responses yet are generated with the tab's
    settings (a setting that failed it can be changed first); the round trains only when the
    button is pressed again."""
    before = ctx.store.round_counts(rnd.id)["items"]
    try:
        rnd = loop.resume_generation(ctx.store, jobs, rnd, settings, wait=False)
    except loop.RoundFailed as exc:
        raise gr.Error(str(exc)) from None
    if rnd.status != "generating":
        return _queued(ctx, f"Round {rnd.id} has every response its generation was given ({before} items): "
                            "press **Run a full round** again to train on it.")
    return _queued(ctx, f"Finishing round {rnd.id}'s generation: {before} items were made before it stopped; "
                        "the rest are being generated with the round's policy. Press **Run a full round** "
                        "again to train once they are ranked.")


def keep_round_open(ctx: AppContext, request: gr.Request):
    """Cancel on the confirmation: nothing trains. Returns (message, confirmation row)."""
    admin(ctx, request)
    rnd = loop.current_round(ctx.store)
    where = f"Round {rnd.id} stays open" if rnd is not None else "Nothing started"
    return f"{where}: rank more of its items, or run the round again and confirm.", gr.update(visible=False)


def start_next_round(ctx: AppContext, prompts_per_round, k, strategy, request: gr.Request):
    """Close the round being annotated without training in it (a policy trained from its policy,
    e.g. by Run PPO, is recorded as its outcome), then generate the next round with the active
    policy. Returns (message, run choice, timer)."""
    admin(ctx, request)
    jobs = _jobs(ctx)
    settings = round_settings(settings_of(ctx), prompts_per_round, k, strategy)
    _no_round_in_flight(ctx)
    rnd = loop.current_round(ctx.store)
    if rnd is not None:
        loop.close_round(ctx.store, rnd)
    try:
        new = loop.start_round(ctx.store, jobs, settings, wait=False)
    except loop.RoundFailed as exc:
        raise gr.Error(str(exc)) from None
    closed = f"Closed round {rnd.id}. " if rnd is not None else ""
    return _queued(ctx, f"{closed}Started round {new.id}: generating responses with the active policy.")


def run_ppo_anyway(ctx: AppContext, request: gr.Request):
    """The round the reward gate stopped: PPO against the reward model it stopped at (no new reward
    model), with the settings the round was trained with, then the next round if the round was to
    start one. Returns (message, run choice, timer, reward-gate line, "Run PPO anyway" button)."""
    admin(ctx, request)
    jobs = _jobs(ctx)
    _no_round_in_flight(ctx)
    rnd = loop.current_round(ctx.store)
    verdict = loop.gated(rnd) if rnd is not None else None
    if verdict is None:
        raise gr.Error("No round is waiting on the reward gate: nothing to run PPO for.")
    reward = ctx.store.get_model_version(verdict["reward_version_id"])
    settings = LoopSettings.from_dict(rnd.meta.get("settings") or {})
    then = bool((rnd.meta.get("plan") or {}).get("next_round"))
    try:
        loop.train_round_policy(ctx.store, jobs, rnd, reward, settings, next_round=then, wait=False)
    except loop.RoundFailed as exc:
        raise gr.Error(str(exc)) from None
    figures = (f"held-out accuracy {verdict['accuracy']:.2f} [{verdict['lo']:.2f}, {verdict['hi']:.2f}]"
               if verdict["accuracy"] is not None else "no held-out accuracy")
    what = f"PPO in round {rnd.id} against {reward.name} ({figures}), as asked{', then the next round' if then else ''}."
    return (*_queued(ctx, what), *reward_gate_line(ctx, settings_of(ctx)))


def reward_gate_line(ctx: AppContext, settings: LoopSettings):
    """(Markdown, "Run PPO anyway" button update): a round the reward gate stopped, with the
    gate's message and the button; else what a useful reward model needed, beside this store's
    pairs so far, the button hidden."""
    rnd = loop.current_round(ctx.store)
    verdict = loop.gated(rnd) if rnd is not None else None
    if verdict is not None:
        return (f"**PPO did not run in round {rnd.id}.** {verdict['message']}",
                gr.update(visible=True, interactive=ctx.jobs is not None))
    pairs = ctx.store.counts()["pairs"]
    rule = ("PPO runs in a round only against a reward model whose held-out accuracy beats chance "
            f"(95% interval above {gate.CHANCE:g})" if settings.loop.reward_gate else
            "The reward gate is off: PPO runs against whatever reward model a round trains")
    return (f"**Reward model data:** {pairs:,} preference pairs so far. {rule}; for reference, {gate.reference()}.",
            gr.update(visible=False))


def _no_round_in_flight(ctx: AppContext) -> None:
    busy = [r for r in ctx.store.list_rounds() if r.status in loop.IN_FLIGHT]
    if busy:
        raise gr.Error(f"Round {busy[-1].id} is still {busy[-1].status}: wait for it to finish.")


# ------------------------------------------------------------------------- the job monitor


def reward_names(store) -> list[str]:
    """Reward model versions with a checkpoint, oldest first."""
    return [mv.name for mv in store.list_model_versions("reward") if mv.path]


def reward_picker(ctx: AppContext, value: str | None):
    """The PPO form's reward model picker: trained reward versions, the newest preselected."""
    names = reward_names(ctx.store)
    return gr.update(choices=names, value=value if value in names else (names[-1] if names else None))


def poll(ctx: AppContext, choice: str | None, reward_value: str | None, request: gr.Request):
    """Everything the monitor shows for the chosen run: (progress bar, one update per plot,
    latest values, log tail, round status, reward-gate line, "Run PPO anyway" button, run picker,
    reward picker, timer). The timer keeps ticking only while a job is queued or running."""
    admin(ctx, request)
    run = monitor.resolve_run(ctx, choice)
    metrics = ctx.store.metrics(run.id) if run is not None else []
    frames = monitor.metric_frames(metrics)
    plots = [gr.update(value=df, visible=len(df) > 0) for df in frames.values()]
    in_flight = ctx.jobs is not None and ctx.jobs.busy()
    settings = settings_of(ctx)
    return (monitor.job_bar(run), *plots, monitor.latest_values(metrics), monitor.log_tail(run),
            monitor.round_status(ctx, settings), *reward_gate_line(ctx, settings), monitor.run_picker(ctx, choice),
            reward_picker(ctx, reward_value),
            gr.update(active=in_flight))


def cancel(ctx: AppContext, choice: str | None, request: gr.Request) -> str:
    """Cancel the chosen (or latest) run: queued never starts; running gets SIGTERM, then SIGKILL."""
    admin(ctx, request)
    jobs = _jobs(ctx)
    run = monitor.resolve_run(ctx, choice)
    if run is None or run.status not in ("queued", "running"):
        raise gr.Error("Nothing to cancel: the chosen run is not queued or running.")
    try:
        jobs.cancel(run.id)
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
    return f"Cancelling run #{run.id} ({run.kind}): it saves a checkpoint and stops."
