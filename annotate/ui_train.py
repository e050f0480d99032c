"""Layout and wiring of the Train and Models tabs (logic: annotate/train.py, annotate/model_admin.py).

Each builder returns {"load": [(handler, inputs, outputs[, form class]), ...]}: what to run when its
tab is opened (annotate/ui.py wires those to the tab's select event, with `bind_form` where a form
class is given; the handlers check the admin role).
Admin endpoints keep readable API names but stay out of the API docs, as on the Data tab.
"""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr
import pandas as pd

from annotate import evaluation_admin as ev
from annotate import model_admin as m
from annotate import monitor
from annotate import train as t
from annotate.bind import bind, bind_form, form_inputs
from annotate.context import AppContext

HIDDEN = {"api_visibility": "undocumented"}
QUIET = {"api_visibility": "private", "show_progress": "hidden"}


def train_tab(ctx: AppContext) -> dict:
    """Four panels (reward model, PPO, DPO and SFT, loop round) over the job monitor; the buttons
    start jobs and the monitor follows them."""
    s = t.settings_of(ctx)
    enabled = ctx.jobs is not None
    if not enabled:
        gr.Markdown(f"**Training is off.** {t.NO_JOBS}", elem_id="rl-no-jobs")
    gr.Markdown(f"Jobs run one at a time as subprocesses on base model `{s.model.model}` (device "
                f"`{s.model.device}`); each writes its own run folder, and the monitor below follows it.")
    with gr.Row():
        lora = gr.Checkbox(value=s.model.lora, label=f"LoRA adapters (rank {s.model.lora_r}; off = full fine-tuning)")
        processes = gr.Number(value=s.processes, precision=0, minimum=1, label="Processes per job",
                              info="data-parallel ranks, e.g. one per GPU (torchrun)", elem_id="rl-processes")
    with gr.Row(equal_height=False):
        with gr.Column(variant="panel"):
            rm = _reward_panel(s, enabled)
        with gr.Column(variant="panel"):
            ppo = _ppo_panel(ctx, s, enabled)
        with gr.Column(variant="panel"):
            dpo = _dpo_panel(s)
        with gr.Column(variant="panel"):
            rnd = _round_panel(s, enabled)
    msg = gr.Markdown(elem_id="rl-train-msg")
    mon = _monitor(enabled)

    started = [msg, mon.run_pick, mon.timer]
    poll_in = [mon.run_pick, ppo.reward]
    poll_out = [mon.bar, *mon.plots, mon.latest, mon.log, rnd.round_md, rnd.gate_md, rnd.anyway, mon.run_pick,
                ppo.reward, mon.timer]
    poll = dict(fn=bind(t.poll, ctx), inputs=poll_in, outputs=poll_out, **QUIET)
    # each form's components by its fields' names, in the order of its fields (bind_form)
    job = {"lora": lora, "processes": processes}
    reward_in = form_inputs(t.RewardForm, {**job, "epochs": rm.epochs, "lr": rm.lr, "batch_size": rm.batch,
                                           "loss": rm.loss, "warm_start": rm.warm})
    rm.button.click(bind_form(t.train_reward, ctx, t.RewardForm), reward_in, started, api_name="train_reward",
                    **HIDDEN).success(**poll)
    ppo_in = form_inputs(t.PPOForm, {**job, "reward_name": ppo.reward, **ppo.form, "lr": ppo.lr,
                                     "activate": ppo.activate})
    ppo.button.click(bind_form(t.run_ppo, ctx, t.PPOForm), ppo_in, started, api_name="run_ppo",
                     **HIDDEN).success(**poll)
    dpo.sft.click(bind(t.run_sft, ctx), [lora, processes, dpo.sft_epochs, dpo.sft_lr], started, api_name="run_sft",
                  **HIDDEN).success(**poll)
    round_in = form_inputs(t.RoundForm, {**job, "epochs": rm.epochs, "rm_lr": rm.lr, "rm_batch": rm.batch,
                                         "rm_loss": rm.loss, **ppo.form, "policy_step": rnd.policy_step, **dpo.form,
                                         **rnd.form})
    round_out = [*started, rnd.confirm_row, rnd.confirm_md]
    rnd.button.click(bind_form(t.run_full_round, ctx, t.RoundForm), [*round_in, gr.State(False)], round_out,
                     api_name="run_round", **HIDDEN).success(**poll)
    rnd.confirm.click(bind_form(t.run_full_round, ctx, t.RoundForm), [*round_in, gr.State(True)], round_out,
                      api_name="run_round_confirmed", **HIDDEN).success(**poll)
    rnd.keep.click(bind(t.keep_round_open, ctx), None, [msg, rnd.confirm_row], **QUIET)
    rnd.anyway.click(bind(t.run_ppo_anyway, ctx), None, [*started, rnd.gate_md, rnd.anyway], api_name="run_ppo_anyway",
                     **HIDDEN).success(**poll)
    # LoRA on/off swaps the PPO learning rates between the two modes' defaults; any setting of a
    # round re-estimates its duration (and so does opening the tab: finished jobs change the figures)
    lora.input(bind(t.lora_lrs, ctx), [lora, ppo.lr, ppo.critic_lr], [ppo.lr, ppo.critic_lr], **QUIET)
    eta = dict(fn=bind_form(t.round_duration, ctx, t.RoundForm), inputs=round_in, outputs=[rnd.eta], **QUIET)
    gr.on([c.change for c in round_in], **eta)
    rnd.next.click(bind(t.start_next_round, ctx), list(rnd.form.values()), started, api_name="next_round",
                   **HIDDEN).success(**poll)
    mon.cancel.click(bind(t.cancel, ctx), [mon.run_pick], [msg], api_name="cancel_run", **HIDDEN).success(**poll)
    # .input, not .change: poll itself updates the picker, and must not trigger itself
    mon.run_pick.input(**poll)
    mon.refresh.click(**poll)
    mon.timer.tick(**poll)
    return {"load": [(t.poll, poll_in, poll_out), (t.round_duration, round_in, [rnd.eta], t.RoundForm)]}


