"""PPO trainer (pipeline/train_ppo.py, pipeline/rollout.py) on tiny random models, CPU fp32.

The tiny model's logits are bounded by its random lm_head (hidden 32, RMS-normed), so LoRA also
targets lm_head here; otherwise no policy could concentrate probability on any token.
"""

from __future__ import annotations

import dataclasses
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.config import ModelConfig, PPOConfig, default_ppo_lr
from pipeline.models import load_scalar_model
from pipeline.saving import save_scalar_model
from pipeline.policy import causal_lm_logits, load_policy, make_reference
from pipeline.ppo_state import lr_factor
from pipeline.rollout import Rollout, kl_shaped_advantages, rollout_forwards
from pipeline.sampling import sample
from pipeline.scoring import make_reward
from pipeline.text import encode_prompts
from pipeline.train_ppo import main, train
from tests.fixtures_models import PPO_PROMPTS

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = PPO_PROMPTS
METRIC_KEYS = [
    "objective/score", "objective/kl", "objective/rlhf_reward", "objective/entropy", "policy/loss",
    "policy/clipfrac", "policy/approxkl", "policy/ratio_mean", "val/loss", "val/clipfrac", "val/explained_var",
    "kl/beta", "gen/length_mean", "gen/eos_rate", "time/rollout", "time/update", "time/episodes_per_s",
]


def small_cfg(**overrides) -> PPOConfig:
    base = dict(steps=2, batch_size=16, mini_batch_size=8, micro_batch_size=8, max_new_tokens=16, lr=1e-2,
                critic_lr=1e-2, temperature=1.0, kl_control="fixed", init_kl_coef=0.2, sample_every=0)
    return PPOConfig(**{**base, **overrides})


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(tmp_path, name, model_cfg, prompts_file, reward="script:count:e", **overrides) -> list[dict]:
    out = tmp_path / name
    train(small_cfg(**overrides), model_cfg, prompts=str(prompts_file), reward=reward, out_dir=out)
    return read_metrics(out)


def mean(rows, key, sl):
    vals = [r[key] for r in rows[sl]]
    return sum(vals) / len(vals)


# --------------------------------------------------------------------------- rollout pieces


def test_scripted_rewards_count_only_real_response_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    e_ids = tok(" the the", add_special_tokens=False)["input_ids"]
    response = torch.tensor([e_ids + [tok.eos_token_id] + e_ids])  # (1, R): 'the' after EOS too
    mask = torch.tensor([[1] * (len(e_ids) + 1) + [0] * len(e_ids)])
    count, rm = make_reward("script:count:the", tok, ModelConfig())
    assert rm is None
    assert count(response, mask, response, mask).tolist() == [2.0]  # not 4: post-EOS text is ignored
    length, _ = make_reward("script:length", tok, ModelConfig())
    assert length(response, mask, response, mask).tolist() == [float(len(e_ids))]  # EOS not counted
    with pytest.raises(ValueError, match="unknown script"):
        make_reward("script:nope", tok, ModelConfig())
    with pytest.raises(ValueError, match="no such folder"):
        make_reward("/nonexistent/reward-model", tok, ModelConfig())


def test_oracle_reward_scores_the_decoded_response_normalised(tiny_tokenizer):
    """'oracle:norm=MEAN,STD:ORACLE' gives (the simulated annotators' score - MEAN) / STD of each
    prompt and decoded response: rule:contains counts the word in the text, not after EOS."""
    tok = tiny_tokenizer
    ids = tok(" the dog and the fox", add_special_tokens=False)["input_ids"]
    response = torch.tensor([ids + [tok.eos_token_id] + ids, ids[:2] + [tok.pad_token_id] * (len(ids) * 2 - 1)])
    mask = torch.tensor([[1] * (len(ids) + 1) + [0] * len(ids), [1, 1] + [0] * (len(ids) * 2 - 1)])
    prompts = ["Tell me a story.", [{"role": "user", "content": "A story?"}]]  # text and chat prompts
    score, rm = make_reward("oracle:norm=1,0.5:rule:contains:the", tok, ModelConfig())
    assert rm is None
    assert score(response, mask, response, mask, prompts=prompts).tolist() == [(2 - 1) / 0.5, (1 - 1) / 0.5]
    raw, _ = make_reward("oracle:rule:contains:the", tok, ModelConfig())  # no norm=: its own units
    assert raw(response, mask, response, mask, prompts=prompts).tolist() == [2.0, 1.0]
    for spec, problem in [("oracle:norm=1:rule:length", "MEAN,STD"), ("oracle:norm=1,0:rule:length", "STD > 0"),
                          ("oracle:norm=nan,1:rule:length", "MEAN must be a number"),
                          ("oracle:", "name the oracle"), ("oracle:nope", "unknown oracle")]:
        with pytest.raises(ValueError, match=problem):
            make_reward(spec, tok, ModelConfig())
    with pytest.raises(ValueError, match="pass prompts"):
        score(response, mask, response, mask)

