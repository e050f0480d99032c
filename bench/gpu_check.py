"""The GPU check: one command, run once when a GPU is lent (docs/gpu.md says how and what to record).

    python bench/gpu_check.py --wheels wheels --out $OUT    # on the GPU machine: at most ~8 minutes
    python bench/gpu_check.py --dry-run --out /tmp/gc       # CPU, tiny shapes, a few steps: the CI test
    python bench/gpu_check.py --prepare-wheels wheels       # here, with internet: the wheels + tokenizer

In bf16 on CUDA, in this order, each phase in its own process(es) and within one time budget
(--budget-s; a phase that no longer fits is skipped and said so):
1. `pytest -m gpu` on the test files that carry GPU tests (without tests/conftest.py, which
   imports the store; the model fixtures come from tests/fixtures_models.py);
2. PPO, ours against TRL 1.12.0's PPOTrainer (bench/ppo_bench.py: same settings, the same span
   timed, the order alternating over --reps) on the SmolLM2-135M and SmolLM2-1.7B architectures
   with random weights (built from their config sizes; no download); the tokenizer's EOS is a token
   the model cannot emit, so every response is exactly --max-new-tokens long on both sides.
   Episodes/s, rollout and update time, peak GPU memory and the update's model FLOP utilisation;
3. reward-model training pairs/s against TRL's RewardTrainer, default and group_by_length
   (bench/reward_bench.py) on the same shapes;
4. sampling tokens/s of our loop against `model.generate` at batch 8 and 64 (bench/generate_bench.py).

Our side runs with store, annotate, duckdb, gradio and datasets unimportable (GUARD_CODE,
RLHF_BLOCK_IMPORTS), as on the GPU machine, where they are not installed; the TRL side runs in its
own processes and may import datasets and trl. --wheels DIR makes the wheels there importable
without a network: each one whose distribution is not installed already is unpacked into a
folder put on PYTHONPATH (a wheel is a zip of its files), binary ones only when their tags fit
this interpreter.

Output: a table and `RESULT gpu_...` lines on stdout; OUT/gpu_check.json (every figure, the
machine, the wheels used, each phase's command, status and seconds), OUT/gpu_results.md (the
table to commit as docs/results/gpu.md) and OUT/logs/<phase>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.run_all import run_command  # noqa: E402

BLOCKED = "store,annotate,duckdb,gradio,datasets"
# Written as sitecustomize.py into a folder put first on our side's PYTHONPATH, so every process of
# our side (and its children, which inherit the environment) refuses the packages the GPU machine
# lacks; the benches take RLHF_BLOCK_IMPORTS out of their TRL processes' environment.
GUARD_CODE = """
import importlib.abc, os, sys

class _Refuse(importlib.abc.MetaPathFinder):
    blocked = {n for n in os.environ.get("RLHF_BLOCK_IMPORTS", "").split(",") if n}

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.blocked:
            raise ImportError(f"{name} is not importable here (RLHF_BLOCK_IMPORTS: the GPU machine lacks it)")
        return None

if os.environ.get("RLHF_BLOCK_IMPORTS"):
    sys.meta_path.insert(0, _Refuse())
