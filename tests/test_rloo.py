"""RLOO and GRPO, PPO's loop without a critic (PPOConfig.advantage_estimator; pipeline/rollout.py,
pipeline/losses.py `group_advantages`), on tiny random models, CPU fp32. That RLOO raises a learned
reward model's score is tests/test_ppo_learned_reward.py's."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pipeline.__main__ import main as pipeline_main
from pipeline.config import PPOConfig, group_size
from pipeline.losses import group_advantages
from pipeline.rollout import Rollout, kl_shaped_advantages
from pipeline.train_ppo import train
from tests.fixtures_models import PPO_PROMPTS
from tests.test_train_ppo import assert_same_run, run, small_cfg

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- the estimators by hand


def test_leave_one_out_baseline_by_hand():
    """Rewards 1, 2, 3, 6 of one prompt's four responses: each against the mean of the other three."""
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 1.0, -1.0]), 4, "rloo")
    expected = [1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3,  # group 1
                0 - 0 / 3, 0 - 0 / 3, 1 - (-1) / 3, -1 - 1 / 3]  # group 2: its own baseline, not group 1's
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert float(adv[:4].sum()) == pytest.approx(0.0, abs=1e-6)  # a group's advantages sum to 0


def test_grpo_normalises_within_each_group():
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0]), 4, "grpo")
    sd = math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + 0 + (6 - 3) ** 2) / 3)  # Bessel's correction
    torch.testing.assert_close(adv[:4], torch.tensor([-2 / sd, -1 / sd, 0.0, 3 / sd]), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(adv[4:], torch.zeros(4))  # equal rewards: nothing to learn, not a division by 0


def test_group_advantages_refuse_what_is_not_groups():
    with pytest.raises(ValueError, match="k >= 2"):
        group_advantages(torch.ones(6), 4, "rloo")
    with pytest.raises(ValueError, match="k >= 2"):
        group_advantages(torch.ones(4), 1, "rloo")


def test_group_size_defaults_per_estimator():
    assert group_size(PPOConfig()) == 1
    assert group_size(PPOConfig(advantage_estimator="rloo")) == 4
    assert group_size(PPOConfig(advantage_estimator="grpo", samples_per_prompt=8)) == 8


def test_rloo_advantage_is_the_sequence_reward_against_the_others_on_every_token():
    """Two prompts x two responses. Each sequence reward is its score (minus the missing-EOS penalty
    when cut) minus beta times its summed KL; with k = 2 the leave-one-out advantage is r_i - r_j,
    the same on each of the response's tokens, 0 past EOS; no critic, so no returns."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float)
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, 9.0, 9.0], [-1.0, -0.5, 9.0], [-1.0, -1.0, -1.0]])
    ref = torch.full((4, 3), -1.5)
    ro = Rollout(prompts=["a", "a", "b", "b"], sequences=torch.zeros(4, 5, dtype=torch.long),
                 attention_mask=torch.ones(4, 5, dtype=torch.long), response_ids=torch.zeros(4, 3, dtype=torch.long),
                 mask=mask, prompt_length=2, logprobs=logp * mask, ref_logprobs=ref * mask, values=torch.zeros(4, 3),
                 eos=torch.tensor([False, True, True, False]))
    score = torch.tensor([1.0, 0.5, -1.0, 2.0])
    beta = 0.1
    cfg = PPOConfig(advantage_estimator="rloo", samples_per_prompt=2, missing_eos_penalty=1.0)
    adv = kl_shaped_advantages(ro, score, cfg, beta)
    kl_seq = ((logp - ref) * mask).sum(1)  # k1
    reward = score - 1.0 * torch.tensor([1.0, 0.0, 0.0, 1.0]) - beta * kl_seq
    expected = torch.tensor([reward[0] - reward[1], reward[1] - reward[0], reward[2] - reward[3], reward[3] - reward[2]])
    torch.testing.assert_close(adv.advantages, expected[:, None] * mask)
    torch.testing.assert_close(adv.kl_seq, kl_seq)
    assert not adv.returns.any()


# --------------------------------------------------------------------------- runs


def test_a_step_samples_each_prompt_k_times_in_a_row_and_trains_no_critic(tmp_path, ppo_model_cfg, prompts_file):
    rows = run(tmp_path, "rloo", ppo_model_cfg, prompts_file, advantage_estimator="rloo", steps=2, sample_every=1,
               batch_size=8, mini_batch_size=8, micro_batch_size=8)
    out = tmp_path / "rloo"
    for step in (1, 2):  # the sample table shows a step's first 4 episodes: one prompt's group
        prompts = [json.loads(line)["prompt"] for line in (out / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(prompts) == 4 and len(set(prompts)) == 1, prompts
    assert not (out / "checkpoint" / "critic").exists() and (out / "policy").is_dir()
    assert not any(key.startswith("val/") for key in rows[-1])
    assert rows[-1]["objective/kl"] > 0  # the policy moved
    config = json.loads((out / "config.json").read_text())
    assert config["ppo"]["advantage_estimator"] == "rloo" and config["critic_init"] == ""
    # PPO's own run: one sample per prompt, so a step's first four episodes are four prompts
    run(tmp_path, "gae", ppo_model_cfg, prompts_file, steps=1, sample_every=1)
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "gae" / "samples" / "step_1.jsonl").read_text().splitlines()]
    assert sorted(prompts) == sorted(PPO_PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_resume_equals_a_run_never_stopped(tmp_path, ppo_model_cfg, prompts_file, estimator):
    cfg = dict(advantage_estimator=estimator, kl_control="adaptive", init_kl_coef=0.2, kl_target=0.5, kl_horizon=32,
               lr_decay=False, steps=4, lr=3e-2)  # a 2-step run decays as a 4-step one would not
    run(tmp_path, "straight", ppo_model_cfg, prompts_file, **cfg)
    out = tmp_path / "resumed"
    train(small_cfg(**{**cfg, "steps": 2}), ppo_model_cfg, prompts=str(prompts_file), reward="script:count:e",
          out_dir=out)
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and "critic_optim" not in state
    with pytest.raises(ValueError, match="without a critic"):  # a critic-free checkpoint is not PPO's
        train(small_cfg(**{**cfg, "advantage_estimator": "gae"}), ppo_model_cfg, prompts=str(prompts_file),
              reward="script:count:e", out_dir=out, resume=True)
    train(small_cfg(**cfg), ppo_model_cfg, prompts=str(prompts_file), reward="script:count:e", out_dir=out,
          resume=True)
    assert_same_run(tmp_path / "straight", out, ("objective/score", "objective/kl", "kl/beta", "policy/loss", "policy/lr"))


def test_cli_rloo_stage_and_its_errors(tmp_path, prompts_file, tiny_model_dir, capsys):
    common = ["--policy", str(tiny_model_dir), "--device", "cpu", "--reward", "script:count:e", "--prompts",
              str(prompts_file), "--steps", "1", "--batch-size", "8", "--mini-batch-size", "8", "--max-new-tokens", "6"]
    assert pipeline_main(["rloo", *common, "--out", str(tmp_path / "cli")]) == 0
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["ppo"]["advantage_estimator"] == "rloo" and not (tmp_path / "cli" / "checkpoint" / "critic").exists()
    assert "done: policy saved" in capsys.readouterr().out
    assert pipeline_main(["rloo", *common, "--out", str(tmp_path / "k1"), "--samples-per-prompt", "1"]) == 2
    assert "--samples-per-prompt must be >= 2" in capsys.readouterr().err
    assert pipeline_main(["rloo", *common, "--out", str(tmp_path / "k3"), "--samples-per-prompt", "3"]) == 2
    assert "multiple of --samples-per-prompt 3" in capsys.readouterr().err
    assert pipeline_main(["rloo", *common, "--out", str(tmp_path / "w"), "--steps", "2", "--critic-warmup-steps", "1"]) == 2
    assert "no critic to warm up" in capsys.readouterr().err
    assert pipeline_main(["ppo", *common, "--out", str(tmp_path / "x"), "--advantage-estimator", "reinforce"]) == 2
    assert "'gae', 'rloo' or 'grpo'" in capsys.readouterr().err