def _rollout(values_tail: float, logp_tail: float) -> Rollout:
    """B=2, R=5: row 0 ends with EOS at t=2, row 1 hits the length limit. Tails hold garbage."""
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    logprobs = torch.tensor([[-1.0, -2, -0.5, logp_tail, logp_tail], [-1, -1, -1, -1, -1]])
    ref = torch.tensor([[-1.5, -2, -1.0, 3 * logp_tail, 0], [-1, -2, -1, -1, -0.5]])
    values = torch.tensor([[0.1, 0.2, 0.3, values_tail, values_tail], [0.0, 0.1, 0.2, 0.3, 0.4]])
    return Rollout(prompts=["a", "b"], sequences=torch.zeros(2, 7, dtype=torch.long),
                   attention_mask=torch.ones(2, 7, dtype=torch.long), response_ids=torch.zeros(2, 5, dtype=torch.long),
                   mask=mask, prompt_length=2, logprobs=logprobs, ref_logprobs=ref, values=values,
                   eos=torch.tensor([True, False]))


def test_post_eos_positions_are_masked_in_rewards_and_advantages():
    cfg = PPOConfig(missing_eos_penalty=1.0, kl_estimator="k1", gamma=1.0, lam=0.95)
    score = torch.tensor([2.0, 3.0])
    a = kl_shaped_advantages(_rollout(values_tail=50.0, logp_tail=-9.0), score, cfg, beta=0.1)
    b = kl_shaped_advantages(_rollout(values_tail=-7.0, logp_tail=4.0), score, cfg, beta=0.1)
    for x in (a, b):
        assert torch.all(x.kl[0, 3:] == 0) and torch.all(x.rewards[0, 3:] == 0)
        assert torch.all(x.advantages[0, 3:] == 0)
    # garbage past EOS changes nothing at all
    for field in ("kl", "rewards", "advantages", "returns", "score"):
        assert torch.allclose(getattr(a, field), getattr(b, field)), field
    # hand-computed: kl = logp - ref; the score sits on the EOS token; no EOS -> penalty 1.0
    assert torch.allclose(a.kl[0, :3], torch.tensor([0.5, 0.0, 0.5]))
    assert a.score.tolist() == [2.0, 2.0]
    assert a.rewards[0, 2].item() == pytest.approx(-0.1 * 0.5 + 2.0)
    assert a.rewards[1, 4].item() == pytest.approx(-0.1 * (-1 + 0.5) + 2.0)
    assert a.kl_seq.tolist() == pytest.approx([1.0, 0.0 + 1 + 0 + 0 - 0.5])


def test_critic_targets_at_lambda_one_are_the_rewards_to_go_whatever_the_values():
    """Decoupled GAE: with critic_lam = 1 (gamma 1) the critic's target at each token is the sum of
    the rewards from there on, however far off the values are; the policy's advantages keep lam."""
    cfg = PPOConfig(missing_eos_penalty=0.0, gamma=1.0, lam=0.95, critic_lam=1.0)
    score = torch.tensor([2.0, 3.0])
    off = _rollout(values_tail=0.0, logp_tail=0.0)
    far = _rollout(values_tail=0.0, logp_tail=0.0)
    far.values[:] = -40.0 * far.mask  # a critic far off at every real token
    a, b = (kl_shaped_advantages(r, score, cfg, beta=0.1) for r in (off, far))
    to_go = a.rewards.flip(1).cumsum(1).flip(1) * off.mask  # (B, R) rewards to go
    for x in (a, b):
        torch.testing.assert_close(x.returns, to_go)
    coupled = kl_shaped_advantages(off, score, PPOConfig(missing_eos_penalty=0.0, gamma=1.0, lam=0.95), beta=0.1)
    torch.testing.assert_close(a.advantages, coupled.advantages)  # the policy's side is unchanged
    assert not torch.allclose(coupled.returns, to_go)


def test_reward_clip_then_penalty():
    cfg = PPOConfig(missing_eos_penalty=0.5, reward_clip=1.0)
    out = kl_shaped_advantages(_rollout(0.0, 0.0), torch.tensor([5.0, -5.0]), cfg, beta=0.0)
    assert out.score.tolist() == [1.0, -1.5]


