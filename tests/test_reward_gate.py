"""The reward gate: a round runs PPO only against a reward model whose held-out accuracy beats chance.

- the decision (pipeline/orchestrate/gate.py) against hand-computed 95% Wilson bounds: trusted,
  not trusted (interval over 0.5, or below it), no held-out pairs, figures that are no measurement;
  the advice (how many more prompts) from the model's own yield of pairs per prompt;
- a round whose reward model is at chance, run by `python -m pipeline loop` with simulated
  annotators on the tiny model, stops before PPO: back to 'annotating', the verdict on the round,
  the message printed, no ppo run; with `--reward-gate false` the same round runs PPO;
- a round whose reward model beats chance runs PPO unasked;
- the Train tab: the data a useful reward model needs before a round, the stopped round's
  message with its figures, and "Run PPO anyway" queueing PPO against the gated reward model.

The rounds at chance are certain, not likely: their reward models are scored on 3 held-out pairs
(--rm-eval-data), and even 3 of 3 right has a Wilson lower bound of 0.44. The trusted round's
figures are stated outright (its reward model's held-out report is replaced as it is registered),
since no tiny model is certain to learn a task from one small round.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from annotate import model_admin, monitor, train
from pipeline.config import LoopConfig, add_arguments, from_args
from pipeline.orchestrate import gate, ingest, loop
from pipeline.oracle import make_oracle
from pipeline.orchestrate.simulate import simulate_annotations
from store import Store
from tests.helpers import req, tiny_settings
from tests.test_jobs import add_prompts
from tests.test_loop_dpo import open_round
from tests.test_train_ui import FULL_ROUND_FORM, full_round, make_ctx


def version(**figures):
    return SimpleNamespace(id=3, name="rm-3", meta={"eval": figures})


# --------------------------------------------------------------------------- the decision


@pytest.mark.parametrize("correct, n, lo, hi", [
    # the roots in p of (correct/n - p)^2 = 1.96^2 p (1 - p) / n, solved by hand
    (60, 100, 0.502001, 0.690600), (59, 100, 0.492013, 0.681328), (40, 100, 0.309400, 0.497999),
    (97, 180, 0.466013, 0.610140), (3, 3, 0.438494, 1.0), (0, 10, 0.0, 0.277540),
])
def test_wilson_matches_hand_computed_bounds(correct, n, lo, hi):
    got = gate.wilson(correct, n)
    assert got == pytest.approx((lo, hi), abs=1e-6)
    assert all(math.isnan(x) for x in gate.wilson(0, 0))


def test_a_reward_model_is_trusted_when_its_interval_lies_above_chance():
    v = gate.judge(version(**{"eval/accuracy": 0.60, "eval/pairs": 100, "eval/length_baseline_accuracy": 0.51}))
    assert v.trusted and (v.lo, v.hi) == pytest.approx((0.502001, 0.690600), abs=1e-6)
    assert (v.reward_version_id, v.reward_name, v.pairs, v.length_baseline, v.more_prompts) == (3, "rm-3", 100, 0.51, None)
    assert v.message == ("Reward model rm-3: held-out accuracy 0.60 [0.50, 0.69] on 100 pairs (longer-wins "
                         "baseline 0.51): its interval lies above chance (0.5).")
    assert gate.Verdict(**v.to_dict()) == v  # the round keeps it as a dict


def test_an_interval_over_chance_is_not_trusted_and_says_how_many_more_prompts():
    figures = {"eval/accuracy": 0.59, "eval/pairs": 100, "eval/length_baseline_accuracy": 0.51,
               "train/pairs": 300, "train/prompts": 60, "eval/prompts": 20}
    v = gate.judge(version(**figures))
    assert not v.trusted and (v.lo, v.hi) == pytest.approx((0.492013, 0.681328), abs=1e-6)
    # 300 training pairs from 80 ranked prompts: 3.75 a prompt; (2,838 - 300) / 3.75 = 676.8
    assert (v.train_pairs, v.more_prompts) == (300, 677)
    assert v.message.startswith(
        "Reward model rm-3: held-out accuracy 0.59 [0.49, 0.68] on 100 pairs (longer-wins baseline 0.51): its "
        "interval does not exclude chance (0.5), so the round does not run PPO against it.")
    assert ("a reward model needed about 2,800 training pairs (about 640 prompts ranked at K = 4) for 0.75 held-out "
            "accuracy; about 690 (160 prompts) gave 0.57-0.64; this one had 300 training pairs: rank about 677 more "
            "prompts") in v.message
    assert '"Run PPO anyway"' in v.message and "--reward-gate false" in v.message


def test_an_interval_below_chance_and_a_model_with_the_reference_data_already():
    v = gate.judge(version(**{"eval/accuracy": 0.40, "eval/pairs": 100, "train/pairs": 3000}))
    assert not v.trusted and v.hi == pytest.approx(0.497999, abs=1e-6)
    assert "its interval lies below chance (0.5)" in v.message and "(longer-wins" not in v.message
    assert v.more_prompts is None and "3,000 training pairs, as many: more rankings alone may not help" in v.message


@pytest.mark.parametrize("figures", [{}, {"eval/pairs": 0, "eval/accuracy": 0.0}])
def test_no_held_out_pairs_is_not_trusted(figures):
    v = gate.judge(version(**figures))
    assert not v.trusted and (v.accuracy, v.lo, v.hi, v.pairs) == (None, None, None, 0)
    assert v.message.startswith("Reward model rm-3: there were no held-out pairs to measure it on")
    assert v.more_prompts == 640 and "rank about 640 prompts in all" in v.message  # the reference's 640
    assert gate.judge(SimpleNamespace(id=1, name="rm-1", meta={})).message.startswith("Reward model rm-1: there were no")


def test_the_verdict_is_the_interval_rule_for_every_count():
    for n in range(1, 41):
        for correct in range(n + 1):
            v = gate.judge(version(**{"eval/accuracy": correct / n, "eval/pairs": n}))
            assert v.trusted == (gate.wilson(correct, n)[0] > 0.5), (correct, n)
    assert not gate.judge(version(**{"eval/accuracy": 1.0, "eval/pairs": 3})).trusted  # 3 of 3: lower bound 0.44


@pytest.mark.parametrize("figures, message", [
    ({"eval/accuracy": 1.5, "eval/pairs": 10}, "eval/accuracy must be a number in \\[0, 1\\], not 1.5"),
    ({"eval/accuracy": "high", "eval/pairs": 10}, "eval/accuracy must be a number in \\[0, 1\\], not 'high'"),
    ({"eval/accuracy": 0.7, "eval/pairs": -1}, "eval/pairs must be a whole number >= 0, not -1"),
    ({"eval/accuracy": 0.7, "eval/pairs": 2.5}, "eval/pairs must be a whole number >= 0, not 2.5"),
    ({"eval/accuracy": 0.7, "eval/pairs": 10, "train/pairs": "many"}, "train/pairs must be a whole number"),
])
def test_figures_that_are_no_measurement_are_refused_by_name(figures, message):
    with pytest.raises(ValueError, match=f"reward model rm-3: {message}"):
        gate.judge(version(**figures))


def test_the_gate_is_on_by_default_and_the_cli_turns_it_off():
    parser = argparse.ArgumentParser()
    add_arguments(parser, LoopConfig)
    assert from_args(LoopConfig, parser.parse_args([])).reward_gate is True
    assert from_args(LoopConfig, parser.parse_args(["--reward-gate", "false"])).reward_gate is False
    assert "Wilson" in parser.format_help()


# --------------------------------------------------------------------------- rounds


def three_held_out_pairs(path):
    """A held-out file of 3 pairs: no reward model can be trusted on it (3 of 3: lower bound 0.44)."""
    path.write_text("".join(json.dumps({"prompt": f"Question {i}?", "chosen": "Make a budget and spend less.",
                                        "rejected": "Spend less."}) + "\n" for i in range(3)))
    return path


@pytest.mark.slow
def test_a_round_at_chance_stops_before_ppo_and_the_cli_says_why(tmp_path, tiny_model_dir, capsys):
    db = tmp_path / "cli" / "rlhf.duckdb"
    store = Store(db)
    add_prompts(store, extra=20)
    store.close()
    args = ["--db", str(db), "--oracle", "rule:length", "--rounds", "1", "--prompts-per-round", "6",
            "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "fp32", "--lora-r", "4", "--lora-alpha", "8",
            "--gen-k", "3", "--gen-max-new-tokens", "8", "--gen-temperature", "1.0", "--gen-batch-size", "18",
            "--rm-batch-size", "4", "--rm-max-length", "64", "--rm-norm-samples", "0", "--rm-lr", "1e-3",
            "--rm-eval-data", str(three_held_out_pairs(tmp_path / "heldout.jsonl")),
            "--ppo-prompts", "8", "--ppo-steps", "2", "--ppo-batch-size", "4", "--ppo-mini-batch-size", "4",
            "--ppo-micro-batch-size", "4", "--ppo-ppo-epochs", "1", "--ppo-max-new-tokens", "8"]

    # 1. the gate on (the default): the round stops after its reward model, saying why
    assert loop.main(args) == 1
    out = capsys.readouterr().out
    store = Store(db)
    (rnd,) = store.list_rounds()
    verdict = loop.gated(rnd)
    (reward,) = store.list_model_versions("reward")
    assert rnd.status == "annotating" and verdict is not None and not verdict["trusted"]
    (snapshot,) = store.list_snapshots()  # trained on all of it: the held-out pairs are the file's
    assert (verdict["reward_version_id"], verdict["pairs"], verdict["train_pairs"]) == \
        (reward.id, 3, snapshot.counts["pairs"])
    assert rnd.meta["last_error"] == verdict["message"] and f"error: round {rnd.id}: {verdict['message']}" in out
    assert f"Reward model {reward.name}: held-out accuracy" in out and "on 3 pairs" in out
    assert "so the round does not run PPO against it" in out
    assert f"this one had {verdict['train_pairs']} training pairs: rank about" in out
    assert store.list_runs(kind="ppo") == []
    with pytest.raises(loop.UntrustedReward, match="does not run PPO") as stopped:
        loop.wait_round(store, rnd)
    assert stopped.value.verdict == verdict and stopped.value.round_id == rnd.id
    store.close()

    # 2. the same round with the gate off: a new reward model, then PPO against it, then the next round
    assert loop.main([*args, "--reward-gate", "false"]) == 0
    store = Store(db)
    round1, round2 = store.list_rounds()
    (ppo,) = store.list_runs(kind="ppo")
    assert round1.status == "done" and loop.gated(round1) is None and round1.meta["last_error"] is None
    assert ppo.status == "done" and ppo.inputs["reward_version_id"] == round1.reward_version_id != reward.id
    assert round2.status == "annotating" and round2.policy_version_id == round1.new_policy_version_id
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize("policy_step, reward_loss", [("ppo", "bt"), ("rloo", "plackett-luce")])
def test_a_round_whose_reward_model_beats_chance_runs_ppo_unasked(store, tiny_model_dir, tmp_path, monkeypatch,
                                                                  policy_step, reward_loss):
    """PPO, or RLOO (the same trainer without a critic), as the policy step the round names; its
    reward model by Bradley-Terry or Plackett-Luce (the round snapshot's rankings)."""
    trusted = {"eval/accuracy": 0.9, "eval/pairs": 200, "eval/length_baseline_accuracy": 0.5, "train/pairs": 18}
    register = ingest.FINISHERS["train-reward"]

    def with_stated_figures(store, run, run_dir, partial):
        outputs = register(store, run, run_dir, partial)
        store.update_model_version(outputs["model_version_id"], meta={"eval": trusted})
        return outputs

    monkeypatch.setitem(ingest.FINISHERS, "train-reward", with_stated_figures)
    add_prompts(store)
    runner = loop.make_runner(store, tmp_path / "runs", poll_s=0.2)
    try:
        settings = tiny_settings(tiny_model_dir)
        settings.policy_step, settings.reward.loss = policy_step, reward_loss
        assert settings.loop.reward_gate  # the default
        rnd = loop.start_round(store, runner, settings)
        simulate_annotations(store, make_oracle("rule:length"))
        done = loop.finish_round(store, runner, rnd, settings)
        (reward,) = store.list_model_versions("reward")
        (ppo,) = store.list_runs(kind="ppo")
        assert gate.judge(reward).trusted and done.status == "done" and loop.gated(done) is None
        assert reward.meta["loss"] == reward_loss and model_admin.trained_by(reward) == \
            {"bt": "Bradley-Terry", "plackett-luce": "Plackett-Luce"}[reward_loss]
        assert ppo.status == "done" and ppo.inputs["reward_version_id"] == reward.id == done.reward_version_id
        assert store.active_policy().id == done.new_policy_version_id
        policy = store.active_policy()
        assert policy.meta["method"] == policy_step and model_admin.trained_by(policy) == policy_step.upper()
        run_dir = Path(policy.path).parent
        assert json.loads((run_dir / "config.json").read_text())["ppo"]["advantage_estimator"] == \
            {"ppo": "gae", "rloo": "rloo"}[policy_step]
        assert (run_dir / "checkpoint" / "critic").is_dir() == (policy_step == "ppo")
    finally:
        runner.shutdown()


# --------------------------------------------------------------------------- the Train tab


@pytest.fixture
def ctx(store, tmp_path, tiny_model_dir):
    ctx = make_ctx(store, tmp_path, tiny_model_dir)
    ctx.train_settings.reward.eval_data = str(three_held_out_pairs(tmp_path / "heldout.jsonl"))
    yield ctx
    ctx.jobs.shutdown()


def gate_line(ctx, boss):
    """(reward-gate Markdown, "Run PPO anyway" update) as the monitor's poll shows them."""
    *_, gate_md, anyway, _, _, _ = train.poll(ctx, monitor.LATEST, None, boss)
    return gate_md, anyway


@pytest.mark.slow
def test_the_train_tab_shows_the_gates_verdict_and_runs_ppo_anyway(ctx, tiny_model_dir):
    store, boss = ctx.store, req("boss")
    rnd, start = open_round(store, tiny_model_dir)
    store.add_prompts([f"Tell me about topic {i}." for i in range(8)], source="test")  # the next round's pool
    simulate_annotations(store, make_oracle("rule:length"))

    # 1. before the round: what a useful reward model needed, beside this store's pairs
    text, anyway = gate_line(ctx, boss)
    assert "**Reward model data:** 18 preference pairs so far." in text and not anyway["visible"]
    assert "about 2,800 training pairs (about 640 prompts ranked at K = 4) for 0.75 held-out accuracy" in text

    # 2. "Run a full round": the reward model is at chance on its held-out pairs, so PPO does not run
    msg, *_ = full_round(ctx, **FULL_ROUND_FORM, request=boss)
    assert "then PPO if the reward model beats chance" in msg
    ctx.jobs.wait_idle(timeout=300)
    (reward,) = store.list_model_versions("reward")
    verdict = loop.gated(store.get_round(rnd.id))
    assert verdict["reward_version_id"] == reward.id and store.list_runs(kind="ppo") == []
    text, anyway = gate_line(ctx, boss)
    assert text.startswith(f"**PPO did not run in round {rnd.id}.** Reward model {reward.name}: held-out accuracy ")
    assert f"[{verdict['lo']:.2f}, {verdict['hi']:.2f}] on 3 pairs" in text and "rank about" in text
    assert anyway["visible"]

    # 3. "Run PPO anyway": PPO against that reward model (no new one), then the next round
    msg, _, timer, text, anyway = train.run_ppo_anyway(ctx, boss)
    assert f"PPO in round {rnd.id} against {reward.name} (held-out accuracy" in msg and "then the next round" in msg
    assert timer["active"] and not anyway["visible"] and "Reward model data" in text
    (ppo,) = store.list_runs(kind="ppo")
    assert (ppo.inputs["round_id"], ppo.inputs["reward_version_id"]) == (rnd.id, reward.id)
    ctx.jobs.wait_idle(timeout=300)
    rounds = store.list_rounds()
    assert len(rounds) == 2, ([(r.status, r.meta) for r in rounds],
                              [(run.kind, run.status, (run.error or "")[-800:]) for run in store.list_runs()])
    round1, round2 = rounds
    assert round1.status == "done" and round1.meta["last_error"] is None, round1.meta
    assert (round1.reward_version_id, store.get_model_version(round1.new_policy_version_id).parent_id) == \
        (reward.id, start.id)
    assert store.list_model_versions("reward") == [reward] and round2.policy_version_id == round1.new_policy_version_id

    # 4. with no round stopped by the gate there is nothing to run anyway
    with pytest.raises(gr.Error, match="No round is waiting on the reward gate"):
        train.run_ppo_anyway(ctx, boss)
