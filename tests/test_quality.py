"""Training on the annotators you trust: four simulated annotators of known noise rank through a
real store, one of them at random; gold items measure each one; reward models trained on (a) all
pairs, (b) pairs weighted by annotator quality and (c) all but the annotators below a quality
threshold are compared on held-out pairs of unseen prompts, labelled by the truth.

The task is the marker task of tests/test_train_reward.py (the better response contains the word
"Paris"); the annotators rank with the oracle `rule:contains:Paris` and a Bradley-Terry noise of
their own (pipeline/oracle.simulated_ranking: 0 is exact, a huge one ranks at random).
The random annotator is the fastest (two items a turn to the others' one), as annotators who
click without reading are: about 2 in 5 of the ranked items are theirs, so a fifth of all pairs
are wrong.

Held-out accuracy and Bradley-Terry loss (200 pairs) over ten seeds (tiny model, 60 steps of 16
pairs each; a all pairs, b weighted, c excluded; `python -m tests.test_quality 0 1 2 3 4 5 6 7 8 9`):

    seed      0     1     2     3     4     5     6     7     8     9
    acc  a  .885  .925  .910  .970  .910  .855  .910  .920  .960  .930
         b  .940  .980  .975  .995  .965  .930  .950  .970  .995  .955
         c  .935  .990  .985  .995  .985  .980  .985  .970  .975  .955
    loss a  .396  .419  .356  .272  .408  .409  .388  .427  .352  .350
         b  .225  .138  .120  .056  .152  .195  .186  .117  .090  .221
         c  .189  .177  .093  .042  .121  .109  .075  .142  .115  .134

Accuracy sits near its ceiling, so its gaps are small and uneven (b - a .025 to .075, c - a .015 to
.125: a fixed gap of .02 failed seed 8). The held-out loss, a proper score of the whole ranking,
moves far more: b / a is .20 to .63 (mean .39, s.d. .14), c / a .15 to .48 (mean .31, s.d. .09).
The test asserts both ratios below 0.8 on seed 0: 2.9 and 5.4 s.d. above the means, passing on
all ten seeds, while a weighting or exclusion that does nothing trains the same model as (a), a
ratio of exactly 1.
"""

import dataclasses
import json

import gradio as gr
import pytest

from annotate import admin
from annotate.context import AppContext
from pipeline.config import LoopConfig, RewardConfig
from pipeline.orchestrate.jobs import JobRunner
from pipeline.oracle import make_oracle
from pipeline.orchestrate.simulate import simulate_annotations
from pipeline.orchestrate.steps import LoopSettings, pairs_snapshot
from pipeline.pairs_data import read_pairs
from pipeline.train_reward import train_reward
from store import RankingIn, Store
from store.io import ExportOptions, export_dataset
from tests.fixtures_store import open_copy, seed_items
from tests.helpers import req
from tests.test_train_reward import marker_pairs, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/fixtures_models.py

# name -> (Bradley-Terry noise, items per turn); right on a pair with probability sigmoid(1 / noise)
# as the oracle's scores differ by 1: 1.0, 0.98, 0.88 and 0.5 (at random)
TEAM = {"exact": (0.0, 1), "careful": (0.25, 1), "hasty": (0.5, 1), "random": (1e9, 2)}
ITEMS, GOLD, GOLD_RATE = 240, 24, 0.3
MIN_QUALITY = 0.7
CFG = RewardConfig(epochs=20, max_steps=60, lr=3e-3, batch_size=16, norm_samples=0)
EXPORTS = {"a_all": {}, "b_weighted": {"quality_weights": True}, "c_excluded": {"min_quality": MIN_QUALITY}}
LOSS_RATIO = 0.8


def seed_team(store, seed: int) -> dict[str, int]:
    """ITEMS prompts, each an item of two responses, one with the marker; the first GOLD items made
    gold with the true order; the team ranks in turns until the queue is empty. Returns
    {annotator: rankings}."""
    policy = store.register_model_version("policy", "sim-policy", base_model="tiny")
    rows = marker_pairs(ITEMS, seed=seed)
    prompt_ids = store.add_prompts([r["prompt"] for r in rows], source="test")
    item_ids = store.add_responses_bulk(policy.id, [(pid, [r["chosen"], r["rejected"]])
                                                    for pid, r in zip(prompt_ids, rows)])
    for item_id in item_ids[:GOLD]:
        chosen, rejected = (r.id for r in store.item_responses(item_id))  # in the order given
        store.set_gold(item_id, [[chosen], [rejected]])
    store.set_gold_rate(GOLD_RATE)
    oracle = make_oracle("rule:contains:Paris")
    done = {name: 0 for name in TEAM}
    for turn in range(10 * ITEMS):
        ranked = 0
        for k, (name, (noise, pace)) in enumerate(TEAM.items()):  # a fresh seed per call: one stream each
            n = simulate_annotations(store, oracle, name, noise, limit=pace, seed=seed * 100_000 + turn * 10 + k)
            done[name] += n
            ranked += n
        if not ranked:
            return done
    raise AssertionError(f"the queue never emptied: {done}")


