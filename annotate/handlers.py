"""Annotate-tab handlers: show an item, submit a ranking, skip, flag, undo, prefetch; and the
Account tab's own password change.

Plain functions `(ctx, state, inputs..., request) -> (state, updates...)`; annotate/ui.py wires
them to components and tests call them directly with a real store and a stand-in request. Every
one starts by asking who the request belongs to (annotate/context.py), so identity and role come
from the server, never from the page.

Each action returns the same six outputs (see `view`): the session state, the item HTML, the
progress line, the comment box and "all bad" box reset for the next item, and the refresh timer.

After each action the next item is fetched ahead in the background (`prefetch`), so the following
Submit shows it without asking the queue: no extra request from the page, no wait for the user.
A Submit leases the item after that one in its ranking's own transaction (one commit per submit),
and the background only loads its content.

Rankings arrive from the page as display positions, best first, "=" for ties: "2>1=3>4" means
response 2 is best, 1 and 3 tie, 4 is worst (positions as shown, 1-based). The handler maps
positions to response ids with the display order it recorded, so the stored ranking names
responses, not screen slots.
"""

from __future__ import annotations

import dataclasses
import math
import re

import gradio as gr

from annotate import render
from annotate.context import AppContext, user
from annotate.state import SessionState, Showing
from annotate.timing import span
from store.errors import StoreError
from store.records import STRENGTHS, Annotator, EditIn, RankingIn
from store.versions import GUIDELINES_KEY

# ------------------------------------------------------------------------- ranking strings


def parse_ranking(text: str, k: int, all_bad: bool = False) -> list[list[int]]:
    """"2>1=3>4" -> [[2], [1, 3], [4]] (1-based display positions, best first).

    One unranked response is placed last (ranking K-1 decides the K-th). With "all bad", unranked
    responses form one tied group at the bottom (and nothing ranked = all tied). Otherwise every
    response must be ranked. Raises gr.Error naming the problem; nothing is stored then.
    """
    text = (text or "").replace(" ", "")
    groups: list[list[int]] = []
    if text:
        for part in text.split(">"):
            if not part:
                raise gr.Error(f"Ranking {text!r}: empty rank between '>' signs.")
            group = []
            for tok in part.split("="):
                if not tok.isdigit():
                    raise gr.Error(f"Ranking {text!r}: {tok!r} is not a response number.")
                group.append(int(tok))
            groups.append(group)
    flat = [p for g in groups for p in g]
    bad = [p for p in flat if not 1 <= p <= k]
    if bad:
        raise gr.Error(f"Ranking {text!r}: there are only {k} responses (got {bad[0]}).")
    if len(set(flat)) != len(flat):
        raise gr.Error(f"Ranking {text!r}: a response is ranked twice.")
    missing = [p for p in range(1, k + 1) if p not in flat]
    if len(missing) == 1:
        groups.append(missing)
    elif missing and all_bad:
        groups.append(missing)
    elif missing:
        raise gr.Error(
            f"Rank all {k} responses ({len(missing)} still unranked: {', '.join(map(str, missing))}), "
            "or mark them all bad."
        )
    return groups


# ------------------------------------------------------------------------- the view


def view(ctx: AppContext, state: SessionState, account: Annotator):
    """(state, item_html, progress_html, comment, all_bad, refresh timer) for the current state.

    The comment and "all bad" boxes are reset for the next item; the refresh timer runs only while
    nothing is on screen (it looks for newly generated items)."""
    if state.current is not None:
        item = state.current.item
        item_html = render.render_item(item.prompt.messages or item.prompt.text, item.responses,
                                       state.current.token)
    else:
        item_html = empty_html(ctx)
    p = ctx.store.progress(account.id)
    progress_html = render.render_progress(p.today, p.total, p.remaining, state.note)
    return state, item_html, progress_html, "", False, gr.update(active=state.current is None)