"""
# NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 Tensor Core 1,979 TFLOPS with
# 2:4 sparsity, so 989 TFLOP/s dense, the figure model FLOP utilisation is measured against.
H200_BF16_DENSE_TFLOPS = 989.0

# Architectures from the models' config.json on the Hugging Face hub (HuggingFaceTB/SmolLM2-135M,
# HuggingFaceTB/SmolLM2-1.7B); weights are random, the vocabulary is the tokenizer's (49152).
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
    "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, rope_theta=130000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
    # the dry run's stand-in: the same code paths in seconds on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=1024,
                 tie_word_embeddings=True, rms_norm_eps=1e-5),
}

# What each phase runs, per shape. GPU sizes: a PPO batch of 64 episodes x 128 new tokens, 2 PPO
# epochs, 4 steps (the first a warm-up); the dry run: the smallest sizes that run every phase.
GPU = {
    "ppo": {"smollm2-135m": "--steps 4 --batch-size 64 --mini-batch-size 32 --micro-batch-size 32 "
                            "--max-new-tokens 128 --ppo-epochs 2",
            "smollm2-1.7b": "--steps 4 --batch-size 64 --mini-batch-size 32 --micro-batch-size 16 "
                            "--max-new-tokens 128 --ppo-epochs 2"},
    "reward": "--train-pairs 256 --eval-pairs 64 --batch-size 8 --grad-accum 1 --max-length 512 --rounds 1",
    "generate": "--k 4 --max-new-tokens 128 --rounds 3",
    "batches": [8, 64],
}
DRY = {
    "ppo": {"tiny": "--steps 2 --batch-size 4 --mini-batch-size 2 --micro-batch-size 2 --max-new-tokens 8 "
                    "--ppo-epochs 1 --n-prompts 16"},
    "reward": "--train-pairs 8 --eval-pairs 8 --batch-size 4 --grad-accum 1 --max-length 256 --rounds 1",
    "generate": "--k 4 --max-new-tokens 8 --rounds 1",
    "batches": [8],
}

# The wheels the GPU machine lacks (Python 3.12, torch, transformers 5.x, peft, accelerate, pandas,
# pyarrow present; no datasets, trl or pytest): `pip download --no-deps` of exactly these.
# datasets 4.7.0 is the oldest that trl 1.12.0 accepts and allows huggingface-hub 1.x (which
# transformers 5.x needs); dill, multiprocess, fsspec at the highest versions it allows.
PURE_WHEELS = ["trl==1.12.0", "datasets==4.7.0", "dill==0.4.0", "multiprocess==0.70.18", "fsspec==2026.2.0",
               "requests==2.32.5", "urllib3==2.5.0", "charset-normalizer==3.4.4", "idna==3.10",
               "certifi==2025.10.5", "pytest==9.0.2", "pluggy==1.6.0", "iniconfig==2.3.0", "pygments==2.19.2"]
BINARY_WHEELS = {"xxhash==3.6.0": ["manylinux_2_17_x86_64", "manylinux_2_17_aarch64"]}


def download_commands(folder: str) -> list[list[str]]:
    """The pip commands that fill the wheels folder (docs/gpu.md lists the same)."""
    base = ["pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "-d", folder]
    cmds = [base + ["--platform", "any"] + PURE_WHEELS]  # pure wheels even where a binary one exists
    for spec, platforms in BINARY_WHEELS.items():
        for plat in platforms:
            cmds.append(base + ["--platform", plat, spec])
    return cmds


def prepare_wheels(folder: Path) -> int:
    """Download the wheels and copy SmolLM2's tokenizer (from the converted default model) beside them."""
    folder.mkdir(parents=True, exist_ok=True)
    for cmd in download_commands(str(folder)):
        print("$ " + " ".join(cmd), flush=True)
        if subprocess.run([sys.executable, "-m", *cmd], check=False).returncode != 0:
            return 1
    sys.path.insert(0, str(ROOT))
    from pipeline.models import default_model_dir

    src, dst = default_model_dir(), folder / "tokenizer"
    dst.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"{folder}: {size / 2**20:.1f} MiB")
    return 0


# --------------------------------------------------------------------------- wheels on the GPU machine