def test_packed_rollout_forwards_equal_full_forward_and_sampling_logprobs(ppo_model_cfg):
    torch.manual_seed(0)
    policy, tok = load_policy(ppo_model_cfg)
    critic, _ = load_scalar_model(ppo_model_cfg.model, kind="critic", cfg=ppo_model_cfg)
    with torch.no_grad():  # move the adapter off zero so policy and reference differ
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    reference = make_reference(policy)
    ids, am = encode_prompts(tok, PROMPTS * 2)
    cfg = PPOConfig(max_new_tokens=12, temperature=0.9)
    sb = sample(policy, ids, am, cfg, tok, draws=torch.Generator().manual_seed(0))
    mask = sb.response_mask.float()
    ref, old, values = rollout_forwards(policy, reference, critic, sb, dataclasses.replace(cfg, forward_batch_size=3),
                                        need_old=True, autocast=contextlib.nullcontext)
    P, R = sb.prompt_length, sb.response_ids.shape[1]
    with torch.no_grad():
        full = torch.log_softmax(causal_lm_logits(policy, sb.sequences, sb.attention_mask)[:, P - 1 : -1] / 0.9, -1)
        full = full.gather(2, sb.response_ids[..., None]).squeeze(2)  # (B, R)
        full_ref = torch.log_softmax(reference(sb.sequences, sb.attention_mask)[:, P - 1 : -1] / 0.9, -1)
        full_ref = full_ref.gather(2, sb.response_ids[..., None]).squeeze(2)
        full_values = critic(sb.sequences, sb.attention_mask)[:, P - 1 : P - 1 + R]
    m = mask.bool()
    assert torch.allclose(old[m], full[m], atol=1e-5)  # packing changes nothing but rounding
    assert torch.allclose(ref[m], full_ref[m], atol=1e-5)
    assert torch.allclose(values[m], full_values[m], atol=1e-5)
    assert torch.allclose(sb.logprobs[m], full[m], atol=1e-4)  # pi_old from sampling = from a forward
    assert (old[m] - ref[m]).abs().max() > 1e-2  # and it is not the reference


