"""DPO with full fine-tuning sharded by FSDP2 over 2 processes (torchrun, a gloo group on CPU, with the
settings `accelerate launch --config_file configs/accelerate/fsdp.yaml` exports), against one process.

The data makes the ranks' work differ, as a run's would: the last batch of the epoch holds one pair
(rank 1 runs a pass whose result it drops), and 17 held-out pairs in batches of 8 give rank 0 two
batches and rank 1 one. About 25 s on 2 cores.
"""

import dataclasses
import json
import math

import pytest
import torch

from pipeline.config import DPOConfig, ModelConfig, to_cli_args
from tests.test_distributed import FSDP_ENV, launch, log_of, metric_lines, status_of
from tests.test_train_reward import marker_pairs, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/fixtures_models.py


def test_distributed_fsdp_dpo_equals_one_process_and_resumes_on_one(tmp_path, tiny_model_dir):
    """Per-step losses, held-out implicit-reward figures and the gathered policy of 2 sharded
    processes are the 1-process run's; the held-out KL is measured (each rank samples its own
    prompts); the sharded checkpoint continues on 1 process."""
    from safetensors.torch import load_file

    from pipeline.train_dpo import train_dpo

    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(13))
    held_out = write_jsonl(tmp_path / "eval.jsonl", marker_pairs(17, seed=2))
    cfg = DPOConfig(batch_size=4, lr=1e-3, eval_data=str(held_out), kl_prompts=3, kl_samples=2, kl_max_new_tokens=6)
    model_cfg = ModelConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32", lora=False)
    one, two = tmp_path / "one", tmp_path / "two"
    report_one = train_dpo(str(data), str(one), cfg, model_cfg)
    proc = launch(["train-dpo", "--data", data, *to_cli_args(cfg), *to_cli_args(model_cfg)], two,
                  extra_env=FSDP_ENV, timeout=120)
    assert proc.returncode == 0, log_of(two)[-3000:]
    assert status_of(two)["state"] == "done"

    report_two = json.loads((two / "eval_report.json").read_text())
    assert report_two["steps"] == report_one["steps"] == 4 and report_two["eval/pairs"] == 17
    for key in ("eval/loss", "eval/reward_accuracy", "eval/margin", "eval/rewards_chosen"):
        assert report_two[key] == pytest.approx(report_one[key], rel=1e-4, abs=1e-6), key
    # measured: a finite k1 estimate (of 6 samples of a policy 4 steps from its reference: either sign)
    assert report_two["kl/samples"] == 6 and math.isfinite(report_two["kl/heldout"])
    train_one = [m for m in metric_lines(one) if "train/loss" in m]
    train_two = [m for m in metric_lines(two) if "train/loss" in m]
    assert [m["step"] for m in train_two] == [1, 2, 3, 4]
    for m1, m2 in zip(train_one, train_two):  # (train/tokens counts the work: no shared prefix when sharded)
        for key in ("train/loss", "train/grad_norm", "train/margin", "train/reward_accuracy"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    w1, w2 = load_file(one / "policy" / "model.safetensors"), load_file(two / "policy" / "model.safetensors")
    assert w1.keys() == w2.keys()
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=1e-4, atol=1e-5)

    # as a cancel at step 4 of 8 leaves the run: the checkpoint, status 'cancelled', no report
    (two / "eval_report.json").unlink()
    (two / "status.json").write_text(json.dumps({**status_of(two), "state": "cancelled"}))
    config = json.loads((two / "config.json").read_text())
    config["dpo"]["epochs"] = 2  # the run's own settings win on --resume
    (two / "config.json").write_text(json.dumps(config))
    resumed = train_dpo(str(data), str(two), dataclasses.replace(cfg, epochs=2), model_cfg, resume=True)
    assert resumed["steps"] == 8
    assert [m["step"] for m in metric_lines(two) if "train/loss" in m] == list(range(1, 9))
