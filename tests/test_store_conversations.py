"""Conversations in the store (store/conversations.py, Store.add_chat_turn): a chat's turns are
ordinary items with the conversation so far as their prompt, ranked through the ordinary submit,
counted, and exported with their history and their conversation id and turn."""

from __future__ import annotations

import json

import pytest

from store import Store
from store.errors import InvalidRequest
from store.export import export_dataset, load_pairs_snapshot
from store.export_options import ExportOptions
from store.records import EditIn, RankingIn


def _setup(store: Store):
    policy = store.register_model_version("policy", "chat-policy", base_model="tiny")
    ann = store.add_annotator("ann", "pw-ann-123456")
    other = store.add_annotator("bob", "pw-bob-123456")
    return policy.id, ann.id, other.id


def _replies(turn: int, k: int = 3) -> list[tuple]:
    return [(f"reply {j} at turn {turn}", 4, "eos", {"temperature": 0.7}) for j in range(k)]


def _rank(store: Store, annotator_id: int, turn, order_of, **kw):
    """Rank a turn's replies: order_of(response ids in id order) -> tie groups."""
    ids = [r.id for r in store.item_responses(turn.item_id)]
    return store.save_ranking(RankingIn(annotator_id=annotator_id, prompt_id=turn.prompt_id,
                                        order=order_of(ids), **kw))