def test_critic_head_scores_in_fp32_under_bf16_autocast(ppo_model_cfg):
    # as the reward head: the backbone under autocast, the head in fp32 on the fp32 hidden state
    from pipeline.packing import hidden_states, pack_responses
    from pipeline.rollout import critic_values

    critic, tok = load_scalar_model(ppo_model_cfg.model, kind="critic", cfg=ppo_model_cfg)
    with torch.no_grad():
        critic.head.weight.normal_(0, 3.0)
        critic.head.bias.fill_(7.3)
    ids, am = encode_prompts(tok, PROMPTS)
    response = torch.randint(3, 300, (len(PROMPTS), 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(len(PROMPTS), 5)
    seq, seq_mask = torch.cat([ids, response], 1), torch.cat([am, mask.long()], 1)
    pr = pack_responses(seq, seq_mask, response, mask, ids.shape[1], 1.0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        values = critic_values(critic, pr)
        hidden = hidden_states(critic.backbone, pr.packed)[pr.index]
        in_bf16 = critic.head(hidden.float()).squeeze(-1)  # what the head gave before: bf16
    expected = pr.scatter(critic.head(hidden.float()).squeeze(-1))  # outside autocast: fp32
    assert values.dtype == torch.float32 and in_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)
    assert (in_bf16.float() - expected[mask.bool()]).abs().max() > 1e-3  # bf16 would have rounded


def other_family_tokenizer():
    """A second tiny tokenizer: another vocabulary and another chat template (no ChatML)."""
    from tests.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer(vocab_size=290)
    tok.chat_template = ("{% for m in messages %}{{ '### ' + m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '### assistant: ' }}{% endif %}")
    return tok


@pytest.mark.parametrize("family", ["same", "other"])
def test_ppo_reward_is_score_texts_of_the_decoded_response_ended_or_cut(tmp_path, ppo_model_cfg, family):
    """PPO's reward of a rollout is exactly what evaluation, best-of-n and the reward model's
    training see: the prompt and the decoded response + EOS (score_texts), for a response that
    ended with EOS and for one cut at the length limit alike; a reward model of another family
    gets its own chat template, never the policy's markup."""
    from pipeline.scoring import load_reward_model, retokenise, score_texts
    from pipeline.text import encode_response, prompt_token_ids
    from tests.tiny import build_tiny_model

    policy, tok = load_policy(ppo_model_cfg)
    rm_tok = other_family_tokenizer() if family == "other" else tok
    assert (rm_tok.get_vocab() != tok.get_vocab()) == (family == "other")
    build_tiny_model(rm_tok, seed=3).save_pretrained(tmp_path / "base")
    rm_tok.save_pretrained(tmp_path / "base")
    rm, _ = load_scalar_model(str(tmp_path / "base"), kind="reward", cfg=dataclasses.replace(ppo_model_cfg, lora=False))
    rm_dir = save_scalar_model(rm, rm_tok, tmp_path / "rm")

    ids, am = encode_prompts(tok, PROMPTS)
    sb = sample(policy, ids, am, PPOConfig(max_new_tokens=24, temperature=1.0), tok, num_samples=4,
                draws=torch.Generator().manual_seed(1))
    prompts = [PROMPTS[i] for i in sb.prompt_index.tolist()]
    assert {"eos", "length"} == set(sb.finish_reason)
    texts = [tok.decode(r[m.bool()], skip_special_tokens=True) for r, m in zip(sb.response_ids, sb.response_mask)]
    rm_ids, rm_mask = retokenise(tok, rm_tok, prompts, sb.response_ids, sb.response_mask)
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        expected = prompt_token_ids(rm_tok, prompt) + encode_response(rm_tok, text)  # EOS, cut or not
        assert rm_ids[i, : int(rm_mask[i].sum())].tolist() == expected
        if family == "other":
            decoded = rm_tok.decode(expected)
            assert decoded.startswith("### system: ") and "<|im_start|>" not in decoded and "assistant\n" not in decoded

    score_fn, _ = make_reward(str(rm_dir), tok, ppo_model_cfg)
    mask = sb.response_mask.float()
    scores = score_fn(sb.sequences, sb.attention_mask, sb.response_ids, mask, prompts=prompts)
    by_text = score_texts(load_reward_model(str(rm_dir), ppo_model_cfg)[0], rm_tok, prompts, texts)
    torch.testing.assert_close(scores, torch.tensor(by_text), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="pass prompts"):
        score_fn(sb.sequences, sb.attention_mask, sb.response_ids, mask)


# --------------------------------------------------------------------------- the loop


def test_ratio_is_pi_theta_over_pi_old(tmp_path, ppo_model_cfg, prompts_file):
    """On the first minibatch of every step pi_theta == pi_old, so the ratio is 1, although the
    policy has moved away from the reference (KL > 0): a ratio against pi_ref would not be 1."""
    rows = run(tmp_path, "fwd", ppo_model_cfg, prompts_file, steps=3, old_logprobs="forward", lr=5e-2)
    for r in rows:
        assert r["policy/ratio_first"] == pytest.approx(1.0, abs=1e-6)
    assert rows[-1]["objective/kl"] > 0.05
    assert any(abs(r["policy/ratio_mean"] - 1) > 1e-4 for r in rows)  # later minibatches do move
    rows = run(tmp_path, "smp", ppo_model_cfg, prompts_file, steps=2, old_logprobs="sample", lr=5e-2)
    for r in rows:
        assert r["policy/ratio_first"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_score_rises_with_the_kl_penalty_and_kl_runs_away_without_it(tmp_path, ppo_model_cfg, prompts_file):
    """About 10 s on an idle 2-core CPU: 2 x 30 PPO steps of 16 episodes on the tiny model."""
    penalised = run(tmp_path, "beta", ppo_model_cfg, prompts_file, steps=30, kl_control="fixed", init_kl_coef=0.2)
    free = run(tmp_path, "free", ppo_model_cfg, prompts_file, steps=30, kl_control="fixed", init_kl_coef=0.0,
               lr=3e-2)
    first, last = slice(0, 5), slice(-5, None)
    # the scripted reward (+1 per 'e' in the response) is learnt clearly ...
    assert mean(penalised, "objective/score", last) > mean(penalised, "objective/score", first) + 1.5
    # ... while the KL penalty keeps the policy near the reference: at every step under half of
    # where beta = 0 ends (measured: at most 19.8 nats against 89.8)
    assert max(r["objective/kl"] for r in penalised) < 0.5 * mean(free, "objective/kl", last)
    # with beta = 0 and a higher learning rate the policy runs away from the reference
    assert mean(free, "objective/kl", last) > 30
    assert mean(free, "objective/kl", last) > 3 * mean(penalised, "objective/kl", last)
    for rows in (penalised, free):
        assert all(set(METRIC_KEYS) <= set(r) for r in rows)
        assert all(r["policy/ratio_first"] == pytest.approx(1.0, abs=1e-4) for r in rows)


def test_critic_warmup_trains_the_critic_alone_then_the_policy(tmp_path, ppo_model_cfg, prompts_file):
    """The first critic_warmup_steps update only the critic: the policy stays the reference (KL 0),
    beta and the policy's learning rate wait; then the policy trains from its full rate."""
    lr = 5e-2
    rows = run(tmp_path, "warm", ppo_model_cfg, prompts_file, steps=4, critic_warmup_steps=2, lr=lr,
               kl_control="adaptive", init_kl_coef=0.2, kl_target=10.0, kl_horizon=16)
    frozen, trained = rows[:2], rows[2:]
    for r in frozen:
        assert r["objective/kl"] == pytest.approx(0.0, abs=1e-4)  # sampled by the untouched policy
        assert r["policy/lr"] == 0.0 and "policy/loss" not in r and "policy/grad_norm" not in r
        assert r["kl/beta"] == r["kl/beta_next"] == 0.2 and r["val/loss"] > 0
        assert r["val/clipfrac"] == 0.0  # fitted plainly while the policy stands still
    assert frozen[1]["val/value_mean"] != frozen[0]["val/value_mean"]  # the critic did train
    assert trained[0]["policy/lr"] == lr and trained[1]["policy/lr"] == pytest.approx(lr / 2)
    assert trained[0]["kl/beta_next"] != 0.2 and trained[1]["objective/kl"] > 0.01
    with pytest.raises(ValueError, match="critic-warmup-steps 4"):
        train(small_cfg(steps=4, critic_warmup_steps=4), ppo_model_cfg, prompts=str(prompts_file),
              reward="script:count:e", out_dir=tmp_path / "all_warmup")


def test_policy_lr_warmup_ramps_its_first_steps_then_decays(tmp_path, ppo_model_cfg, prompts_file):
    """--lr-warmup-steps N: the policy's i-th training step (after the critic's warm-up) at i / N of
    its rate, times the linear decay; the critic's rate is not ramped."""
    assert [lr_factor(4, True, 2)(s) for s in range(4)] == [0.5, 0.75, 0.5, 0.25]
    assert [lr_factor(4, False, 3)(s) for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    lr = 5e-2
    rows = run(tmp_path, "ramp", ppo_model_cfg, prompts_file, steps=3, critic_warmup_steps=1, lr=lr,
               lr_warmup_steps=2, lr_decay=False)
    assert [r["policy/lr"] for r in rows] == pytest.approx([0.0, lr / 2, lr])
    assert rows[0]["val/lr"] == rows[2]["val/lr"] > 0
    with pytest.raises(ValueError, match="lr-warmup-steps 3"):
        train(small_cfg(steps=3, critic_warmup_steps=1, lr_warmup_steps=3), ppo_model_cfg, prompts=str(prompts_file),
              reward="script:count:e", out_dir=tmp_path / "too_long")


def test_critic_head_zero_starts_every_value_at_zero_then_learns(tmp_path, ppo_model_cfg, prompts_file):
    """--critic-head zero: the first rollout's values are 0 at every token (the head's weight and
    bias zeroed, whatever model the critic comes from), and the critic moves from there."""
    rows = run(tmp_path, "zero", ppo_model_cfg, prompts_file, steps=2, critic_warmup_steps=1, critic_head="zero")
    assert rows[0]["val/value_mean"] == 0.0 and rows[1]["val/value_mean"] != 0.0
    kept = run(tmp_path, "kept", ppo_model_cfg, prompts_file, steps=1, critic_head="reward")
    assert kept[0]["val/value_mean"] != 0.0  # the base model's fresh head, not zeroed
    with pytest.raises(ValueError, match="critic-head 'ones'"):
        train(small_cfg(critic_head="ones"), ppo_model_cfg, prompts=str(prompts_file), reward="script:count:e",
              out_dir=tmp_path / "bad")


@pytest.mark.slow
def test_resume_restores_optimiser_and_kl_state(tmp_path, ppo_model_cfg, prompts_file):
    cfg = dict(kl_control="adaptive", init_kl_coef=0.2, kl_target=0.5, kl_horizon=32, lr_decay=False,
               steps=4, lr=3e-2)
    run(tmp_path, "straight", ppo_model_cfg, prompts_file, **cfg)
    out = tmp_path / "resumed"
    train(small_cfg(**{**cfg, "steps": 2}), ppo_model_cfg, prompts=str(prompts_file), reward="script:count:e",
          out_dir=out)
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and state["kl"]["value"] != 0.2
    assert all("exp_avg" in s for s in state["policy_optim"]["state"].values())
    with pytest.raises(ValueError, match="--resume"):
        train(small_cfg(**cfg), ppo_model_cfg, prompts=str(prompts_file), reward="script:count:e", out_dir=out)
    train(small_cfg(**cfg), ppo_model_cfg, prompts=str(prompts_file), reward="script:count:e", out_dir=out,
          resume=True)
    assert_same_run(tmp_path / "straight", out, ("objective/score", "objective/kl", "kl/beta", "policy/loss", "val/loss"))


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False])
def test_a_stop_inside_an_update_saves_a_step_end_and_resume_equals_never_stopped(
        tmp_path, ppo_model_cfg, prompts_file, monkeypatch, lora):
    """SIGTERM during step 2's update, after its first micro-batch (no periodic checkpoints): with
    LoRA the stop is seen after that optimiser step, which is undone, and the checkpoint is step 1's
    end; with full fine-tuning (no copy kept) the update runs to its end and the checkpoint is
    step 2's. Either way the resumed run is the run never stopped."""
    from pipeline import ppo_update
    from pipeline.rundir import Cancelled

    model_cfg = dataclasses.replace(ppo_model_cfg, lora=lora)
    lr = 3e-2 if lora else 1e-3
    cfg = dict(steps=3, save_every=0, lr_decay=False, lr=lr, critic_lr=lr)
    train(small_cfg(**cfg), model_cfg, prompts=str(prompts_file), reward="script:count:e",
          out_dir=tmp_path / "straight")
    backward, seen = ppo_update.micro_batch_backward, []

    def signalled_in_step_2(ppo, *args, **kwargs):
        backward(ppo, *args, **kwargs)
        seen.append(ppo.step)
        if seen.count(1) == 1 and ppo.step == 1:  # step 2's first micro-batch
            os.kill(os.getpid(), signal.SIGTERM)  # the job runner's cancel

    monkeypatch.setattr(ppo_update, "micro_batch_backward", signalled_in_step_2)
    out = tmp_path / "stopped"
    with pytest.raises(Cancelled):
        train(small_cfg(**cfg), model_cfg, prompts=str(prompts_file), reward="script:count:e", out_dir=out)
    per_step = seen.count(0)  # micro-batches of a whole update
    assert seen.count(1) == (1 if lora else per_step) and 2 not in seen
    done = 1 if lora else 2
    assert torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)["step"] == done
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "cancelled" and status["step"] == done
    monkeypatch.undo()
    train(small_cfg(**cfg), model_cfg, prompts=str(prompts_file), reward="script:count:e", out_dir=out,
          resume=True)
    assert_same_run(tmp_path / "straight", out, ("objective/score", "objective/kl", "policy/loss", "val/loss"))


def assert_same_run(straight: Path, resumed: Path, keys: tuple[str, ...]) -> None:
    """A run stopped and resumed logged what the run never stopped logged, step by step, and
    saved the same adapter: continuing == never stopping (same prompts, beta, updates)."""
    from safetensors.torch import load_file

    a_rows, b_rows = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b_rows] == [r["step"] for r in a_rows]
    for a, b in zip(a_rows, b_rows):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    files = sorted(p.name for p in (straight / "policy").glob("*.safetensors"))  # the adapter, or full weights
    assert files and files == sorted(p.name for p in (resumed / "policy").glob("*.safetensors"))
    for name in files:
        wa, wb = load_file(str(straight / "policy" / name)), load_file(str(resumed / "policy" / name))
        assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa), name


