"""Layout and wiring of the admin tabs: Data (statistics, team, import, generate, export, flagged
prompts, users, guidelines), Train and Models. Logic lives in annotate/admin.py (Team:
annotate/ui_team.py and annotate/team.py)."""

from __future__ import annotations

import gradio as gr

from annotate import admin as a
from annotate import admin_users as u
from annotate import ui_team, ui_train
from annotate.bind import bind, bind_form, form_inputs
from annotate.context import AppContext

# Admin endpoints are callable through the API (and refused there for non-admins) but not listed.
HIDDEN = {"api_visibility": "undocumented"}


def data_tab(ctx: AppContext) -> dict:
    """The Data tab's sub-tabs; each builds and wires its own part and says what to fill on load."""
    with gr.Tabs():
        with gr.Tab("Overview"):
            load = _overview(ctx)
        with gr.Tab("Team", elem_id="rl-tab-team"):
            load += ui_team.team_tab(ctx)["load"]
        with gr.Tab("Import"):
            _import(ctx)
        with gr.Tab("Generate"):
            timer, generate_load = _generate(ctx)
            load += generate_load
        with gr.Tab("Export"):
            load += _export(ctx)
        with gr.Tab("Flagged"):
            load += _flagged(ctx)
        with gr.Tab("Users"):
            load += _users(ctx)
        with gr.Tab("Backup"):
            _backup(ctx)
        with gr.Tab("Guidelines"):
            load += _guidelines(ctx)
    return {"timer": timer, "load": load}


def _overview(ctx: AppContext) -> list:
    with gr.Row():
        refresh = gr.Button("Refresh statistics", size="sm", scale=0, min_width=180)
    with gr.Row(equal_height=False):
        counts = gr.Dataframe(label="Counts", interactive=False, scale=1)
        people = gr.Dataframe(label="Annotators (median s = median seconds per ranking)",
                              interactive=False, scale=2)
    with gr.Row(equal_height=False):
        per_annotator = gr.BarPlot(x="annotator", y="rankings", title="Rankings per annotator",
                                   height=260, scale=1)
        by_position = gr.BarPlot(x="position", y="best rate", y_lim=[0, 1], height=260, scale=1,
                                 title="Ranked best, by display position (flat = no position bias)")
    with gr.Row(equal_height=False):
        agreement = gr.Dataframe(label="Agreement on items ranked by 2+ annotators",
                                 interactive=False, scale=1)
        bias = gr.Dataframe(label="Position bias", interactive=False, scale=1)
    stats_outs = [counts, people, agreement, bias, per_annotator, by_position]
    refresh.click(bind(a.statistics, ctx), None, stats_outs, **HIDDEN, api_name="statistics")
    return [(a.statistics, None, stats_outs)]


def _import(ctx: AppContext) -> None:
    gr.Markdown("Upload **prompts** (`prompt` or chat `messages` column), **preference pairs** "
                "(`prompt`/`chosen`/`rejected`, or HH-RLHF transcripts) or **items to rank** (a prompt "
                "and 2–16 `responses`, each `{text, model}`; in CSV `response_1`… with `model_1`…) as "
                "JSONL, CSV or Parquet, a **Label Studio export** (JSON) of a ranking or pairwise project, or "
                "an **Argilla export** (the parquet of a ranking dataset's 'Export to Hub'); their rankings "
                "come in with who made them. "
                "Items whose responses each name their model can be a **blind evaluation** of those "
                "models (APIs, production models, this store's policies), ranked by the team with no "
                "names shown. A file with any bad row is refused as a whole, with every problem listed.")
    with gr.Row():
        kind = gr.Radio(list(a.IMPORT_KINDS), value="prompts", label="The file holds", scale=1,
                        elem_id="rl-import-kind")
        upload = gr.File(label="File", file_types=[".jsonl", ".json", ".csv", ".parquet"],
                         elem_id="rl-import-file", scale=2)
        evaluation = gr.Textbox(label="Evaluation name", placeholder="default: the file's name", scale=1,
                                info="for a blind evaluation", elem_id="rl-import-evaluation")
    import_btn = gr.Button("Import", variant="primary", elem_id="rl-import", size="md")
    import_msg = gr.Markdown(elem_id="rl-import-msg")
    import_errors = gr.Dataframe(label="Problems by row", interactive=False, elem_id="rl-import-errors")
    import_btn.click(bind(a.import_file, ctx), [upload, kind, evaluation], [import_msg, import_errors],
                     **HIDDEN, api_name="import_file")