def _dist_installed(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _wheel_fits(filename: str) -> bool:
    """A wheel's python and platform tags against this interpreter (no pip, no packaging needed)."""
    parts = filename[:-4].split("-")
    py, abi, plat = parts[-3], parts[-2], parts[-1]
    ver = f"{sys.version_info.major}{sys.version_info.minor}"
    py_ok = any(t in (f"py{sys.version_info.major}", f"py{ver}", f"cp{ver}") for t in py.split("."))
    plat_ok = plat == "any" or (sys.platform == "linux" and platform.machine() in plat)
    return py_ok and plat_ok and (abi == "none" or abi.startswith(f"cp{ver}") or abi == "abi3")


def unpack_wheels(folder: Path, site: Path, force: bool = False) -> list[dict]:
    """Unpack each wheel of `folder` whose distribution is missing (all of them with force) into
    `site`; returns what was done with each."""
    site.mkdir(parents=True, exist_ok=True)
    done = []
    for whl in sorted(folder.glob("*.whl")):
        dist, version = whl.name.split("-")[:2]
        installed = _dist_installed(dist.replace("_", "-"))
        row = {"wheel": whl.name}
        if installed and not force:
            row["action"] = f"present ({installed})"
        elif not _wheel_fits(whl.name):
            row["action"] = "not for this interpreter"
        else:
            with zipfile.ZipFile(whl) as zf:
                zf.extractall(site)
            row["action"] = "unpacked"
        done.append(row)
    return done


# --------------------------------------------------------------------------- model folders


def build_shape(name: str, tokenizer_src: str | None, out: Path, device: str) -> tuple[Path, Path]:
    """(folder, no-EOS folder) of a random-weight model of the named shape. The second has the same
    weights (linked) and a tokenizer whose EOS is one token beyond the model's vocabulary: the model
    can never emit it, so every response runs to the length limit on both sides of a comparison."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, noeos = out / name, out / f"{name}-noeos"
    if (noeos / "config.json").is_file() and (folder / "config.json").is_file():
        return folder, noeos
    if tokenizer_src:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    else:
        sys.path.insert(0, str(ROOT))
        from tests.tiny import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SHAPES[name])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):  # a 1.7B model initialises in seconds on the GPU, in minutes on CPU
        model = LlamaForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    noeos.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.suffix == ".safetensors" or f.name.endswith(".safetensors.index.json"):
            target = noeos / f.name
            if not target.exists():
                target.symlink_to(f.resolve())
    tokenizer.add_special_tokens({"eos_token": "<|no_eos|>"})
    never = tokenizer.eos_token_id
    assert never >= config.vocab_size, "the no-EOS token must lie outside the model's vocabulary"
    config.eos_token_id = never
    config.save_pretrained(noeos)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = never
    (noeos / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tokenizer.save_pretrained(noeos)
    return folder, noeos


# --------------------------------------------------------------------------- phases


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run_phase(name: str, cmd: list[str], env: dict, out: Path, budget: Budget, need_s: float,
              limit_s: float) -> dict:
    """Run one phase's command within what is left of the budget; its output goes to OUT/logs."""
    row = {"phase": name, "command": " ".join(cmd)}
    left = budget.left()
    if left < need_s:
        row.update(status="skipped", why=f"{left:.0f} s of the budget left, the phase needs about {need_s:.0f} s")
        print(f"[{name}] skipped: {row['why']}", flush=True)
        return row
    timeout = min(limit_s, left)
    print(f"[{name}] {row['command']}  (at most {timeout:.0f} s)", flush=True)
    t0 = time.perf_counter()
    rc, output = run_command(cmd, env, timeout)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "logs" / f"{name}.log").write_text(output, encoding="utf-8")
    row["status"] = "ok" if rc == 0 else "failed"
    row["exit"] = rc
    results = [ln for ln in output.splitlines() if ln.startswith("RESULT ")]
    row["result"] = results[-1] if results else ""
    if rc != 0:
        row["tail"] = output.strip().splitlines()[-15:]
        print(f"[{name}] FAILED (exit {rc}); last lines:\n  " + "\n  ".join(row["tail"]), flush=True)
    else:
        print(f"[{name}] ok in {row['seconds']:.0f} s", flush=True)
    return row


