"""The loop's data, hardened: a held-out split that stays put as rounds add data, pairs with a
blank response left out of a round's snapshot (and counted), annotator quality only from enough
comparisons, and a round's threshold counted on its own rankable items.

Real store, real snapshots; one tiny-model train-reward run (a few seconds)."""

import dataclasses

import pytest

from pipeline.config import LoopConfig, RewardConfig
from pipeline.orchestrate.jobs import JobRunner
from pipeline.orchestrate.steps import LoopSettings, pairs_snapshot, snapshot_split
from pipeline.pairs_data import read_pairs
from pipeline.train_reward import train_reward
from store import RankingIn
from store.export import load_pairs_snapshot
from store.export_select import held_out_hash

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/fixtures_models.py

SETTINGS = LoopSettings(reward=RewardConfig(eval_fraction=0.25, seed=0))


def rank_round(store, annotator_id: int, n_prompts: int, answers: list[str]) -> list[int]:
    """A round of n_prompts items, each answered by `answers` (in that order), ranked in that order
    by the annotator. Returns the prompt ids."""
    policy = store.find_model_version("policy-0") or store.register_model_version("policy", "policy-0",
                                                                                  base_model="tiny")
    rnd = store.create_round(policy_version_id=policy.id, status="annotating")
    first = len(store.list_prompts())
    prompt_ids = store.add_prompts([f"Question {first + i}: what should I cook tonight?" for i in range(n_prompts)],
                                   source="test")
    item_ids = store.add_responses_bulk(policy.id, [(pid, list(answers)) for pid in prompt_ids], round_id=rnd.id)
    for pid, item_id in zip(prompt_ids, item_ids):
        store.save_ranking(RankingIn(annotator_id, pid, [r.id for r in store.item_responses(item_id)]))
    return prompt_ids


def sides(snapshot) -> tuple[set[int], set[int]]:
    rows = load_pairs_snapshot(snapshot.path)
    return ({r["prompt_id"] for r in rows if r["split"] == "train"},
            {r["prompt_id"] for r in rows if r["split"] == "test"})


@pytest.fixture
def runner(store, tmp_path):
    runner = JobRunner(store, tmp_path / "runs")
    yield runner
    runner.shutdown()


# --------------------------------------------------------------------------- 1. a held-out split that stays


def test_a_prompt_held_out_once_stays_held_out_as_rounds_add_data(store, runner):
    ann = store.ensure_annotator("ann")
    answers = ["Pasta with tomatoes and basil.", "Soup.", "Nothing."]
    rank_round(store, ann.id, 12, answers)
    first = pairs_snapshot(store, runner, SETTINGS)
    train1, test1 = sides(first)
    assert test1 and train1 and not train1 & test1 and first.counts["test"] > 0
    assert first.filters["test_fraction"] == 0.25 and first.filters["seed"] == 0

    for _ in range(3):  # three more rounds: the earlier prompts keep their side
        rank_round(store, ann.id, 12, answers)
    later = pairs_snapshot(store, runner, SETTINGS)
    train2, test2 = sides(later)
    assert test1 <= test2 and train1 <= train2 and not train2 & test2
    assert len(test2) > len(test1)  # new prompts are held out too, about a quarter of them
    assert test2 == {p for p in train2 | test2 if held_out_hash(p, 0) < 0.25}  # each prompt by its own hash
    assert 0.1 < len(test2) / len(train2 | test2) < 0.4, (len(test2), len(train2))

    # the trainer takes the snapshot's split as it is: eval_fraction 0, so it never draws its own
    # (which, on a snapshot with no prompt held out yet, would move prompts between rounds)
    assert snapshot_split(SETTINGS.reward, later).eval_fraction == 0.0
    with_file = dataclasses.replace(SETTINGS, reward=dataclasses.replace(SETTINGS.reward, eval_data="held.jsonl"))
    own_file = pairs_snapshot(store, runner, with_file)
    assert own_file.counts["test"] == 0 and snapshot_split(with_file.reward, own_file) == with_file.reward
    dpo = pairs_snapshot(store, runner, SETTINGS, "dpo")  # the DPO step holds out by its own fraction
    assert dpo.filters["test_fraction"] == SETTINGS.dpo.eval_fraction


