"""The job queue and the round state machine, with real subprocess jobs on tiny models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pipeline.orchestrate.jobs import OWNER_ENV, JobRunner
from pipeline.oracle import make_oracle
from pipeline.orchestrate.loop import (RoundFailed, fail, finish_round, generation_stopped, make_runner,
                                       recover_rounds, resume_generation, start_round, wait_round)
from pipeline.orchestrate.simulate import simulate_annotations
from pipeline.orchestrate.steps import round_ppo
from pipeline.rundir import STATE_FILE
from store import Store
from tests.helpers import alive, tiny_settings, wait_for
from tests.tiny import CORPUS

ROOT = Path(__file__).resolve().parents[1]


def add_prompts(store, extra: int = 10) -> None:
    store.add_prompts([line.split("?")[0] + "?" for line in CORPUS] + [f"Tell me about topic {i}." for i in range(extra)],
                      source="test")


def reward_job_args(tmp_path, model_dir, epochs: int) -> list[str]:
    data = tmp_path / "pairs.jsonl"
    with open(data, "w") as fh:
        for i in range(64):
            fh.write(json.dumps({"prompt": f"Question {i}?", "chosen": "Yes, gladly.", "rejected": "No."}) + "\n")
    return ["--data", str(data), "--model", str(model_dir), "--device", "cpu", "--epochs", str(epochs),
            "--batch-size", "2", "--norm-samples", "0"]


# --------------------------------------------------------------------------- rounds


@pytest.mark.slow
def test_a_round_trains_a_policy_whose_responses_feed_the_next_round(store, tiny_model_dir, tmp_path):
    add_prompts(store)
    runner = make_runner(store, tmp_path / "runs", poll_s=0.2)
    settings = tiny_settings(tiny_model_dir)
    settings.loop.reward_gate = False  # a tiny random reward model is at chance; this test follows the lineage

    rnd = start_round(store, runner, settings)
    assert rnd.status == "annotating"
    base = store.get_model_version(rnd.policy_version_id)
    assert store.round_counts(rnd.id)["items"] == 6
    assert simulate_annotations(store, make_oracle("rule:length"), noise=0.0) == 6

    done = finish_round(store, runner, rnd, settings)
    assert done.status == "done" and done.meta["last_error"] is None
    reward = store.get_model_version(done.reward_version_id)
    policy = store.get_model_version(done.new_policy_version_id)
    # lineage: snapshot -> reward model; base policy + reward model -> new policy
    assert reward.snapshot_id == done.snapshot_id and reward.kind == "reward"
    assert policy.parent_id == base.id and policy.reward_version_id == reward.id
    assert store.active_policy().id == policy.id
    assert store.metrics(store.get_model_version(policy.id).run_id, keys=["objective/kl"])
    # the hash the reward model recorded is the store's hash of the snapshot it trained on
    assert reward.meta["data_sha256"] == store.get_snapshot(done.snapshot_id).sha256
    # its normalisation samples are drawn as the round's PPO draws its rollouts
    rm_cfg = store.get_run(reward.run_id).config["reward"]
    assert (rm_cfg["norm_max_new_tokens"], rm_cfg["norm_temperature"]) == (round_ppo(settings).max_new_tokens,
                                                                           settings.ppo.temperature)

    # the next round picks, of 2N candidates, the N prompts the new reward model separates least
    settings.loop.strategy = "uncertain"
    nxt = start_round(store, runner, settings, 1)
    gen = store.list_runs(kind="generate", limit=1)[0]
    assert "kept the 6 of 12 prompts" in (Path(gen.run_dir) / "log.txt").read_text()
    items = {r.item_id for p in store.list_prompts(limit=1000) for r in store.prompt_responses(p.id)
             if r.model_version_id == policy.id}
    assert nxt.policy_version_id == policy.id and len(items) == 6
    runner.shutdown()


@pytest.mark.slow
def test_a_failed_step_leaves_the_round_open_with_the_reason_and_a_retry_works(store, tiny_model_dir, tmp_path):
    add_prompts(store)
    runner = make_runner(store, tmp_path / "runs", poll_s=0.2)
    settings = tiny_settings(tiny_model_dir)
    settings.loop.reward_gate = False  # a tiny random reward model is at chance; this test is about a failed job
    rnd = start_round(store, runner, settings)
    simulate_annotations(store, make_oracle("rule:length"))
    rankings = store.counts()["rankings"]

    broken = tiny_settings(tiny_model_dir)
    broken.model.dtype = "fp7"  # the train-reward job refuses it
    with pytest.raises(RoundFailed, match="reward"):
        finish_round(store, runner, rnd, broken)
    rnd = store.get_round(rnd.id)
    assert rnd.status == "annotating" and rnd.meta["failed_step"] == "reward"
    assert "reward (run #" in rnd.meta["last_error"] and "fp7" in rnd.meta["last_error"]
    assert store.counts()["rankings"] == rankings and store.list_model_versions("reward") == []

    done = finish_round(store, runner, rnd, settings)  # the same action retries it
    assert done.status == "done" and done.meta["last_error"] is None
    runner.shutdown()


@pytest.mark.slow
def test_a_round_whose_generation_stopped_generates_the_rest(store, tiny_model_dir, tmp_path):
    add_prompts(store)
    runner = make_runner(store, tmp_path / "runs", poll_s=0.2)
    settings = tiny_settings(tiny_model_dir)
    broken = tiny_settings(tiny_model_dir)
    broken.model.dtype = "fp7"  # the generate job refuses it
    with pytest.raises(RoundFailed, match="generate"):
        start_round(store, runner, broken)
    (rnd,) = store.list_rounds()
    assert generation_stopped(rnd) and store.round_counts(rnd.id)["items"] == 0

    rnd = resume_generation(store, runner, rnd, settings)
    assert rnd.status == "annotating" and not generation_stopped(rnd)
    assert store.round_counts(rnd.id)["items"] == 6 and rnd.policy_version_id == store.active_policy().id
    # nothing left to generate: the error is cleared and nothing is generated twice
    rnd = resume_generation(store, runner, fail(store, rnd.id, "generate", "interrupted"), settings)
    assert not generation_stopped(rnd) and store.round_counts(rnd.id)["items"] == 6
    assert len(store.list_runs(kind="generate")) == 2
    runner.shutdown()


def test_a_round_left_mid_step_without_a_job_is_reopened_at_start(store, tmp_path):
    rnd = store.create_round(None, status="training")
    runner = JobRunner(store, tmp_path / "runs")
    assert recover_rounds(store, runner) == 1
    rnd = store.get_round(rnd.id)
    assert rnd.status == "annotating" and "interrupted" in rnd.meta["last_error"]
    with pytest.raises(RoundFailed, match="interrupted"):
        wait_round(store, rnd)
    runner.shutdown()


# --------------------------------------------------------------------------- jobs


@pytest.mark.slow
def test_a_killed_job_is_marked_failed_and_leaves_the_store_unchanged(store, tiny_model_dir, tmp_path):
    runner = JobRunner(store, tmp_path / "runs", poll_s=0.1)
    run = runner.submit("train-reward", reward_job_args(tmp_path, tiny_model_dir, 500))
    wait_for(lambda: store.metrics(run.id), timeout=90, what="the job's first metrics")
    counts, versions = store.counts(), store.list_model_versions()

    os.killpg(store.get_run(run.id).outputs["pid"], signal.SIGKILL)
    ended = runner.wait(run.id, timeout=30)

    assert ended.status == "failed"
    assert "signal 9" in ended.error and "log tail" in ended.error
    assert store.counts() == counts and store.list_model_versions() == versions
    runner.shutdown()


@pytest.mark.slow
def test_cancel_stops_a_job_gracefully_and_a_queued_one_never_starts(store, tiny_model_dir, tmp_path):
    runner = JobRunner(store, tmp_path / "runs", poll_s=0.1, grace_s=20)
    run = runner.submit("train-reward", reward_job_args(tmp_path, tiny_model_dir, 500))
    queued = runner.submit("train-reward", reward_job_args(tmp_path, tiny_model_dir, 500))
    wait_for(lambda: store.metrics(run.id), timeout=90, what="the job's first metrics")
    assert store.get_run(queued.id).status == "queued"  # one job at a time

    runner.cancel(queued.id)
    runner.cancel(run.id)

    assert runner.wait(run.id, timeout=60).status == "cancelled"
    assert runner.wait(queued.id, timeout=10).status == "cancelled"
    assert not (Path(store.get_run(queued.id).run_dir) / "log.txt").exists()
    # a graceful stop leaves a usable last checkpoint
    assert (Path(run.run_dir) / "checkpoint" / "model_meta.json").is_file()
    assert store.list_model_versions("reward") == []
    runner.shutdown()


def test_a_job_stops_itself_once_the_owner_it_was_given_is_gone():
    """The pid the runner puts in a job's environment (OWNER_ENV) is the one the CLI watches: when
    that process is gone the job sends itself SIGTERM."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    job = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom pipeline.__main__ import watch_owner\nwatch_owner(0.05)\ntime.sleep(60)"],
        cwd=ROOT, env={**os.environ, OWNER_ENV: str(owner.pid)}, stderr=subprocess.PIPE, text=True)
    try:
        owner.wait(timeout=30)
        assert job.wait(timeout=30) == -signal.SIGTERM
        assert f"the owner process {owner.pid} is gone" in job.stderr.read()
    finally:
        job.kill()


