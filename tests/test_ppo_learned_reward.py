"""PPO, RLOO and DPO against a *learned* reward model, the mission's default path, on tiny models.

The task is one a tiny model learns with certainty. A simulated annotator prefers, of two responses
the starting policy sampled for a prompt, the one with more letters 'e' (the gold rule); a reward
model trained on those pairs ranks about 97% of held-out pairs right. PPO then runs with every
default of the algorithm (critic initialised from that reward model, adaptive KL, missing-EOS
penalty), on rollouts of which most are cut at the length limit, and must raise the reward model's
score of responses to held-out prompts; DPO on the same pairs must too.

Sized over eight seeds (0-7; each moves prompts, samples, the reward model's training and the
policy's; `python -m tests.test_ppo_learned_reward 0 1 2 3 4 5 6 7`), in reward-model standard
deviations of held-out score gained, min / mean / s.d., and the gold count's ratio min to max:
PPO +1.19 / 1.98 / 0.75, x1.35 to x8.55; RLOO (4 responses per prompt, no critic) +1.55 / 2.27 /
0.57, x1.96 to x6.37; DPO +2.33 / 2.82 / 0.56, x15.8 to x19.5. The tests assert on the mean of two
training seeds: a gain of +0.4 is 3.0 s.d. of that mean below PPO's mean, 4.7 below RLOO's, and
DPO's +0.5 is 5.8 below; the gold ratio 1.2x (PPO) and 1.5x (RLOO, DPO) sit below every run's.
A PPO that inverts the reward (the score's sign flipped) falls to -0.86 and fails. A PPO that
scores cut responses where the reward model never learned to score, or whose critic starts on
another scale, still learns this easy task on a tiny model; those two faults are pinned by exact
tests instead (reward = score_texts, tests/test_train_ppo.py; critic = normalised score, below).
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from pipeline.config import DPOConfig, GenerateConfig, ModelConfig, PPOConfig, RewardConfig
from pipeline.models import attn_ratio, load_scalar_model
from pipeline.packing import pack_responses
from pipeline.policy import load_policy
from pipeline.responses import generate_responses
from pipeline.rollout import critic_values
from pipeline.sampling import sample
from pipeline.scoring import load_reward_model, packed_score, score_texts
from pipeline.text import encode_prompts
from pipeline.train_dpo import train_dpo
from pipeline.train_ppo import train
from pipeline.train_reward import train_reward
from tests.tiny import save_tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/fixtures_models.py

WORDS = "bread guitar stores onions chili flour water salt chords coupons".split()
MAX_NEW, TEMPERATURE = 12, 0.7  # PPO's default temperature; 12 tokens: most responses are cut


def gold(text: str) -> float:
    return float(text.count("e"))


def prompts_for(seed: int, start: int, n: int) -> list[str]:
    rng = random.Random(seed * 7919 + start)
    return [f"Question {start + i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
            for i in range(n)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_learned(root, seed: int = 0) -> dict:
    """The tiny starting policy, 600 training prompts, the annotator's pairs from two of its samples
    per prompt, and a reward model trained on them (full fine-tuning: a LoRA r4 on a hidden-32 random
    model learns this to only about 0.78). seed moves prompts, samples and training order."""
    model_dir = save_tiny_model_dir(root / "tiny")
    policy_cfg = ModelConfig(model=str(model_dir), device="cpu", dtype="fp32", lora=True, lora_r=4, lora_alpha=8,
                             lora_targets="q_proj,v_proj,lm_head")
    rm_cfg = dataclasses.replace(policy_cfg, lora=False)
    train_prompts = prompts_for(seed, 0, 600)
    base, tok = load_policy(rm_cfg)
    gens = generate_responses(base, tok, train_prompts, 2,
                              GenerateConfig(k=2, temperature=TEMPERATURE, max_new_tokens=MAX_NEW, seed=seed))
    pairs = []
    for prompt, (a, b) in zip(train_prompts, ((g[0].text, g[1].text) for g in gens)):
        if a.strip() and b.strip() and gold(a) != gold(b):
            chosen, rejected = (a, b) if gold(a) > gold(b) else (b, a)
            pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    cut = sum(g.finish_reason == "length" for gg in gens for g in gg) / (2 * len(gens))
    assert cut > 0.8 and len(pairs) > 250  # mostly cut responses; enough pairs
    data = write_jsonl(root / "pairs.jsonl", pairs)
    report = train_reward(str(data), str(root / "rm"), RewardConfig(epochs=4, lr=3e-3, batch_size=8, eval_fraction=0.25,
                                                                    norm_samples=32, seed=seed), rm_cfg)
    assert report["eval/accuracy"] > 0.9, report["eval/accuracy"]
    write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in train_prompts])
    rm, rm_tok = load_reward_model(str(root / "rm" / "checkpoint"), rm_cfg)
    return dict(root=root, seed=seed, policy_cfg=policy_cfg, rm_dir=str(root / "rm" / "checkpoint"), rm=rm,
                rm_tok=rm_tok, data=str(data), prompts=str(root / "prompts.jsonl"),
                held_out=prompts_for(seed, 10_000, 32))


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    return build_learned(tmp_path_factory.mktemp("learned"))


def run_ppo(learned, out, seed: int) -> None:
    train(PPOConfig(steps=30, max_new_tokens=MAX_NEW, lr=1e-2, sample_every=0, seed=seed),
          learned["policy_cfg"], prompts=learned["prompts"], reward=learned["rm_dir"], out_dir=out)


def run_rloo(learned, out, seed: int) -> None:
    """RLOO with every default of its own (4 responses per prompt, no critic) and PPO's step size:
    30 steps x 16 episodes (4 prompts x 4)."""
    train(PPOConfig(steps=30, advantage_estimator="rloo", max_new_tokens=MAX_NEW, lr=1e-2, sample_every=0, seed=seed),
          learned["policy_cfg"], prompts=learned["prompts"], reward=learned["rm_dir"], out_dir=out)


def run_dpo(learned, out, seed: int) -> None:
    train_dpo(learned["data"], str(out), DPOConfig(epochs=2, lr=1e-2, batch_size=8, eval_fraction=0.25, kl_prompts=4,
                                                   kl_samples=1, kl_max_new_tokens=8, seed=seed),
              learned["policy_cfg"])


def held_out_scores(learned, policy_dir=None) -> tuple[float, float]:
    """(mean normalised reward-model score, mean gold count) of 4 responses to each held-out prompt."""
    cfg = learned["policy_cfg"]
    policy, tok = (load_policy(cfg, adapter_path=policy_dir) if policy_dir
                   else load_policy(dataclasses.replace(cfg, lora=False)))
    gens = generate_responses(policy, tok, learned["held_out"], 4,
                              GenerateConfig(k=4, temperature=TEMPERATURE, max_new_tokens=MAX_NEW, seed=123))
    texts = [g.text for gg in gens for g in gg]
    prompts = [p for p in learned["held_out"] for _ in range(4)]
    scores = score_texts(learned["rm"], learned["rm_tok"], prompts, texts)
    return sum(scores) / len(scores), sum(map(gold, texts)) / len(texts)


@pytest.mark.slow
def test_ppo_raises_the_learned_reward_models_score_of_held_out_responses(learned, tmp_path):
    """About 10 s: two PPO runs (seeds 0, 1) of 30 steps x 16 episodes. Every algorithm default
    (critic from the reward model, adaptive KL, missing-EOS penalty 1); the learning rate is the
    tiny model's (a LoRA on a hidden-32 model moves at 1e-2 what SmolLM2's moves at the 3e-4
    default). Asserted on the mean of the two runs (module docstring: the margins)."""
    score_before, gold_before = held_out_scores(learned)
    after = []
    for seed in (0, 1):
        out = tmp_path / f"ppo{seed}"
        run_ppo(learned, out, seed)
        config = json.loads((out / "config.json").read_text())
        assert config["critic_init"] == learned["rm_dir"]  # the default path: the critic from the reward model
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert rows[0]["gen/eos_rate"] < 0.5  # the rollouts PPO learns from are mostly cut at the limit
        after.append(held_out_scores(learned, out / "policy"))
    score_after, gold_after = (sum(x) / len(after) for x in zip(*after))
    assert score_after > score_before + 0.4, (score_before, after)
    assert gold_after > 1.2 * gold_before, (gold_before, after)


@pytest.mark.slow
def test_rloo_raises_the_learned_reward_models_score_of_held_out_responses(learned, tmp_path):
    """The same task and step budget for RLOO (its own defaults: 4 responses per prompt, the
    leave-one-out baseline, no critic): two runs, asserted on their mean (module docstring)."""
    score_before, gold_before = held_out_scores(learned)
    after = []
    for seed in (0, 1):
        out = tmp_path / f"rloo{seed}"
        run_rloo(learned, out, seed)
        assert not (out / "checkpoint" / "critic").exists()
        after.append(held_out_scores(learned, out / "policy"))
    score_after, gold_after = (sum(x) / len(after) for x in zip(*after))
    assert score_after > score_before + 0.4, (score_before, after)
    assert gold_after > 1.5 * gold_before, (gold_before, after)


@pytest.mark.slow
def test_dpo_on_the_same_pairs_raises_the_reward_models_score(learned, tmp_path):
    score_before, gold_before = held_out_scores(learned)
    after = []
    for seed in (0, 1):
        run_dpo(learned, tmp_path / f"dpo{seed}", seed)
        after.append(held_out_scores(learned, tmp_path / f"dpo{seed}" / "policy"))
    score_after, gold_after = (sum(x) / len(after) for x in zip(*after))
    assert score_after > score_before + 0.5, (score_before, after)
    assert gold_after > 1.5 * gold_before, (gold_before, after)


def test_a_critic_from_the_reward_model_starts_at_its_normalised_scores(learned):
    """The critic's value before each response token is the reward model's normalised score of
    the sequence up to there: the scale of PPO's rewards from the first step (GAE's -V_T term
    would otherwise add a length-dependent bias while value clipping slows the correction)."""
    critic, _ = load_scalar_model(learned["rm_dir"], kind="critic", cfg=learned["policy_cfg"])
    rm = learned["rm"]
    policy, tok = load_policy(dataclasses.replace(learned["policy_cfg"], lora=False))
    ids, am = encode_prompts(tok, learned["held_out"][:4])
    sb = sample(policy, ids, am, PPOConfig(max_new_tokens=6), tok, draws=torch.Generator().manual_seed(0))
    mask = sb.response_mask.float()
    with torch.no_grad():
        pr = pack_responses(sb.sequences, sb.attention_mask, sb.response_ids, mask, sb.prompt_length,
                            attn_ratio(critic), share_prefix=False)
        values = critic_values(critic, pr)  # (B, R)
        P = sb.prompt_length
        for t in range(sb.response_ids.shape[1]):
            rows = mask[:, t].bool()
            if not rows.any():
                continue
            # the state token t is chosen in: prompt + response[:t], its last real position P - 1 + t
            prefix_mask = sb.attention_mask[rows, : P + t]
            expected = packed_score(rm, sb.sequences[rows, : P + t], prefix_mask, frozen=False)
            torch.testing.assert_close(values[rows, t], expected, atol=1e-5, rtol=1e-5)
    assert rm.reward_std != 1.0 and rm.reward_mean != 0.0  # the fold did something


@pytest.mark.parametrize("temperature", [0.05, 1.0])
def test_the_entropy_bonus_is_of_the_distribution_sampled(learned, tmp_path, temperature):
    """With the first update's policy equal to pi_old, the entropy term (per token, of logits / T)
    must match the sampled tokens' mean -log pi_old (also of logits / T), over 64 x 12 tokens. The
    tiny model's logits are small: at T = 1 both are 5.78 nats per token, at T = 0.05 about 3.6,
    where an entropy of the untempered logits stays at 5.76."""
    out = tmp_path / f"t{temperature}"
    train(PPOConfig(steps=1, batch_size=64, mini_batch_size=64, micro_batch_size=64, ppo_epochs=1, lr=1e-9,
                    critic_lr=1e-9, temperature=temperature, max_new_tokens=MAX_NEW, entropy_coef=0.01,
                    sample_every=0), learned["policy_cfg"], prompts=learned["prompts"], reward=learned["rm_dir"],
          out_dir=out)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    sampled = row["objective/entropy"] / row["gen/length_mean"]  # nats per sampled token
    assert row["policy/entropy"] == pytest.approx(sampled, rel=0.12), (row["policy/entropy"], sampled)

if __name__ == "__main__":  # the sizing above: python -m tests.test_ppo_learned_reward SEED...
    import sys
    import tempfile
    from pathlib import Path

    torch.set_num_threads(1)
    for seed in map(int, sys.argv[1:]):
        root = Path(tempfile.mkdtemp())
        run = build_learned(root, seed)
        before = held_out_scores(run)
        run_ppo(run, root / "ppo", seed)
        run_dpo(run, root / "dpo", seed)
        run_rloo(run, root / "rloo", seed)
        after = {name: held_out_scores(run, root / name / "policy") for name in ("ppo", "dpo", "rloo")}
        print(f"seed {seed}: score {before[0]:+.3f} -> " + ", ".join(
            f"{name.upper()} {s:+.3f} ({s - before[0]:+.3f})" for name, (s, _) in after.items())
            + f"; gold {before[1]:.3f} -> " + ", ".join(
            f"{name.upper()} {g:.3f} (x{g / before[1]:.2f})" for name, (_, g) in after.items()), flush=True)