# --------------------------------------------------------------------------- 4. blank responses


def test_a_rounds_snapshot_leaves_out_blank_responses_and_the_reward_step_trains(store, runner, tmp_path,
                                                                              tiny_model_cfg):
    """A tiny policy can write an empty (or whitespace-only) response; the store keeps it and its
    pairs, the round's snapshot leaves those pairs out and counts them, and train-reward, which
    refuses a blank response, trains on the snapshot."""
    ann = store.ensure_annotator("ann")
    rank_round(store, ann.id, 8, ["A warm lentil soup with bread.", "", "Toast."])
    rank_round(store, ann.id, 4, ["Rice and beans.", "Eggs.", " \n\t"])
    pairs_before = store.counts()["pairs"]
    snap = pairs_snapshot(store, runner, SETTINGS)
    # 8 items lose 2 of their 3 pairs (the empty response is in both), 4 items 2 of theirs
    assert snap.counts["left_out_empty"] == 8 * 2 + 4 * 2 and snap.counts["pairs"] == 8 + 4
    assert snap.filters["include_empty"] is False
    assert store.counts()["pairs"] == pairs_before == 12 * 3  # nothing stored is lost
    pairs, _ = read_pairs(snap.path)  # refused a blank response before: the round's reward step failed
    assert all(p.chosen.strip() and p.rejected.strip() for p in pairs)

    cfg = snapshot_split(dataclasses.replace(SETTINGS.reward, batch_size=4, max_steps=2, max_length=64,
                                             norm_samples=0), snap)
    report = train_reward(snap.path, str(tmp_path / "rm"), cfg, tiny_model_cfg)
    assert report["steps"] == 2 and report["eval/prompts"] == len(sides(snap)[1])


# --------------------------------------------------------------------------- 2. quality from enough comparisons


def test_quality_needs_enough_comparisons_before_it_excludes_or_weights(store, runner, tmp_path):
    """One gold item of two responses is one comparison: right, quality 1.0; wrong, 0.0. Below
    MIN_COMPARISONS neither counts: both annotators are kept at weight 1 and shown as 'not enough
    data'; from MIN_COMPARISONS on, the one who gets gold wrong is left out and weighted down."""
    from annotate.context import AppContext
    from annotate.team import team_tables
    from store.quality import MIN_COMPARISONS, annotator_quality_table
    from tests.fixtures_store import seed_items
    from tests.helpers import req

    store.add_annotator("boss", "boss-password", role="admin")
    right, wrong = store.ensure_annotator("right"), store.ensure_annotator("wrong")

    def rank_gold(n: int) -> None:
        for it in seed_items(store, n, 2, prefix=f"gold {len(store.gold_items())}"):
            store.set_gold(it.item_id, [[r] for r in it.response_ids])  # the first response is best
            store.save_ranking(RankingIn(right.id, it.prompt_id, it.response_ids))
            store.save_ranking(RankingIn(wrong.id, it.prompt_id, list(reversed(it.response_ids))))

    rank_gold(1)
    trusted = LoopSettings(loop=LoopConfig(min_quality=0.5, quality_weights=True))
    snap = pairs_snapshot(store, runner, trusted)
    assert snap.filters["excluded_annotators"] == [] and snap.counts["pairs"] == 2
    assert {p.weight for p in read_pairs(snap.path)[0]} == {1.0}
    table = {q["annotator"]: q for q in annotator_quality_table(store, 0.5)}
    assert [(table[n]["quality"], table[n]["measured_by"], table[n]["comparisons"], table[n]["weight"],
             table[n]["excluded"]) for n in ("right", "wrong")] == [(None, None, 1, 1.0, False)] * 2
    card = (tmp_path / "runs" / "inputs" / (snap.path.rsplit("/", 1)[-1] + ".README.md")).read_text()
    assert "| wrong | – | not enough data | 1 | 1 | 1.000 | no |" in card

    ctx = AppContext(store=store, auth=True, data_dir=tmp_path / "data")
    people = team_tables(ctx, req("boss"))[1].set_index("annotator")
    assert people.loc["wrong", "gold accuracy"] == "0.000"  # the raw share is still shown ...
    assert people.loc["wrong", "quality (exports)"] == f"not enough data (1 of {MIN_COMPARISONS} comparisons)"

    rank_gold(MIN_COMPARISONS - 1)  # ... and counts from MIN_COMPARISONS comparisons on
    snap = pairs_snapshot(store, runner, trusted)
    assert snap.filters["excluded_annotators"] == ["wrong"] and snap.counts["pairs"] == MIN_COMPARISONS
    people = team_tables(ctx, req("boss"))[1].set_index("annotator")
    assert people.loc["wrong", "quality (exports)"] == f"0.000 (gold, {MIN_COMPARISONS} comparisons)"
    assert people.loc["right", "quality (exports)"] == f"1.000 (gold, {MIN_COMPARISONS} comparisons)"