def test_reference_is_unchanged_by_training(tmp_path, ppo_model_cfg, prompts_file, tiny_model_dir):
    rows = run(tmp_path, "ref", ppo_model_cfg, prompts_file, steps=3, lr=5e-2)
    assert rows[-1]["objective/kl"] > 0.05
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    trained, tok = load_policy(ppo_model_cfg, adapter_path=tmp_path / "ref" / "policy")
    ids, am = encode_prompts(tok, PROMPTS)
    with torch.no_grad():
        ref_logits = make_reference(trained)(ids, am)
        assert torch.equal(ref_logits, causal_lm_logits(start, ids, am))  # bit for bit the start
        assert not torch.allclose(causal_lm_logits(trained, ids, am), ref_logits, atol=1e-3)
    meta = json.loads((tmp_path / "ref" / "policy" / "model_meta.json").read_text())
    assert meta["parent"] == str(Path(tiny_model_dir).resolve()) and meta["reward_model"] == "script:count:e"


def test_full_fine_tuning_keeps_a_frozen_reference(tmp_path, tiny_model_dir, prompts_file):
    cfg = ModelConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32", lora=False)
    rows = run(tmp_path, "full", cfg, prompts_file, steps=3, lr=3e-2)
    assert rows[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)
    assert rows[-1]["objective/kl"] > 0.05  # the policy moved, the reference did not follow
    assert (tmp_path / "full" / "policy" / "model.safetensors").is_file()
    # resuming a fully fine-tuned run reloads its weights into the policy (the reference stays the start)
    train(small_cfg(steps=4, lr=3e-2), cfg, prompts=str(prompts_file), reward="script:count:e",
          out_dir=tmp_path / "full", resume=True)
    resumed = read_metrics(tmp_path / "full")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and resumed[-1]["objective/kl"] > 0.05
    # the next round starts from that policy, and its reference is still the base model (as with
    # LoRA, and as in DPO): KL is measured from the first step, not reset to 0
    train(small_cfg(steps=1, lr=1e-9), cfg, prompts=str(prompts_file), reward="script:count:e",
          out_dir=tmp_path / "round2", policy=str(tmp_path / "full" / "policy"))
    assert read_metrics(tmp_path / "round2")[0]["objective/kl"] > 0.05


