"""Chat-tab handlers: an annotator writes a message, the active policy offers K replies, they rank
them with the Annotate tab's panel, and the conversation goes on from the best (or their own) reply.

Each turn is stored as an ordinary item once its replies are there (store/conversations.py,
Store.add_chat_turn): its prompt the conversation so far, leased to the annotator; the ranking is
the Annotate tab's own (handlers.ranking_in, Store.save_ranking), so ties, all bad, strength and
✎ Edit work as there. Replies come from ctx.chat (pipeline/orchestrate/chat.py ChatService: the
local sampler, or an outside OpenAI-compatible server); its errors (busy, timed out, the sampler
restarted) are shown in the tab with the message kept for sending again, and nothing is stored
for a message without replies.

Every handler asks who the request belongs to (annotate/context.py) first: any signed-in account
may chat; the settings (K, the turns a conversation holds) are an admin's. Each returns the same
outputs (`view`): the state, the status line, the conversation (with the replies to rank), the
message box, and the comment and "all bad" boxes reset.
"""

from __future__ import annotations

import gradio as gr

from annotate import render
from annotate.context import AppContext, admin, user
from annotate.handlers import Submission, ranking_in
from annotate.state import ChatState, Showing
from pipeline.orchestrate.chat import Answer, ChatError
from pipeline.orchestrate.steps import LoopSettings, ensure_base_policy
from store.errors import StoreError
from store.records import Annotator

_FINISH = {"stop": "eos", "length": "length"}
"""OpenAI's finish reasons as the store names them (records.Response.finish_reason)."""


# ------------------------------------------------------------------------- the view


def view(ctx: AppContext, state: ChatState, message=gr.skip()):
    """(state, status html, conversation html, message box, comment, all bad)."""
    if state.showing is not None:
        item = state.showing.item
        body = render.render_item(state.messages, item.responses, state.showing.token)
    else:
        body = _conversation_html(ctx, state)
    status = render.render_chat_status(state.turns, ctx.store.chat_max_turns(), state.note, state.error)
    return state, status, body, message, "", False


def _conversation_html(ctx: AppContext, state: ChatState) -> str:
    """The conversation with nothing to rank: what to do next."""
    if not state.messages:
        return render.render_empty("Start a conversation",
                                   f"Write a message: the policy offers {ctx.store.chat_replies()} replies; "
                                   "rank them, and the conversation goes on from the best one.")
    return render.render_transcript(state.messages, "Write your next message below, or End the conversation.")


def busy_html(ctx: AppContext, state: ChatState, message: str) -> str:
    conversation = [*state.messages, {"role": "user", "content": message}]
    return render.render_transcript(conversation, f"Sampling {ctx.store.chat_replies()} replies from the policy …",
                                    busy=True)


# ------------------------------------------------------------------------- actions


def open_chat(ctx: AppContext, state: ChatState | None, request: gr.Request):
    """The tab opened (or the page loaded): the annotator's open conversation as the store holds
    it (a reload, a restart), with the replies of its last message to rank if they are not yet."""
    account = user(ctx, request)
    if not isinstance(state, ChatState):
        state = _resumed(ctx, account)
    return view(ctx, state)


def _resumed(ctx: AppContext, account: Annotator) -> ChatState:
    state = ChatState()
    open_ = [c for c in ctx.store.list_conversations(account.id) if c.status == "open"]
    if not open_:
        return state
    turns = ctx.store.conversation_turns(open_[-1].id)
    if not turns:
        return state
    last = turns[-1]
    state.conversation_id, state.turns = last.conversation_id, len(turns)
    if last.ranking_id is None:
        state.messages = list(last.messages)
        state.showing = Showing(ctx.store.get_item(last.item_id, account.id), shown_at=None)
    else:
        state.messages = [*last.messages, {"role": "assistant", "content": last.reply}]
    return state


def sampling(ctx: AppContext, state: ChatState | None, message: str, request: gr.Request):
    """Send, at once: check the message can be sent and show it with a spinner while `send`
    samples the replies (the page runs `send` only if this succeeded)."""
    account = user(ctx, request)
    state = state if isinstance(state, ChatState) else _resumed(ctx, account)
    text = _sendable(ctx, state, message)
    state.note, state.error = "", False
    return state, gr.skip(), busy_html(ctx, state, text), gr.skip(), gr.skip(), gr.skip()


def send(ctx: AppContext, state: ChatState | None, message: str, request: gr.Request):
    """The policy's replies to the conversation and this message, stored as the turn's item and
    shown to rank. A ChatError (busy, timed out, the sampler restarted) stores nothing, is shown,
    and leaves the message in its box to send again."""
    account = user(ctx, request)
    state = state if isinstance(state, ChatState) else _resumed(ctx, account)
    text = _sendable(ctx, state, message)
    messages = [*state.messages, {"role": "user", "content": text}]
    try:
        answer = ctx.chat.replies(account.id, messages, ctx.store.chat_replies())
    except ChatError as exc:
        state.note, state.error = str(exc), True
        return view(ctx, state, message)
    replies = answer.replies
    if len(replies) < 2:
        state.note, state.error = (f"The policy gave {len(replies)} distinct repl{'y' if len(replies) == 1 else 'ies'}: "
                                   "at least 2 are needed to rank. Send the message again."), True
        return view(ctx, state, message)
    gen = ctx.chat.generate
    sampling_params = {"source": "chat", "temperature": gen.temperature, "top_p": gen.top_p,
                       "max_new_tokens": gen.max_new_tokens}
    rows = [(r.text, None, _FINISH.get(r.finish_reason, r.finish_reason), sampling_params) for r in replies]
    try:
        turn = ctx.store.add_chat_turn(account.id, state.conversation_id, messages, _replying_version(ctx, answer),
                                       rows)
    except StoreError as exc:
        raise gr.Error(f"Not saved: {exc}") from None
    state.conversation_id, state.messages, state.turns = turn.conversation_id, messages, turn.turn
    state.showing = Showing(ctx.store.get_item(turn.item_id, account.id))
    state.note, state.error = f"{len(replies)} replies: rank them, best first", False
    return view(ctx, state, "")