# --------------------------------------------------------------------------- 3. the threshold counts rankable items


def test_the_threshold_counts_the_rounds_rankable_items_and_a_stuck_loop_says_so(store):
    from pipeline.orchestrate import loop
    from tests.fixtures_store import seed_items

    rnd = store.create_round(status="annotating")
    items = seed_items(store, 6, 2, round_id=rnd.id)
    regular, gold, flagged = items[:3], items[3:5], items[5]
    for it in gold:  # everyone ranks a gold item, whatever the overlap: not the round's own rankings
        store.set_gold(it.item_id, [[r] for r in it.response_ids])
    ann = store.ensure_annotator("ann")
    for it in gold + [flagged, regular[0]]:
        store.save_ranking(RankingIn(ann.id, it.prompt_id, it.response_ids))
    store.flag_prompt(flagged.prompt_id, ann.id, "broken")  # ranked, then flagged: out of the queue
    for it in regular[1:]:
        store.skip_item(ann.id, it.item_id)

    settings = LoopSettings(loop=LoopConfig(rankings_per_round=64))
    have = loop.coverage(store, rnd, settings)
    # before: 6 items, 4 rankings (gold and flagged counted), a threshold of 6 only 4 items could reach
    assert (have.items, have.rankings, have.ranked_items, have.threshold) == (3, 1, 1, 3)
    assert have.reachable == 1 and have.stuck  # ann ranks an item once, and skipped the other two
    said = []
    with pytest.raises(loop.RoundFailed, match=r"Round \d+ has 1 of 3 items ranked \(threshold 3\), and its items "
                                               r"can get at most 1 rankings from the active accounts"):
        loop.wait_for_rankings(store, rnd, settings, said.append, poll_s=0.01)

    bea = store.ensure_annotator("bea")  # a second account can rank the other two: waiting can end
    have = loop.coverage(store, rnd, settings)
    assert have.reachable == 3 and not have.stuck and not have.enough
    store.skip_item(bea.id, regular[1].item_id)  # a skip is final: skipped by both, stuck again
    assert loop.coverage(store, rnd, settings).stuck
    cy = store.ensure_annotator("cy")
    for it in regular[1:]:
        store.save_ranking(RankingIn(cy.id, it.prompt_id, it.response_ids))
    assert loop.wait_for_rankings(store, rnd, settings, said.append, poll_s=0.01).enough

    # two rankings an item: 6 needed, 3 made; bea can still rank items 0 and 2, cy item 0: 5 at most
    store.set_round_queue(rnd.id, overlap=2)
    have = loop.coverage(store, rnd, settings)
    assert (have.rankings, have.threshold, have.reachable) == (3, 6, 5) and have.stuck
