"""The reward model on rankings, one forward per response (`--grouped`, the default): on the same
pairs the grouped loss and its gradients are the pairwise path's up to the per-ranking
normalisation; pairs without ranking ids group by prompt; ties and annotators' own answers give
the groups the store's pairs say; a group is never split; the CLI reports the same figures either
way."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from pipeline.__main__ import main as pipeline_main
from pipeline.config import RewardConfig
from pipeline.models import load_scalar_model
from pipeline.pairs_data import (collate, collate_groups, encode_groups, group_pairs, group_weights, pair_weights,
                                 read_pairs)
from pipeline.reward_eval import evaluate, forward_groups
from pipeline.train_reward import group_loss, pair_loss, token_chunks, train_reward
from tests.test_train_reward import WORDS, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/fixtures_models.py

CPU = torch.device("cpu")


def ranked_rows(n_prompts: int, k: int = 4, seed: int = 0, ids: bool = True, tie_every: int = 0) -> list[dict]:
    """n_prompts rankings of k responses as the store exports their pairs: response j mentions the
    marker k - 1 - j times, so earlier responses rank higher; a pair for every two responses of
    different tiers (with tie_every, every tie_every-th prompt ties its responses 1 and 2: no pair
    between them). Each pair carries its ranking's id (ids), a margin and a weight."""
    rng = random.Random(seed)
    rows = []
    for i in range(n_prompts):
        prompt = f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        texts = [" ".join([rng.choice(WORDS) for _ in range(rng.randint(2, 6))] + ["Paris"] * (k - 1 - j))
                 for j in range(k)]
        tiers = list(range(k))
        if tie_every and i % tie_every == 0:
            tiers[2] = tiers[1]
        for a in range(k):
            for b in range(k):
                if tiers[a] < tiers[b]:
                    row = {"prompt": prompt, "chosen": texts[a], "rejected": texts[b],
                           "margin": float(tiers[b] - tiers[a]), "weight": rng.choice([0.5, 1.0, 2.0])}
                    if ids:
                        row["ranking_id"] = 100 + i
                    rows.append(row)
    return rows


def as_pairs(path, rows):
    return read_pairs(write_jsonl(path, rows))[0]


@pytest.fixture
def reward_model(tiny_model_cfg):
    torch.manual_seed(0)
    return load_scalar_model(tiny_model_cfg.model, "reward", tiny_model_cfg)


def call(model):
    """`wrapped(fn, *args)` of one process (pipeline/distributed.py CallThrough)."""
    return lambda fn, *args: fn(model, *args)


def loss_and_grads(model, loss_of, *args, **kwargs):
    model.zero_grad()
    loss, right, gap, tokens = loss_of(*args, **kwargs)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return loss.detach(), right, gap, tokens, grads


# --------------------------------------------------------------------------- the same pairs, the same numbers


@pytest.mark.parametrize("share", [True, False])
def test_equal_groups_give_the_pairwise_loss_and_gradients(tmp_path, reward_model, share):
    """Rankings of K = 4 (6 pairs each), the batch all of them: the grouped loss (weights, margin,
    centering, LM term) and its gradients are the pairwise path's on the same pairs, with each
    response run once instead of once per pair it is in."""
    model, tok = reward_model
    groups, _ = encode_groups(group_pairs(as_pairs(tmp_path / "p.jsonl", ranked_rows(3))), tok, 512)
    assert [(len(g.responses), g.n_pairs) for g in groups] == [(4, 6)] * 3
    pairs = [p for g in groups for p in g.pairs()]
    cfg = RewardConfig(margin=True, center_coef=0.1, lm_coef=0.5)
    lm_weight = torch.randn(len(tok), model.backbone.config.hidden_size, generator=torch.Generator().manual_seed(1))
    model.train()
    kw = dict(pad_id=tok.pad_token_id, device=CPU, share_prompt=share, lm_weight=lm_weight)
    grouped = loss_and_grads(model, group_loss, cfg, call(model), groups, group_weights(groups, True), **kw)
    pairwise = loss_and_grads(model, pair_loss, cfg, call(model), pairs, pair_weights(pairs, True), **kw)
    assert group_weights(groups, True) is not None  # the weights are mixed: the weighted loss is tested
    assert torch.allclose(grouped[0], pairwise[0], rtol=1e-5)
    assert torch.allclose(grouped[4], pairwise[4], rtol=1e-4, atol=1e-4 * pairwise[4].abs().max().item())
    assert torch.equal(grouped[1], pairwise[1]) and torch.allclose(grouped[2], pairwise[2], atol=1e-5)
    assert grouped[3] < pairwise[3] / 2  # 4 responses and a prompt per ranking, not 6 x (prompt + 2)


