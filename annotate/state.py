"""Per-session state of the annotation view, kept in a gr.State (one per browser tab or API client).

The gr.State starts as None; the first handler a session calls (page load, or /refresh through the
API) puts a SessionState in it.

Nothing here says *who* the user is: every handler asks the request (gr.Request.username, set by
Gradio from the login cookie) and the store, so a session cannot claim another identity or role.
The state only remembers what this tab shows: the item on screen, the ones fetched (or leased)
ahead of time, and when the item appeared (for the ranking's duration).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from store.records import Item


@dataclass
class Showing:
    """One showing of an item. A fresh `token` per showing identifies it to the page (the JS resets
    its ranking when the token changes) and to the store (client token: a double submit of the
    same showing stores one ranking). The token starts with the item's id ("<item id>.<random>"),
    so a process that never saw the showing (the app restarted meanwhile) knows which item the
    page ranked (`item_of`). `shown_at` None: not known (a showing recovered after a restart)."""

    item: Item
    token: str = ""
    shown_at: float | None = field(default_factory=time.monotonic)

    def __post_init__(self):
        if not self.token:
            self.token = f"{self.item.item_id}.{uuid.uuid4().hex}"

    @staticmethod
    def item_of(token: str) -> int | None:
        """The item id a token names, or None for a token not made by Showing."""
        head, dot, _ = (token or "").partition(".")
        return int(head) if dot and head.isdigit() else None

    @property
    def k(self) -> int:
        return len(self.item.responses)

    def elapsed(self) -> float | None:
        return None if self.shown_at is None else round(time.monotonic() - self.shown_at, 3)


@dataclass
class SessionState:
    current: Showing | None = None
    """The item on screen (None: nothing to rank)."""
    prefetched: Item | None = None
    """The next item, fetched (and leased) after the current one appeared, so Submit can show it
    without a query."""
    ahead: int | None = None
    """The id of the item after `prefetched`, leased by the last Submit's transaction
    (Store.save_ranking_and_lease_next); `prefetch` loads it into `prefetched`."""
    note: str = ""
    """What the last action did ("Saved: 6 pairs"), shown in the progress line."""
    prefetching: bool = False
    """A prefetch is running in the background for this session."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """Guards `prefetched`/`ahead`/`prefetching`: the background prefetch and the next action meet
    here."""

    def take_prefetched(self, exclude_prompt: int | None = None) -> Item | None:
        """The prefetched item (and forget it); None if there is none or it has the excluded prompt."""
        with self.lock:
            item, self.prefetched = self.prefetched, None
        if item is not None and exclude_prompt is not None and item.prompt.id == exclude_prompt:
            return None
        return item


@dataclass
class ChatState:
    """What the Chat tab shows (annotate/chat.py): the conversation so far, and the turn whose
    replies are on screen to rank. The store holds the same (a reload rebuilds it from there)."""

    conversation_id: int | None = None
    """None until the first message's replies are stored."""
    messages: list[dict] = field(default_factory=list)
    """The conversation so far: ends with the annotator's message while its replies are ranked,
    with the chosen reply after."""
    showing: Showing | None = None
    """The replies of the last message, to rank (None: write the next message)."""
    turns: int = 0
    """The annotator's messages answered so far."""
    note: str = ""
    """What the last action did, or why it failed ("The sampler is busy ..."), shown above the
    conversation."""
    error: bool = False
    """The note is an error."""
