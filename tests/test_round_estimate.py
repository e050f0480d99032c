"""The expected round duration (pipeline/orchestrate/estimate.py) and the Train tab's defaults.

- on a real store whose runs were queued, started and finished through the store (the store's
  clock, the `clock` fixture, sets how long each took): per-unit figures from the newest finished
  runs of the same kind and base model, scaled to the settings; failed runs and other models left
  out; the 2-core reference before any run; a DPO round with no DPO run says it cannot tell;
- the Train tab: the estimate handler (and its refusal of annotators, and a bad field), LoRA on/off
  swapping the PPO learning rates, the measured note matching docs/results/round_defaults.md;
- the LoRA-aware learning-rate rule of pipeline/config.py;
- in headless Chromium: opening the Train tab shows the estimate, a setting changes it, and
  switching LoRA off sets the policy LR to full fine-tuning's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gradio as gr
import pytest

from annotate import train
from annotate.context import AppContext, Refused
from pipeline.config import GenerateConfig, ModelConfig, PPOConfig, default_ppo_lr, to_dict, with_ppo_lrs
from pipeline.orchestrate import estimate
from pipeline.orchestrate.steps import LoopSettings
from tests.fixtures_browser import chromium_browser, login, serve  # noqa: F401  (the fixture `browser`)
from tests.helpers import req

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "round_defaults.md"
ROUND_COST = ROOT / "docs" / "results" / "round_cost" / "results.json"
FORM = dict(lora=True, processes=1, epochs=1, rm_lr=5e-5, rm_batch=8, rm_loss="bt", n_prompts=256, steps=20, kl_control="adaptive",
            beta=0.05, kl_target=6.0, ppo_lr=3e-4, critic_lr=1e-4, policy_step="ppo", dpo_loss="sigmoid", dpo_beta=0.1,
            dpo_epochs=1, dpo_lr=5e-5, prompts_per_round=64, k=4, strategy="random")


def finished(store, clock, kind: str, seconds: float, *, config: dict, inputs: dict | None = None,
             outputs: dict | None = None, status: str = "done"):
    """A run taken through the store's lifecycle (queued -> running -> ended) that took `seconds`."""
    run = store.create_run(kind, config=config, inputs=inputs)
    store.update_run(run.id, status="running")
    clock.advance(seconds)
    return store.update_run(run.id, status=status, outputs=outputs)


def ppo_run(store, clock, seconds: float, *, model: str = "default", lora: bool = True, status: str = "done", **ppo):
    return finished(store, clock, "ppo", seconds, status=status,
                    config={"ppo": to_dict(PPOConfig(**ppo)), "model": to_dict(ModelConfig(model=model, lora=lora))})


# --------------------------------------------------------------------------- the estimator


def test_before_any_run_the_round_is_estimated_from_the_reference(store):
    est = estimate.round_estimate(store, LoopSettings())
    assert [p.kind for p in est.parts] == ["train-reward", "ppo", "generate"]
    assert {p.source for p in est.parts} == {"reference"}
    for part in est.parts:
        assert part.seconds == pytest.approx(part.units * estimate.REFERENCE[part.kind])
    # no pairs yet: the reward model is costed on a fully ranked round's pairs, 64 x C(4, 2)
    assert est.parts[0].units == 64 * 6
    assert est.seconds == pytest.approx(sum(p.seconds for p in est.parts))
    text = est.markdown()
    assert "reference measurement on a 2-core CPU" in text and estimate.duration(est.seconds) in text


