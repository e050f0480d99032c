"""DPO on groups (pipeline/dpo_data.py): a ranking's pairs as one batch element, each distinct
response's log-probs computed once; the tiny random model, CPU fp32.

The grouped packing must give each response the log-prob of its prompt + response run alone, and
the loss must be the pairwise path's with each group normalised (InstructGPT's: a group's loss the
mean over its pairs, the batch's the mean over groups).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest
import torch

from pipeline.dpo_data import (Packing, encode_dpo, pack_pairs, pair_stats, preference_loss, reference_logps,
                               sequence_logps)
from pipeline.losses import logprobs_from_logits
from pipeline.models import attn_ratio
from pipeline.pairs_data import group_weights, pair_weights, read_pairs
from pipeline.policy import causal_lm_logits, load_policy, make_reference
from tests.test_train_dpo import FAST, dpo_model_cfg  # noqa: F401  (a fixture)
from tests.test_train_reward import WORDS, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/fixtures_models.py

ROOT = Path(__file__).resolve().parents[1]


def ranking_rows(ranking_id, prompt: str, responses: list[str], **extra) -> list[dict]:
    """The pairs an export writes for one ranking, best first: every (better, worse) pair."""
    return [{"prompt": prompt, "chosen": a, "rejected": b, "ranking_id": ranking_id, **extra}
            for a, b in combinations(responses, 2)]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def marker_rankings(n: int, k: int, seed: int = 0) -> list[dict]:
    """n rankings of k responses: those with the marker word 'Paris' (the first half) above those
    without; its pairs across the two halves only (a tie within each half)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = f"Question {i}: {words(rng, rng.randint(3, 10))}"
        good = [f"{words(rng, rng.randint(2, 6))} Paris {words(rng, rng.randint(0, 4))}" for _ in range(k // 2)]
        bad = [words(rng, rng.randint(3, 9)) for _ in range(k - k // 2)]
        rows += [{"prompt": prompt, "chosen": g, "rejected": b, "ranking_id": i} for g in good for b in bad]
    return rows


def moved_policy(cfg, seed: int):
    """The tiny policy with its adapter moved off zero, so policy and reference differ."""
    torch.manual_seed(seed)  # before load_policy: peft draws the LoRA A matrices from the global stream
    model, tok = load_policy(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model, tok


def alone_logps(model, groups) -> torch.Tensor:
    """(R,) each response's log-prob with its prompt run alone, group by group (the packing's order)."""
    out = []
    for g in groups:
        for response in g.responses:
            ids = torch.tensor([g.prompt_ids + response])
            logits = causal_lm_logits(model, ids, torch.ones_like(ids))[:, len(g.prompt_ids) - 1:-1]
            out.append(logprobs_from_logits(logits, torch.tensor([response]))[0].sum())
    return torch.stack(out)


def mixed_pairs(tmp_path) -> list:
    """A K = 4 ranking (6 pairs), a K = 3 one (3 pairs), and two pairs without a ranking id."""
    rng = random.Random(3)
    rows = (ranking_rows(7, "Tell me about bread.", [words(rng, rng.randint(2, 8)) for _ in range(4)])
            + ranking_rows(8, "What is the capital of France?", [words(rng, rng.randint(2, 8)) for _ in range(3)])
            + [{"prompt": f"Guitar tips {i}?", "chosen": words(rng, 4), "rejected": words(rng, 6)} for i in range(2)])
    return read_pairs(write_jsonl(tmp_path / "mixed.jsonl", rows))[0]


# --------------------------------------------------------------------------- the grouped packing


def test_grouped_packing_gives_each_response_its_whole_sequence_logp_and_gradient(tmp_path, dpo_model_cfg):
    """Every distinct response once, its prompt once: the same log-probs and gradients as each
    prompt + response run alone, with and without the shared prefix, one row or a group per row."""
    model, tok = moved_policy(dpo_model_cfg, 0)
    groups, _ = encode_dpo(mixed_pairs(tmp_path), tok, 512, grouped=True)
    assert [len(g.responses) for g in groups] == [4, 3, 2, 2] and [g.n_pairs for g in groups] == [6, 3, 1, 1]
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    want = alone_logps(model, groups)  # (11,)
    (want * torch.linspace(-1, 1, len(want))).sum().backward()
    want_grads = [p.grad.clone() for p in params]
    pairwise, _ = encode_dpo(mixed_pairs(tmp_path), tok, 512, grouped=False)
    for share_prefix, attn_cost in ((True, 0.0), (False, attn_ratio(model))):
        model.zero_grad()
        pp = pack_pairs(groups, Packing(attn_cost, tok.pad_token_id, share_prefix))
        assert (pp.responses, pp.pairs, pp.groups) == (11, 11, 4)
        assert (pp.prefix is not None) == share_prefix and pp.input_ids.shape[0] == (1 if attn_cost == 0 else 4)
        got = sequence_logps(model, pp)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
        (got * torch.linspace(-1, 1, len(got))).sum().backward()
        assert all((p.grad - g).abs().max() <= 1e-5 * g.abs().max() for p, g in zip(params, want_grads))
        # each response once: fewer tokens than the pairs packed one by one (22 responses, 11 prompts)
        assert pp.real_tokens < pack_pairs(pairwise, Packing(attn_cost, tok.pad_token_id, share_prefix)).real_tokens
    # a pair's chosen and rejected are numbers of the group's responses, in the file's order
    first = groups[0]
    assert (first.chosen, first.rejected) == ([0, 0, 0, 1, 1, 2], [1, 2, 3, 2, 3, 3])
    assert pp.chosen[:6].tolist() == first.chosen and pp.pairs_per_group == [6, 3, 1, 1]
    with torch.no_grad():
        ref = reference_logps(make_reference(model), pp)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(dpo_model_cfg.model).eval()
    with torch.no_grad():
        assert torch.allclose(ref, alone_logps(base, groups), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_grouped_loss_is_the_pairwise_loss_normalised_per_group(tmp_path, dpo_model_cfg, loss):
    """Groups of equal pair counts: the grouped loss and its gradients are the pairwise path's mean
    over pairs. Unequal groups (6, 3, 1, 1 pairs), weighted or not: the mean over groups of each
    group's mean of w * loss over its pairs, from the pairwise path's per-pair losses."""
    cfg = dataclasses.replace(FAST, loss=loss)
    model, tok = moved_policy(dpo_model_cfg, 1)
    reference = make_reference(model)
    params = [p for p in model.parameters() if p.requires_grad]
    packing = Packing(attn_ratio(model), tok.pad_token_id)

    def loss_and_grads(items, weights=None):
        model.zero_grad()
        pp = pack_pairs(items, packing, weights=weights)
        loss = preference_loss(cfg, sequence_logps(model, pp), reference_logps(reference, pp), pp)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    rng = random.Random(4)
    equal = [r for i in range(3) for r in ranking_rows(i, f"Prompt {i}: {words(rng, 5)}",
                                                       [words(rng, rng.randint(2, 7)) for _ in range(3)])]
    pairs = read_pairs(write_jsonl(tmp_path / "equal.jsonl", equal))[0]
    grouped, _ = encode_dpo(pairs, tok, 512, grouped=True)
    pairwise, _ = encode_dpo(pairs, tok, 512, grouped=False)
    assert [g.n_pairs for g in grouped] == [3, 3, 3] and len(pairwise) == 9
    got, got_grads = loss_and_grads(grouped)
    want, want_grads = loss_and_grads(pairwise)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    assert all((g - w).abs().max() <= 1e-5 * w.abs().max() for g, w in zip(got_grads, want_grads))

    pairs = mixed_pairs(tmp_path)
    for i, p in enumerate(pairs):
        p.weight = 0.5 + (i % 3)
    grouped, _ = encode_dpo(pairs, tok, 512, grouped=True)
    pairwise, _ = encode_dpo(pairs, tok, 512, grouped=False)
    n_g = torch.tensor([6.0] * 6 + [3.0] * 3 + [1.0, 1.0])  # each pair's group size, in file order
    with torch.no_grad():
        pp = pack_pairs(pairwise, packing)
        logps, ref = sequence_logps(model, pp), reference_logps(reference, pp)
        # each pair's own loss, the pair packed alone
        per_pair = torch.stack([preference_loss(cfg, sequence_logps(model, q), reference_logps(reference, q), q)
                                for q in [pack_pairs([it], packing) for it in pairwise]])
    for weights in (None, group_weights(grouped, True)):
        w = torch.ones(11) if weights is None else torch.tensor([x for g in weights for x in g])
        want = (w * per_pair / n_g).sum() / 4  # sum over groups of each group's mean, over 4 groups
        flat = None if weights is None else [x for g in weights for x in g]
        got, got_grads = loss_and_grads(grouped, flat)
        assert torch.allclose(got, want, rtol=1e-5, atol=0), (weights, got, want)
        # the gradients too: the pairwise path with each pair's share of the grouped loss as its weight
        shares = (w * 11 / (4 * n_g)).tolist()
        pair_loss, pair_grads = loss_and_grads(pairwise, shares)
        assert torch.allclose(pair_loss, got, rtol=1e-5, atol=0)
        assert all((g - q).abs().max() <= 1e-5 * q.abs().max() for g, q in zip(got_grads, pair_grads))
    # the weights are normalised over all training pairs, grouped or not
    assert [x for g in group_weights(grouped, True) for x in g] == pair_weights([g.pairs()[0] for g in pairwise],
                                                                              True)
    # held out, every pair counts once: the plain mean over pairs, whatever the groups
    with torch.no_grad():
        pg = pack_pairs(grouped, packing)
        held = preference_loss(cfg, sequence_logps(model, pg), reference_logps(reference, pg), pg, per_group=False)
        assert torch.allclose(held, per_pair.mean(), rtol=1e-5)
        stats = pair_stats(sequence_logps(model, pg), reference_logps(reference, pg), pg, cfg.beta)
        assert stats == pytest.approx(pair_stats(logps, ref, pp, cfg.beta), rel=1e-4, abs=1e-5)


# --------------------------------------------------------------------------- what a group is


def test_pairs_without_ranking_ids_group_by_their_exact_prompt(tmp_path, dpo_model_cfg):
    """A file without ranking ids (HH-style pairs, an older export): the pairs of one prompt are one
    group, each response once; a prompt that differs in case is a group of its own, so every pair is
    trained on the tokens it has alone. --grouped false: a group per pair."""
    rows = [{"prompt": "Tell me about bread.", "chosen": a, "rejected": b}
            for a, b in (("Mix flour and water.", "No."), ("Mix flour and water.", "Bake it."), ("Bake it.", "No."))]
    rows += [{"prompt": "tell me about bread.", "chosen": "Use yeast.", "rejected": "No."},
             {"prompt": "Guitar tips?", "chosen": "Practise daily.", "rejected": "Buy a drum."}]
    pairs = read_pairs(write_jsonl(tmp_path / "plain.jsonl", rows))[0]
    assert all(p.ranking == "" for p in pairs)
    model, tok = moved_policy(dpo_model_cfg, 2)
    groups, _ = encode_dpo(pairs, tok, 512, grouped=True)
    assert [(len(g.responses), g.chosen, g.rejected) for g in groups] == [
        (3, [0, 0, 2], [1, 2, 1]), (2, [0], [1]), (2, [0], [1])]
    assert groups[1].prompt_ids != groups[0].prompt_ids  # the lower-case prompt keeps its own tokens
    singles, _ = encode_dpo(pairs, tok, 512, grouped=False)
    assert [(len(g.responses), g.n_pairs) for g in singles] == [(2, 1)] * 5
    # the same pairs either way: each pair's (chosen, rejected) log-probs agree
    with torch.no_grad():
        pg, ps = pack_pairs(groups, Packing(0.0, tok.pad_token_id)), pack_pairs(singles, Packing(0.0, tok.pad_token_id))
        lg, ls = sequence_logps(model, pg), sequence_logps(model, ps)
    assert (pg.responses, ps.responses) == (7, 10)
    assert torch.allclose(torch.stack([lg[pg.chosen], lg[pg.rejected]]), torch.stack([ls[ps.chosen], ls[ps.rejected]]),
                          rtol=1e-5, atol=1e-4)


def test_an_edited_answer_is_one_more_response_of_its_rankings_group(tmp_path, dpo_model_cfg):
    """An annotator's own answer (the export's source 'edit' pairs, with its ranking's id) joins the
    ranking's group: ranking 1's three responses and the answer are one group of 4 responses and 6
    pairs, the answer computed once; another annotator's ranking of the same responses (id 2) is a
    group of its own."""
    prompt, responses = "What is the capital of France?", ["Paris.", "It is Lyon.", "France has no capital."]
    answer = "The capital of France is Paris."
    rows = (ranking_rows(1, prompt, responses, source="ranking")
            + [{"prompt": prompt, "chosen": answer, "rejected": r, "ranking_id": 1, "source": "edit"}
               for r in responses]
            + ranking_rows(2, prompt, [responses[1], responses[0], responses[2]], source="ranking"))
    pairs = read_pairs(write_jsonl(tmp_path / "edit.jsonl", rows))[0]
    model, tok = moved_policy(dpo_model_cfg, 3)
    groups, _ = encode_dpo(pairs, tok, 512, grouped=True)
    assert [(len(g.responses), g.n_pairs) for g in groups] == [(4, 6), (3, 3)]
    assert groups[0].chosen[3:] == [3, 3, 3] and groups[0].rejected[3:] == [0, 1, 2]  # the answer is response 3
    with torch.no_grad():
        pp = pack_pairs(groups, Packing(attn_ratio(model), tok.pad_token_id))
        got = sequence_logps(model, pp)
        assert torch.allclose(got, alone_logps(model, groups), rtol=1e-5, atol=1e-4)
    assert pp.responses == 7 and int((pp.sequence == 3).sum()) == len(tok(answer)["input_ids"]) + 1  # + EOS, once


# --------------------------------------------------------------------------- end to end


def test_train_dpo_cli_grouped_and_pair_by_pair(tmp_path, tiny_model_dir):
    """`python -m pipeline train-dpo` on 40 rankings of K = 4 (4 pairs each): grouped (the default,
    batch size 2 rankings) and --grouped false (batch size 8 pairs), 15 steps each on the same 120
    training pairs; the grouped run computes fewer tokens, both see the same held-out pairs."""
    from pipeline.train_dpo import build_parser

    assert "--grouped" in build_parser().format_help()
    data = write_jsonl(tmp_path / "rankings.jsonl", marker_rankings(40, 4))
    common = ["--data", str(data), "--model", str(tiny_model_dir), "--device", "cpu", "--lora-r", "4",
              "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,lm_head", "--lr", "1e-2", "--epochs", "1",
              "--eval-fraction", "0.25", "--kl-prompts", "0"]
    runs = {}
    for name, extra in (("grouped", []), ("pairs", ["--grouped", "false", "--batch-size", "8"])):
        out = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "pipeline", "train-dpo", *common, "--out", str(out), *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads((out / "eval_report.json").read_text())
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[name] = report, [s for s in steps if "train/loss" in s]
        assert json.loads((out / "config.json").read_text())["dpo"]["grouped"] == (name == "grouped")
    (grouped, g_steps), (pairs, p_steps) = runs["grouped"], runs["pairs"]
    assert (grouped["train/pairs"], grouped["train/groups"], pairs["train/groups"]) == (120, 30, 120)
    assert grouped["steps"] == pairs["steps"] == 15 and grouped["eval/pairs"] == pairs["eval/pairs"] == 40
    assert grouped["truncation"]["sequences"] == 4 * 40 and pairs["truncation"]["sequences"] == 2 * 160
    for rows in (g_steps, p_steps):  # the policy starts as the reference: every implicit reward 0
        assert rows[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6) and rows[0]["train/reward_accuracy"] == 0
    # each response once instead of once per pair it is in (2 of 4 here), each prompt once per ranking
    g_tokens, p_tokens = sum(s["train/tokens"] for s in g_steps), sum(s["train/tokens"] for s in p_steps)
    assert g_tokens < 0.7 * p_tokens, (g_tokens, p_tokens)
    print(f"held-out accuracy {grouped['eval/reward_accuracy']:.3f} grouped, {pairs['eval/reward_accuracy']:.3f} "
          f"pair by pair; tokens {g_tokens} against {p_tokens}")
    assert grouped["eval/margin"] > 0 and pairs["eval/margin"] > 0
