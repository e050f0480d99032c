"""Experiment tracking: TensorBoard event files beside metrics.jsonl (pipeline/tracking.py), read back
with TensorBoard's own EventAccumulator; and the Train tab's plots of response length and EOS rate."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.rundir import append_metrics, open_tracker, read_jsonl, set_writer, truncate_metrics
from pipeline.tracking import EVENTS_DIR

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/fixtures_models.py

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["How can I shop?", "What is the capital of France?", "Tell me about bread.", "Guitar tips?"]


def read_events(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard shows the run (orphaned events purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / EVENTS_DIR), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_events_match_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every number of metrics.jsonl is a scalar at the same step under the same key, and nothing
    else is (float32 in the events: compared to 1e-6 relative)."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        step = row.pop("step")
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                expected.setdefault(key, []).append((step, float(value)))
    events = read_events(run_dir)
    assert sorted(events) == sorted(expected)
    for key, rows in expected.items():
        assert [s for s, _ in events[key]] == [s for s, _ in rows], key
        for (_, got), (_, want) in zip(events[key], rows):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-30), key
    return events


def test_events_equal_metrics_jsonl_and_a_resume_shows_each_step_once(tmp_path):
    open_tracker(tmp_path)
    for step in (1, 2, 3, 4):  # the first process logs four steps, then dies after the checkpoint of 2
        append_metrics(tmp_path, step, {"train/loss": 1.0 / step, "train/tokens": 10 * step, "x/nan": float("nan")})
    time.sleep(1.1)  # event files sort by the second they were created; a resume takes longer than that
    open_tracker(tmp_path)  # the resumed process
    truncate_metrics(tmp_path, 2)
    for step in (3, 4, 5):
        append_metrics(tmp_path, step, {"train/loss": 2.0 / step, "train/tokens": 100 * step})
    assert len(list((tmp_path / EVENTS_DIR).glob("events.out.tfevents.*"))) == 2
    events = assert_events_match_metrics(tmp_path)
    steps, values = zip(*events["train/loss"])  # steps 3 and 4 of the first process are gone
    assert steps == (1, 2, 3, 4, 5) and values == pytest.approx([1.0, 0.5, 2 / 3, 0.5, 0.4])
    assert "x/nan" not in events  # null in metrics.jsonl, absent from the events


def test_no_tracker_no_events_and_other_ranks_write_nothing(tmp_path):
    open_tracker(tmp_path / "a", "none")
    (tmp_path / "a").mkdir()
    append_metrics(tmp_path / "a", 1, {"x": 1.0})
    assert not (tmp_path / "a" / EVENTS_DIR).exists()
    open_tracker(tmp_path / "b")
    (tmp_path / "b").mkdir()
    set_writer(False)
    try:
        append_metrics(tmp_path / "b", 1, {"x": 1.0})
        truncate_metrics(tmp_path / "b", 0)
    finally:
        set_writer(True)
    assert not (tmp_path / "b" / EVENTS_DIR).exists()
    with pytest.raises(ValueError, match="--report-to 'wandb'"):
        open_tracker(tmp_path, "wandb")


def test_importing_the_run_directory_module_loads_no_tensorboard():
    """The app reads run directories through pipeline.rundir: it must not pull tensorboard in."""
    code = "import sys, pipeline.rundir, pipeline.tracking; print(sorted({m.split('.')[0] for m in sys.modules} " \
           "& {'tensorboard', 'torch', 'numpy'}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_train_reward_cli_writes_the_same_scalars(tmp_path, tiny_model_dir):
    from pipeline.train_reward import main

    rows = [{"prompt": f"Question {i}: {PROMPTS[i % 4]}", "chosen": "Paris is nice " * (1 + i % 3),
             "rejected": "no idea"} for i in range(24)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rm"
    assert main(["--data", str(data), "--out", str(out), "--model", str(tiny_model_dir), "--device", "cpu",
                 "--norm-samples", "0", "--batch-size", "6", "--max-steps", "3", "--lr", "1e-2"]) == 0
    events = assert_events_match_metrics(out)
    assert [s for s, _ in events["train/loss"]] == [1, 2, 3] and [s for s, _ in events["eval/accuracy"]] == [3]


def test_train_dpo_cli_writes_the_same_scalars(tmp_path, tiny_model_dir):
    from pipeline.train_dpo import main

    rows = [{"prompt": f"Question {i}: {PROMPTS[i % 4]}", "chosen": "Paris is nice " * (1 + i % 3),
             "rejected": "no idea"} for i in range(16)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "dpo"
    assert main(["--data", str(data), "--out", str(out), "--model", str(tiny_model_dir), "--device", "cpu",
                 "--batch-size", "4", "--max-steps", "2", "--lr", "1e-3"]) == 0
    events = assert_events_match_metrics(out)
    assert [s for s, _ in events["train/loss"]] == [1, 2]


def test_ppo_cli_writes_the_same_scalars_and_a_resume_continues_them(tmp_path, tiny_model_dir):
    from pipeline.train_ppo import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))

    def argv(out: Path, *more: str) -> list[str]:
        return ["--policy", str(tiny_model_dir), "--reward", "script:length", "--prompts", str(prompts), "--out",
                str(out), "--batch-size", "4", "--mini-batch-size", "4", "--micro-batch-size", "4",
                "--max-new-tokens", "6", "--sample-every", "0", "--device", "cpu", "--lora-r", "4", *more]

    out = tmp_path / "ppo"
    assert main(argv(out, "--steps", "2")) == 0
    time.sleep(1.1)  # see the first test: the resumed process's file must sort after the first one
    assert main(argv(out, "--steps", "3", "--resume")) == 0
    events = assert_events_match_metrics(out)
    assert [s for s, _ in events["gen/length_mean"]] == [1, 2, 3]
    assert all(0.0 <= v <= 1.0 for _, v in events["gen/eos_rate"])
    quiet = tmp_path / "quiet"
    assert main(argv(quiet, "--steps", "1", "--report-to", "none")) == 0
    assert (quiet / "metrics.jsonl").is_file() and not (quiet / EVENTS_DIR).exists()


def test_the_train_tab_plots_response_length_and_eos_rate():
    from annotate import monitor
    from store.records import Metric

    metrics = [Metric(1, step, key, value) for step in (1, 2, 3)
               for key, value in (("gen/length_mean", 10.0 + step), ("gen/eos_rate", step / 4), ("objective/kl", 0.1))]
    frames = monitor.metric_frames(metrics)
    length = frames["Response length (tokens)"]
    eos = frames["EOS rate"]
    assert list(length["value"]) == [11.0, 12.0, 13.0] and set(length["metric"]) == {"gen/length_mean"}
    assert list(eos["value"]) == [0.25, 0.5, 0.75] and set(eos["metric"]) == {"gen/eos_rate"}