def test_cli_with_reward_model_ptx_and_sample_table(tmp_path, ppo_model_cfg, prompts_file, tiny_model_dir):
    rm, tok = load_scalar_model(str(tiny_model_dir), kind="reward", cfg=ppo_model_cfg)
    rm_dir = save_scalar_model(rm, tok, tmp_path / "rm")
    ptx = tmp_path / "ptx.jsonl"
    ptx.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["The quick brown fox.", "Bake bread daily."]))
    out = tmp_path / "cli"
    argv = ["--policy", str(tiny_model_dir), "--reward", str(rm_dir), "--prompts", str(prompts_file),
            "--out", str(out), "--steps", "2", "--batch-size", "8", "--mini-batch-size", "4",
            "--micro-batch-size", "2", "--max-new-tokens", "8", "--sample-every", "1", "--ptx-coef", "0.1",
            "--ptx-data", str(ptx), "--entropy-coef", "0.01", "--kl-estimator", "k3", "--whiten-rewards", "true",
            "--reward-clip", "3", "--kl-control", "x1.5", "--device", "cpu", "--lora-r", "4", "--lora-alpha", "8"]
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["critic_init"] == str(rm_dir)  # the critic starts from the reward model
    # both LoRA models of the policy's base: their frozen weights are the policy's (models.share_frozen_weights)
    assert config["shared_base_bytes"]["reward"] == config["shared_base_bytes"]["critic"] > 0
    assert config["ppo"]["lr"] == default_ppo_lr(True)  # LoRA (the default) keeps the LoRA rate
    assert config["ppo"]["critic_lr"] == default_ppo_lr(True, critic=True)  # a LoRA critic's own rate
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert set(METRIC_KEYS) <= set(r)
        assert all(torch.isfinite(torch.tensor(float(v))) for v in r.values())
        assert "ptx/loss" in r and "policy/entropy" in r
    samples = [json.loads(line) for line in (out / "samples" / "step_2.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "response", "score", "kl", "finish_reason"} <= set(samples[0])
    # the table's format: a step's first 4 episodes, these fields only, written whole (no leftover file)
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]
    prompts = {json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines()}
    assert len(samples) == 4
    for row in samples:
        assert set(row) == {"prompt", "response", "score", "kl", "tokens", "finish_reason"}
        assert row["prompt"] in prompts and isinstance(row["response"], str)
        assert 1 <= row["tokens"] <= 8 and row["finish_reason"] in ("eos", "length")
        assert row["score"] == round(row["score"], 4) and row["kl"] == round(row["kl"], 4)
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "done" and status["step"] == 2 and status["progress"] == 1.0
    meta = json.loads((out / "policy" / "model_meta.json").read_text())
    assert meta["reward_model"] == str(Path(rm_dir).resolve())
    assert {"policy", "critic", "trainer_state.pt"} <= set(os.listdir(out / "checkpoint"))


def test_cli_full_fine_tuning_takes_its_own_learning_rates_unless_given(tmp_path, prompts_file, tiny_model_dir):
    common = ["--policy", str(tiny_model_dir), "--reward", "script:count:e", "--prompts", str(prompts_file),
              "--steps", "1", "--batch-size", "4", "--mini-batch-size", "4", "--micro-batch-size", "4",
              "--max-new-tokens", "4", "--device", "cpu", "--lora", "false", "--report-to", "none"]
    assert main(common + ["--out", str(tmp_path / "default")]) == 0
    ppo = json.loads((tmp_path / "default" / "config.json").read_text())["ppo"]
    assert (ppo["lr"], ppo["critic_lr"]) == (default_ppo_lr(False), default_ppo_lr(False, critic=True))
    # a rate given is kept, even the one LoRA would default to
    assert main(common + ["--out", str(tmp_path / "given"), "--lr", str(default_ppo_lr(True))]) == 0
    assert json.loads((tmp_path / "given" / "config.json").read_text())["ppo"]["lr"] == default_ppo_lr(True)


def test_cli_rejects_bad_input_with_clear_errors(tmp_path, prompts_file, tiny_model_dir, capsys):
    common = ["--policy", str(tiny_model_dir), "--device", "cpu", "--out", str(tmp_path / "bad")]
    assert main(common + ["--reward", "script:length", "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(common + ["--reward", "script:length", "--prompts", str(prompts_file), "--batch-size", "6"]) == 2
    assert "multiple of --mini-batch-size" in capsys.readouterr().err
    assert main(common + ["--reward", "nope/rm", "--prompts", str(prompts_file)]) == 2
    assert "nope/rm" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    assert main(common + ["--reward", "script:length", "--prompts", str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err
    status = json.loads((tmp_path / "bad" / "status.json").read_text())
    assert status["state"] == "failed" and "line 2" in status["error"]


def test_cli_resume_with_other_prompts_reward_model_or_options_is_refused_naming_it(
        tmp_path, ppo_model_cfg, prompts_file, tiny_model_dir, capsys):
    """`ppo --resume` continues the run its checkpoint started or none: other prompts, another
    reward model or another option is refused before anything loads (exit code 2, the run left as
    it was) with a message naming what changed; the run's own inputs with a larger --steps go on."""
    rm, tok = load_scalar_model(str(tiny_model_dir), kind="reward", cfg=ppo_model_cfg)
    rm_dir, other_rm = save_scalar_model(rm, tok, tmp_path / "rm"), save_scalar_model(rm, tok, tmp_path / "rm-2")
    other_prompts = tmp_path / "other.jsonl"
    other_prompts.write_text("".join(json.dumps({"prompt": p + " Briefly."}) + "\n" for p in PPO_PROMPTS))
    out = tmp_path / "run"
    common = ["--policy", str(tiny_model_dir), "--out", str(out), "--batch-size", "4", "--mini-batch-size", "4",
              "--micro-batch-size", "4", "--max-new-tokens", "4", "--device", "cpu", "--lora-r", "4",
              "--lora-alpha", "8", "--report-to", "none"]
    own = ["--reward", str(rm_dir), "--prompts", str(prompts_file)]
    assert main(common + own + ["--steps", "1"]) == 0
    capsys.readouterr()
    state, metrics = (out / "checkpoint" / "trainer_state.pt").read_bytes(), (out / "metrics.jsonl").read_text()
    refused = [(["--reward", str(rm_dir), "--prompts", str(other_prompts)], "prompts_sha256"),
               (["--reward", str(other_rm), "--prompts", str(prompts_file)], "reward_model"),
               (own + ["--lr", "0.005"], "ppo_options.lr"),
               (own + ["--kl-control", "x1.5"], "ppo_options.kl_control")]
    for changed, named in refused:
        assert main(common + changed + ["--steps", "2", "--resume"]) == 2, named
        err = capsys.readouterr().err
        assert named in err and err.startswith("error: "), err
        assert (out / "checkpoint" / "trainer_state.pt").read_bytes() == state
        assert (out / "metrics.jsonl").read_text() == metrics
        assert json.loads((out / "status.json").read_text())["state"] == "done"
    assert main(common + own + ["--steps", "2", "--resume"]) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_finishes(tmp_path, prompts_file, tiny_model_dir):
    out = tmp_path / "job"
    args = [sys.executable, "-m", "pipeline", "ppo", "--policy", str(tiny_model_dir), "--reward", "script:count:e",
            "--prompts", str(prompts_file), "--out", str(out), "--batch-size", "8", "--mini-batch-size", "8",
            "--micro-batch-size", "8", "--max-new-tokens", "8", "--device", "cpu", "--lora-r", "4",
            "--sample-every", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args + ["--steps", "500"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until a step has finished, as a job runner would see it
        try:
            if json.loads((out / "status.json").read_text())["step"] >= 1:
                break
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, output[-2000:]
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "cancelled" and "SIGTERM" in status["error"]
    step = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)["step"]
    assert 1 <= step < 500 and not (out / "policy").exists()
    done = subprocess.run(args + ["--steps", str(step + 1), "--resume"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads((out / "status.json").read_text())["state"] == "done"
    assert [r["step"] for r in read_metrics(out)] == list(range(1, step + 2))


@pytest.mark.gpu
def test_cuda_bf16_run(tmp_path, tiny_model_dir, prompts_file):
    cfg = ModelConfig(model=str(tiny_model_dir), device="cuda", dtype="bf16", lora=True, lora_r=4, lora_alpha=8,
                      lora_targets="q_proj,v_proj,lm_head")
    rows = run(tmp_path, "gpu", cfg, prompts_file, steps=2)
    assert all(torch.isfinite(torch.tensor(r["objective/kl"])) for r in rows)
    assert rows[0]["policy/ratio_first"] == pytest.approx(1.0, abs=2e-2)  # 'auto' -> forward in bf16


def test_gradient_checkpointing_gives_the_same_step(tmp_path, ppo_model_cfg, prompts_file):
    """Checkpointed policy and critic (training mode in the update, no shared prefix) compute the
    same losses and the same update as the stored-activation run."""
    plain = run(tmp_path, "plain", ppo_model_cfg, prompts_file, steps=2)
    gc_cfg = dataclasses.replace(ppo_model_cfg, gradient_checkpointing=True)
    recomputed = run(tmp_path, "gc", gc_cfg, prompts_file, steps=2)
    for key in ("policy/loss", "val/loss", "policy/grad_norm", "objective/score", "objective/kl"):
        assert [m[key] for m in recomputed] == pytest.approx([m[key] for m in plain], rel=1e-4, abs=1e-6), key