OWNER = textwrap.dedent("""
    import sys, time
    from pipeline.orchestrate.loop import make_runner
    from store import Store

    store = Store(sys.argv[1])
    runner = make_runner(store, sys.argv[2], poll_s=0.1)
    args = sys.argv[3:]
    split = args.index("--")
    runner.submit("train-reward", args[:split])
    runner.submit("train-reward", args[split + 1:])
    time.sleep(600)
""")


@pytest.mark.slow
def test_the_queue_survives_a_kill_9_of_its_owner(store_path, tiny_model_dir, tmp_path):
    """The owner dies with one job running and one queued: the running job stops by itself, saving
    its state; the next owner queues it again, and it continues from that state (no step logged
    twice), then the queued one runs."""
    runs = tmp_path / "runs"
    long_args = reward_job_args(tmp_path, tiny_model_dir, 500)
    short_args = reward_job_args(tmp_path, tiny_model_dir, 1)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(store_path), str(runs), *long_args, "--", *short_args],
                             cwd=ROOT)
    try:
        wait_for(lambda: (runs / "00001-train-reward" / "metrics.jsonl").is_file(), timeout=120,
                 what="the first job's metrics")
    finally:
        owner.kill()
        owner.wait()

    store = Store(store_path)
    first, second = sorted(store.list_runs(), key=lambda r: r.id)
    assert (first.status, second.status) == ("running", "queued")
    wait_for(lambda: not alive(first.outputs["pid"]), timeout=15, what="the orphaned job to stop")

    saved = torch.load(Path(first.run_dir) / STATE_FILE, weights_only=False)["step"]  # written as it stopped
    runner = make_runner(store, runs, poll_s=0.1)
    first = store.get_run(first.id)
    assert first.status in ("queued", "running") and first.outputs["resume"] is True

    def steps() -> list[int]:
        lines = (Path(first.run_dir) / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["step"] for line in lines if line.strip()]

    wait_for(lambda: max(steps()) > saved + 1, timeout=120, what="the resumed job's steps after its saved one")
    assert "--resume" in (Path(first.run_dir) / "command.txt").read_text()
    logged = steps()
    assert logged == list(range(logged[0], logged[-1] + 1)) and saved >= 1  # continued, not started again
    runner.cancel(first.id)
    assert runner.wait(first.id, timeout=60).status == "cancelled"
    second = runner.wait(second.id, timeout=120)
    assert second.status == "done", second.error
    (reward,) = store.list_model_versions("reward")
    assert reward.run_id == second.id
    runner.shutdown()
    store.close()


def test_a_run_picked_up_before_its_folder_is_recorded_gets_the_same_folder(tmp_path):
    """The worker can take a queued run between its creation and the recording of its folder."""
    store = Store(tmp_path / "s.duckdb")
    runner = JobRunner(store, tmp_path / "runs")
    runner.shutdown()  # no worker: the test plays both sides
    try:
        bare = store.create_run("generate", config={"args": []}, inputs={})  # as submit leaves it a moment
        assert bare.run_dir is None
        first = runner._with_run_dir(bare)
        again = runner._with_run_dir(store.get_run(bare.id))
        assert first.run_dir == again.run_dir == str(tmp_path / "runs" / f"{bare.id:05d}-generate")
        assert Path(first.run_dir).is_dir()
    finally:
        store.close()
