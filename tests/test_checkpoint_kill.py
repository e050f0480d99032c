"""SIGKILL in the middle of a checkpoint write: the last good checkpoint is used.

A reward-training job saves a checkpoint every step; it is killed (SIGKILL, nothing to clean up)
at the moment a new checkpoint folder is being written, several times, and `--resume` continues
each time. The run reaches its last step with metrics for every step and a checkpoint that loads,
and through the job runner a killed run registers nothing (tests/test_jobs.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24
KILLS = 4


def start(args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline", "train-reward", *args], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def kill_mid_write(proc: subprocess.Popen, run_dir: Path, timeout: float = 120) -> bool:
    """SIGKILL the job as soon as a checkpoint is being written (a temporary folder beside it);
    True if it was caught mid-write (False: it ended first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(run_dir.glob(".checkpoint-tmp-*")) and (run_dir / "trainer_state.pt").is_file():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.002)
    return False


@pytest.mark.slow
def test_a_kill_during_checkpoint_writes_never_loses_the_last_good_checkpoint(tiny_model_dir, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Question {i}?", "chosen": "Yes, gladly.", "rejected": "No."})
                            + "\n" for i in range(40)))
    run_dir = tmp_path / "run"
    args = ["--data", str(data), "--out", str(run_dir), "--model", str(tiny_model_dir), "--device", "cpu",
            "--batch-size", "2", "--epochs", "50", "--max-steps", str(STEPS), "--save-every", "1",
            "--norm-samples", "0", "--eval-fraction", "0.25"]
    caught = 0
    with open(tmp_path / "log.txt", "ab") as log:
        for attempt in range(KILLS):
            proc = start(args if attempt == 0 else [*args, "--resume"], log)
            caught += kill_mid_write(proc, run_dir)
            assert proc.returncode is not None, "the job neither finished nor was killed"
            if proc.returncode == 0:
                break
        assert caught >= 2, f"only {caught} kills landed mid-write"
        final = start([*args, "--resume"], log)
        assert final.wait(timeout=300) == 0, (tmp_path / "log.txt").read_text()[-3000:]

    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "done" and status["step"] == STEPS
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = sorted({s for s in steps if s <= STEPS})
    assert train_steps == list(range(1, STEPS + 1))  # every step once, none lost to a kill
    assert not any(run_dir.glob(".checkpoint-*")), "a half-written folder was left behind"
    wait_for(lambda: (run_dir / "eval_report.json").is_file(), timeout=5, what="the eval report")

    # every resume continued from a whole checkpoint: the killed run trained exactly as one that was
    # never killed (same losses step by step, same weights), which a resume from a half-written or
    # stale checkpoint would not
    straight = tmp_path / "straight"
    with open(tmp_path / "log.txt", "ab") as log:
        assert start([*args[:3], str(straight), *args[4:]], log).wait(timeout=300) == 0
    assert train_losses(run_dir) == pytest.approx(train_losses(straight), rel=1e-4, abs=1e-6)
    from pipeline.models import load_scalar_model

    killed = load_scalar_model(str(run_dir / "checkpoint"), kind="reward")[0].state_dict()
    uninterrupted = load_scalar_model(str(straight / "checkpoint"), kind="reward")[0].state_dict()
    assert killed.keys() == uninterrupted.keys()
    for name, weight in uninterrupted.items():
        assert torch.allclose(killed[name], weight, atol=1e-5), name
    assert any(not torch.equal(w, load_scalar_model(str(tiny_model_dir), kind="reward")[0].state_dict()[n])
               for n, w in uninterrupted.items() if "lora_B" in n)  # training moved the weights


def train_losses(run_dir: Path) -> list[float]:
    """train/loss of each step, the last line for a step written twice (a kill after the metrics
    line but before the checkpoint: the resumed run redoes the step)."""
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/loss" in row:
            losses[row["step"]] = row["train/loss"]
    return [losses[step] for step in sorted(losses)]


def test_recover_folder_puts_back_the_last_good_folder_and_drops_half_written_ones(tmp_path):
    from pipeline.saving import recover_folder

    # killed between the two renames: the good folder is aside, a new one half-written
    (tmp_path / ".checkpoint-old-123").mkdir()
    (tmp_path / ".checkpoint-old-123" / "model_meta.json").write_text("{}")
    (tmp_path / ".checkpoint-tmp-abc").mkdir()
    recover_folder(tmp_path / "checkpoint")
    assert (tmp_path / "checkpoint" / "model_meta.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    # killed while writing: the good folder is in place, the temporary one goes
    (tmp_path / ".checkpoint-tmp-def").mkdir()
    (tmp_path / ".checkpoint-old-456").mkdir()
    recover_folder(tmp_path / "checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
