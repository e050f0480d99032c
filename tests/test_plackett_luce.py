"""Plackett-Luce, a reward model that learns whole rankings (`train-reward --loss plackett-luce`):
the loss against hand-computed numbers, a store export's rankings read back as the annotators
ranked them, and, with K = 2, training that equals Bradley-Terry's step for step."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from pipeline.config import ModelConfig, RewardConfig
from pipeline.losses import pairwise_loss, plackett_luce_loss
from pipeline.pairs_data import PairsError, read_pairs, read_rankings, rankings_path
from pipeline.train_reward import main, train_reward
from store import RankingIn
from store.io import ExportOptions, export_dataset
from tests.fixtures_store import seed_items

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- the loss


def test_two_responses_are_bradley_terry():
    g = torch.Generator().manual_seed(0)
    for s in torch.randn(20, 2, generator=g) * 3:
        assert float(plackett_luce_loss(s, torch.tensor([0, 1]))) == pytest.approx(float(pairwise_loss(s[:1], s[1:])),
                                                                                     rel=1e-5, abs=1e-6)


def test_a_strict_ranking_is_the_product_of_its_choices():
    s, order = torch.tensor([0.2, 1.5, -0.7, 0.4]), [1, 3, 0, 2]  # response 1 best, then 3, 0, 2
    tiers = torch.tensor([2, 0, 3, 1])
    probability = 1.0
    for i, best in enumerate(order):
        rest = order[i:]
        probability *= math.exp(s[best]) / sum(math.exp(s[j]) for j in rest)
    assert float(plackett_luce_loss(s, tiers)) == pytest.approx(-math.log(probability), rel=1e-5)


def test_a_tie_group_by_efron_is_close_to_the_average_over_its_orders():
    """Efron's form replaces the choices' denominators by their mean over the group's orders: by
    hand for a group of two in the middle, and within 1% of the log-likelihood averaged over both
    orders; tied scores at the bottom cost least when equal."""
    s, tiers = torch.tensor([1.0, 0.5, -0.2, 0.3]), torch.tensor([0, 1, 1, 2])
    e = s.exp()
    by_hand = (-(s[0] - torch.log(e.sum()))
               - (s[1] + s[2]) + torch.log(e[1:].sum()) + torch.log(e[1:].sum() - 0.5 * (e[1] + e[2])))
    assert float(plackett_luce_loss(s, tiers)) == pytest.approx(float(by_hand), rel=1e-5)
    averaged = []
    for middle in itertools.permutations([1, 2]):
        order = [0, *middle, 3]
        averaged.append(-sum(float(s[o] - torch.logsumexp(s[order[i:]], 0)) for i, o in enumerate(order)))
    assert float(plackett_luce_loss(s, tiers)) == pytest.approx(sum(averaged) / 2, rel=0.01)
    bottom = torch.tensor([0, 1, 1])
    equal, apart = torch.tensor([2.0, 0.0, 0.0]), torch.tensor([2.0, 0.5, -0.5])
    assert float(plackett_luce_loss(equal, bottom)) < float(plackett_luce_loss(apart, bottom))


# --------------------------------------------------------------------------- reading the rankings


@pytest.fixture
def exported(store, store_annotators, tmp_path):
    """A round of 5 items of K = 4 ranked in the store, with ties, one all tied and one blank
    answer, exported as a round snapshot is (a parquet pairs file, its rankings beside it)."""
    rnd = store.create_round()
    items = seed_items(store, 5, 4, round_id=rnd.id)
    a, _ = store_annotators
    orders = []
    for i, it in enumerate(items):
        r = it.response_ids
        order = [[r[0]], [r[1], r[2]], [r[3]]] if i % 2 else [[r[3]], [r[2]], [r[1]], [r[0]]]
        if i == 4:
            order = [r]  # all four tied: no order, no pair
        store.save_ranking(RankingIn(a.id, it.prompt_id, order))
        orders.append(order)
    snap = export_dataset(store, tmp_path / "pairs-1.parquet", ExportOptions(format="parquet"))
    return store, items, orders, snap


def test_a_round_snapshots_rankings_are_read_as_ranked(exported):
    store, items, orders, snap = exported
    assert rankings_path(snap.path).name == "pairs-1.rankings.parquet"
    rankings, report = read_rankings(snap.path)
    assert report["rows"] == 5 and report["rankings"] == 4 and report["dropped_all_tied"] == 1
    for ranking, it, order in zip(rankings, items, orders):
        texts = {rid: store.get_response(rid).text for rid in it.response_ids}
        expected = [(texts[rid], tier) for tier, group in enumerate(order) for rid in group]
        assert list(zip(ranking.responses, ranking.tiers)) == expected
        assert ranking.prompt == [{"role": "user", "content": store.get_prompt(it.prompt_id).text}]


def test_rankings_that_are_not_rankings_are_refused_by_name(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Q?", "chosen": "a", "rejected": "b"}) + "\n")
    with pytest.raises(PairsError, match="not a ranking: expected fields 'responses' and 'order'"):
        read_rankings(pairs)  # no rankings beside it: the pairs file itself is no ranking
    bad = tmp_path / "pairs.rankings.jsonl"
    bad.write_text(json.dumps({"prompt": "Q?", "responses": [{"response_id": 1, "text": "a"}], "order": [[1], [2]]}) + "\n")
    with pytest.raises(PairsError, match=r"row 1, field 'order': response id 2 is not among its responses"):
        read_rankings(pairs)


# --------------------------------------------------------------------------- training


def k2_rankings(pairs_file, out):
    """Each pair of `pairs_file` as the export writes a ranking of two responses, in the same order."""
    pairs, _ = read_pairs(pairs_file)
    with open(out, "w", encoding="utf-8") as f:
        for i, p in enumerate(pairs):
            f.write(json.dumps({"ranking_id": i, "prompt": p.prompt, "order": [[2 * i], [2 * i + 1]],
                                "responses": [{"response_id": 2 * i, "text": p.chosen},
                                              {"response_id": 2 * i + 1, "text": p.rejected}],
                                "split": p.split}) + "\n")
    return out


@pytest.mark.slow
def test_on_pairs_plackett_luce_trains_as_bradley_terry(tmp_path, test_data, tiny_model_dir):
    """The bundled HH pairs as rankings of two: every step's loss and accuracy, the held-out figures
    and the weights equal Bradley-Terry's (the same batches; BT shares each prompt, PL scores whole
    sequences, so equal up to float rounding)."""
    pairs = tmp_path / "hh.jsonl"
    pairs.write_text("".join((test_data / "hh_dev_pairs.jsonl").read_text().splitlines(keepends=True)[:48]))
    k2_rankings(pairs, tmp_path / "hh.rankings.jsonl")
    model = ModelConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32", lora=True, lora_r=4, lora_alpha=8)
    reports = {}
    for loss in ("bt", "plackett-luce"):
        cfg = RewardConfig(loss=loss, epochs=2, batch_size=4, lr=1e-3, max_length=256, eval_fraction=0.25,
                           norm_samples=0, seed=3)
        reports[loss] = train_reward(str(pairs), str(tmp_path / loss), cfg, model)
    bt, pl = reports["bt"], reports["plackett-luce"]
    assert pl["train/rankings"] == bt["train/pairs"] == 36
    rows = {loss: [json.loads(line) for line in (tmp_path / loss / "metrics.jsonl").read_text().splitlines()]
            for loss in reports}
    assert len(rows["bt"]) == len(rows["plackett-luce"]) > 10
    for a, b in zip(rows["bt"], rows["plackett-luce"]):
        for key in ("train/loss", "train/accuracy", "eval/accuracy", "eval/loss"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a.get("step"), key)
    assert bt["eval/loss"] != pytest.approx(math.log(2), abs=1e-3)  # it trained


def test_cli_loss_errors_name_the_problem(tmp_path, tiny_model_dir, capsys):
    pairs = tmp_path / "p.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Q{i}?", "chosen": "yes", "rejected": "no"}) + "\n" for i in range(8)))
    common = ["--data", str(pairs), "--model", str(tiny_model_dir), "--device", "cpu", "--norm-samples", "0"]
    assert main([*common, "--out", str(tmp_path / "a"), "--loss", "listnet"]) == 2
    assert "--loss 'listnet'" in capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "b"), "--loss", "plackett-luce"]) == 2
    assert "not a ranking" in capsys.readouterr().err  # no rankings beside the pairs
    k2_rankings(pairs, tmp_path / "p.rankings.jsonl")
    assert main([*common, "--out", str(tmp_path / "c"), "--loss", "plackett-luce", "--margin", "true"]) == 2
    assert "--margin" in capsys.readouterr().err
