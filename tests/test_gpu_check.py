"""bench/gpu_check.py on the CPU: its dry run end to end in bf16 (CPU autocast) with the TRL side
on, so a dtype mismatch on either side fails here rather than on the GPU; what it leaves in OUT
against what comes back from the GPU machine; the store, the UI, duckdb, gradio and datasets
unimportable for our side; a phase cut at the budget; the process group of a timed-out phase
ended; how wheels are made importable. (The dry run: about a minute on an idle 2-core machine,
more when it is shared; the check's phases each start their own processes.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from bench import gpu_check
from bench.run_all import run_command

ROOT = Path(__file__).resolve().parents[1]
# what comes back from the GPU machine's output folder (docs/gpu.md)
BACK_FILES, BACK_DEPTH, BACK_BYTES = 6, 2, 16 * 2**20


def results(stdout: str) -> dict[str, dict]:
    found = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT gpu_"):
            parts = line.split()
            found.setdefault(parts[1], dict(p.split("=", 1) for p in parts[2:]))
    return found


def assert_comes_back(out: Path) -> None:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= BACK_FILES, sorted(map(str, files))
    for path in files:
        assert len(path.relative_to(out).parts) - 1 <= BACK_DEPTH, path
        assert path.stat().st_size < BACK_BYTES // 4, (path, path.stat().st_size)  # well under the limit
        assert not path.is_symlink()


@pytest.mark.slow
def test_the_bf16_dry_run_measures_both_sides_of_every_phase_and_out_comes_back(tmp_path):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--dtype", "bf16", "--trl", "on",
                           "--out", str(out), "--work", str(tmp_path / "work"), "--budget-s", "1200"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    seconds = time.perf_counter() - t0
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    found = results(done.stdout)
    assert found["gpu_tests"]["failed"] == "0" and int(found["gpu_tests"]["passed"]) >= 1
    ppo, reward, generate = found["gpu_ppo"], found["gpu_reward"], found["gpu_generate"]
    assert ppo["shape"] == "tiny" and ppo["status"] == "ok"
    assert float(ppo["ours_eps"]) > 0 and float(ppo["trl_eps"]) > 0 and float(ppo["ratio"]) > 0  # both sides, bf16
    assert reward["status"] == "ok" and float(reward["ours_pairs_s"]) > 0
    assert float(reward["trl_pairs_s"]) > 0 and float(reward["trl_grouped_pairs_s"]) > 0
    assert generate["batch"] == "8" and float(generate["ratio"]) > 0 and generate["rounds"] == "1/1"
    check = found["gpu_check"]
    assert (check["failed"], check["cut"], check["skipped"]) == ("0", "0", "0")
    assert check["trl"] == "run" and check["dtype"] == "bf16"

    # OUT: the three files, every phase's results in the JSON and every phase's log in one file
    assert sorted(p.name for p in out.iterdir()) == sorted(gpu_check.OUT_FILES)
    assert_comes_back(out)
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["out_problems"] == [] and report["dtype"] == "bf16"
    assert report["guard"].endswith("duckdb,gradio,datasets unimportable")
    phases = [r["phase"] for r in report["phases"]]
    assert phases == ["pytest", "ppo-tiny", "reward-tiny", "generate-tiny-b8"]  # the order of the GPU run
    assert all(r["status"] == "ok" for r in report["phases"])
    assert report["results"] == [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT gpu_")]
    bench = report["phases"][1]["bench"]
    assert bench["settings"]["dtype"] == "bf16" and bench["failed"] == {} and bench["complete"]
    # the no-EOS tokenizer made every PPO response run to --max-new-tokens (8 in the dry run)
    assert all(r["response_tokens"] == 8 for r in bench["runs"]["ours"]) and len(bench["runs"]["trl"]) == 1
    log = (out / "phases.log").read_text()
    assert [ln.split(":")[0][len(gpu_check.LOG_HEADER):] for ln in log.splitlines()
            if ln.startswith(gpu_check.LOG_HEADER)] == phases
    table = (out / "gpu_check.md").read_text()
    assert table.count("| ok |") == 4 and "RESULT gpu_check" in table
    print(f"bf16 dry run with the TRL side: {seconds:.0f} s")


def test_what_would_not_come_back_is_named(tmp_path):
    assert (gpu_check.MAX_OUT_FILES, gpu_check.MAX_OUT_DEPTH, gpu_check.MAX_FILE_BYTES) == (
        BACK_FILES, BACK_DEPTH, BACK_BYTES)
    assert len(gpu_check.OUT_FILES) <= BACK_FILES
    for name in gpu_check.OUT_FILES:
        (tmp_path / name).write_text("x")
    assert gpu_check.out_problems(tmp_path) == []
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.log").write_text("x")
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(BACK_BYTES)  # sparse: no disk used
    for i in range(3):
        (tmp_path / f"extra{i}.txt").write_text("x")
    problems = " ".join(gpu_check.out_problems(tmp_path))
    assert "deeper than 2 folders" in problems and "big.bin" in problems and "8 files, at most 6" in problems


def test_a_phase_log_is_capped_head_and_tail():
    text = "start\n" + "x" * (3 * gpu_check.LOG_CAP_BYTES) + "\nthe end"
    kept = gpu_check.capped(text)
    assert len(kept.encode()) < gpu_check.LOG_CAP_BYTES + 100
    assert kept.startswith("start") and kept.endswith("the end") and "bytes left out" in kept
    assert gpu_check.capped("short") == "short"
    # every phase of a GPU run, each capped, fits in one file that comes back
    n_phases = 1 + sum(1 + 1 + len(gpu_check.GPU["batches"]) for _ in gpu_check.GPU["ppo"])
    assert n_phases * (gpu_check.LOG_CAP_BYTES + 1000) < BACK_BYTES


def test_the_budget_and_time_limit_leave_a_minute_each_and_small_shapes_go_first():
    assert gpu_check.BUDGET_S + 60 <= gpu_check.TIME_LIMIT_S <= 600 - 60
    assert list(gpu_check.GPU["ppo"]) == ["smollm2-135m", "smollm2-1.7b"]
    doc = (ROOT / "docs" / "gpu.md").read_text()
    assert "python3 bench/gpu_check.py --wheels wheels --out $OUT" in doc
    assert f"timeout_s={gpu_check.TIME_LIMIT_S}" in doc and 'carry=["wheels"]' in doc


def test_a_phase_past_the_budget_is_cut_and_its_process_group_ended(tmp_path):
    # the phase starts a worker of its own (as the benches do); both must be gone after the cut
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(120)']); print('worker', p.pid, flush=True); time.sleep(120)")
    log = tmp_path / "phases.log"
    row, output = gpu_check.run_phase("slow", [sys.executable, "-c", code], dict(os.environ),
                                      gpu_check.Budget(3), 60, log)
    assert row["status"] == "cut" and "the budget" in row["why"] and row["seconds"] < 20
    worker = int(next(ln for ln in output.splitlines() if ln.startswith("worker")).split()[1])
    assert not _alive(worker)
    assert log.read_text().startswith(f"{gpu_check.LOG_HEADER}slow: status=cut")


def _alive(pid: int, wait_s: float = 5.0) -> bool:
    """Whether pid still runs (a zombie waiting to be reaped counts as ended)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state == "Z":
            return False
        time.sleep(0.1)
    return True