def test_unequal_groups_are_the_pairwise_loss_reweighted_per_group(tmp_path, reward_model):
    """Rankings of K = 2, 3 and 4 (1, 3 and 6 pairs): the grouped loss counts each ranking once, i.e.
    the pairwise loss with each pair's weight times P / (G n_g); its gradients are that loss's."""
    model, tok = reward_model
    rows = ranked_rows(1, k=2, seed=1) + ranked_rows(1, k=3, seed=2) + ranked_rows(1, k=4, seed=3)
    for r, i in zip(rows, [0] * 1 + [1] * 3 + [2] * 6):
        r["ranking_id"] = i
    groups, _ = encode_groups(group_pairs(as_pairs(tmp_path / "p.jsonl", rows)), tok, 512)
    assert [g.n_pairs for g in groups] == [1, 3, 6]
    pairs = [p for g in groups for p in g.pairs()]
    base = group_weights(groups, True)
    reweighted = [w * 10 / (3 * g.n_pairs) for g, ws in zip(groups, base) for w in ws]  # P = 10, G = 3
    cfg = RewardConfig(margin=True)
    kw = dict(pad_id=tok.pad_token_id, device=CPU, share_prompt=True, lm_weight=None)
    model.train()
    grouped = loss_and_grads(model, group_loss, cfg, call(model), groups, base, **kw)
    pairwise = loss_and_grads(model, pair_loss, cfg, call(model), pairs, reweighted, **kw)
    assert torch.allclose(grouped[0], pairwise[0], rtol=1e-5)
    assert torch.allclose(grouped[4], pairwise[4], rtol=1e-4, atol=1e-4 * pairwise[4].abs().max().item())
    plain = loss_and_grads(model, pair_loss, cfg, call(model), pairs, [w for ws in base for w in ws], **kw)
    assert not torch.allclose(grouped[0], plain[0], rtol=1e-3)  # the mean over pairs is another loss


def test_group_scores_are_whole_sequence_scores(tmp_path, reward_model):
    """Each response scored once, after its group's prompt's KV cache or as a whole sequence, is
    what ScalarModel.score (PPO's scorer) reads for that prompt + response."""
    model, tok = reward_model
    groups, _ = encode_groups(group_pairs(as_pairs(tmp_path / "p.jsonl", ranked_rows(3, k=3, seed=4))), tok, 512)
    pairs = [p for g in groups for p in g.pairs()]
    batch = collate(pairs, tok.pad_token_id)
    with torch.no_grad():
        whole = model.score(batch["input_ids"], batch["attention_mask"])  # (2P,)
        for share in (True, False):
            scores, b, _, _ = forward_groups(model, groups, tok.pad_token_id, CPU, share)
            assert scores.shape == (9,)
            assert torch.allclose(torch.cat([scores[b["chosen"]], scores[b["rejected"]]]), whole, atol=1e-5)


# --------------------------------------------------------------------------- what a group is