def test_three_turns_keep_their_history_and_export_as_any_item(store, tmp_path):
    policy, ann, _ = _setup(store)
    first = [{"role": "user", "content": "What should I cook tonight?"}]
    t1 = store.add_chat_turn(ann, None, first, policy, _replies(1))
    assert (t1.turn, store.holds_lease(ann, t1.item_id)) == (1, True)
    _rank(store, ann, t1, lambda ids: [[ids[2]], [ids[0]], [ids[1]]])
    turns = store.conversation_turns(t1.conversation_id)
    assert turns[0].reply == "reply 2 at turn 1" and not store.holds_lease(ann, t1.item_id)

    second = first + [{"role": "assistant", "content": "reply 2 at turn 1"},
                      {"role": "user", "content": "Something with rice?"}]
    t2 = store.add_chat_turn(ann, t1.conversation_id, second, policy, _replies(2))
    # a tie at the top: the conversation goes on from the first of them as shown
    _rank(store, ann, t2, lambda ids: [[ids[1], ids[0]], [ids[2]]], display_order=None)
    shown = store.get_item(t2.item_id, ann).display_order
    ids2 = [r.id for r in store.item_responses(t2.item_id)]
    first_top = next(r for r in shown if r in (ids2[0], ids2[1]))
    reply2 = store.get_response(first_top).text
    assert store.conversation_turns(t1.conversation_id)[1].reply == reply2

    third = second + [{"role": "assistant", "content": reply2}, {"role": "user", "content": "Thanks, and dessert?"}]
    t3 = store.add_chat_turn(ann, t1.conversation_id, third, policy, _replies(3))
    ids3 = [r.id for r in store.item_responses(t3.item_id)]
    store.save_ranking(RankingIn(annotator_id=ann, prompt_id=t3.prompt_id, order=[[ids3[0]], [ids3[1]], [ids3[2]]],
                                 strength="better", edit=EditIn(text="A fruit salad: quick and light.",
                                                                made_from=ids3[0])))
    assert store.conversation_turns(t1.conversation_id)[2].reply == "A fruit salad: quick and light."
    store.end_conversation(ann, t1.conversation_id)

    c = store.counts()
    assert (c["conversations"], c["conversation_turns"], c["flagged_conversations"]) == (1, 3, 0)
    assert c["items"] == 0  # chat turns are not queued: no one else is handed them

    snap = export_dataset(store, tmp_path / "chat.jsonl", ExportOptions())
    rows = load_pairs_snapshot(snap.path)
    by_turn = {t: [r for r in rows if r["turn"] == t] for t in (1, 2, 3)}
    assert {r["conversation_id"] for r in rows} == {t1.conversation_id}
    assert [len(by_turn[t]) for t in (1, 2, 3)] == [3, 2, 3 + 3]  # 3 pairs; a tie drops one; 3 + the edit's 3
    assert by_turn[1][0]["prompt"] == first and by_turn[2][0]["prompt"] == second
    assert by_turn[3][0]["prompt"] == third
    assert {(r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in by_turn[1]} == {
        ("reply 2 at turn 1", "reply 0 at turn 1"), ("reply 2 at turn 1", "reply 1 at turn 1"),
        ("reply 0 at turn 1", "reply 1 at turn 1")}
    rankings = [json.loads(line) for line in open(tmp_path / "chat.rankings.jsonl")]
    assert [(r["conversation_id"], r["turn"]) for r in rankings] == [(t1.conversation_id, t) for t in (1, 2, 3)]
    demos = [json.loads(line) for line in open(tmp_path / "chat.demonstrations.jsonl")]
    assert [(d["turn"], d["messages"]) for d in demos] == [
        (3, third + [{"role": "assistant", "content": "A fruit salad: quick and light."}])]


def test_a_turn_must_continue_the_ranked_reply(store):
    policy, ann, bob = _setup(store)
    first = [{"role": "user", "content": "Hello"}]
    t1 = store.add_chat_turn(ann, None, first, policy, _replies(1))
    nxt = first + [{"role": "assistant", "content": "reply 0 at turn 1"}, {"role": "user", "content": "More"}]
    with pytest.raises(InvalidRequest, match="not ranked yet"):
        store.add_chat_turn(ann, t1.conversation_id, nxt, policy, _replies(2))
    _rank(store, ann, t1, lambda ids: [[ids[1]], [ids[0], ids[2]]])
    with pytest.raises(InvalidRequest, match="do not continue"):  # reply 0 was not the chosen one
        store.add_chat_turn(ann, t1.conversation_id, nxt, policy, _replies(2))
    with pytest.raises(InvalidRequest, match="another annotator"):
        store.add_chat_turn(bob, t1.conversation_id, nxt, policy, _replies(2))
    with pytest.raises(InvalidRequest, match="2 or more"):
        store.add_chat_turn(ann, None, first, policy, _replies(1, k=1))
    with pytest.raises(InvalidRequest, match="role 'user'"):
        store.add_chat_turn(ann, None, first + [{"role": "assistant", "content": "x"}], policy, _replies(1))
    assert store.counts()["conversation_turns"] == 1  # nothing of the refused turns was stored
    assert len(store.list_conversations()) == 1


def test_flag_ends_a_conversation_and_gives_back_its_unranked_turn(store):
    policy, ann, _ = _setup(store)
    t1 = store.add_chat_turn(ann, None, [{"role": "user", "content": "Hi"}], policy, _replies(1))
    flagged = store.end_conversation(ann, t1.conversation_id, flag=True, reason="the model insulted me")
    assert (flagged.status, flagged.reason, flagged.turns) == ("flagged", "the model insulted me", 1)
    assert not store.holds_lease(ann, t1.item_id)
    assert store.counts()["flagged_conversations"] == 1
    with pytest.raises(InvalidRequest, match="is flagged"):
        store.end_conversation(ann, t1.conversation_id)
    with pytest.raises(InvalidRequest, match="is flagged"):
        store.add_chat_turn(ann, t1.conversation_id, [{"role": "user", "content": "Hi"}], policy, _replies(2))


def test_chat_settings_are_checked(store):
    assert (store.chat_replies(), store.chat_max_turns()) == (4, 8)
    store.set_chat_settings(replies=2, max_turns=3)
    assert (store.chat_replies(), store.chat_max_turns()) == (2, 3)
    for bad in ({"replies": 1}, {"replies": 2.5}, {"max_turns": 0}):
        with pytest.raises(InvalidRequest):
            store.set_chat_settings(**bad)