def test_finished_runs_set_the_figures_scaled_to_the_settings(store, clock):
    # PPO: 4 steps of 16 episodes took 100 s; 20 steps are expected to take 500 s
    ppo_run(store, clock, 100.0, steps=4)
    # ... a failed run, a run on another base model and a full fine-tuning run say nothing about it
    ppo_run(store, clock, 9999.0, steps=4, status="failed")
    ppo_run(store, clock, 7777.0, steps=4, model="some/other-model")
    ppo_run(store, clock, 5555.0, steps=4, lora=False)
    # generate: 32 responses of 64 tokens in 40 s; the round generates 64 x 4 of 64 tokens
    finished(store, clock, "generate", 40.0, config={"args": [], "generate": {"max_new_tokens": 64}},
             outputs={"responses": 32})
    # train-reward: 2 epochs over a 50-pair snapshot in 25 s
    snap = store.record_snapshot("pairs.parquet", "parquet", {"pairs": 50}, {}, "0" * 64)
    finished(store, clock, "train-reward", 25.0, config={"reward": {"epochs": 2, "max_steps": 0}},
             inputs={"snapshot_id": snap.id})

    est = estimate.round_estimate(store, LoopSettings())
    reward, ppo, gen = est.parts
    assert {p.source for p in est.parts} == {"store"}
    assert ppo.seconds == pytest.approx(500.0, rel=1e-3) and ppo.runs == 1
    # (40 s for 32 x 64 tokens; the round: 64 prompts x 4 responses of the default length)
    assert gen.seconds == pytest.approx(40.0 / (32 * 64) * 64 * 4 * GenerateConfig().max_new_tokens, rel=1e-3)
    assert reward.seconds == pytest.approx(25.0 / 100 * 64 * 6, rel=1e-3)  # 0.25 s per pair-epoch
    assert "from this store's 3 finished runs" in est.markdown()

    # fewer steps, shorter responses: the PPO part scales with steps x tokens
    settings = LoopSettings()
    settings.ppo.steps, settings.ppo.max_new_tokens = 10, 24
    # (the 4-step run's rollouts: the default length, the generation's)
    expected = 100.0 * 10 / 4 * 24 / GenerateConfig().max_new_tokens
    assert estimate.round_estimate(store, settings).parts[1].seconds == pytest.approx(expected, rel=1e-3)
    # with LoRA off, the full fine-tuning run is the one that counts
    settings.model.lora = False
    assert estimate.round_estimate(store, settings).parts[1].seconds == pytest.approx(5555.0 / 100.0 * expected, rel=1e-3)


def test_the_newest_runs_count(store, clock):
    ppo_run(store, clock, 1000.0, steps=4)  # an old, slow machine
    for _ in range(estimate.RECENT):
        ppo_run(store, clock, 80.0, steps=4)
    part = estimate.round_estimate(store, LoopSettings()).parts[1]
    assert part.runs == estimate.RECENT and part.seconds == pytest.approx(400.0, rel=1e-3)


def test_a_dpo_round_without_a_dpo_run_says_it_cannot_tell(store, clock):
    settings = LoopSettings(policy_step="dpo")
    text = estimate.round_estimate(store, settings).markdown()
    assert "unknown until a train-dpo job has finished here" in text
    snap = store.record_snapshot("pairs.parquet", "parquet", {"pairs": 40}, {}, "0" * 64)
    finished(store, clock, "train-dpo", 60.0, config={"dpo": {"epochs": 1}}, inputs={"snapshot_id": snap.id})
    est = estimate.round_estimate(store, settings)
    assert est.parts[0].seconds == pytest.approx(60.0 / 40 * 64 * 6, rel=1e-3)
    assert est.seconds is not None and "partly from this store's finished runs" in est.markdown()


def test_max_steps_caps_a_grouped_run_at_its_rankings_pairs(store, clock):
    """A step of a grouped run holds batch_size x grad_accum rankings, each of its pairs (here
    120 pairs of 20 rankings: 6 each); pair by pair, that many pairs."""
    snap = store.record_snapshot("pairs.parquet", "parquet", {"pairs": 120, "rankings": 20}, {}, "0" * 64)
    dpo = {"epochs": 1, "max_steps": 3, "batch_size": 2, "grad_accum": 2}
    for grouped, units in ((True, 3 * 2 * 2 * 6), (False, 3 * 2 * 2)):
        run = finished(store, clock, "train-dpo", 60.0, config={"dpo": {**dpo, "grouped": grouped}},
                       inputs={"snapshot_id": snap.id})
        assert estimate.run_units(store, run) == units
    settings = LoopSettings(policy_step="dpo")  # k = 4: 6 pairs a ranking
    settings.dpo.max_steps = 1
    assert estimate.round_estimate(store, settings).parts[0].units == settings.dpo.batch_size * 6