def _reward_panel(s, enabled: bool) -> SimpleNamespace:
    gr.Markdown("#### Reward model\nOn every pair so far (a Parquet snapshot is exported first, its rankings "
                "beside it).")
    return SimpleNamespace(
        loss=gr.Radio([(name, key) for key, name in t.REWARD_LOSSES.items()], value=s.reward.loss, label="Loss",
                      elem_id="rl-reward-loss", info="Plackett-Luce learns each ranking once, ties as tie groups; "
                                                     "with K = 2 the two are the same"),
        epochs=gr.Number(value=s.reward.epochs, precision=0, minimum=1, label="Epochs"),
        lr=gr.Number(value=s.reward.lr, label="Learning rate"),
        batch=gr.Number(value=s.reward.batch_size, precision=0, minimum=1, label="Batch size (pairs or rankings)"),
        warm=gr.Checkbox(value=True, label="Warm start from the newest reward model"),
        button=gr.Button("Train reward model", variant="primary", elem_id="rl-train-reward", interactive=enabled))


def _ppo_panel(ctx: AppContext, s, enabled: bool) -> SimpleNamespace:
    """`form`: the PPO options by RoundForm's names (PPOForm calls the policy LR `lr`)."""
    gr.Markdown("#### PPO\nFrom the active policy, against a frozen reward model. The KL reference is "
                f"the base model `{s.model.model}` in every round, for PPO and DPO alike (LoRA: the "
                "adapter switched off; full fine-tuning: the base weights, frozen).", elem_id="rl-ppo-intro")
    names = t.reward_names(ctx.store)
    reward = gr.Dropdown(names, value=names[-1] if names else None, label="Reward model", elem_id="rl-ppo-reward")
    with gr.Row():
        steps = gr.Number(value=s.ppo.steps, precision=0, minimum=1, label="Steps")
        n_prompts = gr.Number(value=s.ppo_prompts, precision=0, minimum=1, label="Prompts")
    kl_control = gr.Radio(list(t.KL_CONTROLS), value=s.ppo.kl_control, label="KL control",
                          info="adaptive: Ziegler et al. 2019 · x1.5: Schulman et al. 2017 · fixed β")
    with gr.Row():
        beta = gr.Number(value=s.ppo.init_kl_coef, label="β (initial)")
        kl_target = gr.Number(value=s.ppo.kl_target, label="KL target (nats)")
    with gr.Row():
        lr = gr.Number(value=s.ppo.lr, label="Policy LR")
        critic_lr = gr.Number(value=s.ppo.critic_lr, label="Critic LR")
    gr.Markdown(t.measured_defaults_note(), elem_id="rl-ppo-defaults")
    activate = gr.Checkbox(value=True, label="Make the new policy active when done")
    button = gr.Button("Run PPO", variant="primary", elem_id="rl-run-ppo", interactive=enabled)
    form = {"n_prompts": n_prompts, "steps": steps, "kl_control": kl_control, "beta": beta, "kl_target": kl_target,
            "ppo_lr": lr, "critic_lr": critic_lr}
    return SimpleNamespace(reward=reward, lr=lr, critic_lr=critic_lr, activate=activate, button=button, form=form)


