"""Layout and wiring of the Chat tab: the conversation on the left, the Annotate tab's ranking
panel on the right (the same page script drives both: static/annotate.js, its panel
window.rlhfChat, the elements named rl-chat-*). Logic lives in annotate/chat.py; annotate/ui.py
puts this tab beside Annotate."""

from __future__ import annotations

import gradio as gr

from annotate import chat
from annotate.bind import bind, bind_form, form_inputs
from annotate.context import AppContext
from annotate.handlers import Submission

def chat_tab(ctx: AppContext, submit_js: str, edit_box: str) -> dict:
    """Build the tab's content (inside a gr.Tab); returns {"state", "outs"} for the tab's select
    event (annotate/ui.py). submit_js / edit_box: the Annotate tab's Submit hook and own-answer box,
    for this tab's panel."""
    state = gr.State(None)  # a ChatState once the tab has opened (chat.open_chat)
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, min_width=640):
            status = gr.HTML(elem_id="rl-chat-status", js_on_load=None)
            body = gr.HTML(elem_id="rl-chat-item", js_on_load=None, min_height=320)
            with gr.Row():
                message = gr.Textbox(placeholder="Your message to the assistant · Enter sends", show_label=False,
                                     lines=1, max_lines=8, elem_id="rl-chat-message", scale=5)
                send = gr.Button("Send", variant="primary", elem_id="rl-chat-send", scale=0, min_width=100)
        with gr.Column(scale=1, min_width=300, elem_id="rl-chat-side"):
            gr.HTML("", elem_id="rl-chat-rankbar", js_on_load=None)
            all_bad = gr.Checkbox(label="All replies are bad · A", elem_id="rl-chat-allbad")
            comment = gr.Textbox(placeholder="Comment (optional; the reason when flagging) · C", show_label=False,
                                 lines=2, max_lines=4, elem_id="rl-chat-comment")
            gr.HTML(edit_box, elem_id="rl-chat-edit", js_on_load=None)
            submit = gr.Button("Submit  ⏎", variant="primary", elem_id="rl-chat-submit", size="lg")
            with gr.Row():
                end = gr.Button("End conversation", elem_id="rl-chat-end", size="sm", min_width=60)
                flag = gr.Button("Flag · F", elem_id="rl-chat-flag", size="sm", min_width=60)
            # filled by the page script on Submit, as on the Annotate tab
            ranking = gr.Textbox(visible="hidden", elem_id="rl-chat-ranking")
            token = gr.Textbox(visible="hidden", elem_id="rl-chat-token")
            strength = gr.Textbox("", visible="hidden", elem_id="rl-chat-strength")
            edit = gr.Textbox("", visible="hidden", elem_id="rl-chat-edit-value")
            edit_from = gr.Textbox("", visible="hidden", elem_id="rl-chat-edit-from-value")

    outs = [state, status, body, message, comment, all_bad]
    quick = dict(show_progress="hidden", trigger_mode="once")
    for trigger, api in ((send.click, dict(api_name="chat_send")), (message.submit, dict(api_visibility="private"))):
        # the message and a spinner at once; then the replies (seconds: the policy samples K)
        trigger(bind(chat.sampling, ctx), [state, message], outs, api_visibility="private", **quick).success(
            bind(chat.send, ctx), [state, message], outs, show_progress="minimal", show_progress_on=[status], **api)
    submission = form_inputs(Submission, dict(ranking=ranking, all_bad=all_bad, comment=comment, token=token,
                                              strength=strength, edit=edit, edit_from=edit_from))
    submit.click(bind_form(chat.submit, ctx, Submission), [*submission, state], outs, api_name="chat_submit",
                 js=submit_js, **quick)
    end.click(bind(chat.end, ctx), [state], outs, api_name="chat_end", **quick)
    flag.click(bind(chat.flag, ctx), [state, comment], outs, api_name="chat_flag", **quick)
    return {"state": state, "outs": outs}