def _generate(ctx: AppContext) -> tuple[gr.Timer, list]:
    """The Generate sub-tab, and the timer that polls its job (the app starts it on load)."""
    d = ctx.generate_defaults
    gr.Markdown("Sample **K responses** with the active policy for prompts that have none. "
                "Runs in the background; annotators see items as soon as each chunk is stored.")
    with gr.Row():
        n_prompts = gr.Number(value=d.get("n_prompts", 32), precision=0, minimum=1, label="Prompts")
        k = gr.Slider(2, 16, value=d.get("k", 4), step=1, label="K responses per prompt")
        max_new = gr.Number(value=d.get("max_new_tokens", 64), precision=0, minimum=1,
                            label="Max new tokens")
        temperature = gr.Slider(0.0, 2.0, value=d.get("temperature", 0.7), step=0.05, label="Temperature")
        top_p = gr.Slider(0.05, 1.0, value=d.get("top_p", 1.0), step=0.05, label="Top-p")
        version = gr.Dropdown([], label="Policy version", info="default: the active policy")
    gen_btn = gr.Button("Generate", variant="primary", elem_id="rl-generate",
                        interactive=ctx.jobs is not None)
    job = gr.HTML(elem_id="rl-job", js_on_load=None)
    timer = gr.Timer(1.5, active=False)
    gen_btn.click(bind(a.generate, ctx), [n_prompts, k, max_new, temperature, top_p, version], [job, timer],
                  **HIDDEN, api_name="generate")
    timer.tick(bind(a.job_poll, ctx), None, [job, timer], api_visibility="private", show_progress="hidden")
    return timer, [(a.job_poll, None, [job, timer]), (a.policy_choices, None, [version])]


def _export(ctx: AppContext) -> list:
    gr.Markdown("Export the preference pairs as a **snapshot** (recorded, with its hash), with the "
                "rankings behind them and a dataset card (README.md), and download it. The split is "
                "by prompt, so no prompt is in both train and test.")
    with gr.Row():
        fmt = gr.Radio(["jsonl", "parquet", "datasets"], value="jsonl", label="Format",
                       info="datasets = a Hugging Face `datasets` folder, zipped", elem_id="rl-export-fmt")
        trl_format = gr.Radio(["conversational", "text"], value="conversational", label="TRL format",
                              info="conversational: prompt as chat messages (TRL applies the chat "
                                   "template); text: plain strings", elem_id="rl-export-trl-format")
        test_fraction = gr.Slider(0.0, 0.5, value=0.1, step=0.05, label="Test fraction")
    with gr.Row():
        who = gr.Dropdown([], multiselect=True, label="Only these annotators (empty = all)")
        since = gr.Textbox(label="Only pairs since (YYYY-MM-DD)", placeholder="all time")
        min_agreement = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label="Minimum agreement",
                                  info="share of the item's annotators who agree with the pair")
    with gr.Row():
        all_bad = gr.Checkbox(label="Include 'all bad' rankings", value=False)
        imported = gr.Checkbox(label="Include imported pairs", value=True)
        margin = gr.Checkbox(label="Add a `margin` column (the strength, else the rank gap)", value=False,
                             info="TRL's RewardTrainer reads it: loss -log σ(r_chosen − r_rejected − margin)")
        license_id = gr.Textbox(value="unknown", label="License (dataset card)", placeholder="cc-by-4.0")
    with gr.Row():
        min_quality = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label="Minimum annotator quality",
                                info="leave out annotators whose gold accuracy (else agreement with the "
                                     "majority) is below this; 0 keeps everyone",
                                elem_id="rl-export-min-quality")
        quality_weights = gr.Checkbox(label="Weight pairs by annotator quality", value=False,
                                      info="a `weight` column (2q − 1, at least 0.05) that reward training "
                                           "weighs each pair's loss by", elem_id="rl-export-quality-weights")
    export_btn = gr.Button("Export", variant="primary", elem_id="rl-export")
    export_msg = gr.Markdown(elem_id="rl-export-msg")
    export_file = gr.File(label="Download", interactive=False, file_count="multiple", elem_id="rl-export-file")
    form = form_inputs(a.ExportForm, dict(
        fmt=fmt, include_all_bad=all_bad, include_imported=imported, annotators=who, since=since,
        min_agreement=min_agreement, test_fraction=test_fraction, trl_format=trl_format, margin_column=margin,
        license=license_id, min_quality=min_quality, quality_weights=quality_weights))
    export_btn.click(bind_form(a.export, ctx, a.ExportForm), form, [export_file, export_msg], **HIDDEN,
                     api_name="export")
    return [(u.annotator_names, None, [who])]


