"""`python -m pipeline compare`: two policies, one reward model, a run directory with result.json."""

from __future__ import annotations

import json
import os
import signal

import pytest

from pipeline.__main__ import main as cli
from pipeline.rundir import read_status


@pytest.fixture
def compare_inputs(tiny_model_cfg, tmp_path):
    from pipeline.models import load_scalar_model
    from pipeline.saving import save_scalar_model
    from pipeline.policy import load_policy

    rm, tok = load_scalar_model(tiny_model_cfg.model, kind="reward", cfg=tiny_model_cfg)
    save_scalar_model(rm, tok, tmp_path / "rm")
    policy, tok = load_policy(tiny_model_cfg)  # a fresh LoRA adapter: B = 0, the base model's outputs
    from pipeline.saving import save_policy

    save_policy(policy, tok, tmp_path / "policy")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in
                                 enumerate(["How do I bake bread?", "Hi!", "Tell me a joke."])) + "\n")
    base = ["--prompts", str(prompts), "--reward", str(tmp_path / "rm"), "--max-new-tokens", "5",
            "--batch-size", "2", "--device", "cpu", "--dtype", "fp32"]
    return base, tiny_model_cfg.model, tmp_path


def test_compare_writes_result_status_and_config(compare_inputs):
    base, model, tmp_path = compare_inputs
    out = tmp_path / "run"
    rc = cli(["compare", *base, "--out", str(out), "--a-model", model, "--a-adapter", str(tmp_path / "policy"),
              "--a-name", "v1", "--b-model", model, "--b-name", "base"])
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    assert set(result) == {"a", "b", "win_rate", "stderr", "mean_a", "mean_b", "prompts", "rows"}
    assert (result["a"], result["b"], result["prompts"]) == ("v1", "base", 3)
    assert set(result["rows"][0]) == {"prompt", "response_a", "response_b", "score_a", "score_b"}
    # a zero adapter samples what its base model samples, with the same seed: a tie everywhere
    assert [r["response_a"] for r in result["rows"]] == [r["response_b"] for r in result["rows"]]
    assert result["win_rate"] == 0.5
    status = read_status(out)
    # 2 sampling batches per policy (3 prompts, batch size 2), then scoring
    assert (status["state"], status["step"], status["total"], status["progress"]) == ("done", 5, 5, 1.0)
    config = json.loads((out / "config.json").read_text())
    assert config["stage"] == "compare" and config["a"]["adapter"] == str(tmp_path / "policy")


def test_compare_fails_clearly(compare_inputs, capsys):
    base, model, tmp_path = compare_inputs
    out = tmp_path / "bad"
    rc = cli(["compare", *base[:2], "--reward", str(tmp_path / "nope"), *base[4:], "--out", str(out),
              "--a-model", model, "--b-model", model])
    assert rc == 1 and "no such folder" in capsys.readouterr().err
    status = read_status(out)
    assert status["state"] == "failed" and "no such folder" in status["error"]
    assert not (out / "result.json").exists()


def test_sigterm_cancels_compare(compare_inputs, monkeypatch):
    import pipeline.compare as compare

    base, model, tmp_path = compare_inputs
    original, sent = compare.score_texts, []

    def score_then_sigterm(*args, **kwargs):
        if not sent:  # once: a second signal would stop at once
            sent.append(os.kill(os.getpid(), signal.SIGTERM))  # what the job runner's cancel sends
        return original(*args, **kwargs)

    monkeypatch.setattr(compare, "score_texts", score_then_sigterm)
    out = tmp_path / "cancelled"
    rc = cli(["compare", *base, "--out", str(out), "--a-model", model, "--b-model", model])
    assert rc == 130
    status = read_status(out)
    assert status["state"] == "cancelled" and "SIGTERM" in status["error"]
    assert not (out / "result.json").exists()


@pytest.mark.slow
def test_a_policy_trained_on_the_reward_models_pairs_wins(tmp_path):
    """Not a tie: DPO on the learned-reward task's pairs (tests/test_ppo_learned_reward.py) against
    its starting model, judged by that task's reward model on held-out prompts. Both sides sample
    with the same seed, so the win rate is the trained policy's, and every row's scores are the
    reward model's scores of its texts (score_texts), from which the win rate is computed."""
    from pipeline.compare import win_rate
    from pipeline.scoring import score_texts
    from tests.test_ppo_learned_reward import build_learned, run_dpo

    learned = build_learned(tmp_path / "learned")
    run_dpo(learned, tmp_path / "dpo", seed=0)
    prompts = tmp_path / "held_out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in learned["held_out"]))
    model = learned["policy_cfg"].model
    out = tmp_path / "run"
    rc = cli(["compare", "--prompts", str(prompts), "--reward", learned["rm_dir"], "--max-new-tokens", "12",
              "--device", "cpu", "--dtype", "fp32", "--out", str(out), "--a-model", model,
              "--a-adapter", str(tmp_path / "dpo" / "policy"), "--a-name", "dpo", "--b-model", model])
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    rows = result["rows"]
    assert result["prompts"] == len(rows) == 32
    texts_a, texts_b = [r["response_a"] for r in rows], [r["response_b"] for r in rows]
    assert texts_a != texts_b
    for side, texts in (("a", texts_a), ("b", texts_b)):
        expected = score_texts(learned["rm"], learned["rm_tok"], [r["prompt"] for r in rows], texts)
        assert [r[f"score_{side}"] for r in rows] == pytest.approx(expected, abs=1e-5)
    rate, stderr = win_rate([r["score_a"] for r in rows], [r["score_b"] for r in rows])
    assert (result["win_rate"], result["stderr"]) == (rate, stderr)
    # the trained policy's responses carry more of what the reward model learned to reward
    assert result["win_rate"] > 0.5 + 3 * result["stderr"] and result["mean_a"] > result["mean_b"], result