def held_out(tmp_path, seed: int):
    """Pairs of prompts the team never saw, labelled by the truth (the marker)."""
    rows = [dict(r, prompt="Held out " + r["prompt"]) for r in marker_pairs(200, seed=10_000 + seed)]
    return write_jsonl(tmp_path / "held_out.jsonl", rows)


def measure(store, tmp_path, model_cfg, seed: int) -> dict:
    """Export (a), (b), (c) and train a reward model on each, same seed and steps; held-out
    accuracy, pairs, and the snapshots' manifests."""
    rankings = seed_team(store, seed)
    cfg = dataclasses.replace(CFG, seed=seed, eval_data=str(held_out(tmp_path, seed)))
    out = {"rankings": rankings}
    for name, options in EXPORTS.items():
        snap = export_dataset(store, tmp_path / f"{name}.parquet", ExportOptions(format="parquet", **options))
        report = train_reward(snap.path, str(tmp_path / f"run-{name}"), cfg, model_cfg)
        manifest = json.loads((tmp_path / f"{name}.parquet.snapshot.json").read_text())
        out[name] = {"accuracy": report["eval/accuracy"], "loss": report["eval/loss"], "pairs": snap.counts["pairs"],
                     "snapshot": snap,
                     "manifest": manifest, "weighted": report["train/weighted"], "steps": report["steps"]}
    return out


def test_quality_weighting_and_exclusion_beat_training_on_everyone(store, tmp_path, tiny_model_cfg):
    check(measure(store, tmp_path, tiny_model_cfg, seed=0))


def check(result: dict) -> None:
    a, b, c = (result[name] for name in EXPORTS)
    assert result["rankings"]["random"] > 1.5 * result["rankings"]["exact"]  # the fastest of the team
    # gold items measured everyone; only the random annotator is below the threshold
    quality = {q["annotator"]: q for q in b["manifest"]["annotator_quality"]}
    assert all(q["measured_by"] == "gold" and q["n_gold"] >= 5 for q in quality.values()), quality
    assert sorted(quality, key=lambda n: quality[n]["quality"])[0] == "random"
    assert quality["random"]["quality"] < MIN_QUALITY <= min(q["quality"] for n, q in quality.items() if n != "random")
    assert quality["random"]["weight"] < 0.3 and quality["exact"]["weight"] == 1.0
    # (b) trained on the weights its file carries; (c) left out the random annotator's pairs
    weights = {p.weight for p in read_pairs(b["snapshot"].path)[0]}
    assert b["weighted"] and not a["weighted"] and min(weights) == quality["random"]["weight"]
    assert c["snapshot"].filters["excluded_annotators"] == ["random"] and c["pairs"] < a["pairs"] == b["pairs"]
    assert a["steps"] == b["steps"] == c["steps"] == CFG.max_steps
    loss = {name: result[name]["loss"] for name in EXPORTS}
    assert loss["b_weighted"] < LOSS_RATIO * loss["a_all"], loss
    assert loss["c_excluded"] < LOSS_RATIO * loss["a_all"], loss


@pytest.fixture(scope="module")
def good_and_bad(tmp_path_factory):
    """A closed store file: boss (admin); three items of five responses, the first gold (its 10
    response pairs are store/quality.py's MIN_COMPARISONS, the fewest a quality is used from);
    'good' ranks them all right, '<b>bad</b>' (a name with markup) all wrong: gold accuracy 1
    and 0. (Accounts are hashed once per module; each test opens a copy.)"""
    path = tmp_path_factory.mktemp("quality") / "rlhf.duckdb"
    with Store(path) as s:
        s.add_annotator("boss", "boss-password", role="admin")
        good, bad = s.ensure_annotator("good"), s.ensure_annotator("<b>bad</b>")
        items = seed_items(s, 3, 5)
        s.set_gold(items[0].item_id, [[r] for r in items[0].response_ids])  # the first response is best
        for it in items:
            s.save_ranking(RankingIn(good.id, it.prompt_id, it.response_ids))
            s.save_ranking(RankingIn(bad.id, it.prompt_id, list(reversed(it.response_ids))))
    return path