def generating(ctx: AppContext):
    """The generate job in flight (queued or running), or None."""
    runs = ctx.jobs.in_flight(("generate",)) if ctx.jobs is not None else []
    return runs[0] if runs else None


def empty_html(ctx: AppContext) -> str:
    run = generating(ctx)
    if run is not None:
        status = ctx.jobs.progress(run.id)
        done = f"{status.get('step', 0)}/{status['total']} responses done. " if status.get("total") else ""
        return render.render_empty(
            "Responses are being generated",
            f"Run #{run.id} ({run.status}): {done}New items appear here as they are ready.",
            busy=True,
        )
    return render.render_empty(
        "You're all caught up",
        "No items are waiting for you. New ones appear here when an admin generates or imports them.",
    )


def _advance(ctx: AppContext, state: SessionState, account: Annotator, exclude_prompt: int | None = None) -> None:
    """Show the next item: the prefetched one if still good, else ask the queue."""
    done_item = state.current.item.item_id if state.current else None
    item = state.take_prefetched(exclude_prompt)
    if item is not None and not ctx.store.holds_lease(account.id, item.item_id):
        item = None  # ranked, skipped or flagged meanwhile (another tab, a racing action): ask anew
    if item is None:
        item = ctx.store.next_item(account.id, exclude=[done_item] if done_item else [])
    with state.lock:  # a background prefetch may have fetched this same item (own leases come first)
        state.current = Showing(item) if item is not None else None
        if item is not None and state.ahead == item.item_id:
            state.ahead = None
        if item is not None and state.prefetched is not None and state.prefetched.item_id == item.item_id:
            state.prefetched = None


def _current(state: SessionState | None, token: str = "") -> Showing:
    if state is None or state.current is None:
        raise gr.Error("There is no item on screen to act on.")
    if token and token != state.current.token:
        # The page ranked a different showing than the one the server has (a stale tab).
        raise gr.Error("This item changed before your ranking arrived; nothing was saved. Rank it again.")
    return state.current


def _recovered(ctx: AppContext, state: SessionState | None, account: Annotator, token: str) -> SessionState | None:
    """The session's state, or, when this process has none for it (the app restarted since the
    page drew its item: a gr.State lives in the process), one rebuilt from the store: the item the
    page's token names, if the annotator still holds its lease (leases are in the store), shown
    under that same token (so a repeated submit still stores one ranking)."""
    if isinstance(state, SessionState) and state.current is not None:
        return state
    item_id = Showing.item_of(token)
    if item_id is None or not ctx.store.holds_lease(account.id, item_id):
        return state
    state = state if isinstance(state, SessionState) else SessionState()
    state.current = Showing(ctx.store.get_item(item_id, account.id), token=token, shown_at=None)
    return state


# ------------------------------------------------------------------------- actions


def open_page(ctx: AppContext, state: SessionState | None, request: gr.Request):
    """Page load: the header, which tabs this account may see (admins: Data, Train, Models, and the
    Data tab's job timer while a job runs), the guidelines, then the annotation view (see `load`)."""
    account = user(ctx, request, fresh=True)
    is_admin = account.is_admin
    header = render.render_header(account.name, account.role, ctx.auth)
    tabs = [gr.update(visible=is_admin)] * 3
    timer = gr.update(active=is_admin and generating(ctx) is not None)
    return (header, *tabs, timer, guidelines(ctx, request), *load(ctx, state, request))


def load(ctx: AppContext, state: SessionState | None, request: gr.Request):
    """Page load (and the refresh timer while nothing is on screen): show the current item, or the
    one the queue has leased to this annotator (a reload shows the same item)."""
    account = user(ctx, request)
    state = state if isinstance(state, SessionState) else SessionState()
    if state.current is None:
        item = ctx.store.next_item(account.id)
        state.current = Showing(item) if item is not None else None
    out = view(ctx, state, account)
    _prefetch_later(ctx, state, account)
    return out


