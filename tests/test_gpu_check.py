"""bench/gpu_check.py on the CPU: its dry run end to end with the store, the UI, duckdb, gradio and
datasets unimportable for our side, the import guard itself, and how wheels are made importable.
(About a minute on an idle 2-core machine; the check's phases each start their own processes.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def results(stdout: str) -> dict[str, dict]:
    found = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT gpu_"):
            parts = line.split()
            found.setdefault(parts[1], dict(p.split("=", 1) for p in parts[2:]))
    return found


def test_the_dry_run_measures_every_phase_with_our_side_guarded(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out), "--work",
                           str(tmp_path / "work"), "--budget-s", "1200"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = results(done.stdout)
    assert found["gpu_tests"]["failed"] == "0" and int(found["gpu_tests"]["passed"]) >= 1
    assert found["gpu_ppo"]["shape"] == "tiny" and float(found["gpu_ppo"]["ours_eps"]) > 0
    assert float(found["gpu_reward"]["ours_pairs_s"]) > 0
    assert found["gpu_generate"]["batch"] == "8" and float(found["gpu_generate"]["ratio"]) > 0
    assert found["gpu_check"]["failed"] == "0" and found["gpu_check"]["skipped"] == "0"
    assert "TRL side SKIPPED" in done.stdout and found["gpu_check"]["trl"] == "skipped"
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["guard"].endswith("duckdb,gradio,datasets unimportable")
    assert {r["phase"] for r in report["phases"]} == {"pytest", "ppo-tiny", "reward-tiny", "generate-tiny-b8"}
    assert all(r["status"] == "ok" for r in report["phases"])
    assert report["results"] == [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT gpu_")]
    # the no-EOS tokenizer made every PPO response run to --max-new-tokens (8 in the dry run)
    ppo = json.loads((out / "ppo-tiny.json").read_text())
    assert all(r["response_tokens"] == 8 for r in ppo["runs"]["ours"])
    assert (out / "gpu_results.md").read_text().count("| ok |") == 4
    assert (out / "logs" / "ppo-tiny.log").is_file()


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


def test_download_commands_pin_every_wheel():
    cmds = gpu_check.download_commands("wheels")
    specs = [a for c in cmds for a in c if "==" in a]
    assert "trl==1.12.0" in specs and all(c[:3] == ["pip", "download", "--no-deps"] for c in cmds)
    assert len(specs) == len(gpu_check.PURE_WHEELS) + sum(map(len, gpu_check.BINARY_WHEELS.values()))
