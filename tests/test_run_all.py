"""bench/run_all.py: keeping earlier benches' logs, per-bench arguments, and the table's spreads,
intervals and per-row commit/date/load (no bench is run)."""

from __future__ import annotations

import pytest

from bench import run_all


def test_a_kept_log_gives_back_command_exit_code_output_seconds_and_run(tmp_path, monkeypatch):
    monkeypatch.setattr(run_all, "LOGS", tmp_path)
    command = run_all.bench_command("gold_loop", False, "--threads 1 --out 'a b'")
    assert command == ("python bench/gold/closed_loop.py --quick --seeds 0 --rounds 2 --prompts-per-round 4 "
                       "--eval-samples 2 --leaderboard-prompts 3 --threads 1 --out 'a b'")
    meta = {"commit": "abc1234-dirty", "date": "2026-12-01 10:30", "load": "2.1-3.4"}
    (tmp_path / "gold_loop.log").write_text(
        f"{run_all.COMMAND_PREFIX}{command}\n{run_all.SECONDS_PREFIX}42 exit=3\n"
        f"{run_all.RUN_PREFIX}{run_all.format_meta(meta)}\nsome output\nRESULT gold_loop a=1\n")
    assert run_all.kept_log("gold_loop") == (command, 3, "some output\nRESULT gold_loop a=1", 42.0, meta)
    # an older log without the run line: its output intact, no run facts
    (tmp_path / "store_bench.log").write_text(
        f"{run_all.COMMAND_PREFIX}x\n{run_all.SECONDS_PREFIX}5 exit=0\nRESULT store a=1\n")
    assert run_all.kept_log("store_bench") == ("x", 0, "RESULT store a=1", 5.0, {})
    # a log that run_bench did not write (no header) is not taken
    (tmp_path / "ppo_bench.log").write_text("RESULT ppo ours_eps=1\n")
    assert run_all.kept_log("ppo_bench") is None and run_all.kept_log("ui_bench") is None


def test_bench_args_must_name_a_bench(capsys):
    with pytest.raises(SystemExit, match="unknown"):
        run_all.main(["--only", "store_bench", "--bench-args", "nope=--x"])
    with pytest.raises(SystemExit, match="not NAME=ARGS"):
        run_all.main(["--bench-args", "gold_loop"])


def test_rows_show_medians_with_ranges_intervals_and_where_they_were_measured():
    _, ppo = run_all.parse_result_line(
        "RESULT ppo ours_eps=0.660 ours_eps_min=0.600 ours_eps_max=0.700 trl_eps=0.482 trl_eps_min=0.450 "
        "trl_eps_max=0.500 ratio=1.37 ratio_min=1.20 ratio_max=1.50 ours_peak_mb=3808 trl_peak_mb=5268")
    _, reward = run_all.parse_result_line(
        "RESULT reward ours_pairs_s=0.6 trl_pairs_s=0.3 trl_grouped_pairs_s=0.4 ratio=2.00 ratio_grouped=1.50 "
        "ours_acc=0.525 ours_acc_lo=0.476 ours_acc_hi=0.574 trl_acc=0.500 trl_acc_lo=0.451 trl_acc_hi=0.549")
    runs = {"ppo": {"commit": "abc1234", "date": "2026-12-01 10:30", "load": "2.1-3.4"}}
    table = run_all.build_table({"ppo": ppo, "reward": reward}, runs=runs)
    eps = next(line for line in table if "PPO episodes/s" in line)
    assert "| 0.660 [0.600-0.700] |" in eps and "| 0.482 [0.450-0.500] |" in eps
    assert "| 1.37x [1.20-1.50] |" in eps and eps.endswith("| abc1234 | 2026-12-01 10:30 | 2.1-3.4 |")
    acc = next(line for line in table if "accuracy" in line)
    assert "| 0.525 [0.476, 0.574] |" in acc and "| 0.500 [0.451, 0.549] |" in acc and "| +0.025 |" in acc
    assert acc.endswith("| ? | ? | ? |")  # no run facts given for this bench: said so, not invented
    grouped = next(line for line in table if "group_by_length" in line)
    assert "| 1.50x |" in grouped


def test_the_commit_is_read_from_git():
    commit = run_all.git_commit()
    assert commit != "unknown" and len(commit.removesuffix("-dirty")) >= 7
