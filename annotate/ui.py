"""Build and launch the Gradio app: layout and wiring only (logic is in handlers.py and admin.py).

Tabs: Annotate and Chat (everyone: ui_chat.py), Data, Train and Models (admins; hidden for annotators on page load, and
refused by every admin handler anyway). The annotation view is server-rendered HTML plus a small
script (static/annotate.js) that keeps the ranking in the page, so picking responses costs no
round trip; Submit sends it along with the item's token.

Endpoints keep readable API names because the HTTP API is a real way in (bench/ui_bench.py drives
/submit and /refresh with gradio_client): the annotation endpoints are documented, the
admin ones and /refresh callable but undocumented, page-load and tab-select events private.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gradio as gr
from starlette.middleware import Middleware

from annotate import accounts, ui_admin, ui_chat
from annotate import chat as chat_h
from annotate import handlers as h
from annotate.bind import bind, bind_form, form_inputs
from annotate.context import AppContext
from annotate.render import render_shortcuts
from annotate.timing import TimingMiddleware

STATIC = Path(__file__).resolve().parent / "static"
QUEUE_STATUS_SECONDS = 2.0
"""How often Gradio tells the events waiting in its queue their place (see launch)."""

# IBM Plex Sans ships with Gradio (served locally): nothing is fetched from a font CDN.
THEME = gr.themes.Soft(
    primary_hue="indigo", neutral_hue="slate", radius_size="md",
    font=[gr.themes.LocalFont("IBM Plex Sans", weights=(400, 600, 700)), "ui-sans-serif", "system-ui", "sans-serif"],
    font_mono=[gr.themes.LocalFont("IBM Plex Mono"), "ui-monospace", "monospace"],
)


# Before Submit reaches the server, the page script fills in the ranking, the item's token, the
# strength, and the annotator's own answer with the position of the response it was written from.
# `panel`: the page script's panel (window.rlhf: this tab; window.rlhfChat: the Chat tab's).
def submit_js(panel: str) -> str:
    return f"""(r, b, c, t, g, e, f, s) => window.{panel}
    ? [window.{panel}.encode(), b, c, window.{panel}.currentToken(), window.{panel}.strength || "",
       window.{panel}.editText(), String(window.{panel}.editFrom || ""), s]
    : [r, b, c, t, g, e, f, s]"""


# The annotator's own answer: a plain textarea the page script owns (filled from a card's text by
# ✎ Edit or E, emptied for each new item), ranked as one more card; Submit sends it (submit_js).
# `prefix`: the panel's element ids (rl: this tab; rl-chat: the Chat tab).
def edit_box(prefix: str) -> str:
    return (f'<div class="rl-editbox"><label for="{prefix}-edit-text">Your better answer <span class="rl-muted">'
            f'(optional) · E</span></label><div id="{prefix}-edit-from" class="rl-muted">Press ✎ Edit on a response '
            f'(or E) to write a better one from it.</div><textarea id="{prefix}-edit-text" rows="5" '
            'placeholder="Your answer to the prompt"></textarea></div>')


# Skip and Flag name the showing they act on too (the token), so a restarted app knows the item
SKIP_JS = "(s, t) => window.rlhf ? [s, window.rlhf.currentToken()] : [s, t]"
FLAG_JS = "(s, c, t) => window.rlhf ? [s, c, window.rlhf.currentToken()] : [s, c, t]"


def build_ui(ctx: AppContext) -> gr.Blocks:
    """The whole app as a gr.Blocks (launch it with `launch`)."""
    with gr.Blocks(title="rlhf-loop · annotate", fill_width=True) as demo:
        state = gr.State(None)  # a SessionState once the page has loaded (handlers.load)
        header = gr.HTML(elem_id="rl-header-box", js_on_load=None)
        with gr.Tabs(elem_id="rl-tabs"):
            with gr.Tab("Annotate", id="annotate", elem_id="rl-tab-annotate"):
                annotate = _annotate_tab(ctx, state)
            with gr.Tab("Chat", id="chat", elem_id="rl-tab-chat") as chat_tab:
                chat = ui_chat.chat_tab(ctx, submit_js("rlhfChat"), edit_box("rl-chat"))
            with gr.Tab("Data", id="data", visible=False, elem_id="rl-tab-data") as data_tab:
                data = ui_admin.data_tab(ctx)
            with gr.Tab("Train", id="train", visible=False, elem_id="rl-tab-train") as train_tab:
                train = ui_admin.train_tab(ctx)
            with gr.Tab("Models", id="models", visible=False, elem_id="rl-tab-models") as models_tab:
                models = ui_admin.models_tab(ctx)
            with gr.Tab("Account", id="account", elem_id="rl-tab-account"):
                _account_tab(ctx)

        # Page load: who is this, which tabs may they see, and their first item.
        demo.load(
            bind(h.open_page, ctx), [state],
            [header, data_tab, train_tab, models_tab, data["timer"], annotate["guidelines"], *annotate["outs"]],
            api_visibility="private",
        )
        demo.unload(bind(h.leave, ctx))
        chat_tab.select(bind(chat_h.open_chat, ctx), [chat["state"]], chat["outs"], api_visibility="private",
                        show_progress="hidden")
        # Admin tabs load their tables when opened (only admins can see them; the handlers check).
        for tab, loads in ((data_tab, data["load"]), (train_tab, train.get("load", [])), (models_tab, models["load"])):
            for fn, inputs, outputs, *form in loads:
                tab.select(bind_form(fn, ctx, *form) if form else bind(fn, ctx), inputs, outputs,
                           api_visibility="private", show_progress="hidden")
    return demo


def _annotate_tab(ctx: AppContext, state: gr.State) -> dict:
    # Argilla's layout: the record (prompt and responses) on the left, the question panel (the
    # ranking, comment and actions) on the right, sticky so it stays in view while reading.
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, min_width=640):
            progress = gr.HTML(elem_id="rl-progress", js_on_load=None)
            item = gr.HTML(elem_id="rl-item", js_on_load=None, min_height=320)
        with gr.Column(scale=1, min_width=300, elem_id="rl-side"):
            gr.HTML("", elem_id="rl-rankbar", js_on_load=None)
            all_bad = gr.Checkbox(label="All responses are bad · A", elem_id="rl-allbad")
            comment = gr.Textbox(placeholder="Comment (optional) · C", show_label=False, lines=2,
                                 max_lines=4, elem_id="rl-comment")
            gr.HTML(edit_box("rl"), elem_id="rl-edit", js_on_load=None)
            submit = gr.Button("Submit  ⏎", variant="primary", elem_id="rl-submit", size="lg")
            with gr.Row(elem_id="rl-secondary"):
                skip = gr.Button("Skip · S", elem_id="rl-skip", size="sm", min_width=60)
                flag = gr.Button("Flag · F", elem_id="rl-flag", size="sm", min_width=60)
                undo = gr.Button("Undo · U", elem_id="rl-undo", size="sm", min_width=60)
            with gr.Accordion("Guidelines", open=True, elem_id="rl-guidelines-box"):
                guidelines = gr.Markdown(elem_id="rl-guidelines", sanitize_html=True)
            with gr.Accordion("Keyboard shortcuts", open=True, elem_id="rl-keys-box"):
                gr.HTML(render_shortcuts(), js_on_load=None)
            # Filled by the page script on Submit (never typed): the ranking, the item's token, the
            # strength of the best response over the second, and the annotator's own answer.
            ranking = gr.Textbox(visible="hidden", elem_id="rl-ranking")
            token = gr.Textbox(visible="hidden", elem_id="rl-token")
            # Submit's optional values start empty, so an API client may leave them out
            strength = gr.Textbox("", visible="hidden", elem_id="rl-strength")
            edit = gr.Textbox("", visible="hidden", elem_id="rl-edit-value")
            edit_from = gr.Textbox("", visible="hidden", elem_id="rl-edit-from-value")

    # While nothing is on screen (queue empty, generation running), look for new items; the
    # handlers switch this timer on and off (see handlers.view).
    timer = gr.Timer(3.0, active=False)
    outs = [state, item, progress, comment, all_bad, timer]
    quick = dict(show_progress="hidden", trigger_mode="once")
    submission = form_inputs(h.Submission, dict(ranking=ranking, all_bad=all_bad, comment=comment, token=token,
                                                strength=strength, edit=edit, edit_from=edit_from))
    submit.click(bind_form(h.submit, ctx, h.Submission), [*submission, state], outs, api_name="submit", js=submit_js("rlhf"),
                 **quick)
    skip.click(bind(h.skip, ctx), [state, token], outs, api_name="skip", js=SKIP_JS, **quick)
    flag.click(bind(h.flag, ctx), [state, comment, token], outs, api_name="flag", js=FLAG_JS, **quick)
    undo.click(bind(h.undo, ctx), [state], outs, api_name="undo", **quick)
    timer.tick(bind(h.refresh, ctx), [state], outs, api_name="refresh", api_visibility="undocumented",
               show_progress="hidden")
    return {"outs": outs, "guidelines": guidelines}


def _account_tab(ctx: AppContext) -> None:
    """Everyone: change your own password, sign out."""
    with gr.Column(elem_id="rl-account"):
        current = gr.Textbox(label="Current password", type="password", elem_id="rl-pw-current")
        new = gr.Textbox(label="New password (at least 8 characters)", type="password", elem_id="rl-pw-new")
        again = gr.Textbox(label="New password again", type="password", elem_id="rl-pw-again")
        change = gr.Button("Change password", variant="primary", elem_id="rl-pw-change")
        msg = gr.Markdown(elem_id="rl-pw-msg")
        if ctx.auth:
            gr.HTML('<a href="logout">Sign out</a> (on every device)', js_on_load=None)
    change.click(bind(h.change_password, ctx), [current, new, again], [msg],
                 api_name="change_password", api_visibility="undocumented")


def _settle_matplotlib() -> None:
    """Gradio wraps every event in `matplotlib.use("agg")` and back. Importing matplotlib (seconds)
    inside the first event, and resolving an undecided backend on each one, would stall the event
    loop for everyone; choosing 'agg' once at start makes both no-ops."""
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot  # noqa: F401  (imported now, not inside the first event)


def queue_events(demo: gr.Blocks) -> None:
    """Gradio's queue as the app runs it (bench/ui_bench.py runs a no-op app with the same)."""
    # Gradio recomputes a summary of its last 10,000 events with pandas after every event, for a
    # monitoring page this app does not enable: 1.6 ms of CPU per action at 500 events served, 5 ms
    # from 10,000 on (a quarter of the CPU at full load; bench/ui_bench.py). Its cache setting
    # (read when the queue is made) makes it compute it never.
    os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", str(2**62))
    # Submit, skip, ... of different annotators run in parallel (16 at once); the store serialises
    # the writes. Gradio's default sends every waiting event its place in the queue whenever a job
    # starts: with n waiting that is n messages per job, n^2 per round of them, and at 100
    # annotators the messages outgrew the work (bench/ui_bench.py). Places go out every
    # QUEUE_STATUS_SECONDS instead.
    demo.queue(default_concurrency_limit=16, status_update_rate=QUEUE_STATUS_SECONDS)