@pytest.fixture
def team_store(good_and_bad, tmp_path):
    s = open_copy(good_and_bad, tmp_path / "db")
    yield s
    s.close()


def test_data_tab_export_leaves_out_and_weights(team_store, tmp_path):
    """Data > Export's two controls: a minimum quality and the weight column."""
    store = team_store
    ctx = AppContext(store=store, auth=True, data_dir=tmp_path / "data")
    paths, summary = admin.export(ctx, admin.ExportForm(min_quality=0.5, quality_weights=True), req("boss"))
    assert "left out below quality 0.5: &lt;b&gt;bad&lt;/b&gt;" in summary and "weighted by annotator quality" in summary
    rows = [json.loads(line) for line in open(paths[0], encoding="utf-8")]
    assert {(r["annotator"], r["weight"]) for r in rows} == {("good", 1.0)}
    (snap,) = store.list_snapshots()
    assert snap.filters["min_quality"] == 0.5 and snap.filters["quality_weights"] is True
    _, summary = admin.export(ctx, admin.ExportForm(min_quality=0.0), req("boss"))
    assert "left out" not in summary and "weighted" not in summary  # 0 keeps everyone: no filter at all
    assert "min_quality" not in store.list_snapshots()[-1].filters
    for bad_value in (1.5, "yes"):
        with pytest.raises(gr.Error, match="Minimum annotator quality"):
            admin.export(ctx, admin.ExportForm(min_quality=bad_value), req("boss"))
    with pytest.raises(gr.Error, match="Weight pairs by annotator quality"):
        admin.export(ctx, admin.ExportForm(quality_weights="yes"), req("boss"))


def test_a_rounds_snapshot_takes_the_loops_quality_options(team_store, tmp_path):
    """python -m pipeline loop --min-quality / --quality-weights: the snapshot a round trains on."""
    store = team_store
    runner = JobRunner(store, tmp_path / "runs")
    try:
        plain = pairs_snapshot(store, runner, LoopSettings())
        trusted = pairs_snapshot(store, runner, LoopSettings(loop=LoopConfig(min_quality=0.5, quality_weights=True)))
    finally:
        runner.shutdown()
    assert "min_quality" not in plain.filters and plain.filters["quality_weights"] is False
    assert trusted.filters["excluded_annotators"] == ["<b>bad</b>"] and trusted.filters["quality_weights"]
    assert {p.weight for p in read_pairs(trusted.path)[0]} == {1.0} and trusted.counts["pairs"] == 3 * 10


if __name__ == "__main__":  # the ten-seed table: python -m tests.test_quality 0 1 2 ... 9
    import sys
    import tempfile
    from pathlib import Path

    import torch

    from pipeline.config import ModelConfig
    from tests.tiny import save_tiny_model_dir

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    model_cfg = ModelConfig(model=str(save_tiny_model_dir(root / "tiny")), device="cpu", dtype="fp32", lora=True,
                            lora_r=4, lora_alpha=8)
    for seed in map(int, sys.argv[1:]):
        work = root / f"seed{seed}"
        work.mkdir()
        with Store(work / "rlhf.duckdb") as store:
            result = measure(store, work, model_cfg, seed)
        acc = {name: result[name]["accuracy"] for name in EXPORTS}
        loss = {name: result[name]["loss"] for name in EXPORTS}
        print(f"seed {seed} loss: a {loss['a_all']:.3f}  b {loss['b_weighted']:.3f}  c {loss['c_excluded']:.3f}  "
              f"b/a {loss['b_weighted'] / loss['a_all']:.2f}  c/a {loss['c_excluded'] / loss['a_all']:.2f}")
        try:
            check(result)
            verdict = "passes"
        except AssertionError as exc:
            verdict = f"FAILS: {exc}"
        print(f"seed {seed}: a {acc['a_all']:.3f}  b {acc['b_weighted']:.3f}  c {acc['c_excluded']:.3f}  "
              f"b-a {acc['b_weighted'] - acc['a_all']:+.3f}  c-a {acc['c_excluded'] - acc['a_all']:+.3f}  {verdict}",
              flush=True)