# --------------------------------------------------------------------------- the Train tab


@pytest.fixture
def ctx(store):
    store.add_annotator("boss", "boss-password", role="admin")
    store.add_annotator("ann", "ann-password")
    return AppContext(store=store, auth=True, data_dir=Path("unused"), jobs=None)


def test_the_tab_shows_the_expected_round_and_follows_the_settings(ctx, clock):
    first = train.round_duration(ctx, train.RoundForm(**FORM), req("boss"))
    assert first.startswith("**Expected round duration: about") and "2-core" in first
    ppo_run(ctx.store, clock, 100.0, steps=4)
    shorter = train.round_duration(ctx, train.RoundForm(**{**FORM, "steps": 4}), req("boss"))
    assert "PPO 4 steps 2 min" in shorter
    bad = train.round_duration(ctx, train.RoundForm(**{**FORM, "k": 1}), req("boss"))
    assert bad.startswith("**Expected round duration:** fix the settings first") and "K responses" in bad
    with pytest.raises(Refused):
        train.round_duration(ctx, train.RoundForm(**FORM), req("ann"))


def test_lora_switches_the_ppo_learning_rates(ctx):
    lora, full = default_ppo_lr(True), default_ppo_lr(False)
    off = train.lora_lrs(ctx, False, lora, default_ppo_lr(True, critic=True), request=req("boss"))
    assert [u["value"] for u in off] == [full, full]
    on = train.lora_lrs(ctx, True, full, full, request=req("boss"))
    assert [u["value"] for u in on] == [lora, default_ppo_lr(True, critic=True)]
    typed = train.lora_lrs(ctx, False, 2e-4, full, request=req("boss"))  # the admin's own value stays
    assert "value" not in typed[0] and "value" not in typed[1]
    with pytest.raises(Refused):
        train.lora_lrs(ctx, False, lora, lora, request=req("ann"))


def test_the_measured_note_is_the_measurement_file():
    """The Train tab's note is the RESULT line of the results page."""
    lines = RESULTS.read_text(encoding="utf-8").splitlines()
    got = dict(re.findall(r"(\w+)=(\S+)", next(x for x in lines if x.startswith("RESULT defaults "))))
    timings = dict(re.findall(r"(\w+)=(\S+)", next(x for x in lines if x.startswith("RESULT timings "))))
    m = estimate.MEASURED_ROUND
    assert got["lora"] == "true" and float(got["lr"]) == m["lr"] == default_ppo_lr(True)
    assert int(got["steps"]) == m["steps"] == PPOConfig().steps and int(got["batch"]) == m["batch"]
    assert float(got["kl_target"]) == m["kl_target"] == PPOConfig().kl_target
    assert float(got["kl_final"]) == pytest.approx(m["kl_final"], rel=1e-3)
    assert float(got["beta_final"]) == pytest.approx(m["beta_final"], rel=1e-3)
    assert float(got["ppo_wall_s"]) / 60 == pytest.approx(m["minutes"], abs=0.5)
    note = train.measured_defaults_note()
    assert f"KL {m['kl_final']:.1f} of target 6" in note and "20 steps" in note