def test_run_command_reports_what_a_timed_out_command_printed():
    rc, output = run_command([sys.executable, "-c", "print('measured', flush=True); import time; time.sleep(60)"],
                             dict(os.environ), 2)
    assert rc == 124 and "measured" in output and "process group" in output


def test_a_failed_side_keeps_the_other_sides_figures():
    run = {"eps": 2.0, "rollout_s": 1.0, "update_s": 0.5, "peak_mb": 100}
    data = {"flops": {"update_flops": 1e12}, "runs": {"ours": [run], "trl": []},
            "failed": {"trl": "exit 1\nRuntimeError: expected m1 and m2 to have the same dtype"}}
    row = {"status": "failed", "figures": gpu_check.ppo_figures(data, "tiny"), "failed_sides": data["failed"]}
    assert row["figures"]["ours_eps"] == 2.0 and "trl_eps" not in row["figures"] and "ratio" not in row["figures"]
    line = gpu_check.result_line("ppo", row, gpu_check.PPO_KEYS, "cuda")
    assert line.startswith("RESULT gpu_ppo status=failed shape=tiny ours_eps=2.0") and " trl=failed " in line
    assert "trl failed: RuntimeError: expected m1" in gpu_check._figures_text(row)


def test_the_guard_refuses_what_the_gpu_machine_lacks(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(gpu_check.GUARD_CODE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
           "RLHF_BLOCK_IMPORTS": gpu_check.BLOCKED}
    for name in ("duckdb", "gradio", "datasets", "store"):
        done = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True)
        assert done.returncode != 0 and "RLHF_BLOCK_IMPORTS" in done.stderr, name
    done = subprocess.run([sys.executable, "-c", "import duckdb"], capture_output=True, text=True,
                          env={**env, "RLHF_BLOCK_IMPORTS": ""})
    assert done.returncode == 0, done.stderr  # without the variable nothing is refused


def _wheel(folder: Path, name: str, module: str) -> Path:
    path = folder / name
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{module}/__init__.py", "VALUE = 42\n")
    return path


def test_wheels_are_unpacked_only_when_missing_and_fitting(tmp_path):
    ver = f"{sys.version_info.major}{sys.version_info.minor}"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "rlhf_fake_dist-1.0-py3-none-any.whl", "rlhf_fake_mod")
    _wheel(wheels, "torch-0.0.1-py3-none-any.whl", "torch_fake")  # torch is installed: left alone
    _wheel(wheels, f"other_fake-1.0-cp{ver}-cp{ver}-manylinux_2_17_notamachine.whl", "other_fake")
    done = {r["wheel"].split("-")[0]: r["action"] for r in gpu_check.unpack_wheels(wheels, tmp_path / "site")}
    assert done["rlhf_fake_dist"] == "unpacked" and done["torch"].startswith("present")
    assert done["other_fake"] == "not for this interpreter"
    assert (tmp_path / "site" / "rlhf_fake_mod" / "__init__.py").is_file()
    assert not (tmp_path / "site" / "torch_fake").exists()
    assert gpu_check._wheel_fits(f"x-1-cp{ver}-cp{ver}-manylinux_2_17_{os.uname().machine}.whl")
    assert not gpu_check._wheel_fits("x-1-cp27-cp27mu-manylinux1_x86_64.whl")


def test_download_commands_pin_every_wheel_and_only_those_the_image_lacks():
    cmds = gpu_check.download_commands("wheels")
    specs = [a for c in cmds for a in c if "==" in a]
    assert "trl==1.12.0" in specs and all(c[:3] == ["pip", "download", "--no-deps"] for c in cmds)
    assert len(specs) == len(gpu_check.PURE_WHEELS) + sum(map(len, gpu_check.BINARY_WHEELS.values()))
    assert {s.split("==")[0] for s in specs} == {"trl", "datasets", "dill", "multiprocess"}
