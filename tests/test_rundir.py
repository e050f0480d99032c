"""pipeline/rundir.py: the run-directory scaffold both trainers and generate/compare write through."""

from __future__ import annotations

import json
import os
import signal

import pytest

from pipeline.rundir import (
    Cancelled, MetricsTail, StopFlag, append_metrics, read_jsonl, read_status, truncate_metrics, write_status,
)


def test_status_metrics_and_tail(tmp_path):
    write_status(tmp_path, "running", 3, 12, phase="training")
    status = read_status(tmp_path)
    assert (status["state"], status["step"], status["total"], status["progress"], status["error"],
            status["phase"]) == ("running", 3, 12, 0.25, None, "training")
    with pytest.raises(ValueError):
        write_status(tmp_path, "sleeping", 0, 0)
    tail = MetricsTail(tmp_path)
    append_metrics(tmp_path, 1, {"a/x": 1.5, "a/nan": float("nan")})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "a/x": 1.5, "a/nan": None}
    assert tail.read() == [(1, "a/x", 1.5), (1, "a/nan", None)]


def test_truncate_metrics_keeps_steps_up_to_the_checkpoint_and_drops_a_cut_line(tmp_path):
    for step in (1, 2, 3):
        append_metrics(tmp_path, step, {"x": step})
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "x"')  # a kill mid-line
    truncate_metrics(tmp_path, 2)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    truncate_metrics(tmp_path / "nothing-here", 0)  # no file: nothing to do


def test_read_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{oops\n')
    with pytest.raises(ValueError, match=r"rows.jsonl, line 4: not valid JSON"):
        read_jsonl(path)

    def positive(row):
        if row["a"] < 2:
            raise ValueError("field 'a' must be >= 2")

    path.write_text('{"a": 3}\n{"a": 1}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl, line 2: field 'a' must be >= 2"):
        read_jsonl(path, check=positive)


def test_stop_flag_sets_on_sigterm_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with StopFlag() as stop:
        stop.check()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == "SIGTERM"
        with pytest.raises(Cancelled, match="SIGTERM"):
            stop.check()
        os.kill(os.getpid(), signal.SIGTERM)  # a launcher forwarding the group's SIGTERM: same cancel
        assert stop.signal == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C stops at once
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_only_the_writer_process_writes_the_run_directory(tmp_path):
    """Ranks other than 0 of a multi-process job (pipeline/distributed.py) write nothing."""
    from pipeline.rundir import append_metrics, set_writer, write_json, write_status

    set_writer(False)
    try:
        write_json(tmp_path / "config.json", {"a": 1})
        write_status(tmp_path, "running", 1, 2)
        append_metrics(tmp_path, 1, {"x": 1.0})
        with pytest.raises(ValueError):  # a bad state is still refused on every rank
            write_status(tmp_path, "nope", 1, 2)
    finally:
        set_writer(True)
    assert list(tmp_path.iterdir()) == []
    write_status(tmp_path, "running", 1, 2)
    assert (tmp_path / "status.json").is_file()