def refresh(ctx: AppContext, state: SessionState | None, request: gr.Request):
    """Timer tick while the queue is empty: pick up newly generated items; leave a shown item alone
    (re-rendering it would wipe the ranking being made)."""
    if isinstance(state, SessionState) and state.current is not None:
        return (state,) + (gr.skip(),) * 4 + (gr.update(active=False),)
    return load(ctx, state, request)


@dataclasses.dataclass(frozen=True)
class Submission:
    """What Submit sends, by name. The field order is the order the page passes its components in
    (annotate/ui.py builds that list from these fields; annotate/bind.py `bind_form` turns it back
    into this record), and so the order of the /submit API's values.

    ranking: display positions best first ("2>1=3>4"); all_bad: every response is bad; comment;
    token: the showing the ranking is of; strength (optional, records.STRENGTHS): how much better
    the best response is than the second; edit (optional): the annotator's own better answer,
    written from the response at display position `edit_from`; the ranking names it as position
    K+1 where the annotator placed it (else it goes just above that response)."""

    ranking: str
    all_bad: bool
    comment: str
    token: str
    strength: str | None = None
    edit: str | None = None
    edit_from: str | None = None


def submit(ctx: AppContext, form: Submission, state: SessionState | None, request: gr.Request):
    """Save the ranking of the item on screen (and its pairs), then show the next item."""
    token = form.token
    account = user(ctx, request)
    state = _recovered(ctx, state, account, token)
    showing = _current(state, token)
    submitted, note = ranking_in(account, showing, form)
    with state.lock:
        on_deck = state.prefetched if state.ahead is None else None
    ahead = None
    try:
        with span(ctx, "store"):
            if ctx.prefetch and on_deck is not None:
                # the item after the prefetched one is leased in the ranking's own transaction (one
                # commit per submit, not two); its content is loaded in the background (`prefetch`)
                _, ahead = ctx.store.save_ranking_and_lease_next(submitted, exclude=[on_deck.item_id])
            else:
                ctx.store.save_ranking(submitted)
    except StoreError as exc:
        raise gr.Error(f"Not saved: {exc}") from None
    state.note = note
    _advance(ctx, state, account)
    if ahead is not None:
        with state.lock:
            shown = state.current.item.item_id if state.current is not None else None
            if ahead != shown:
                state.ahead = ahead
    out = view(ctx, state, account)
    _prefetch_later(ctx, state, account)
    return out


def ranking_in(account: Annotator, showing: Showing, form: Submission) -> tuple[RankingIn, str]:
    """The ranking a Submission makes of the showing on screen (positions mapped to response ids,
    the annotator's own answer placed, the strength checked), and the note saying what it saves.
    The Annotate tab's submit and the Chat tab's (annotate/chat.py) both read their panel so."""
    ids = showing.item.display_order
    own = _edit(showing, form.edit, form.edit_from)
    all_bad = bool(form.all_bad)
    if own is not None and str(showing.k + 1) in re.split(r"[>=\s]+", form.ranking or ""):
        groups, place = _without_edit(parse_ranking(form.ranking, showing.k + 1, all_bad), showing.k + 1)
        own = dataclasses.replace(own, place=place)
    else:
        groups = parse_ranking(form.ranking, showing.k, all_bad)
    strength = (form.strength or "").strip() or None
    if strength is not None and strength not in STRENGTHS:
        raise gr.Error(f"Strength must be one of {', '.join(STRENGTHS)} (or none), not {strength!r}.")
    order = [[ids[pos - 1] for pos in g] for g in groups]
    submitted = RankingIn(account.id, showing.item.prompt.id, order, all_bad=all_bad, display_order=list(ids),
                          duration_s=showing.elapsed(), client_token=showing.token,
                          comment=(form.comment or "").strip(), strength=strength, edit=own)
    n_pairs = sum(len(a) * len(b) for i, a in enumerate(groups) for b in groups[i + 1:]) + (own is not None) * showing.k
    note = (f"Saved · {n_pairs} pair{'s' if n_pairs != 1 else ''}" + (" · all bad" if all_bad else "")
            + (f" · the best is {strength}" if strength else "") + (" · your answer" if own else ""))
    return submitted, note


