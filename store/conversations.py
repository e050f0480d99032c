"""Conversations: an annotator chats with the policy and ranks its replies turn by turn (the Chat
tab, annotate/chat.py).

A conversation is a row of `conversations` (whose it is; open, ended or flagged). Each of its
turns is an ordinary item, written by Store.add_chat_turn (store/repo.py, beside the other item
writes) once the replies are there: its prompt is the conversation so far as chat messages (the
annotator's message last), its responses the K replies the policy offered, marked with the
conversation's id and the turn's number, and leased to the annotator in the same transaction.
The annotator ranks it through the ordinary submit (save_ranking with a RankingIn: ties, all bad,
strength, their own better answer as an edit), so its pairs, agreement, exports and training are
those of any item. The reply the conversation goes on from is read back from that ranking
(`turns_of`): the annotator's own answer when it ranks above every reply, else the first of the
best-ranked replies in the order they were shown; the next turn must continue from exactly it.

Chat turns are not queued: the conversation went on from its author's choice, so the turn is
theirs to rank, never another annotator's next item (they can still be exported, gold-marked or
compared like any item). This file reads conversations and their turns, ends and flags them, and
keeps the Chat tab's settings.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from formats.chat import prompt_messages, server_url_problem
from store.errors import InvalidRequest, NotFoundError
from store.records import HUMAN_EDIT, ChatTurn, Conversation
from store.values import from_db_time, utcnow, whole_number

REPLIES_KEY = "chat_replies"
MAX_TURNS_KEY = "chat_max_turns"
SERVER_KEY = "chat_server"
"""An outside OpenAI-compatible server the Chat tab asks instead of the local sampler: {url, model}."""
DEFAULT_REPLIES = 4
"""K, the replies offered at each turn (HH-RLHF offered two; four give six pairs a turn, as the
round's generation does)."""
DEFAULT_MAX_TURNS = 8
MAX_REPLIES = 8
MAX_MAX_TURNS = 50

_CONVERSATION_COLS = ("c.id, c.annotator_id, c.status, c.reason, c.created_at, c.ended_at, "
                      "(SELECT count(*) FROM items i WHERE i.conversation_id = c.id)")


def _conversation(row) -> Conversation:
    return Conversation(id=row[0], annotator_id=row[1], status=row[2], reason=row[3],
                        created_at=from_db_time(row[4]), ended_at=from_db_time(row[5]), turns=int(row[6]))


def turns_of(cur, conversation_id: int) -> list[ChatTurn]:
    """The conversation's turns in order, each with its author's latest ranking and the reply the
    conversation went on from (module docstring); `cur` may be inside a transaction."""
    rows = cur.execute(
        "SELECT i.turn, i.id, i.prompt_id, p.text, p.messages, k.id, k.order_groups, k.display_order, e.id, e.text "
        "FROM items i JOIN conversations c ON c.id = i.conversation_id JOIN prompts p ON p.id = i.prompt_id "
        "LEFT JOIN (SELECT item_id, annotator_id, max(id) AS id FROM rankings GROUP BY ALL) last "
        "       ON last.item_id = i.id AND last.annotator_id = c.annotator_id "
        "LEFT JOIN rankings k ON k.id = last.id "
        "LEFT JOIN responses e ON json_extract(e.sampling, '$.ranking_id')::BIGINT = k.id "
        "      AND e.model_version_id = (SELECT id FROM model_versions WHERE name = ?) "
        "WHERE i.conversation_id = ? ORDER BY i.turn", [HUMAN_EDIT, conversation_id]).fetchall()
    texts = dict(cur.execute(
        "SELECT r.id, r.text FROM responses r JOIN items i ON i.id = r.item_id WHERE i.conversation_id = ?",
        [conversation_id]).fetchall())
    beaten = {r[0] for r in cur.execute(  # own answers some reply ranks above
        "SELECT p.rejected_id FROM pairs p JOIN items i ON i.id = p.item_id "
        "WHERE i.conversation_id = ? AND p.source = 'edit'", [conversation_id]).fetchall()}
    turns = []
    for turn, item_id, prompt_id, text, messages, ranking_id, groups, shown, edit_id, edit_text in rows:
        reply = None
        if ranking_id is not None:
            if edit_id is not None and edit_id not in beaten:
                reply = edit_text
            else:
                best = set(groups[0])
                reply = texts[next(r for r in shown if r in best)]
        turns.append(ChatTurn(conversation_id=conversation_id, turn=turn, item_id=item_id, prompt_id=prompt_id,
                              messages=prompt_messages(text, None if messages is None else json.loads(messages)), ranking_id=ranking_id, reply=reply))
    return turns


class ConversationsMixin:
    """Conversation methods of Store. Besides the core (store/db.py) they use, declared here,
    the settings (store/versions.py) and the queue's end of a lease (store/queue.py)."""

    get_setting: Callable[..., Any]
    set_setting: Callable[[str, Any], None]
    release_lease: Callable[..., None]

    # -- the Chat tab's settings

    def chat_replies(self) -> int:
        """K, the replies offered at each turn (setting 'chat_replies', default 4)."""
        return int(self.get_setting(REPLIES_KEY, DEFAULT_REPLIES))

    def chat_max_turns(self) -> int:
        """The annotator's messages a conversation holds at most (setting 'chat_max_turns', default 8)."""
        return int(self.get_setting(MAX_TURNS_KEY, DEFAULT_MAX_TURNS))

    def chat_server(self) -> tuple[str, str]:
        """(base URL, model name) of the outside server the Chat tab asks (setting 'chat_server'),
        ('', '') for the local sampler serving the active policy. Its API key is not stored: the
        app reads it from its environment (pipeline/orchestrate/chat.py API_KEY_ENV)."""
        server = self.get_setting(SERVER_KEY) or {}
        return server.get("url", ""), server.get("model", "")

    def set_chat_settings(self, *, replies: int | None = None, max_turns: int | None = None,
                          server_url: str | None = None, server_model: str | None = None) -> None:
        """Each setting given, checked before any is written (InvalidRequest naming the bad one).
        server_url '' = back to the local sampler (its model name is then dropped too)."""
        if replies is not None:
            replies = whole_number(replies, "replies per turn", 2, MAX_REPLIES)
        if max_turns is not None:
            max_turns = whole_number(max_turns, "turns per conversation", 1, MAX_MAX_TURNS)
        server = None
        if server_url is not None or server_model is not None:
            url, model = self.chat_server()
            url = url if server_url is None else server_url.strip()
            model = model if server_model is None else server_model.strip()
            problem = server_url_problem(url) if url else None
            if problem:
                raise InvalidRequest(problem)
            server = {"url": url, "model": model} if url else {}
        given = {REPLIES_KEY: replies, MAX_TURNS_KEY: max_turns, SERVER_KEY: server}
        self.set_settings({key: value for key, value in given.items() if value is not None})

    # -- reads

    def get_conversation(self, conversation_id: int) -> Conversation:
        row = self._one(f"SELECT {_CONVERSATION_COLS} FROM conversations c WHERE c.id = ?", [conversation_id])
        if row is None:
            raise NotFoundError(f"no conversation with id {conversation_id}")
        return _conversation(row)

    def list_conversations(self, annotator_id: int | None = None) -> list[Conversation]:
        """Every conversation (or one annotator's), oldest first."""
        where, params = ("WHERE c.annotator_id = ?", [annotator_id]) if annotator_id is not None else ("", [])
        return [_conversation(r) for r in self._rows(
            f"SELECT {_CONVERSATION_COLS} FROM conversations c {where} ORDER BY c.id", params)]

    def conversation_turns(self, conversation_id: int) -> list[ChatTurn]:
        """Its turns in order, with the reply each went on from (turns_of)."""
        self.get_conversation(conversation_id)
        return turns_of(self._cur(), conversation_id)

    # -- the end of a conversation

    def end_conversation(self, annotator_id: int, conversation_id: int, *, flag: bool = False,
                         reason: str = "") -> Conversation:
        """Close the annotator's open conversation: ended, or flagged (with the reason: harmful,
        broken, a test). A last turn still unranked keeps its replies and gives its lease back.
        Ending one already closed, or another annotator's, is refused."""
        if flag and not (reason or "").strip():
            reason = "flagged in the Chat tab"
        with self._tx() as cur:
            row = cur.execute("SELECT annotator_id, status FROM conversations WHERE id = ?",
                              [conversation_id]).fetchall()
            own_open(row, annotator_id, conversation_id)
            cur.execute("UPDATE conversations SET status = ?, reason = ?, ended_at = ? WHERE id = ?",
                        ["flagged" if flag else "ended", reason.strip() if flag else "", utcnow(), conversation_id])
            last = cur.execute("SELECT id FROM items WHERE conversation_id = ? ORDER BY turn DESC LIMIT 1",
                               [conversation_id]).fetchall()
        if last:
            self.release_lease(annotator_id, last[0][0])
        return self.get_conversation(conversation_id)


def own_open(row: list, annotator_id: int, conversation_id: int) -> None:
    """Refuse a conversation that is missing, another annotator's, or closed (the rows of one
    SELECT annotator_id, status)."""
    if not row:
        raise NotFoundError(f"no conversation with id {conversation_id}")
    owner, status = row[0]
    if owner != annotator_id:
        raise InvalidRequest(f"conversation {conversation_id} is another annotator's")
    if status != "open":
        raise InvalidRequest(f"conversation {conversation_id} is {status}: start a new one")