def _dpo_panel(s) -> SimpleNamespace:
    gr.Markdown("#### DPO\nThe round's policy step when it is DPO (Rafailov et al. 2023): the round's "
                "policy learns the pairs directly, and the round trains no reward model.")
    loss = gr.Radio(list(t.DPO_LOSSES), value=s.dpo.loss, label="Loss", elem_id="rl-dpo-loss",
                    info="sigmoid: DPO · ipo: IPO (Azar et al. 2023)")
    beta = gr.Number(value=s.dpo.beta, label="DPO β",
                     info="larger stays closer to the reference (the base model, as in PPO)")
    with gr.Row():
        epochs = gr.Number(value=s.dpo.epochs, precision=0, minimum=1, label="DPO epochs")
        lr = gr.Number(value=s.dpo.lr, label="DPO learning rate")
    gr.Markdown("#### Demonstrations (SFT)\nThe answers annotators wrote themselves (✎ Edit): the active "
                "policy learns them, and the result becomes the active policy the next round samples from.")
    with gr.Row():
        sft_epochs = gr.Number(value=s.sft.epochs, precision=0, minimum=1, label="SFT epochs")
        sft_lr = gr.Number(value=s.sft.lr, label="SFT learning rate")
    sft = gr.Button("Fine-tune on demonstrations", elem_id="rl-sft")
    return SimpleNamespace(form={"dpo_loss": loss, "dpo_beta": beta, "dpo_epochs": epochs, "dpo_lr": lr},
                           sft=sft, sft_epochs=sft_epochs, sft_lr=sft_lr)


def _round_panel(s, enabled: bool) -> SimpleNamespace:
    """`form`: the next round's prompts per round, K and prompt selection (start_next_round's order)."""
    gr.Markdown("#### Loop round\nFinish the round being annotated (snapshot → reward model → PPO, RLOO or GRPO, or "
                "snapshot → DPO → new active policy), then generate the next one. With fewer than "
                f"{s.loop.rankings_per_round} rankings (or fewer than its items) it asks first.")
    policy_step = gr.Radio([("PPO", "ppo"), ("RLOO", "rloo"), ("GRPO", "grpo"), ("DPO", "dpo")], value=s.policy_step,
                           label="Policy step", elem_id="rl-policy-step",
                           info="PPO: a critic; RLOO, GRPO: 4 answers per prompt compared, no critic (the PPO "
                                "panel's settings); DPO: no reward model")
    per_round = gr.Number(value=s.loop.prompts_per_round, precision=0, minimum=1, label="Prompts per round")
    k = gr.Slider(2, 8, value=s.generate.k, step=1, label="K responses per prompt")
    strategy = gr.Radio(["random", "uncertain"], value=s.loop.strategy, label="Prompt selection",
                        info="uncertain: the prompts the reward model separates least")
    eta = gr.Markdown(elem_id="rl-round-eta")
    button = gr.Button("Run a full round", variant="primary", elem_id="rl-run-round", interactive=enabled)
    # Gradio has no modal: the confirmation is a hidden group the handler's update shows
    with gr.Column(visible=False, variant="panel", elem_id="rl-round-confirm") as confirm_row:
        confirm_md = gr.Markdown(elem_id="rl-round-confirm-text")
        with gr.Row():
            confirm = gr.Button("Confirm", variant="primary", size="sm", elem_id="rl-round-confirm-yes")
            keep = gr.Button("Cancel", size="sm", elem_id="rl-round-confirm-no")
    next_btn = gr.Button("Start the next round (no training)", elem_id="rl-next-round", interactive=enabled)
    round_md = gr.Markdown(elem_id="rl-round")
    # what a useful reward model needs; after the reward gate stopped a round, its verdict and the way on
    gate_md = gr.Markdown(elem_id="rl-reward-gate")
    anyway = gr.Button("Run PPO anyway", variant="stop", size="sm", visible=False, elem_id="rl-ppo-anyway")
    return SimpleNamespace(policy_step=policy_step, form={"prompts_per_round": per_round, "k": k, "strategy": strategy},
                           eta=eta, button=button,
                           confirm_row=confirm_row, confirm_md=confirm_md, confirm=confirm, keep=keep,
                           next=next_btn, round_md=round_md, gate_md=gate_md, anyway=anyway)


