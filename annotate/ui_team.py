"""Layout and wiring of Data > Team: queue settings, live agreement, gold items.
Logic lives in annotate/team.py; annotate/ui_admin.py puts this tab in the Data tab."""

from __future__ import annotations

import gradio as gr

from annotate import chat
from annotate import team as t
from annotate.bind import bind
from annotate.context import AppContext

HIDDEN = {"api_visibility": "undocumented"}


def team_tab(ctx: AppContext) -> dict:
    """Build the tab's content (inside a gr.Tab); returns {"load": [(fn, inputs, outputs)]} to run
    when the Data tab opens."""
    gr.Markdown("**Overlap** is how many annotators rank each item; an annotator never gets an item twice. "
                "The newest round's items come first unless a round has its own **priority** (higher first). "
                "**Gold items** have a reference ranking and are mixed into everyone's queue at the gold rate, "
                "looking like any other item; each annotator is scored against them.")
    with gr.Row():
        overlap = gr.Number(None, label="Overlap (store default)", precision=0, minimum=1, elem_id="rl-team-overlap")
        gold_rate = gr.Number(None, label="Gold rate (share of each annotator's items, 0–1)", minimum=0, maximum=1,
                              elem_id="rl-team-gold-rate")
        save_btn = gr.Button("Save", variant="primary", elem_id="rl-team-save", scale=0, min_width=120)
    with gr.Row():
        round_id = gr.Dropdown([], label="Round", elem_id="rl-team-round")
        round_overlap = gr.Number(None, label="Its overlap (blank = store default)", precision=0, minimum=1,
                                  elem_id="rl-team-round-overlap")
        priority = gr.Number(None, label="Its priority (blank = newest first)", precision=0,
                             elem_id="rl-team-round-priority")
        round_btn = gr.Button("Set for the round", elem_id="rl-team-round-save", scale=0, min_width=160)
    with gr.Row():
        chat_replies = gr.Number(None, label="Chat: replies per turn (K)", precision=0, minimum=2,
                                 elem_id="rl-chat-replies")
        chat_turns = gr.Number(None, label="Chat: turns per conversation", precision=0, minimum=1,
                               elem_id="rl-chat-turns")
    with gr.Row():
        chat_url = gr.Textbox(label="Chat: outside server URL (blank = the local sampler on the active policy)",
                              placeholder="http://localhost:8000/v1", elem_id="rl-chat-url", scale=2)
        chat_model = gr.Textbox(label="Its model name (blank = the server's own)", elem_id="rl-chat-model")
        chat_btn = gr.Button("Save chat settings", elem_id="rl-chat-settings-save", scale=0, min_width=160)
    queue_msg = gr.Markdown(elem_id="rl-team-msg")
    rounds = gr.Dataframe(label="Rounds", interactive=False, elem_id="rl-team-rounds")

    summary = gr.Markdown(elem_id="rl-team-summary")
    people = gr.Dataframe(label=f"Annotators (refreshed every {t.LIVE_SECONDS:g} s)", interactive=False,
                          elem_id="rl-team-annotators")
    items = gr.Dataframe(label=f"Items ranked by 2+ annotators, least agreement first (up to {t.ITEMS_SHOWN})",
                         interactive=False, wrap=True, elem_id="rl-team-items")
    with gr.Row():
        ranking_id = gr.Number(None, label="Ranking id (from the items table)", precision=0, minimum=1,
                               elem_id="rl-gold-ranking")
        mark_btn = gr.Button("Use as gold", variant="primary", elem_id="rl-gold-mark", scale=0, min_width=140)
        item_id = gr.Number(None, label="Gold item id", precision=0, minimum=1, elem_id="rl-gold-item")
        unmark_btn = gr.Button("No longer gold", elem_id="rl-gold-unmark", scale=0, min_width=140)
    with gr.Row():
        upload = gr.File(label='Gold rankings (JSONL: {"item": id, "ranking": [...]} or {"prompt": text, '
                               '"ranking": [reply texts]}, best first)', file_types=[".jsonl", ".json"],
                         elem_id="rl-gold-file", scale=2)
        import_btn = gr.Button("Import gold", elem_id="rl-gold-import", scale=0, min_width=140)
    gold_msg = gr.Markdown(elem_id="rl-gold-msg")
    gold_errors = gr.Dataframe(label="Problems by row", interactive=False, elem_id="rl-gold-errors")
    gold = gr.Dataframe(label="Gold items", interactive=False, elem_id="rl-gold-items")
    timer = gr.Timer(t.LIVE_SECONDS, active=False)

    tables = [summary, people, items, gold]
    form = [overlap, gold_rate, round_id, rounds]
    save_btn.click(bind(t.save_queue, ctx), [overlap, gold_rate], [queue_msg], **HIDDEN, api_name="save_queue")
    chat_form = [chat_replies, chat_turns, chat_url, chat_model]
    chat_btn.click(bind(chat.save_settings, ctx), chat_form, [queue_msg], **HIDDEN,
                   api_name="save_chat_settings")
    round_id.change(bind(t.round_form, ctx), [round_id], [round_overlap, priority], api_visibility="private")
    round_btn.click(bind(t.save_round, ctx), [round_id, round_overlap, priority], [queue_msg, rounds],
                    **HIDDEN, api_name="save_round")
    mark_btn.click(bind(t.mark_gold, ctx), [ranking_id], [gold_msg, *tables], **HIDDEN, api_name="mark_gold")
    unmark_btn.click(bind(t.unmark_gold, ctx), [item_id], [gold_msg, *tables], **HIDDEN, api_name="unmark_gold")
    import_btn.click(bind(t.import_gold, ctx), [upload], [gold_msg, gold_errors, *tables],
                     **HIDDEN, api_name="import_gold")
    timer.tick(bind(t.team_tables, ctx), None, tables, api_visibility="private", show_progress="hidden")
    return {"load": [(t.queue_form, None, form), (chat.settings_form, None, chat_form),
                     (t.team_tables, None, tables), (t.go_live, None, [timer])]}