def _flagged(ctx: AppContext) -> list:
    gr.Markdown("Prompts annotators **flagged** (broken, harmful, unanswerable) are out of the "
                "queue for everyone. Look at them here; unflag one to put its items back.")
    flagged = gr.Dataframe(label="Flagged prompts", interactive=False, elem_id="rl-flagged",
                           datatype=["number", "number", "str", "str"], wrap=True)
    with gr.Row():
        flag_id = gr.Number(None, label="Prompt id", precision=0, minimum=1, elem_id="rl-unflag-id", scale=1)
        unflag_btn = gr.Button("Unflag", variant="primary", elem_id="rl-unflag", scale=0, min_width=120)
        flag_refresh = gr.Button("Refresh", size="sm", scale=0, min_width=100)
    unflag_msg = gr.Markdown(elem_id="rl-unflag-msg")
    unflag_btn.click(bind(a.unflag, ctx), [flag_id], [unflag_msg, flagged], **HIDDEN, api_name="unflag")
    flag_refresh.click(bind(a.flagged_table, ctx), None, [flagged], **HIDDEN, api_name="flagged")
    return [(a.flagged_table, None, [flagged])]


def _users(ctx: AppContext) -> list:
    with gr.Row():
        name = gr.Textbox(label="Name", elem_id="rl-user-name")
        role = gr.Radio(["annotator", "admin"], value="annotator", label="Role")
        password = gr.Textbox(label="Password (blank = generate one)", type="password")
    add_btn = gr.Button("Add user", variant="primary", elem_id="rl-add-user")
    add_msg = gr.Markdown()
    users = gr.Dataframe(label="Accounts (locked = too many failed sign-ins, for the time shown)",
                         interactive=False, elem_id="rl-users")
    gr.Markdown("**Manage an account.** A password reset and a deactivation end the account's "
                "open sessions at once; a deactivated account keeps its rankings.")
    with gr.Row():
        who_name = gr.Textbox(label="Account name", elem_id="rl-manage-name")
        new_role = gr.Radio(["annotator", "admin"], value="annotator", label="Role")
        new_password = gr.Textbox(label="New password (blank = generate one)", type="password")
    with gr.Row():
        reset_btn = gr.Button("Reset password", size="sm", elem_id="rl-reset-password")
        role_btn = gr.Button("Set role", size="sm", elem_id="rl-set-role")
        deactivate_btn = gr.Button("Deactivate", size="sm", variant="stop", elem_id="rl-deactivate")
        activate_btn = gr.Button("Activate", size="sm", elem_id="rl-activate")
        unlock_btn = gr.Button("Unlock", size="sm", elem_id="rl-unlock")
        users_refresh = gr.Button("Refresh", size="sm")
    manage_msg = gr.Markdown(elem_id="rl-manage-msg")
    add_btn.click(bind(u.add_user, ctx), [name, role, password], [add_msg, users], **HIDDEN, api_name="add_user")
    for btn, fn, inputs, api in ((reset_btn, u.reset_password, [who_name, new_password], "reset_password"),
                                 (role_btn, u.change_role, [who_name, new_role], "set_role"),
                                 (deactivate_btn, u.deactivate, [who_name], "deactivate"),
                                 (activate_btn, u.activate, [who_name], "activate"),
                                 (unlock_btn, u.unlock, [who_name], "unlock")):
        btn.click(bind(fn, ctx), inputs, [manage_msg, users], **HIDDEN, api_name=api)
    users_refresh.click(bind(u.users_table, ctx), None, [users], **HIDDEN, api_name="users")
    return [(u.users_table, None, [users])]


def _backup(ctx: AppContext) -> None:
    gr.Markdown("A **backup** is a copy of the whole database at one instant, taken while "
                "annotators keep working. Restore it with `python -m store restore FILE` "
                "while the app is stopped.")
    backup_btn = gr.Button("Back up now", variant="primary", elem_id="rl-backup")
    backup_msg = gr.Markdown(elem_id="rl-backup-msg")
    backup_file = gr.File(label="Download", interactive=False, elem_id="rl-backup-file")
    backup_btn.click(bind(a.backup, ctx), None, [backup_file, backup_msg], **HIDDEN, api_name="backup")


def _guidelines(ctx: AppContext) -> list:
    guidelines = gr.Code(language="markdown", label="Annotation guidelines (markdown)", lines=14)
    save_btn = gr.Button("Save guidelines", variant="primary")
    save_msg = gr.Markdown()
    save_btn.click(bind(a.save_guidelines, ctx), [guidelines], [save_msg], **HIDDEN, api_name="save_guidelines")
    return [(a.load_guidelines, None, [guidelines])]


def train_tab(ctx: AppContext) -> dict:
    """Reward-model and PPO jobs, loop rounds, and a job monitor (annotate/ui_train.py)."""
    return ui_train.train_tab(ctx)


def models_tab(ctx: AppContext) -> dict:
    """Model versions with lineage, samples, the active policy and comparisons (annotate/ui_train.py)."""
    return ui_train.models_tab(ctx)