def _monitor(enabled: bool) -> SimpleNamespace:
    """The job monitor: which run, its progress bar, metric plots, latest values and log tail."""
    gr.Markdown("### Job monitor")
    with gr.Row():
        run_pick = gr.Dropdown([("Latest job (follows new jobs)", monitor.LATEST)], value=monitor.LATEST, label="Run",
                               elem_id="rl-run-pick", scale=3)
        refresh = gr.Button("Refresh", size="sm", scale=0, min_width=100)
        cancel = gr.Button("Cancel job", variant="stop", size="sm", scale=0, min_width=120, elem_id="rl-cancel",
                           interactive=enabled)
    bar = gr.HTML(elem_id="rl-train-job", js_on_load=None)
    plots = []
    titles = list(monitor.PLOTS)
    for row in (titles[:3], titles[3:6], titles[6:]):
        with gr.Row():
            for title in row:
                plots.append(gr.LinePlot(x="step", y="value", color="metric", title=title, height=240,
                                         visible=False, elem_classes=["rl-train-plot"]))
    with gr.Row(equal_height=False):
        latest = gr.Dataframe(pd.DataFrame(columns=["metric", "step", "value"]), label="Latest values",
                              interactive=False, scale=1, max_height=320)
        log = gr.Textbox(label="Log (last lines)", lines=14, max_lines=14, interactive=False, autoscroll=True,
                         scale=2, elem_id="rl-train-log")
    return SimpleNamespace(run_pick=run_pick, refresh=refresh, cancel=cancel, bar=bar, plots=plots, latest=latest,
                           log=log, timer=gr.Timer(1.0, active=False))


