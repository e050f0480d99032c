"""Jobs forked from the warm process (pipeline/orchestrate/warm.py) are the jobs a cold start runs:
the same exit status and log, their own process group, the runner's environment; a warm process
that dies is replaced, and what it cannot start starts cold."""

from __future__ import annotations

import json
import os
import signal
import sys

from pipeline.orchestrate.jobs import JobRunner
from pipeline.orchestrate.warm import Warm
from tests.helpers import wait_for


def pairs_file(tmp_path) -> str:
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Question {i}?", "chosen": "Yes, gladly.", "rejected": "No."}) + "\n"
                            for i in range(16)))
    return str(data)


def test_a_warm_job_exits_logs_and_trains_as_a_cold_one(store, tiny_model_dir, tmp_path):
    runner = JobRunner(store, tmp_path / "runs", poll_s=0.1)
    try:
        # bad input: the stage's own error, in the log, and its exit status
        bad = runner.wait(runner.submit("train-reward", ["--data", str(tmp_path / "missing.jsonl"), "--model",
                                                         str(tiny_model_dir), "--device", "cpu"]).id, timeout=120)
        assert bad.status == "failed" and bad.outputs["start"] == "warm", bad.outputs
        assert "missing.jsonl: no such file\n--- log tail ---\nerror: " in bad.error  # stderr in the log
        # an exit status of its own (no status file): `python -m pipeline` refusing an unknown stage
        unknown = runner.wait(runner.submit("no-such-stage", []).id, timeout=60)
        assert unknown.error.startswith("exit code 2") and "usage: python -m pipeline" in unknown.error
        # a real job: trained, its model registered, its process group its own
        args = ["--data", pairs_file(tmp_path), "--model", str(tiny_model_dir), "--device", "cpu", "--epochs", "200",
                "--batch-size", "2", "--norm-samples", "0"]
        run = runner.submit("train-reward", args)
        wait_for(lambda: store.metrics(run.id), timeout=90, what="the job's first metrics")
        pid = store.get_run(run.id).outputs["pid"]
        assert os.getpgid(pid) == pid and os.getsid(pid) == pid  # a cancel reaches it and its children
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
        assert env[b"RLHF_LOOP_OWNER_PID"] == str(os.getpid()).encode()  # the runner's (the warm process's)
        runner.cancel(run.id)
        cancelled = runner.wait(run.id, timeout=60)
        assert cancelled.status == "cancelled" and cancelled.outputs["start"] == "warm"
        short = runner.wait(runner.submit("train-reward", [*args[:-5], "1", *args[-4:]]).id, timeout=120)
        assert short.status == "done", short.error
        assert "checkpoint:" in (tmp_path / "runs" / f"{short.id:05d}-train-reward" / "log.txt").read_text()
        (reward,) = store.list_model_versions("reward")
        assert reward.run_id == short.id
    finally:
        runner.shutdown()


def test_a_dead_warm_process_is_replaced(store, tiny_model_dir, tmp_path):
    runner = JobRunner(store, tmp_path / "runs", poll_s=0.1)
    bad_args = ["--data", str(tmp_path / "missing.jsonl"), "--model", str(tiny_model_dir), "--device", "cpu"]
    try:
        first = runner.wait(runner.submit("train-reward", bad_args).id, timeout=120)
        warm_pid = runner._warm._proc.pid
        os.kill(warm_pid, signal.SIGKILL)
        wait_for(lambda: runner._warm._proc.poll() is not None, timeout=10, what="the warm process to die")
        second = runner.wait(runner.submit("train-reward", bad_args).id, timeout=120)
        assert (first.outputs["start"], second.outputs["start"]) == ("warm", "warm")
        assert runner._warm._proc.pid != warm_pid and "no such file" in second.error
    finally:
        runner.shutdown()


def test_what_the_warm_process_cannot_start_starts_cold(store, tiny_model_dir, tmp_path):
    warm = Warm({**os.environ}, tmp_path / "warm.log")
    # another environment than the one it imported under: refused before anything starts
    assert warm.start(["train-reward", "--help"], str(tmp_path), str(tmp_path / "log.txt"), {"OTHER": "1"}) is None
    assert warm._proc is None
    # a runner with a launcher of its own starts its jobs as new processes
    runner = JobRunner(store, tmp_path / "runs", launcher=(sys.executable, "-m", "pipeline", "--no-such"))
    try:
        run = runner.wait(runner.submit("train-reward", []).id, timeout=60)
        assert run.outputs["start"] == "cold" and run.status == "failed"
    finally:
        runner.shutdown()
