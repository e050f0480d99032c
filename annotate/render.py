"""Safe HTML for the annotation view: prompts as conversation turns, responses as rankable cards.

Everything shown here is untrusted: prompts come from uploaded files and responses from a model.
The single rule that keeps it inert is *escape first, then add our own markup*: every piece of
untrusted text goes through `html.escape` (quotes included) before any tag of ours is put around
it, and nothing untrusted ever lands in an attribute, a URL or a script. What we add afterwards is
a fixed vocabulary (turn bubbles, code fences as <pre>), so a `<script>` or an
`<img src=x onerror=...>` in a response shows up as the literal text it is.

The cards carry `data-pos` (1-based display position) and `data-key` (the key that ranks it: 1-9,
then letters, POSITION_KEYS), and the item carries `data-token` and `data-k`;
annotate/static/annotate.js reads those to rank by click or key and to reset itself when a new item
arrives. No other data crosses into the page.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass

# An HH-RLHF transcript is "\n\nHuman: ...\n\nAssistant: ...", ending with an empty
# "\n\nAssistant:" that the response continues (Bai et al. 2022, dataset card of anthropics/hh-rlhf).
_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant|User|System):[ \t]?", re.MULTILINE)
_FENCE = re.compile(r"```[^\n`]*\n?(.*?)(?:```|\Z)", re.DOTALL)
# Applied to text that is already escaped, so the captured groups hold no markup of their own.
_BOLD = re.compile(r"\*\*([^*\n]+?)\*\*")
_CODE = re.compile(r"`([^`\n]+)`")
_ROLE_LABEL = {"human": "Human", "user": "Human", "assistant": "Assistant", "system": "System"}

POSITION_KEYS = "123456789bdghijklmnopqrvwxyz"
"""The key of each display position: 1-9, then the letters the other shortcuts leave free (A, C, E,
F, S, T and U are actions), so up to 28 responses can be ranked from the keyboard; the card shows its
key. Beyond that, cards are ranked by clicking."""


def position_key(pos: int) -> str:
    """The key that ranks display position `pos` (1-based); '' past POSITION_KEYS."""
    return POSITION_KEYS[pos - 1] if 1 <= pos <= len(POSITION_KEYS) else ""


def keys_hint(k: int) -> str:
    """How to rank k responses, in words for the page: "1–4", or "1–9, then B, D, G"."""
    if k <= 9:
        return f"1–{k}"
    letters = [key.upper() for key in POSITION_KEYS[9:k]]
    shown = ", ".join(letters[:3]) + (" …" if len(letters) > 3 else "")
    return f"1–9, then {shown}"


def esc(text: object) -> str:
    """Escape untrusted text for element content *and* attribute values."""
    return html.escape("" if text is None else str(text), quote=True)


# --------------------------------------------------------------------------- prompt turns


@dataclass(frozen=True)
class Turn:
    role: str  # "Human" | "Assistant" | "System"
    text: str


def split_turns(prompt: str | Sequence[dict]) -> list[Turn]:
    """A prompt as conversation turns.

    Accepts chat messages ([{"role": ..., "content": ...}]) or a string. A string with HH-style
    markers is split at each "Human:"/"Assistant:"; the trailing empty "Assistant:" (the slot the
    response fills) is dropped. A plain string is one Human turn.
    """
    if not isinstance(prompt, str):
        turns = [
            Turn(_ROLE_LABEL.get(str(m.get("role", "")).lower(), str(m.get("role", "")).title()),
                 str(m.get("content", "")))
            for m in prompt
        ]
        return [t for t in turns if t.text.strip()]
    matches = list(_TURN.finditer(prompt))
    if not matches:
        return [Turn("Human", prompt.strip())]
    turns: list[Turn] = []
    head = prompt[: matches[0].start()].strip()
    if head:
        turns.append(Turn("Human", head))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(prompt)
        text = prompt[m.end() : end].strip()
        if text:
            turns.append(Turn(_ROLE_LABEL[m.group(1).lower()], text))
    return turns


# --------------------------------------------------------------------------- text blocks


def _prose(text: str) -> str:
    """Escape, then show **bold** and `code` (models write markdown); the rest stays plain text."""
    out = _BOLD.sub(r"<strong>\1</strong>", esc(text))
    return _CODE.sub(r"<code>\1</code>", out)


def format_text(text: str) -> str:
    """Escaped text with ``` fences shown as code blocks; newlines kept by CSS (pre-wrap)."""
    text = (text or "").strip("\n")
    out, last = [], 0
    for m in _FENCE.finditer(text):
        out.append(f'<span class="rl-prose">{_prose(text[last:m.start()])}</span>')
        out.append(f"<pre><code>{esc(m.group(1).rstrip())}</code></pre>")
        last = m.end()
    out.append(f'<span class="rl-prose">{_prose(text[last:])}</span>')
    return "".join(part for part in out if part != '<span class="rl-prose"></span>')


def render_prompt(prompt: str | Sequence[dict]) -> str:
    turns = split_turns(prompt)
    rows = []
    for t in turns:
        css = t.role.lower()
        rows.append(
            f'<div class="rl-turn rl-{esc(css)}"><div class="rl-role">{esc(t.role)}</div>'
            f'<div class="rl-text">{format_text(t.text)}</div></div>'
        )
    label = "Conversation" if len(turns) > 1 else "Prompt"
    return (
        f'<section class="rl-prompt"><div class="rl-section-label">{label}'
        f'<span class="rl-muted"> · {len(turns)} turn{"s" if len(turns) != 1 else ""}</span></div>'
        f'{"".join(rows)}</section>'
    )


# --------------------------------------------------------------------------- the item


def _response_meta(resp) -> str:
    bits = []
    n = getattr(resp, "token_count", None)
    if n:
        bits.append(f"{int(n)} tokens")
    if getattr(resp, "finish_reason", None) == "length":
        bits.append('<span class="rl-warn" title="the model hit its length limit">cut off</span>')
    return " · ".join(bits)


def render_item(prompt: str | Sequence[dict], responses: Sequence, token: str, meta: str = "") -> str:
    """The prompt and its K responses, in the given (already shuffled) display order.

    `responses[i]` is shown at display position i+1 under key i+1. `token` identifies this showing
    of the item (a fresh one each time it is shown), so the page can tell items apart. Each card
    holds its text verbatim too (a hidden textarea), which the page copies when the annotator writes
    a better answer from it.
    """
    k = len(responses)
    cards = []
    for pos, resp in enumerate(responses, start=1):
        text = getattr(resp, "text", resp)
        key = position_key(pos)
        kbd = f"<kbd>{key.upper()}</kbd>" if key else ""
        cards.append(
            f'<article class="rl-card" data-pos="{pos}" data-key="{key}" tabindex="-1">'
            f'<header class="rl-card-head">{kbd}<span class="rl-card-title">Response {pos}</span>'
            f'<span class="rl-badge" aria-live="polite"></span>'
            f'<button type="button" class="rl-edit-from" data-pos="{pos}" title="Write a better answer from this one"'
            f'>✎ Edit</button></header>'
            f'<div class="rl-text">{format_text(str(text))}</div>'
            f'<textarea class="rl-raw" hidden aria-hidden="true">{esc(text)}</textarea>'
            f'<div class="rl-card-foot">{_response_meta(resp)}</div></article>'
        )
    return (
        f'<div class="rl-item" data-token="{esc(token)}" data-k="{k}">'
        f'{render_prompt(prompt)}'
        f'<div class="rl-section-label rl-resp-label">Responses'
        f'<span class="rl-muted"> · click or press {keys_hint(k)} from best to worst{esc(meta)}</span></div>'
        f'<div class="rl-grid rl-k{k}">{"".join(cards)}</div></div>'
    )


def render_transcript(messages: Sequence[dict], hint: str, busy: bool = False) -> str:
    """A conversation with nothing to rank (the Chat tab between turns, or while its replies are
    sampled): its turns, then what happens next."""
    spinner = '<div class="rl-spinner"></div>' if busy else ""
    return (f'<div class="rl-item rl-chat" data-token="" data-k="0">{render_prompt(messages)}'
            f'<div class="rl-chat-next">{spinner}<p class="rl-muted">{esc(hint)}</p></div></div>')


def render_chat_status(turns: int, max_turns: int, note: str = "", error: bool = False) -> str:
    """The Chat tab's line above the conversation: its turns so far, and what the last action did
    (an error, such as a busy or restarted sampler, stands out)."""
    note_html = (f'<span class="rl-note{" rl-error" if error else ""}" role="{"alert" if error else "status"}">'
                 f'{esc(note)}</span>') if note else ""
    return (f'<div class="rl-progress"><span class="rl-stat"><b>{turns}</b> of {max_turns} turns</span>'
            f'{note_html}</div>')


def render_empty(title: str, detail: str = "", busy: bool = False) -> str:
    """The placeholder when there is nothing to rank (queue empty, generation running)."""
    spinner = '<div class="rl-spinner"></div>' if busy else '<div class="rl-done-mark">✓</div>'
    return (
        f'<div class="rl-item rl-empty" data-token="" data-k="0">{spinner}'
        f'<h3>{esc(title)}</h3><p class="rl-muted">{esc(detail)}</p></div>'
    )


# --------------------------------------------------------------------------- small pieces


def render_progress(today: int, total: int, remaining: int, note: str = "") -> str:
    """The progress line above the item: today's count, total, and what is left in the queue."""
    note_html = f'<span class="rl-note">{esc(note)}</span>' if note else ""
    return (
        '<div class="rl-progress">'
        f'<span class="rl-stat"><b>{today}</b> today</span>'
        f'<span class="rl-stat"><b>{total}</b> total</span>'
        f'<span class="rl-stat"><b>{remaining}</b> in queue</span>{note_html}</div>'
    )


def render_job(label: str, done: int, total: int, status: str, detail: str = "") -> str:
    """A progress bar for a background job (generation today; training jobs later)."""
    frac = 0.0 if total <= 0 else max(0.0, min(1.0, done / total))
    return (
        f'<div class="rl-job rl-job-{esc(status)}" data-status="{esc(status)}">'
        f'<div class="rl-job-head"><b>{esc(label)}</b><span>{esc(status)} · {done}/{total}</span></div>'
        f'<div class="rl-bar"><div class="rl-bar-fill" style="width:{frac * 100:.1f}%"></div></div>'
        f'<div class="rl-muted">{esc(detail)}</div></div>'
    )


def render_header(username: str, role: str, auth: bool) -> str:
    """The top bar: product name, who is signed in, sign-out link."""
    out = '<a class="rl-signout" href="logout">Sign out</a>' if auth else ""
    return (
        '<div class="rl-header"><div class="rl-brand"><span class="rl-logo">◆</span>rlhf-loop'
        '<span class="rl-muted"> · preference annotation</span></div>'
        f'<div class="rl-user"><span class="rl-avatar">{esc(username[:1].upper())}</span>'
        f'{esc(username)}<span class="rl-role-tag">{esc(role)}</span>{out}</div></div>'
    )


SHORTCUTS = [
    ("1–9", "rank next best (click a card works too); past 9 responses, the letter on the card"),
    ("Shift + key", "tie with the previous rank (or T, then the key)"),
    ("Backspace", "take back the last pick"),
    ("Esc", "clear the ranking"),
    ("0", "how much better the best is than the second: much better, better, slightly better, "
          "about the same, none (press again to change; K = 2, or the top two of K)"),
    ("E", "write a better answer, from the best-ranked response (or a card's ✎ Edit); E again ranks it"),
    ("A", "all responses are bad"),
    ("C", "write a comment"),
    ("Enter", "submit"),
    ("S", "skip"),
    ("U", "undo last submission"),
    ("F", "flag the prompt"),
]


def render_shortcuts() -> str:
    rows = "".join(f"<li><kbd>{esc(k)}</kbd><span>{esc(v)}</span></li>" for k, v in SHORTCUTS)
    return f'<div class="rl-shortcuts"><ul>{rows}</ul></div>'
