"""The job runner and the closed loop, with real subprocess jobs on tiny models."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pipeline.config import GenerateConfig, LoopConfig, ModelConfig, PPOConfig, RewardConfig
from pipeline.orchestrate.jobs import JobRunner
from pipeline.orchestrate.judge import make_judge
from pipeline.orchestrate.loop import LoopSettings, finish_round, start_round
from pipeline.orchestrate.simulate import simulate_annotations
from tests.tiny import CORPUS


def runner_runs(store):
    return sorted(store.list_runs(kind="generate"), key=lambda r: r.id)


def tiny_settings(model_dir, prompts_per_round=6) -> LoopSettings:
    return LoopSettings(
        loop=LoopConfig(prompts_per_round=prompts_per_round),
        model=ModelConfig(model=str(model_dir), device="cpu", dtype="fp32", lora_r=4, lora_alpha=8),
        generate=GenerateConfig(k=3, max_new_tokens=8, temperature=1.0, batch_size=18),
        reward=RewardConfig(batch_size=4, max_length=64, norm_samples=0, eval_fraction=0.25, lr=1e-3),
        ppo=PPOConfig(steps=2, batch_size=4, mini_batch_size=4, micro_batch_size=4, ppo_epochs=1,
                      max_new_tokens=8, sample_every=1),
        ppo_prompts=8,
    )


def wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_round_trains_a_policy_whose_responses_feed_the_next_round(store, tiny_model_dir, tmp_path):
    store.add_prompts([line.split("?")[0] + "?" for line in CORPUS] + [f"Tell me about topic {i}." for i in range(10)],
                      source="test")
    runner = JobRunner(store, tmp_path / "runs", poll_s=0.2)
    settings = tiny_settings(tiny_model_dir)

    rnd = start_round(store, runner, settings)
    assert rnd.status == "annotating"
    base = store.get_model_version(rnd.policy_version_id)
    assert store.round_counts(rnd.id)["items"] == 6
    assert simulate_annotations(store, make_judge("rule:length"), noise=0.0) == 6

    done = finish_round(store, runner, rnd, settings)
    assert done.status == "done"
    reward = store.get_model_version(done.reward_version_id)
    policy = store.get_model_version(done.new_policy_version_id)
    # lineage: snapshot -> reward model; base policy + reward model -> new policy
    assert reward.snapshot_id == done.snapshot_id and reward.kind == "reward"
    assert policy.parent_id == base.id and policy.reward_version_id == reward.id
    assert store.active_policy().id == policy.id
    assert store.metrics(store.get_model_version(policy.id).run_id, keys=["objective/kl"])

    # the next round picks, of 2N candidates, the N prompts the new reward model separates least
    settings.loop.strategy = "uncertain"
    nxt = start_round(store, runner, settings, 1)
    assert "kept the 6 of 12 prompts" in (tmp_path / "runs" / f"{runner_runs(store)[-1].id:05d}-generate" /
                                         "log.txt").read_text()
    items = {r.item_id for p in store.list_prompts(limit=1000) for r in store.prompt_responses(p.id)
             if r.model_version_id == policy.id}
    assert nxt.policy_version_id == policy.id and len(items) == 6
    runner.shutdown()


def _long_reward_job(store, runner, tiny_model_dir, tmp_path):
    data = tmp_path / "pairs.jsonl"
    import json

    with open(data, "w") as fh:
        for i in range(64):
            fh.write(json.dumps({"prompt": f"Question {i}?", "chosen": "Yes, gladly.", "rejected": "No."}) + "\n")
    return runner.submit("train-reward", ["--data", str(data), "--model", str(tiny_model_dir), "--device", "cpu",
                                          "--epochs", "500", "--batch-size", "2", "--norm-samples", "0"])


@pytest.mark.slow
def test_a_killed_job_is_marked_failed_and_leaves_the_store_unchanged(store, tiny_model_dir, tmp_path):
    runner = JobRunner(store, tmp_path / "runs", poll_s=0.1)
    run = _long_reward_job(store, runner, tiny_model_dir, tmp_path)
    wait_for(lambda: store.metrics(run.id), timeout=90, what="the job's first metrics")
    counts = store.counts()
    versions = store.list_model_versions()

    os.killpg(runner._jobs[run.id].process.pid, signal.SIGKILL)
    ended = runner.wait(run.id, timeout=30)

    assert ended.status == "failed"
    assert "signal 9" in ended.error and "log tail" in ended.error
    assert store.counts() == counts and store.list_model_versions() == versions


@pytest.mark.slow
def test_cancel_stops_a_job_gracefully(store, tiny_model_dir, tmp_path):
    runner = JobRunner(store, tmp_path / "runs", poll_s=0.1, grace_s=20)
    run = _long_reward_job(store, runner, tiny_model_dir, tmp_path)
    queued = _long_reward_job(store, runner, tiny_model_dir, tmp_path)  # one job at a time per device
    wait_for(lambda: store.metrics(run.id), timeout=90, what="the job's first metrics")
    assert store.get_run(queued.id).status == "queued"

    runner.cancel(queued.id)
    runner.cancel(run.id)

    assert runner.wait(run.id, timeout=60).status == "cancelled"
    assert runner.wait(queued.id, timeout=10).status == "cancelled"
    # a graceful stop leaves a usable last checkpoint
    assert (tmp_path / "runs" / f"{run.id:05d}-train-reward" / "checkpoint" / "model_meta.json").is_file()
    assert store.list_model_versions("reward") == []