def _edit(showing: Showing, edit: str | None, edit_from: str | None) -> EditIn | None:
    """The annotator's own answer (placed by submit), or None when there is none. Refuses
    (gr.Error) an answer with no response it was made from, or one unchanged."""
    text = (edit or "").strip()
    if not text:
        return None
    k, responses = showing.k, showing.item.display_order
    try:
        pos = int(edit_from or 0)
    except ValueError:
        pos = 0
    if not 1 <= pos <= k:
        raise gr.Error(f"Your answer needs the response it was written from (1 to {k}): press ✎ Edit on one.")
    source = next(r for r in showing.item.responses if r.id == responses[pos - 1])
    if text == source.text.strip():
        raise gr.Error(f"Your answer is response {pos} unchanged: change it, or clear it.")
    return EditIn(text, made_from=source.id)


def _without_edit(groups: list[list[int]], edit_pos: int) -> tuple[list[list[int]], int]:
    """The ranking without the annotator's own answer (display position `edit_pos`), and the tie
    group it was placed just above."""
    at = next(g for g, group in enumerate(groups) if edit_pos in group)
    if len(groups[at]) > 1:
        raise gr.Error("Your answer cannot tie with a response: give it a place of its own.")
    return groups[:at] + groups[at + 1:], at


def skip(ctx: AppContext, state: SessionState | None, request: gr.Request, token: str = ""):
    """Skip the item on screen: this annotator will not be offered it again. `token` (the page
    sends it): the showing skipped, as for Submit."""
    account = user(ctx, request)
    state = _recovered(ctx, state, account, token)
    showing = _current(state, token)
    ctx.store.skip_item(account.id, showing.item.item_id)
    state.note = "Skipped"
    _advance(ctx, state, account)
    out = view(ctx, state, account)
    _prefetch_later(ctx, state, account)
    return out


def flag(ctx: AppContext, state: SessionState | None, comment: str, request: gr.Request, token: str = ""):
    """Flag the prompt on screen (broken, harmful, unanswerable): it leaves the queue for everyone
    until an admin looks at it. The comment box, if filled, is the reason; `token` as for skip."""
    account = user(ctx, request)
    state = _recovered(ctx, state, account, token)
    showing = _current(state, token)
    prompt_id = showing.item.prompt.id
    ctx.store.flag_prompt(prompt_id, account.id, reason=(comment or "").strip() or "flagged while annotating")
    state.note = "Flagged"
    _advance(ctx, state, account, exclude_prompt=prompt_id)
    out = view(ctx, state, account)
    _prefetch_later(ctx, state, account)
    return out


def undo(ctx: AppContext, state: SessionState | None, request: gr.Request):
    """Delete this annotator's last ranking (and its pairs) and show that item again. The item that
    was on screen becomes the next one."""
    account = user(ctx, request)
    state = state if isinstance(state, SessionState) else SessionState()
    item = ctx.store.undo_last_ranking(account.id)
    if item is None:
        raise gr.Error("Nothing to undo: you have no submitted ranking.")
    with state.lock:
        dropped = [state.prefetched.item_id] if state.prefetched is not None else []
        dropped += [state.ahead] if state.ahead is not None else []
        keep = {item.item_id} | ({state.current.item.item_id} if state.current is not None else set())
        state.prefetched = state.current.item if state.current is not None else None
        state.ahead = None
        state.current = Showing(item)
    for item_id in set(dropped) - keep:  # the one on screen stays leased: it is shown next
        ctx.store.release_lease(account.id, item_id)
    state.note = "Undone · rank it again"
    return view(ctx, state, account)