def models_tab(ctx: AppContext) -> dict:
    gr.Markdown("Every model version with its lineage. **●** marks the active policy, which generates new responses.")
    table = gr.Dataframe(interactive=False, elem_id="rl-models")
    refresh = gr.Button("Refresh", size="sm", scale=0, min_width=120)
    with gr.Row():
        pick = gr.Dropdown([], label="Model version", elem_id="rl-model-pick", scale=3)
        make_active = gr.Button("Make this the active policy", elem_id="rl-make-active", scale=1, size="md")
        download = gr.Button("Download (Hugging Face folder)", elem_id="rl-download", scale=1, size="md")
    model_msg = gr.Markdown()
    with gr.Row(equal_height=False):
        export_bar = gr.HTML(elem_id="rl-export-job", js_on_load=None)
        export_file = gr.File(label="Exported model (zip: weights, tokenizer, model card)", interactive=False,
                              elem_id="rl-export-file")
    export_timer = gr.Timer(1.0, active=False)
    with gr.Row(equal_height=False):
        lineage = gr.Markdown(elem_id="rl-lineage")
        meta = gr.JSON(label="Metrics and metadata", open=False)
    caption = gr.Markdown()
    samples = gr.Dataframe(pd.DataFrame(columns=m.SAMPLE_COLUMNS),
                           label="Sample table", interactive=False, wrap=True, max_height=360)

    gr.Markdown("### Compare two policies\nBoth sample one response per held-out prompt (never annotated, never "
                "in a PPO prompt file) with the same seed; the reward model judges each pair.")
    with gr.Row():
        a = gr.Dropdown([], label="Policy A", elem_id="rl-compare-a")
        b = gr.Dropdown([], label="Policy B", elem_id="rl-compare-b")
        reward = gr.Dropdown([], label="Judged by reward model", elem_id="rl-compare-reward")
        n = gr.Number(value=16, precision=0, minimum=1, label="Held-out prompts")
    compare_btn = gr.Button("Compare", variant="primary", elem_id="rl-compare")
    compare_bar = gr.HTML(elem_id="rl-compare-job", js_on_load=None)
    compare_md = gr.Markdown(elem_id="rl-compare-result")
    compare_df = gr.Dataframe(pd.DataFrame(columns=["prompt", "A", "A score", "B", "B score"]), interactive=False,
                              wrap=True, max_height=420, label="Side by side")
    compare_timer = gr.Timer(1.0, active=False)

    gr.Markdown("### Blind evaluation\nPeople judge the policies: each answers held-out prompts (never annotated, "
                "never trained on) once, with the same seed; annotators rank the answers in their queue without "
                "names. Results: win rates and a Bradley-Terry leaderboard with 95% bootstrap intervals.")
    with gr.Row():
        ev_versions = gr.Dropdown([], multiselect=True, label="Policies", elem_id="rl-eval-versions", scale=3)
        ev_n = gr.Number(value=32, precision=0, minimum=1, label="Held-out prompts", elem_id="rl-eval-n")
        ev_name = gr.Textbox(label="Name (optional)", elem_id="rl-eval-name")
    ev_start = gr.Button("Start evaluation", variant="primary", elem_id="rl-eval-start")
    ev_msg = gr.Markdown(elem_id="rl-eval-msg")
    ev_table = gr.Dataframe(pd.DataFrame(columns=ev.EVALUATION_COLUMNS), interactive=False, elem_id="rl-evaluations")
    with gr.Row():
        ev_pick = gr.Dropdown([ev.ALL], value=ev.ALL, label="Results of", elem_id="rl-eval-pick", scale=3)
        ev_show = gr.Button("Show results", elem_id="rl-eval-show", scale=1)
        ev_download = gr.Button("Download results (JSON)", elem_id="rl-eval-download", scale=1)
    ev_summary = gr.Markdown(elem_id="rl-eval-summary")
    ev_board = gr.Dataframe(pd.DataFrame(columns=ev.LEADERBOARD_COLUMNS), interactive=False,
                            label="Leaderboard", elem_id="rl-eval-leaderboard")
    ev_rates = gr.Dataframe(pd.DataFrame(columns=ev.WIN_RATE_COLUMNS), interactive=False,
                            label="Win rates", elem_id="rl-eval-win-rates")
    ev_file = gr.File(label="Results", interactive=False, elem_id="rl-eval-file")


    opened = [table, pick, a, b, reward, lineage, meta, samples, caption]
    refresh.click(bind(m.open_tab, ctx), None, opened, api_name="models", **HIDDEN)
    pick.input(bind(m.version_details, ctx), [pick], [lineage, meta, samples, caption], **QUIET)
    make_active.click(bind(m.set_active, ctx), [pick], [model_msg, table], api_name="set_active_policy", **HIDDEN)
    export_outs = [export_bar, export_file, export_timer]
    download.click(bind(m.export_model, ctx), [pick], export_outs, api_name="export_model", **HIDDEN)
    export_timer.tick(bind(m.export_poll, ctx), None, export_outs, **QUIET)
    compare_outs = [compare_bar, compare_md, compare_df, compare_timer]
    compare_btn.click(bind(m.compare, ctx), [a, b, reward, n], [compare_bar, compare_timer],
                      api_name="compare_policies", **HIDDEN)
    compare_timer.tick(bind(m.compare_poll, ctx), None, compare_outs, **QUIET)
    ev_opened = [ev_versions, ev_pick, ev_table]
    refresh.click(bind(ev.choices, ctx), None, ev_opened, **QUIET)
    ev_start.click(bind(ev.start, ctx), [ev_versions, ev_n, ev_name], [ev_msg, ev_pick, ev_table],
                   api_name="start_evaluation", **HIDDEN)
    ev_results = [ev_summary, ev_board, ev_rates, ev_table]
    ev_show.click(bind(ev.results, ctx), [ev_pick], ev_results, api_name="evaluation_results", **HIDDEN)
    ev_pick.input(bind(ev.results, ctx), [ev_pick], ev_results, **QUIET)
    ev_download.click(bind(ev.download, ctx), [ev_pick], [ev_file], api_name="download_evaluation", **HIDDEN)
    return {"load": [(m.open_tab, None, opened), (ev.choices, None, ev_opened), (m.compare_poll, None, compare_outs),
                     (m.export_poll, None, export_outs)]}
