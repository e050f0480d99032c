"""Multi-turn data in and out, end to end: HH-RLHF's own multi-turn transcripts (tests/data/
hh_dev_pairs.jsonl, MIT) imported as pairs and as items to rank, TRL conversational preference rows
whose chosen/rejected carry the history (implicit prompt) or that give it as an explicit prompt,
each exported with its whole history in TRL's conversational format; and a snapshot of
conversations held in the store that trains the reward model and DPO, encoded exactly as the chat
sampler prompts the policy (pipeline/text.py prompt_token_ids of the same messages)."""

from __future__ import annotations

import dataclasses
import json

from formats.chat import prompt_messages
from pipeline.config import DPOConfig, RewardConfig
from pipeline.dpo_data import encode_dpo
from pipeline.models import load_tokenizer
from pipeline.pairs_data import encode_pairs, read_pairs
from pipeline.text import prompt_token_ids
from pipeline.train_dpo import train_dpo
from pipeline.train_reward import train_reward
from store.export import export_dataset, load_pairs_snapshot
from store.export_options import ExportOptions
from store.import_items import import_items
from store.io import import_pairs
from store.records import RankingIn
from tests.fixtures_store import TEST_DATA


def multiturn_rows(n: int = 2, min_turns: int = 3) -> list[dict]:
    """The first n pairs of hh_dev_pairs.jsonl whose conversation has min_turns or more human
    turns (and is short enough for a tiny model), in file order."""
    rows = []
    with open(TEST_DATA / "hh_dev_pairs.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["prompt"].count("\n\nHuman:") >= min_turns and len(row["prompt"]) < 900:
                rows.append(row)
                if len(rows) == n:
                    return rows
    raise AssertionError(f"fewer than {n} pairs of {min_turns}+ turns")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _history(row: dict) -> list[dict]:
    """An HH row's conversation before its last reply, as chat messages."""
    return prompt_messages(row["prompt"])


def test_hh_multiturn_transcripts_import_as_pairs_and_as_items_and_export_their_history(store, tmp_path):
    rows = multiturn_rows()
    histories = [_history(r) for r in rows]
    assert all(len(h) >= 5 and h[-1]["role"] == "user" and h[-2]["role"] == "assistant" for h in histories)
    # 1. as pairs: HH's own layout, two full transcripts split at their last "Assistant:"
    hh = _write(tmp_path / "hh.jsonl", [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                                        for r in rows])
    assert import_pairs(store, hh)["pairs"] == 2
    # 2. the same conversations as items to rank, their two replies and a third of our own
    items = _write(tmp_path / "items.jsonl", [{"prompt": r["prompt"], "responses": [
        {"text": r["chosen"], "model": "hh-chosen"}, {"text": r["rejected"], "model": "hh-rejected"},
        {"text": " I am not sure.", "model": "ours"}]} for r in rows])
    assert import_items(store, items)["queued"] == 2
    ann = store.add_annotator("ann", "pw-ann-123456")
    for _ in rows:
        item = store.next_item(ann.id)
        by_model = {store.get_model_version(r.model_version_id).name: r.id for r in item.responses}
        store.save_ranking(RankingIn(annotator_id=ann.id, prompt_id=item.prompt.id,
                                     order=[[by_model["hh-chosen"]], [by_model["ours"]], [by_model["hh-rejected"]]]))

    snap = export_dataset(store, tmp_path / "out.jsonl", ExportOptions(include_imported=True))
    out = load_pairs_snapshot(snap.path)
    assert len(out) == 2 + 2 * 3
    for row, history in zip(rows, histories):
        mine = [o for o in out if o["prompt"] == history]
        assert len(mine) == 4  # the imported pair and the ranking's three, one prompt
        assert {(o["source"], o["chosen"][0]["content"], o["rejected"][0]["content"]) for o in mine} >= {
            (f"import:{hh.name}", row["chosen"], row["rejected"]), ("ranking", row["chosen"], row["rejected"])}
        assert {(o["conversation_id"], o["turn"]) for o in mine} == {(None, None)}


def test_trl_conversational_rows_with_history_import_with_implicit_and_explicit_prompts(store, tmp_path):
    implicit_row, explicit_row = multiturn_rows()
    h1, h2 = _history(implicit_row), _history(explicit_row)
    reply = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    trl = _write(tmp_path / "trl.jsonl", [
        {"chosen": h1 + reply(implicit_row["chosen"]), "rejected": h1 + reply(implicit_row["rejected"])},
        {"prompt": h2, "chosen": reply(explicit_row["chosen"]), "rejected": reply(explicit_row["rejected"])},
    ])
    assert import_pairs(store, trl)["pairs"] == 2
    snap = export_dataset(store, tmp_path / "trl-out.jsonl", ExportOptions(include_imported=True))
    out = sorted(load_pairs_snapshot(snap.path), key=lambda o: o["pair_id"])
    assert [(o["prompt"], o["chosen"], o["rejected"]) for o in out] == [
        (h1, reply(implicit_row["chosen"]), reply(implicit_row["rejected"])),
        (h2, reply(explicit_row["chosen"]), reply(explicit_row["rejected"]))]
    # and back in: the export is itself a TRL conversational file this store imports
    assert import_pairs(store, snap.path)["pairs"] == 2


def _chat(store, annotator_id: int, policy_id: int, opening: list[dict], turns: int) -> list[list[dict]]:
    """A conversation of `turns` turns held in the store as the Chat tab holds one: each turn's
    replies ranked, the best one continued from. Returns each turn's messages."""
    messages, conversation_id, seen = list(opening), None, []
    for t in range(turns):
        replies = [(f"Reply {j} at turn {t + 1}: try onions and relish.", 8, "eos", {}) for j in range(3)]
        turn = store.add_chat_turn(annotator_id, conversation_id, messages, policy_id, replies)
        conversation_id = turn.conversation_id
        ids = [r.id for r in store.item_responses(turn.item_id)]
        store.save_ranking(RankingIn(annotator_id=annotator_id, prompt_id=turn.prompt_id,
                                     order=[[ids[(t + 1) % 3]], [ids[t % 3]], [ids[(t + 2) % 3]]]))
        seen.append(messages)
        chosen = store.conversation_turns(conversation_id)[-1].reply
        messages = messages + [{"role": "assistant", "content": chosen},
                               {"role": "user", "content": f"Thank you. And question {t + 2}?"}]
    return seen


def test_a_multiturn_snapshot_trains_reward_and_dpo_encoded_as_the_sampler_prompts(
        store, tmp_path, tiny_model_cfg, tiny_model_dir):
    policy = store.register_model_version("policy", "base", base_model=str(tiny_model_dir))
    ann = store.add_annotator("ann", "pw-ann-123456")
    conversations = [_chat(store, ann.id, policy.id, _history(r), 3) for r in multiturn_rows(4)]
    snap = export_dataset(store, tmp_path / "chat.jsonl", ExportOptions(test_fraction=0.25, seed=1))
    assert snap.counts["rankings"] == 12 and snap.counts["pairs"] == 36

    # 1. every turn's prompt is read back as the very tokens the chat sampler gives the policy
    tok = load_tokenizer(tiny_model_dir)
    pairs, _ = read_pairs(snap.path)
    sampler = {json.dumps(m): prompt_token_ids(tok, m) for turns in conversations for m in turns}
    encoded, _ = encode_pairs(pairs, tok, max_length=4096)
    assert {json.dumps(p.prompt) for p in pairs} == set(sampler)
    assert all(e.prompt_ids == sampler[json.dumps(p.prompt)] for p, e in zip(pairs, encoded))
    groups, _ = encode_dpo(pairs, tok, max_length=4096, grouped=True)
    assert len(groups) == 12 and {tuple(g.prompt_ids) for g in groups} == {tuple(v) for v in sampler.values()}

    # 2. a step or two of each trainer on it
    reward = train_reward(str(snap.path), str(tmp_path / "rm"),
                          RewardConfig(max_steps=2, batch_size=2, norm_samples=0, eval_fraction=0.25), tiny_model_cfg)
    assert reward["steps"] == 2 and reward["eval/pairs"] > 0
    dpo_cfg = DPOConfig(max_steps=2, batch_size=2, eval_fraction=0.25, kl_prompts=2, kl_samples=1,
                        kl_max_new_tokens=4)
    dpo = train_dpo(str(snap.path), str(tmp_path / "dpo"), dpo_cfg,
                    dataclasses.replace(tiny_model_cfg, lora_targets="q_proj,v_proj,lm_head"))
    assert dpo["steps"] == 2 and dpo["eval/pairs"] > 0