def test_the_reference_figures_are_the_round_cost_measurement():
    """Before a store has runs of its own, each part's seconds per unit are those of the default
    round measured by bench/round_cost.py (its parts' wall time over their units at the defaults)."""
    cost = json.loads(ROUND_COST.read_text(encoding="utf-8"))
    parts, prompts, k = cost["after_parts"], cost["measure_prompts"], cost["k"]
    gen = GenerateConfig()
    assert k == gen.k and cost["threads"] == 2
    assert estimate.REFERENCE["generate"] == pytest.approx(
        parts["generate"]["wall_s"] / estimate.generate_units(prompts * k, gen.max_new_tokens), rel=1e-4)
    assert estimate.REFERENCE["train-reward"] == pytest.approx(
        parts["reward"]["wall_s"] / (prompts * k * (k - 1) // 2), rel=1e-4)
    assert estimate.REFERENCE["ppo"] == pytest.approx(
        parts["ppo (per step)"]["wall_s"] / estimate.ppo_units(vars(PPOConfig(steps=1))), rel=1e-4)


def test_full_fine_tuning_keeps_its_own_learning_rate():
    assert default_ppo_lr(False) == default_ppo_lr(False, critic=True) == 1e-5
    assert default_ppo_lr(True) > 10 * default_ppo_lr(False)
    assert (PPOConfig().lr, PPOConfig().critic_lr) == (0.0, 0.0)  # 0 = the mode's default
    full = with_ppo_lrs(PPOConfig(), policy_lora=False)
    assert (full.lr, full.critic_lr) == (1e-5, 1e-5)
    lora = with_ppo_lrs(PPOConfig(), policy_lora=True)
    assert (lora.lr, lora.critic_lr) == (default_ppo_lr(True), default_ppo_lr(True, critic=True))
    # a rate the user gave is kept, even one equal to the other mode's default
    assert with_ppo_lrs(PPOConfig(lr=3e-4), policy_lora=False).lr == 3e-4
    # the critic's own mode decides its rate (a LoRA reward model as critic under full fine-tuning)
    assert with_ppo_lrs(PPOConfig(), policy_lora=False, critic_lora=True).critic_lr == default_ppo_lr(True, critic=True)


def test_the_form_that_starts_a_round_still_refuses_a_bad_value():
    """The estimate turns a bad field into a line of text; starting the round refuses it by name."""
    with pytest.raises(gr.Error, match="Steps"):
        train.RoundForm(**{**FORM, "steps": 0}).settings(LoopSettings())


# --------------------------------------------------------------------------- in the browser


@pytest.mark.browser
def test_the_train_tab_shows_the_estimate_and_swaps_the_lrs_in_the_browser(store, browser):
    """Opening the Train tab fills the estimate; a setting changes it; LoRA off sets the LRs to 1e-5."""
    store.add_annotator("boss", "boss-password", role="admin")
    shipped = estimate.round_estimate(store, LoopSettings())  # the reference figures: no runs yet
    two_steps = LoopSettings()
    two_steps.ppo.steps = 2
    ppo_two = next(p for p in estimate.round_estimate(store, two_steps).parts if p.kind == "ppo")
    with serve(AppContext(store=store, auth=True)) as url:
        page = login(browser, url, "boss", "boss-password")
        page.get_by_role("tab", name="Train").click()
        page.wait_for_selector(f"#rl-round-eta :text('Expected round duration: about {estimate.duration(shipped.seconds)}')",
                               timeout=20_000)
        assert "KL 7.2 of target 6 nats in 20 steps" in page.locator("#rl-ppo-defaults").inner_text()
        assert "The KL reference is the base model" in page.locator("#rl-ppo-intro").inner_text()
        steps = page.get_by_label("Steps", exact=True)
        steps.fill("2")
        steps.press("Enter")
        page.wait_for_selector(f"#rl-round-eta :text('{ppo_two.what} {estimate.duration(ppo_two.seconds)}')",
                               timeout=20_000)
        page.get_by_label("LoRA adapters", exact=False).uncheck()
        policy_lr = page.get_by_label("Policy LR", exact=True)
        page.wait_for_function("el => Number(el.value) === 1e-5", arg=policy_lr.element_handle(), timeout=20_000)
        page.close()