def launch(demo: gr.Blocks, ctx: AppContext, *, host: str = "127.0.0.1", port: int = 7860,
           prevent_thread_lock: bool = False, quiet: bool = False):
    """Serve the app. With ctx.auth, Gradio's login page checks passwords against the store (scrypt
    hashes, throttled) and signs a session cookie that lasts ctx.session_hours; handlers read the
    name from it (annotate/context.py, annotate/accounts.py)."""
    auth = accounts.password_check(ctx) if ctx.auth else None
    _settle_matplotlib()
    if ctx.background is None:  # the next item is fetched ahead by these threads (handlers.prefetch)
        ctx.background = ThreadPoolExecutor(max_workers=4, thread_name_prefix="prefetch")
    queue_events(demo)
    # Gradio's sign-in tokens, aged and kept in the store (a restart signs no one out), with the
    # store's own cookie id; SessionsMiddleware installs them before the first request is served
    ctx.sessions = accounts.Sessions(ctx.session_hours * 3600.0, store=ctx.store)
    ctx.cookie_id = accounts.cookie_id(ctx.store)
    ctx.throttle.persist_in(ctx.store)
    middleware = [Middleware(accounts.ClientAddress), Middleware(accounts.SessionsMiddleware, ctx=ctx)]
    if ctx.timings is not None:
        middleware.append(Middleware(TimingMiddleware, timings=ctx.timings))
    result = demo.launch(
        server_name=host, server_port=port, auth=auth,
        auth_message="rlhf-loop · preference annotation. Sign in with the account an admin created for you.",
        prevent_thread_lock=True, quiet=quiet, show_error=True, ssr_mode=False,
        footer_links=[], theme=THEME, css=(STATIC / "annotate.css").read_text(),
        head=f"<script>{(STATIC / 'annotate.js').read_text()}</script>",
        max_threads=64, app_kwargs={"middleware": middleware},
    )
    if not prevent_thread_lock:
        demo.block_thread()
    return result