def pytest_counts(xml: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not xml.is_file():
        return {}
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    get = lambda k: int(suite.get(k, 0))  # noqa: E731
    return {"tests": get("tests"), "failed": get("failures") + get("errors"), "skipped": get("skipped"),
            "passed": get("tests") - get("failures") - get("errors") - get("skipped")}


def gpu_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", default="", help="folder for gpu_check.json, gpu_results.md and logs/")
    parser.add_argument("--wheels", default="", help="folder of wheels (and tokenizer/) brought to this machine")
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny shape, a few steps")
    parser.add_argument("--trl", choices=["auto", "on", "off"], default="",
                        help="run the TRL side: auto = when trl and datasets import (default on a GPU); "
                             "the dry run defaults to off (TRL's import alone takes most of a minute on 2 cores)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="seconds for all phases together")
    parser.add_argument("--reps", type=int, default=2, help="PPO repetitions per side, the order alternating")
    parser.add_argument("--shapes", default="", help="comma-separated shapes (default: both SmolLM2 shapes; tiny "
                                                     "in the dry run)")
    parser.add_argument("--phases", default="pytest,ppo,reward,generate", help="which phases to run")
    parser.add_argument("--work", default="", help="folder for model folders and runs (default: a temporary one)")
    parser.add_argument("--prepare-wheels", default="", metavar="DIR", help="download the wheels into DIR and stop")
    args = parser.parse_args(argv)
    if args.prepare_wheels:
        return prepare_wheels(Path(args.prepare_wheels))
    if not args.out:
        parser.error("--out is required")
    started, t_start = time.strftime("%Y-%m-%d %H:%M:%S %Z"), time.perf_counter()
    budget = Budget(args.budget_s)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU machine")
        return 2
    plan = DRY if args.dry_run else GPU
    shapes = args.shapes.split(",") if args.shapes else list(plan["ppo"])
    phases = args.phases.split(",")

    # 0. the wheels, the environments of our side and of TRL's side
    wheels = Path(args.wheels).resolve() if args.wheels else None
    site = work / "site"
    unpacked = unpack_wheels(wheels, site) if wheels else []
    pythonpath = [str(ROOT)] + ([str(site)] if wheels else []) + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    guard = work / "guard"
    guard.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(GUARD_CODE, encoding="utf-8")
    ours_env = {**base_env, "PYTHONPATH": os.pathsep.join([str(guard), *pythonpath]), "RLHF_BLOCK_IMPORTS": BLOCKED}
    probe = subprocess.run([sys.executable, "-c", "import trl, datasets; print(trl.__version__, datasets.__version__)"],
                           env={**base_env, "PYTHONPATH": os.pathsep.join(pythonpath)}, capture_output=True, text=True)
    trl_mode = args.trl or ("off" if args.dry_run else "auto")
    trl_ok = probe.returncode == 0
    run_trl = trl_mode == "on" or (trl_mode == "auto" and trl_ok)
    trl_note = (f"trl {probe.stdout.split()[0]}, datasets {probe.stdout.split()[1]}" if trl_ok
                else "trl/datasets not importable: " + (probe.stderr.strip().splitlines() or ["?"])[-1])
    if not run_trl:
        print(f"TRL side SKIPPED ({'--trl off' if trl_mode == 'off' else trl_note}): ours only, no ratios", flush=True)
    tok_src = None
    if not args.dry_run:
        tok_dir = wheels / "tokenizer" if wheels else None
        if tok_dir is None or not (tok_dir / "tokenizer.json").is_file():
            print("the SmolLM2 tokenizer is missing: bring it as WHEELS/tokenizer (--prepare-wheels does)")
            return 2
        tok_src = str(tok_dir)
    machine = {"python": platform.python_version(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
               "cpus": os.cpu_count(), "trl": trl_note}
    for dist in ("transformers", "peft", "accelerate"):
        machine[dist] = _dist_installed(dist)
    print(f"machine: {json.dumps(machine)}", flush=True)
    report = {"started": started, "dry_run": args.dry_run, "machine": machine, "wheels": unpacked,
              "guard": f"our side with {BLOCKED} unimportable", "trl_side": "run" if run_trl else "skipped",
              "phases": []}
    rows, results = report["phases"], []

    def save() -> None:  # after every phase: a check stopped half-way keeps what it measured
        report["seconds"] = round(time.perf_counter() - t_start, 1)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1), encoding="utf-8")

    py = sys.executable

    def measure(name: str, cmd: list[str], need_s: float, limit_s: float, js: Path | None = None):
        """(row, the bench's JSON or None) of one measured phase, its row recorded."""
        row = run_phase(name, cmd, ours_env, out, budget, need_s, limit_s)
        rows.append(row)
        ok = row["status"] == "ok" and js is not None and js.is_file()
        return row, json.loads(js.read_text()) if ok else None
    # 1. pytest -m gpu over every test file with GPU tests. The dry run collects them all (they
    # import here without the store) and runs tests/test_gpu.py's on the CPU (RLHF_TEST_DEVICE=cpu;
    # about 10 s on an idle 2-core machine); the others name cuda themselves
    if "pytest" in phases:
        xml = out / "pytest.xml"
        env = {**ours_env, "RLHF_TEST_DEVICE": device}
        cmd = [py, "-m", "pytest", "--noconftest", "-p", "tests.fixtures_models", "-m", "gpu", "-q",
               "-p", "no:cacheprovider", f"--junitxml={xml}", *gpu_test_files()]
        cmd += ["-k", "test_gpu.py"] if args.dry_run else []  # pytest's keywords include the file name
        row = run_phase("pytest", cmd, env, out, budget, 20, 150)
        row.update(pytest_counts(xml))
        rows.append(row)
        if "tests" in row:
            results.append(f"RESULT gpu_tests passed={row['passed']} failed={row['failed']} "
                           f"skipped={row['skipped']} seconds={row['seconds']:.0f} device={device}")
        save()

    folders = {}
    for shape in shapes:
        if any(p in phases for p in ("ppo", "reward", "generate")):
            t0 = time.perf_counter()
            folders[shape] = build_shape(shape, tok_src, work / "models", device)
            print(f"[{shape}] random-weight model folders in {time.perf_counter() - t0:.0f} s", flush=True)

    # 2. PPO, ours and TRL, per shape
    for shape in shapes if "ppo" in phases else []:
        js = out / f"ppo-{shape}.json"
        cmd = [py, "bench/ppo_bench.py", "--device", device, "--model", str(folders[shape][1]), "--reps",
               str(args.reps if run_trl else 1), "--threads", "4" if device == "cuda" else "2",
               "--work", str(work / f"ppo-{shape}"), "--json", str(js), *plan["ppo"][shape].split()]
        cmd += [] if run_trl else ["--only", "ours"]
        row, data = measure(f"ppo-{shape}", cmd, 60 if device == "cuda" else 10, 330, js)
        if data:
            flops = data["flops"]["update_flops"]
            row["figures"] = fig = {"shape": shape, "update_tflop_per_step": round(flops / 1e12, 4)}
            for side, runs in data["runs"].items():
                update = statistics.median(r["update_s"] for r in runs)
                fig[f"{side}_eps"] = round(statistics.median(r["eps"] for r in runs), 3)
                fig[f"{side}_eps_range"] = [round(min(r["eps"] for r in runs), 3), round(max(r["eps"] for r in runs), 3)]
                fig[f"{side}_rollout_s"] = round(statistics.median(r["rollout_s"] for r in runs), 3)
                fig[f"{side}_update_s"] = round(update, 3)
                fig[f"{side}_peak_mb"] = round(max(r["peak_mb"] for r in runs))
                fig[f"{side}_update_mfu"] = float(f"{flops / update / (H200_BF16_DENSE_TFLOPS * 1e12):.3g}")
            line = (f"RESULT gpu_ppo shape={shape} ours_eps={fig['ours_eps']} ours_rollout_s={fig['ours_rollout_s']} "
                    f"ours_update_s={fig['ours_update_s']} ours_peak_mb={fig['ours_peak_mb']} "
                    f"ours_update_mfu={fig['ours_update_mfu']}")
            if "trl_eps" in fig:
                fig["ratio"] = round(fig["ours_eps"] / fig["trl_eps"], 2)
                fig["ratio_per_rep"] = [round(x, 2) for x in data.get("ratio_per_rep", [])]
                line += (f" trl_eps={fig['trl_eps']} trl_rollout_s={fig['trl_rollout_s']} "
                         f"trl_update_s={fig['trl_update_s']} trl_peak_mb={fig['trl_peak_mb']} "
                         f"trl_update_mfu={fig['trl_update_mfu']} ratio={fig['ratio']}")
            results.append(line + f" reps={len(data['runs']['ours'])} device={device}")
        save()

    # 3. reward training, per shape
    for shape in shapes if "reward" in phases else []:
        js = out / f"reward-{shape}.json"
        cmd = [py, "bench/reward_bench.py", "--device", device, "--model", str(folders[shape][0]), "--threads",
               "4" if device == "cuda" else "1", "--json", str(js), *plan["reward"].split()]
        cmd += [] if run_trl else ["--only", "ours"]
        row, data = measure(f"reward-{shape}", cmd, 45 if device == "cuda" else 10, 240, js)
        if data:
            res = data["results"]
            row["figures"] = fig = {"shape": shape, **{f"{k}_pairs_s": round(v["pairs_per_s"], 3) for k, v in res.items()},
                                    **{f"{k}_peak_mb": round(v.get("peak_gpu_mb", v["peak_rss_mb"])) for k, v in res.items()}}
            line = f"RESULT gpu_reward shape={shape} ours_pairs_s={fig['ours_pairs_s']} ours_peak_mb={fig['ours_peak_mb']}"
            if "trl" in res:
                line += (f" trl_pairs_s={fig['trl_pairs_s']} trl_grouped_pairs_s={fig['trl_grouped_pairs_s']} "
                         f"ratio={data['ratio']:.2f} ratio_grouped={data['ratio_grouped']:.2f} "
                         f"trl_peak_mb={fig['trl_peak_mb']}")
            results.append(line + f" device={device}")
        save()

    # 4. sampling tokens/s, ours against model.generate, at each batch size
    for shape in shapes if "generate" in phases else []:
        for batch in plan["batches"]:
            cmd = [py, "bench/generate_bench.py", "--device", device, "--model", str(folders[shape][1]),
                   "--prompts-per-batch", str(batch // 4), "--threads", "4" if device == "cuda" else "1",
                   *plan["generate"].split()]
            row, _ = measure(f"generate-{shape}-b{batch}", cmd, 25 if device == "cuda" else 5, 150)
            if row["status"] == "ok" and row["result"]:
                vals = dict(kv.split("=", 1) for kv in row["result"].split()[2:])
                row["figures"] = vals
                results.append(f"RESULT gpu_generate shape={shape} batch={batch} ours_tok_s={vals['ours_tok_s']} "
                               f"hf_tok_s={vals['hf_tok_s']} ratio={vals['ratio']} "
                               f"hf_logprobs_tok_s={vals['hf_logprobs_tok_s']} ratio_logprobs={vals['ratio_logprobs']} "
                               f"device={device}")
            save()

    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "failed", "skipped")}
    results.append(f"RESULT gpu_check ok={counts['ok']} failed={counts['failed']} skipped={counts['skipped']} "
                   f"trl={'run' if run_trl else 'skipped'} seconds={time.perf_counter() - t_start:.0f} "
                   f"dry_run={args.dry_run} device={machine['device'].replace(' ', '_')}")
    report["results"] = results
    save()
    table = summary_table(report)
    (out / "gpu_results.md").write_text(table, encoding="utf-8")
    print("\n" + table)
    print("\n".join(results))
    if args.work == "":
        shutil.rmtree(work, ignore_errors=True)
    return 0 if counts["failed"] == 0 else 1


def summary_table(report: dict) -> str:
    """The markdown the GPU run's results are committed as (docs/results/gpu.md)."""
    m = report["machine"]
    lines = [f"GPU check {'(dry run, CPU) ' if report['dry_run'] else ''}started {report['started']}, "
             f"{report.get('seconds', 0):.0f} s; {m['device']}, torch {m['torch']} (CUDA {m['cuda']}), "
             f"transformers {m['transformers']}, peft {m['peft']}, Python {m['python']}; {m['trl']}; "
             f"TRL side {report['trl_side']}. MFU: update-phase model FLOPs against the H200's dense bf16 "
             f"peak ({H200_BF16_DENSE_TFLOPS:.0f} TFLOP/s).", "",
             "| phase | status | s | figures |", "|---|---|---|---|"]
    for r in report["phases"]:
        figs = r.get("figures") or {k: r[k] for k in ("passed", "failed", "skipped") if k in r}
        text = ", ".join(f"{k} {v}" for k, v in figs.items() if k != "shape") or r.get("why", "")
        lines.append(f"| {r['phase']} | {r['status']} | {r.get('seconds', '-')} | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
