"""bench/run_all.py: keeping earlier benches' logs, and per-bench arguments (no bench is run)."""

from __future__ import annotations

import pytest

from bench import run_all


def test_a_kept_log_gives_back_command_exit_code_output_and_seconds(tmp_path, monkeypatch):
    monkeypatch.setattr(run_all, "LOGS", tmp_path)
    command = run_all.bench_command("gold_loop", False, "--ppo-steps 24 --out 'a b'")
    assert command == "python bench/gold_loop.py --quick --ppo-steps 24 --out 'a b'"
    (tmp_path / "gold_loop.log").write_text(
        f"{run_all.COMMAND_PREFIX}{command}\n{run_all.SECONDS_PREFIX}42 exit=3\nsome output\nRESULT gold_loop a=1\n")
    assert run_all.kept_log("gold_loop") == (command, 3, "some output\nRESULT gold_loop a=1", 42.0)
    # a log that run_bench did not write (no header) is not taken
    (tmp_path / "ppo_bench.log").write_text("RESULT ppo ours_eps=1\n")
    assert run_all.kept_log("ppo_bench") is None and run_all.kept_log("ui_bench") is None


def test_bench_args_must_name_a_bench(capsys):
    with pytest.raises(SystemExit, match="unknown"):
        run_all.main(["--only", "store_bench", "--bench-args", "nope=--x"])
    with pytest.raises(SystemExit, match="not NAME=ARGS"):
        run_all.main(["--bench-args", "gold_loop"])