def prefetch(ctx: AppContext, state: SessionState, account: Annotator) -> None:
    """Fetch (and lease) the item after the one on screen, so the next action shows it at once:
    only its content when the submit's transaction already leased it (`state.ahead`).
    Runs in the background after each action (see `_prefetch_later`)."""
    with state.lock:
        if state.current is None or state.prefetched is not None or state.prefetching:
            return
        state.prefetching = True
        on_screen = state.current.item.item_id
        ahead, state.ahead = state.ahead, None
    item = None
    try:
        with span(ctx, "prefetch"):
            if ahead is not None:
                item = ctx.store.get_item(ahead, account.id)  # leased already: no write, no lock
            else:
                item = ctx.store.next_item(account.id, exclude=[on_screen])
    finally:
        with state.lock:
            state.prefetching = False
            # An action may have run meanwhile and put this very item on screen (the queue hands
            # an annotator their own leased item first), or filled the slot: then keep it unused.
            shown = state.current.item.item_id if state.current is not None else None
            if item is not None and state.prefetched is None and item.item_id != shown:
                state.prefetched = item
    # An item not kept stays leased to this annotator: the queue hands an annotator their own lease
    # first, so it comes next. Releasing it here would race an action of this tab that is taking
    # the same own-leased item from the queue at this moment: the item would be on screen with no
    # lease, and another annotator could rank it beyond the overlap. `leave` releases everything.


def _prefetch_later(ctx: AppContext, state: SessionState, account: Annotator) -> None:
    if not ctx.prefetch or state.current is None:
        return
    if ctx.background is None:
        prefetch(ctx, state, account)
    else:
        ctx.background.submit(prefetch, ctx, state, account)


def leave(ctx: AppContext, request: gr.Request) -> None:
    """The tab was closed or reloaded: give back this annotator's leased items (the one on screen
    and the prefetched one) so others get them now rather than when the lease expires. A second
    open tab of the same annotator keeps its item on screen and can still submit it."""
    ctx.store.release_lease(user(ctx, request).id)


def guidelines(ctx: AppContext, request: gr.Request) -> str:
    """The annotation guidelines (markdown, edited by admins in the Data tab)."""
    user(ctx, request)
    return ctx.store.get_setting(GUIDELINES_KEY, "") or DEFAULT_GUIDELINES


DEFAULT_GUIDELINES = """\
**Rank the responses from best to worst.**

1. **Helpful**: does it answer what was asked, correctly and completely?
2. **Honest**: no made-up facts; says so when unsure.
3. **Harmless**: refuses clearly harmful requests politely, without lecturing.

Ties are fine when two responses are equally good. Mark **all bad** when none is acceptable
(the order still counts, but these rankings are kept apart in exports). **Flag** a prompt that is
broken or should not be annotated; **skip** one you cannot judge.
"""


def change_password(ctx, current: str, new: str, again: str, request: gr.Request) -> str:
    """The signed-in user changes their own password (their current one is asked for, so a
    browser left open cannot be used to take the account over)."""
    account = user(ctx, request, fresh=True)
    if not all(isinstance(v, str) or v is None for v in (current, new, again)):
        raise gr.Error("Passwords must be text.")
    wait, _ = ctx.throttle.wait_s(account.name, None)
    if wait > 0:
        raise gr.Error(f"Too many wrong passwords: try again in {math.ceil(wait)} s.")
    if (new or "") != (again or ""):
        raise gr.Error("The two new passwords differ.")
    if not ctx.store.check_password(account.id, current or ""):
        ctx.throttle.failed(account.name, None)
        raise gr.Error("Your current password is not right.")
    try:
        ctx.store.set_password(account.id, new)
    except StoreError as exc:
        raise gr.Error(f"Password not changed: {exc}.") from None
    return f"Password changed for **{account.name}**. It applies from your next sign-in."