def test_pairs_without_ranking_ids_group_by_prompt_with_each_response_once(tmp_path, tiny_tokenizer):
    """Without ranking ids a group is a prompt's pairs (by its exact text, so every pair keeps the
    tokens it has alone), each response text once however many pairs it is in."""
    rows = ranked_rows(2, k=3, ids=False, seed=5)
    rows.append(dict(rows[0]))  # the same pair again: its responses are the group's
    rows.append(dict(rows[0], prompt=rows[0]["prompt"] + " "))  # another prompt's text: another group
    groups = group_pairs(as_pairs(tmp_path / "p.jsonl", rows))
    assert [(len(g.responses), len(g.chosen)) for g in groups] == [(3, 4), (3, 3), (2, 1)]
    assert groups[0].chosen == [0, 0, 1, 0] and groups[0].rejected == [1, 2, 2, 1]
    encoded, _ = encode_groups(groups, tiny_tokenizer, 512)
    batch = collate_groups(encoded, tiny_tokenizer.pad_token_id, shared=True)
    assert batch["response_ids"].shape[0] == 8 and batch["prompt_of_row"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert batch["chosen"].tolist() == [0, 0, 1, 0, 3, 3, 4, 6]
    assert batch["chosen_count"].tolist() == [3, 1, 0, 2, 1, 0, 1, 0]
    assert batch["group"].tolist() == [0, 0, 0, 0, 1, 1, 1, 2]


def test_ties_and_an_own_answer_group_as_the_store_exports_them(store, store_annotators, tmp_path):
    """A ranking with a tie and an annotator's own answer, exported by the store: one group, the
    answer one more response, the pairs exactly the export's (none between the tied responses)."""
    from store.io import ExportOptions, export_dataset
    from store.records import EditIn, RankingIn
    from tests.fixtures_store import seed_items

    [item] = seed_items(store, 1, 4)
    r = item.response_ids
    ann, _ = store_annotators
    store.save_ranking(RankingIn(ann.id, item.prompt_id, [[r[0]], [r[1], r[2]], [r[3]]],
                                 edit=EditIn("my own answer", made_from=r[1])))
    snap = export_dataset(store, tmp_path / "export.jsonl", ExportOptions(format="jsonl"))
    pairs, _ = read_pairs(snap.path)
    assert len({p.ranking for p in pairs}) == 1 and pairs[0].ranking  # the answer's pairs carry its ranking's id
    [group] = group_pairs(pairs)
    text = {rid: store.get_response(rid).text for rid in r}
    assert sorted(group.responses) == sorted([*text.values(), "my own answer"])
    got = {(group.responses[c], group.responses[j]) for c, j in zip(group.chosen, group.rejected)}
    assert got == {(p.chosen, p.rejected) for p in pairs} and len(got) == len(pairs)
    tied = {text[r[1]], text[r[2]]}
    assert not any({c, j} == tied for c, j in got)
    assert ("my own answer", text[r[1]]) in got


def test_training_sees_exactly_the_pairs_given_and_never_a_split_group(tmp_path, tiny_model_cfg, tiny_tokenizer,
                                                                       monkeypatch):
    """An epoch of grouped training, in chunks of at most max_tokens: every chunk holds whole groups,
    and over the epoch the pairs trained on are the training pairs, each once (a tie's missing pair
    stays missing)."""
    import pipeline.train_reward as train_reward_module

    rows = ranked_rows(8, k=4, seed=6, tie_every=2)
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    seen, real = [], train_reward_module.group_loss

    def spy(cfg, wrapped, items, *args, **kwargs):
        seen.append(items)
        return real(cfg, wrapped, items, *args, **kwargs)

    monkeypatch.setattr(train_reward_module, "group_loss", spy)
    cfg = RewardConfig(epochs=1, batch_size=4, max_tokens=200, eval_fraction=0.0, norm_samples=0, seed=3)
    report = train_reward(str(data), str(tmp_path / "run"), cfg, tiny_model_cfg)
    assert report["train/pairs"] == len(rows) == 4 * 6 + 4 * 5  # the tied rankings have 5 pairs
    assert report["data"]["groups"]["train"] == {"groups": 8, "responses": 32, "pairs_max": 6}
    assert any(len(chunk) < 4 for chunk in seen)  # max_tokens cut batches into chunks
    trained = [(tuple(p.prompt_ids), tuple(p.chosen_response), tuple(p.rejected_response))
               for chunk in seen for g in chunk for p in g.pairs()]
    groups, _ = encode_groups(group_pairs(read_pairs(data)[0]), tiny_tokenizer, cfg.max_length)  # the model's tokenizer
    given = [(tuple(p.prompt_ids), tuple(p.chosen_response), tuple(p.rejected_response)) for g in groups for p in g.pairs()]
    assert sorted(trained) == sorted(given)
    assert sorted(g.n_pairs for chunk in seen for g in chunk) == sorted(g.n_pairs for g in groups)


def test_token_chunks_keep_each_group_whole():
    lengths, rows = [30, 10, 20, 25], [4, 2, 6, 3]
    # longest first: 4 rows x 30 = 120; + 3 rows = 7 x 30 = 210 > 200 -> new chunk; 3 x 25 + 6 x 25 = 225 > 200
    assert token_chunks([0, 1, 2, 3], lengths, 200, rows) == [[0], [3], [2, 1]]
    assert token_chunks([0, 1, 2, 3], lengths, 0, rows) == [[0, 1, 2, 3]]
    assert token_chunks([2], lengths, 50, rows) == [[2]]  # too big for any chunk: alone, never split


# --------------------------------------------------------------------------- evaluation and the CLI


def test_evaluation_of_groups_is_the_evaluation_of_their_pairs(tmp_path, reward_model):
    model, tok = reward_model
    groups, _ = encode_groups(group_pairs(as_pairs(tmp_path / "p.jsonl", ranked_rows(5, seed=7, tie_every=2))), tok, 512)
    pairs = [p for g in groups for p in g.pairs()]
    calls = []
    grouped = evaluate(model, groups, tok.pad_token_id, CPU, torch.float32, batch_size=2,
                       on_progress=lambda done, total: calls.append((done, total)))
    plain = evaluate(model, pairs, tok.pad_token_id, CPU, torch.float32, batch_size=2)
    assert grouped.keys() == plain.keys() and grouped["eval/pairs"] == len(pairs) == 3 * 5 + 2 * 6
    for key in ("eval/accuracy", "eval/margin", "eval/loss", "eval/reward_chosen", "eval/length_baseline_accuracy"):
        assert grouped[key] == pytest.approx(plain[key], abs=1e-5), key
    assert [row["count"] for row in grouped["calibration"]] == [row["count"] for row in plain["calibration"]]
    assert calls[-1] == (27, 27) and len(calls) == 3  # 5 groups, 2 a batch


def test_cli_trains_grouped_by_default_and_pairwise_on_request(tmp_path, tiny_model_dir, capsys):
    """`python -m pipeline train-reward` on rankings: grouped by default, --grouped false pair by
    pair; both report the same keys and held-out pairs, per pair, and the grouped run takes one
    optimiser step per batch of rankings."""
    data = write_jsonl(tmp_path / "p.jsonl", ranked_rows(12, seed=8, tie_every=3))
    base = ["train-reward", "--data", str(data), "--model", str(tiny_model_dir), "--device", "cpu",
            "--norm-samples", "0", "--lr", "1e-2", "--eval-fraction", "0.25", "--seed", "0"]
    reports = {}
    for name, extra in (("grouped", []), ("pairs", ["--grouped", "false", "--batch-size", "8"])):
        assert pipeline_main([*base, "--out", str(tmp_path / name), *extra]) == 0
        assert "held-out accuracy" in capsys.readouterr().out
        reports[name] = json.loads((tmp_path / name / "eval_report.json").read_text())
    grouped, pairs = reports["grouped"], reports["pairs"]
    assert json.loads((tmp_path / "grouped" / "config.json").read_text())["reward"]["grouped"] is True
    assert grouped.keys() == pairs.keys()
    assert {k for k in grouped if k.startswith("eval/")} == {k for k in pairs if k.startswith("eval/")}
    assert grouped["eval/pairs"] == pairs["eval/pairs"] > 0 and grouped["train/pairs"] == pairs["train/pairs"]
    assert grouped["data"]["groups"]["train"]["groups"] == 9 and "groups" not in pairs["data"]
    assert grouped["steps"] == 5 and pairs["steps"] == -(-pairs["train/pairs"] // 8)  # ceil(9 / 2), ceil(P / 8)
    assert grouped["truncation"]["sequences"] == 12 * 4
    lines = [json.loads(x) for x in (tmp_path / "grouped" / "metrics.jsonl").read_text().splitlines()]
    assert {"train/loss", "train/accuracy", "train/margin", "train/pairs_per_s"} <= set(lines[0])


def test_pairs_that_are_their_own_ranking_train_exactly_as_pairs(tmp_path, tiny_model_cfg):
    """One pair per prompt (no ranking ids): every group is one pair, so the grouped run is the
    pairwise run, step for step."""
    from tests.test_train_reward import marker_pairs

    data = write_jsonl(tmp_path / "p.jsonl", marker_pairs(24, seed=9))
    cfg = RewardConfig(epochs=1, lr=1e-2, batch_size=4, norm_samples=0, eval_fraction=0.25, center_coef=0.1)
    runs = {}
    for grouped in (True, False):
        out = tmp_path / str(grouped)
        runs[grouped] = train_reward(str(data), str(out), dataclasses.replace(cfg, grouped=grouped), tiny_model_cfg)
        runs[grouped]["losses"] = [json.loads(x)["train/loss"] for x in (out / "metrics.jsonl").read_text().splitlines()
                                   if "train/loss" in x]
    assert runs[True]["losses"] == pytest.approx(runs[False]["losses"], rel=1e-5)
    assert runs[True]["eval/margin"] == pytest.approx(runs[False]["eval/margin"], rel=1e-4)
