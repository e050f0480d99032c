"""Smoke tests of benches that have no other test: each runs end to end on the tiny model in
seconds, so a change that breaks a bench is seen (their figures come from full runs, not these)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ppo_bench_runs_our_ppo_our_rloo_and_trls_rloo_side_by_side(tmp_path, tiny_model_dir):
    """bench/ppo_bench.py with our PPO, our RLOO and TRL's RLOOTrainer (TRL's PPOTrainer side is
    exercised by the bench's full runs): each side's runs and the ratio lines."""
    cmd = [sys.executable, "bench/ppo_bench.py", "--model", str(tiny_model_dir), "--threads", "1", "--reps", "1",
           "--steps", "3", "--batch-size", "8", "--mini-batch-size", "4", "--micro-batch-size", "4",
           "--max-new-tokens", "6", "--ppo-epochs", "1", "--sides", "ours,rloo,trl_rloo", "--work", str(tmp_path),
           "--json", str(tmp_path / "results.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT ppo "))
    fields = dict(kv.split("=") for kv in result.split()[2:])
    for key in ("ours_eps", "rloo_eps", "trl_rloo_eps", "rloo_ratio", "rloo_trl_ratio", "rloo_trl_peak_ratio"):
        assert float(fields[key]) > 0, key
    assert "trl_eps" not in fields and not (tmp_path / "ours_rloo_run" / "checkpoint" / "critic").exists()
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    # every side timed the same steps: 3, the first left out as a warm-up
    assert {side: runs[side][0]["steps_measured"] for side in runs} == {"ours": 2, "rloo": 2, "trl_rloo": 2}


@pytest.mark.slow
def test_soak_survives_a_kill_with_no_one_signed_out_and_nothing_lost():
    """bench/soak.py with 2 annotators and 1 SIGKILL (the full run: 10 and 30): its checks pass."""
    sys.path.insert(0, str(ROOT / "bench"))
    import soak

    assert soak.main(["--kills", "1", "--annotators", "2", "--gap", "2", "4"]) == 0


@pytest.mark.slow
def test_job_start_bench_times_cold_and_warm_jobs_side_by_side():
    """bench/job_start_bench.py --quick: one short job on each side, the ratio line."""
    done = subprocess.run([sys.executable, "bench/job_start_bench.py", "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT job_start "))
    fields = dict(kv.split("=") for kv in result.split()[2:])
    assert float(fields["cold_s"]) > 0 and float(fields["warm_s"]) > 0 and fields["jobs"] == "1"


@pytest.mark.slow
def test_store_bench_measures_every_phase_on_a_small_store(tmp_path):
    """bench/store_bench.py on 500 rankings by 4 annotators (overlap 2): every phase runs, the RESULT line has
    them all."""
    done = subprocess.run([sys.executable, "bench/store_bench.py", "--rankings", "500", "--concurrent-seconds", "1", "--annotators", "4",
                           "--dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT store "))
    fields = dict(kv.split("=") for kv in result.split()[2:])
    assert fields["rankings"] == "500" and fields["overlap"] == "2" and int(fields["pairs"]) > 500
    assert all(float(fields[k]) > 0 for k in ("next_item_p95_ms", "think_next_p95_ms", "think_submit_p95_ms", "team_s",
                                              "overview_s", "parquet_pairs_per_s"))
    assert (tmp_path / "backup.duckdb").is_file()


@pytest.mark.slow
def test_ui_bench_times_the_app_and_gradios_floor_over_http():
    """bench/ui_bench.py with 2 annotators for 4 s: the app through HTTP and the no-op Gradio app
    (the floor under it) each serve submissions without error, with their CPU per submission."""
    done = subprocess.run([sys.executable, "bench/ui_bench.py", "--annotators", "2", "--seconds", "4", "--think", "0.2",
                           "--phases", "http,http-no-op"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = [dict(kv.split("=", 1) for kv in line.split()[2:])
               for line in done.stdout.splitlines() if line.startswith("RESULT ui ")]
    assert [r["phase"] for r in results] == ["http", "http-no-op"]
    for r in results:
        assert int(r["submissions"]) > 0 and r["errors"] == "0"
        if Path("/proc/self/stat").is_file():  # the app's CPU is read from Linux's /proc
            assert float(r["server_cpu_ms"]) > 0 and float(r["client_cpu_ms"]) > 0


def test_scale_bench_memory_table_counts_one_base_and_sampling_copy():
    """PPO with LoRA holds one base for its four roles (2P + 2 adapters' training state), and while
    sampling a bf16 copy of the adapted matrices: Llama-2-7B then needs more than a 24 GB card."""
    sys.path.insert(0, str(ROOT / "bench"))
    import scale_bench

    rows = {(r["model"], r["stage"], r["mode"]): r for r in scale_bench.memory_rows(scale_bench.ARCHS)}
    ppo, reward = rows["Llama-2-7B", "ppo", "lora"], rows["Llama-2-7B", "reward", "lora"]
    P, Pl = ppo["params"], ppo["lora_params"]
    assert ppo["weights_gb"] * scale_bench.GB == pytest.approx(2 * P + 32 * Pl)
    assert ppo["weights_gb"] - reward["weights_gb"] == pytest.approx(16 * Pl / scale_bench.GB)
    assert 12 < ppo["sampling_gb"] < 2 * P / scale_bench.GB
    assert not scale_bench.fits(ppo["weights_gb"], ppo["act_gc_gb"], 24, sampling_gb=ppo["sampling_gb"])
    assert scale_bench.fits(ppo["weights_gb"], ppo["act_gc_gb"], 80, sampling_gb=ppo["sampling_gb"])


@pytest.mark.slow
def test_round_cost_times_every_part_of_a_round_on_both_revisions(tmp_path, tiny_model_dir):
    """bench/round_cost.py with this revision on both sides (HEAD's tree from git archive): every
    part timed on each side, the table's round line and a RESULT line whose ratio is the totals'."""
    cmd = [sys.executable, "bench/round_cost.py", "--quick", "--before", "HEAD", "--model", str(tiny_model_dir),
           "--threads", "1", "--work", str(tmp_path), "--json", str(tmp_path / "cost.json")]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT round_cost "))
    fields = dict(kv.split("=", 1) for kv in result.split()[2:])
    cost = json.loads((tmp_path / "cost.json").read_text())
    assert set(cost["before_parts"]) == set(cost["after_parts"]) == {
        "generate", "reward", "reward normalisation", "ppo (once)", "ppo (per step)", "evaluation"}
    for side in ("before_parts", "after_parts"):
        assert all(p["cpu_s"] > 0 for name, p in cost[side].items() if name != "reward normalisation"), cost[side]
    assert float(fields["ratio"]) == pytest.approx(float(fields["after_cpu_s"]) / float(fields["before_cpu_s"]), rel=1e-2)
    assert cost["after_parts"]["generate"]["scale"] == 2.0 and cost["after_parts"]["ppo (per step)"]["scale"] == 2.0


@pytest.mark.slow
def test_reward_bench_times_grouped_pairwise_and_trl_on_rankings_of_four(tmp_path):
    """bench/reward_bench.py --quick on the tiny model with the K = 4 rankings: every side trains
    the same 36 pairs (6 rankings) and the RESULT line has each one's pairs/s and the ratios."""
    cmd = [sys.executable, "bench/reward_bench.py", "--quick", "--model", "tiny", "--threads", "1", "--rounds", "1",
           "--max-length", "128", "--json", str(tmp_path / "reward.json")]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT reward "))
    fields = dict(kv.split("=", 1) for kv in result.split()[2:])
    assert fields["data"] == "k4"
    for key in ("ours_pairs_s", "ours_pairs_pairs_s", "trl_pairs_s", "ratio", "ratio_pairs"):
        assert float(fields[key]) > 0, key
    results = json.loads((tmp_path / "reward.json").read_text())["results"]
    assert {side: r["pairs"] for side, r in results.items()} == {"ours": 36, "ours_pairs": 36, "trl": 36, "trl_grouped": 36}


@pytest.mark.slow
def test_dpo_bench_times_grouped_pairwise_and_trl_on_rankings_of_four(tmp_path):
    """bench/dpo_bench.py --quick (a small random model) on the K = 4 rankings: ours grouped, ours
    pair by pair and TRL's DPOTrainer on the same 36 pairs, and the ratios in the RESULT line."""
    cmd = [sys.executable, "bench/dpo_bench.py", "--quick", "--threads", "1", "--rounds", "1", "--max-length", "128",
           "--json", str(tmp_path / "dpo.json")]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT dpo "))
    fields = dict(kv.split("=", 1) for kv in result.split()[2:])
    assert fields["data"] == "k4" and fields["pairs"] == "36"
    for key in ("ours_pairs_s", "ours_pairs_pairs_s", "trl_pairs_s", "ratio", "ratio_pairs"):
        assert float(fields[key]) > 0, key


@pytest.mark.slow
def test_generate_bench_compares_our_sampler_and_hf_generate_at_two_batches(tmp_path):
    """bench/generate_bench.py on the tiny model at batches 8 and 16: every method at both, the
    table's ratios in the JSON and a RESULT line with the last batch's figures and the batch gain."""
    cmd = [sys.executable, "bench/generate_bench.py", "--model", "tiny", "--device", "cpu", "--quick", "--rounds", "2",
           "--batches", "8,16", "--max-new-tokens", "8", "--json", str(tmp_path / "generate.json")]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT generate "))
    fields = dict(kv.split("=") for kv in result.split()[2:])
    assert (fields["batch"], fields["base_batch"], fields["rounds"]) == ("16", "8", "2")
    for key in ("ours_tok_s", "hf_tok_s", "hf_logprobs_tok_s", "ours_base_tok_s", "hf_base_tok_s", "batch_gain"):
        assert float(fields[key]) > 0, key
    data = json.loads((tmp_path / "generate.json").read_text())
    assert data["complete"] and set(data["figures"]["batches"]) == {"8", "16"}
    at = data["figures"]["batches"]
    assert float(fields["ratio"]) == pytest.approx(at["16"]["ours"]["tok_s"] / at["16"]["hf generate"]["tok_s"], abs=0.01)
    assert float(fields["batch_gain"]) == pytest.approx(at["16"]["ours"]["tok_s"] / at["8"]["ours"]["tok_s"], abs=0.01)
    # every method sampled the same prompts at both batches: 2 rounds x 4 prompts x K=4 responses
    assert all(len(run) == 6 for run in data["runs"]) and data["figures"]["methods"] == at["16"]


@pytest.mark.slow
def test_chat_bench_times_turns_through_the_apps_client_and_the_openai_one(tiny_model_dir):
    """bench/chat_bench.py on the tiny model, 3 turns a side (the full run: the default model, 20):
    the model's load apart, both sides timed, the RESULT line."""
    done = subprocess.run([sys.executable, "bench/chat_bench.py", "--model", str(tiny_model_dir), "--turns", "3",
                           "--max-new-tokens", "8", "--threads", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT chat "))
    fields = dict(kv.split("=") for kv in result.split()[2:])
    assert fields["k"] == "4" and fields["turns"] == "3" and fields["threads"] == "1"
    assert all(float(fields[key]) > 0 for key in ("p50_s", "p95_s", "openai_p50_s", "openai_p95_s", "load_s"))
    assert float(fields["p50_s"]) <= float(fields["p95_s"])
    assert "| openai |" in done.stdout