def _sendable(ctx: AppContext, state: ChatState, message: str) -> str:
    """The message, stripped, if it can be sent now; else gr.Error saying why."""
    if ctx.chat is None:
        raise gr.Error("Chat is not available in this app: it was started without a chat sampler.")
    if state.showing is not None:
        raise gr.Error("Rank the replies on screen first: the conversation goes on from the best one.")
    if state.turns >= ctx.store.chat_max_turns():
        raise gr.Error(f"This conversation has its {state.turns} turns: End it to start another.")
    text = (message or "").strip() if isinstance(message, str) else ""
    if not text:
        raise gr.Error("Write a message first.")
    return text


def _replying_version(ctx: AppContext, answer: Answer) -> int:
    """The model version the replies are stored as written by, as the service found it when it
    sent the request (an admin may change the server or the active policy meanwhile): the active
    policy the local sampler served (the base model, registered as policy 'base', on a fresh
    store); or, for an outside server, an external version named after its model."""
    if answer.outside is not None:
        name = f"chat:{answer.outside.model or answer.outside.root}"
        found = ctx.store.find_model_version(name)
        return (found or ctx.store.register_model_version("external", name, meta={"url": answer.outside.root})).id
    if answer.policy is not None:
        return answer.policy.id
    settings = ctx.train_settings or LoopSettings()
    return (ctx.store.find_model_version("base") or ensure_base_policy(ctx.store, settings.model)).id


def submit(ctx: AppContext, form: Submission, state: ChatState | None, request: gr.Request):
    """Save the ranking of the replies on screen (the Annotate tab's panel, handlers.ranking_in);
    the best-ranked reply, or the annotator's own answer ranked above them all, becomes the
    assistant's turn. The conversation ends by itself at its last turn."""
    account = user(ctx, request)
    state = state if isinstance(state, ChatState) else _resumed(ctx, account)
    showing = state.showing
    if showing is None:
        raise gr.Error("There are no replies on screen to rank: write a message first.")
    if form.token and form.token != showing.token:
        raise gr.Error("These replies changed before your ranking arrived; nothing was saved. Rank them again.")
    submitted, note = ranking_in(account, showing, form)
    try:
        ctx.store.save_ranking(submitted)
    except StoreError as exc:
        raise gr.Error(f"Not saved: {exc}") from None
    reply = ctx.store.conversation_turns(state.conversation_id)[-1].reply
    state.messages = [*state.messages, {"role": "assistant", "content": reply}]
    state.showing, state.note, state.error = None, note, False
    if state.turns >= ctx.store.chat_max_turns():
        ctx.store.end_conversation(account.id, state.conversation_id)
        ended = ChatState(note=f"{note} · the conversation has its {state.turns} turns and is ended: "
                               "write a message to start another")
        return view(ctx, ended, "")
    return view(ctx, state)


def end(ctx: AppContext, state: ChatState | None, request: gr.Request):
    """End the conversation (its ranked turns stay, an unranked last one is given back)."""
    return _close(ctx, state, request, flag=False, reason="")


def flag(ctx: AppContext, state: ChatState | None, comment: str, request: gr.Request):
    """Flag the conversation (harmful, broken): it ends, marked with the comment as the reason."""
    return _close(ctx, state, request, flag=True, reason=comment or "")


def _close(ctx: AppContext, state: ChatState | None, request: gr.Request, *, flag: bool, reason: str):
    account = user(ctx, request)
    state = state if isinstance(state, ChatState) else _resumed(ctx, account)
    if state.conversation_id is None:
        raise gr.Error("There is no conversation to end: write a message to start one.")
    try:
        ctx.store.end_conversation(account.id, state.conversation_id, flag=flag, reason=reason)
    except StoreError as exc:
        raise gr.Error(f"Not done: {exc}") from None
    done = "Flagged" if flag else "Ended"
    return view(ctx, ChatState(note=f"{done} the conversation of {state.turns} turns: write a message to start another"),
                "")


# ------------------------------------------------------------------------- settings (admins)


def settings_form(ctx: AppContext, request: gr.Request):
    """(replies per turn, turns per conversation, outside server URL, its model) as stored."""
    admin(ctx, request)
    return (ctx.store.chat_replies(), ctx.store.chat_max_turns(), *ctx.store.chat_server())


def save_settings(ctx: AppContext, replies, max_turns, server_url, server_model, request: gr.Request) -> str:
    """Store the Chat tab's settings (all or none: a bad one is named and nothing is saved)."""
    admin(ctx, request)
    try:
        ctx.store.set_chat_settings(replies=None if replies in (None, "") else replies,
                                    max_turns=None if max_turns in (None, "") else max_turns,
                                    server_url=server_url or "", server_model=server_model or "")
    except StoreError as exc:
        raise gr.Error(f"Not saved: {exc}") from None
    url, model = ctx.store.chat_server()
    server = f"replies from {url}" + (f" (model {model})" if model else "") if url else "replies from the active policy"
    heard = ctx.chat.check_outside() if ctx.chat is not None else ""  # '' for the local sampler
    return (f"Saved: {ctx.store.chat_replies()} replies per turn, "
            f"{ctx.store.chat_max_turns()} turns per conversation, {server}" + (f": {heard}." if heard else "."))
