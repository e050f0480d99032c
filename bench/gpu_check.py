"""The GPU check: one command, run once when a GPU is lent (docs/gpu.md says how and what to record).

    python3 bench/gpu_check.py --wheels wheels --out $OUT     # on the GPU machine: at most 8 minutes
    python3 bench/gpu_check.py --dry-run --out "$(mktemp -d)"  # CPU, tiny shapes, bf16 autocast: the CI test
    python3 bench/gpu_check.py --prepare-wheels wheels        # here, with internet: the wheels + tokenizer

In bf16 (--dtype) on CUDA, each phase in its own process(es), within one time budget (--budget-s,
480 s: a minute under the documented time limit of 540 s, itself a minute under the 10-minute
command limit), every phase of the small shape before any of the large one:
1. `pytest -m gpu` on the test files that carry GPU tests (without tests/conftest.py, which
   imports the store; the model fixtures come from tests/fixtures_models.py);
then for SmolLM2-135M, then for SmolLM2-1.7B (random weights built from their config sizes; no
download; the tokenizer's EOS is a token the model cannot emit, so every response is exactly
--max-new-tokens long on both sides):
2. PPO, ours against TRL 1.12.0's PPOTrainer (bench/ppo_bench.py: same settings, the same span
   timed, the order alternating over --reps): episodes/s, rollout and update time, peak GPU memory
   and the update's model FLOP utilisation;
3. reward-model training pairs/s against TRL's RewardTrainer, default and group_by_length
   (bench/reward_bench.py);
4. sampling tokens/s of our loop against `model.generate` at batch 8 and 64 (bench/generate_bench.py).
A phase that no longer fits the budget is skipped and said so; one that runs past it (or past its
own limit) is stopped, its whole process group ended, and reported `cut` with what it measured:
every bench writes its results after each repetition. A side that fails (ours or TRL's) is
reported failed with its traceback; the other side's figures are still reported.

Our side runs with store, annotate, duckdb, gradio and datasets unimportable (GUARD_CODE,
RLHF_BLOCK_IMPORTS), as on the GPU machine, where they are not installed; the TRL side runs in its
own processes and may import datasets and trl. --wheels DIR makes the wheels there importable
without a network: each one whose distribution is not installed already is unpacked into a
folder put on PYTHONPATH (a wheel is a zip of its files), binary ones only when their tags fit
this interpreter.

Output: a table and `RESULT gpu_...` lines on stdout, and exactly three files in OUT (OUT_FILES;
at most MAX_OUT_FILES come back from the GPU machine): gpu_check.json (every figure, each bench's
own results, the machine, the wheels used, each phase's command, status, seconds and failures'
tracebacks), gpu_check.md (the table and RESULT lines to commit as docs/results/gpu.md) and
phases.log (every phase's output, each capped at LOG_CAP_BYTES). All three are rewritten after
every phase, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
from bench.run_all import run_command, traceback_tail  # noqa: E402

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
# The time limits are guesses until the first GPU run.
GPU = {
    "ppo": {"smollm2-135m": "--steps 4 --batch-size 64 --mini-batch-size 32 --micro-batch-size 32 "
                            "--max-new-tokens 128 --ppo-epochs 2",
            "smollm2-1.7b": "--steps 4 --batch-size 64 --mini-batch-size 32 --micro-batch-size 16 "
                            "--max-new-tokens 128 --ppo-epochs 2"},
    "reward": "--train-pairs 256 --eval-pairs 64 --batch-size 8 --grad-accum 1 --max-length 512 --rounds 1",
    "generate": "--k 4 --max-new-tokens 128 --rounds 3",
    "batches": [8, 64],
    "reps": 2,
    # (seconds a phase needs at least to start, seconds it may run at most): the small shape's
    # phases are capped so that a slow one leaves time for the others of its shape
    "seconds": {"pytest": (20, 120), "ppo-smollm2-135m": (60, 200), "reward-smollm2-135m": (45, 120),
                "generate-smollm2-135m": (20, 60), "ppo-smollm2-1.7b": (60, 400),
                "reward-smollm2-1.7b": (45, 240), "generate-smollm2-1.7b": (25, 150)},
}
DRY = {
    "ppo": {"tiny": "--steps 2 --batch-size 4 --mini-batch-size 2 --micro-batch-size 2 --max-new-tokens 8 "
                    "--ppo-epochs 1 --n-prompts 16"},
    "reward": "--train-pairs 8 --eval-pairs 8 --batch-size 4 --grad-accum 1 --max-length 256 --rounds 1",
    "generate": "--k 4 --max-new-tokens 8 --rounds 1",
    "batches": [8],
    "reps": 1,
    "seconds": {"pytest": (10, 300), "ppo-tiny": (10, 300), "reward-tiny": (10, 300), "generate-tiny": (5, 150)},
}

# The wheels the GPU machine lacks. Its image has Python 3.12, torch + CUDA, transformers 5.x, peft,
# accelerate, pandas, pyarrow, pytest, tensorboard, requests, fsspec, xxhash and pygments; not trl,
# datasets or datasets' dill and multiprocess: `pip download --no-deps` of exactly these. datasets
# 4.7.0 is the oldest that trl 1.12.0 accepts and allows huggingface-hub 1.x (which transformers
# 5.x needs); dill and multiprocess at the highest versions it allows. All four are pure wheels.
PURE_WHEELS = ["trl==1.12.0", "datasets==4.7.0", "dill==0.4.0", "multiprocess==0.70.18"]
BINARY_WHEELS: dict[str, list[str]] = {}  # spec -> platforms (none needed: xxhash is in the image)

# What comes back from the GPU machine's output folder: at most 6 files, none deeper than two
# folders below it, each under 16 MiB. The check writes these three, each well under the size.
OUT_FILES = ("gpu_check.json", "gpu_check.md", "phases.log")
MAX_OUT_FILES, MAX_OUT_DEPTH, MAX_FILE_BYTES = 6, 2, 16 * 2**20
LOG_CAP_BYTES = 2**20  # of each phase's output in phases.log (head and tail kept): a GPU run's 9 phases < 10 MiB
BUDGET_S = 480.0  # --budget-s default; docs/gpu.md gives the command a time limit of TIME_LIMIT_S
TIME_LIMIT_S = 540  # a minute under the device's 10-minute command limit; the budget a minute under it
LOG_HEADER = "#### phase "  # starts each phase's part of phases.log


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


def _dist_installed(dist: str, also: list[str] | None = None) -> str | None:
    """The version of an installed distribution (also looked for in the folders `also`), or None."""
    from importlib import metadata

    found = next(iter(metadata.distributions(name=dist, path=[*(also or []), *sys.path])), None)
    return found.version if found is not None else None


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


def capped(output: str, cap: int = LOG_CAP_BYTES) -> str:
    """A phase's output for phases.log: whole when under cap bytes, else its head and its tail."""
    data = output.encode("utf-8", "replace")
    if len(data) <= cap:
        return output
    head, tail = data[: cap // 8], data[-(cap - cap // 8):]
    return (head.decode("utf-8", "ignore") + f"\n[... {len(data) - len(head) - len(tail)} bytes left out ...]\n"
            + tail.decode("utf-8", "ignore"))


def out_problems(out: Path) -> list[str]:
    """Why OUT would not come back whole from the GPU machine: more than MAX_OUT_FILES files, a
    file deeper than MAX_OUT_DEPTH folders below OUT, one of MAX_FILE_BYTES or more, or anything
    that is not a plain file."""
    problems, files = [], []
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out)
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            problems.append(f"{rel}: not a plain file")
        elif path.is_file():
            files.append(rel)
            if len(rel.parts) - 1 > MAX_OUT_DEPTH:
                problems.append(f"{rel}: deeper than {MAX_OUT_DEPTH} folders")
            if path.stat().st_size >= MAX_FILE_BYTES:
                problems.append(f"{rel}: {path.stat().st_size} bytes, the limit is {MAX_FILE_BYTES}")
    if len(files) > MAX_OUT_FILES:
        problems.append(f"{len(files)} files, at most {MAX_OUT_FILES} come back")
    return problems


def run_phase(name: str, cmd: list[str], env: dict, budget: Budget, limit_s: float, log: Path) -> tuple[dict, str]:
    """(row, output) of one phase's command run within what is left of the budget and its own limit;
    its output is appended to the phases log. Status: ok, failed (its traceback in `tail`) or cut
    (stopped at the budget or its limit: what it measured is still read by the caller)."""
    row = {"phase": name, "command": " ".join(cmd)}
    left = budget.left()
    timeout = max(1.0, min(limit_s, left))
    row["limit_s"] = round(timeout)
    print(f"[{name}] {row['command']}  (at most {timeout:.0f} s)", flush=True)
    t0 = time.perf_counter()
    rc, output = run_command(cmd, env, timeout)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    row["exit"] = rc
    if rc == 124:
        row["status"] = "cut"
        at = "the end of the budget" if left < limit_s else "its limit"
        row["why"] = (f"stopped after {row['seconds']:.0f} s, at {at} ({timeout:.0f} s for it), its process group "
                      "ended; its figures are what it finished")
    else:
        row["status"] = "ok" if rc == 0 else "failed"
    results = [ln for ln in output.splitlines() if ln.startswith("RESULT ")]
    row["result"] = results[-1] if results else ""
    if rc not in (0, 124):
        row["tail"] = traceback_tail(output)
        print(f"[{name}] FAILED (exit {rc}):\n  " + "\n  ".join(row["tail"].splitlines()[-12:]), flush=True)
    else:
        print(f"[{name}] {row['status']} in {row['seconds']:.0f} s" + (f": {row['why']}" if rc else ""), flush=True)
    with log.open("a", encoding="utf-8") as f:
        f.write(f"{LOG_HEADER}{name}: status={row['status']} exit={rc} seconds={row['seconds']}\n"
                f"$ {row['command']}\n{capped(output)}\n\n")
    return row, output


def read_json(path: Path) -> dict | None:
    """A bench's results file, or None when there is none (the benches write theirs whole or not at all)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def pytest_counts(xml: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not xml.is_file():
        return {}
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    get = lambda k: int(suite.get(k, 0))  # noqa: E731
    failing = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
               if case.find("failure") is not None or case.find("error") is not None]
    return {"tests": get("tests"), "failed": get("failures") + get("errors"), "skipped": get("skipped"),
            "passed": get("tests") - get("failures") - get("errors") - get("skipped"), "failing": failing}


def gpu_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text(encoding="utf-8"))


def ppo_figures(data: dict, shape: str) -> dict:
    """The GPU check's PPO figures from bench/ppo_bench.py's JSON, complete or not: per side that
    finished a run, the medians over its runs; the ratio when both sides did."""
    flops = data["flops"]["update_flops"]
    fig = {"shape": shape, "update_tflop_per_step": round(flops / 1e12, 4)}
    for side, runs in data["runs"].items():
        if not runs:
            continue
        update = statistics.median(r["update_s"] for r in runs)
        fig[f"{side}_eps"] = round(statistics.median(r["eps"] for r in runs), 3)
        fig[f"{side}_eps_range"] = [round(min(r["eps"] for r in runs), 3), round(max(r["eps"] for r in runs), 3)]
        fig[f"{side}_rollout_s"] = round(statistics.median(r["rollout_s"] for r in runs), 3)
        fig[f"{side}_update_s"] = round(update, 3)
        fig[f"{side}_peak_mb"] = round(max(r["peak_mb"] for r in runs))
        fig[f"{side}_update_mfu"] = float(f"{flops / update / (H200_BF16_DENSE_TFLOPS * 1e12):.3g}")
        fig[f"{side}_reps"] = len(runs)
    if "ours_eps" in fig and "trl_eps" in fig:
        fig["ratio"] = round(fig["ours_eps"] / fig["trl_eps"], 2)
        pairs = zip(data["runs"]["ours"], data["runs"]["trl"])  # each repetition's pair, run back to back
        fig["ratio_per_rep"] = [round(a["eps"] / b["eps"], 2) for a, b in pairs]
    return fig


def reward_figures(data: dict, shape: str) -> dict:
    res = data["results"]
    fig = {"shape": shape, **{f"{k}_pairs_s": round(v["pairs_per_s"], 3) for k, v in res.items()},
           **{f"{k}_peak_mb": round(v.get("peak_gpu_mb", v["peak_rss_mb"])) for k, v in res.items()},
           **{f"{k}_rounds": len(v) for k, v in data["runs"].items() if v}}
    for theirs, key in (("trl", "ratio"), ("trl_grouped", "ratio_grouped")):
        if "ours" in res and theirs in res:
            fig[key] = round(res["ours"]["pairs_per_s"] / res[theirs]["pairs_per_s"], 2)
    return fig


def generate_figures(data: dict, shape: str, batch: int) -> dict:
    m = data["figures"]["methods"]
    return {"shape": shape, "batch": batch, "ours_tok_s": round(m["ours"]["tok_s"], 1),
            "hf_tok_s": round(m["hf generate"]["tok_s"], 1), "ratio": round(m["hf generate"]["ratio"], 2),
            "hf_logprobs_tok_s": round(m["hf generate + logprobs"]["tok_s"], 1),
            "ratio_logprobs": round(m["hf generate + logprobs"]["ratio"], 2),
            "rounds": f"{data['rounds_done']}/{data['rounds']}"}


def result_line(kind: str, row: dict, keys: list[str], device: str) -> str:
    """RESULT gpu_<kind> with the phase's status and those of its figures that were measured."""
    fig = row.get("figures", {})
    parts = [f"{k}={fig[k]}" for k in keys if k in fig]
    parts += [f"{side}=failed" for side in row.get("failed_sides", {})]
    return " ".join([f"RESULT gpu_{kind}", f"status={row['status']}", *parts, f"device={device}"])


PPO_KEYS = ["shape", "ours_eps", "ours_rollout_s", "ours_update_s", "ours_peak_mb", "ours_update_mfu", "ours_reps",
            "trl_eps", "trl_rollout_s", "trl_update_s", "trl_peak_mb", "trl_update_mfu", "trl_reps", "ratio"]
REWARD_KEYS = ["shape", "ours_pairs_s", "ours_peak_mb", "trl_pairs_s", "trl_grouped_pairs_s", "ratio",
               "ratio_grouped", "trl_peak_mb"]
GENERATE_KEYS = ["shape", "batch", "ours_tok_s", "hf_tok_s", "ratio", "hf_logprobs_tok_s", "ratio_logprobs", "rounds"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", default="", help=f"folder for {', '.join(OUT_FILES)}")
    parser.add_argument("--wheels", default="", help="folder of wheels (and tokenizer/) brought to this machine")
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny shape, a few steps")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                        help="the benches' precision, both sides (bf16: autocast over bf16 weights, on the CPU "
                             "too: the dry run catches dtype mismatches there); the GPU tests are bf16 anyway")
    parser.add_argument("--trl", choices=["auto", "on", "off"], default="auto",
                        help="run the TRL side: auto = when trl and datasets import; on = always (a failure to "
                             "import is then the TRL side's failure)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all phases together")
    parser.add_argument("--reps", type=int, default=0, help="PPO repetitions per side, the order alternating "
                                                            "(default 2; 1 in the dry run)")
    parser.add_argument("--shapes", default="", help="comma-separated shapes, run in this order (default: both "
                                                     "SmolLM2 shapes, the small one first; tiny in the dry run)")
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
    for name in OUT_FILES:
        (out / name).unlink(missing_ok=True)
    log = out / "phases.log"
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
    reps = args.reps or plan["reps"]

    # 0. the wheels, the environments of our side and of TRL's side
    wheels = Path(args.wheels).resolve() if args.wheels else None
    site = work / "site"
    unpacked = unpack_wheels(wheels, site) if wheels else []
    pythonpath = [str(ROOT)] + ([str(site)] if wheels else []) + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    guard = work / "guard"
    guard.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(GUARD_CODE, encoding="utf-8")
    ours_env = {**base_env, "PYTHONPATH": os.pathsep.join([str(guard), *pythonpath]), "RLHF_BLOCK_IMPORTS": BLOCKED}
    versions = {d: _dist_installed(d, [str(site)] if wheels else []) for d in ("trl", "datasets")}
    trl_note = f"trl {versions['trl']}, datasets {versions['datasets']}"
    run_trl = args.trl == "on"
    if args.trl == "auto":  # importing them is what counts (a few seconds)
        probe = subprocess.run([sys.executable, "-c", "import trl, datasets"], capture_output=True, text=True,
                               env={**base_env, "PYTHONPATH": os.pathsep.join(pythonpath)})
        run_trl = probe.returncode == 0
        if not run_trl:
            trl_note = "trl/datasets not importable: " + (probe.stderr.strip().splitlines() or ["?"])[-1]
    if not run_trl:
        print(f"TRL side SKIPPED ({'--trl off' if args.trl == 'off' else trl_note}): ours only, no ratios", flush=True)
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
    report = {"started": started, "dry_run": args.dry_run, "dtype": args.dtype, "budget_s": args.budget_s,
              "machine": machine, "wheels": unpacked, "guard": f"our side with {BLOCKED} unimportable",
              "trl_side": "run" if run_trl else "skipped", "models": {}, "phases": [], "results": []}
    rows, results = report["phases"], report["results"]

    def save() -> None:  # after every phase: a check stopped half-way keeps what it measured
        report["seconds"] = round(time.perf_counter() - t_start, 1)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
        (out / "gpu_check.md").write_text(summary_table(report), encoding="utf-8")
        if not log.exists():
            log.write_text("", encoding="utf-8")

    # on the CPU (the dry run) every phase computes on one thread, as the suite's workers do: two
    # threads beside another worker's would wait on each other
    py, threads = sys.executable, "4" if device == "cuda" else "1"
    built: dict[str, tuple[Path, Path]] = {}

    def folders(shape: str) -> tuple[Path, Path]:
        """The shape's model folders (normal, no-EOS), built on first use (inside the budget)."""
        if shape not in built:
            t0 = time.perf_counter()
            built[shape] = build_shape(shape, tok_src, work / "models", device)
            report["models"][shape] = {"seconds": round(time.perf_counter() - t0, 1)}
            print(f"[{shape}] random-weight model folders in {time.perf_counter() - t0:.0f} s", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
        return built[shape]

    def phase(name: str, seconds: tuple[float, float], command, env: dict = ours_env, js: Path | None = None):
        """(row, the bench's JSON or None) of one phase, run when the budget still fits it; the row
        is recorded and everything saved. `command` makes the command line (it may build models)."""
        need_s, limit_s = seconds
        left = budget.left()
        if left < need_s:
            row = {"phase": name, "status": "skipped",
                   "why": f"{left:.0f} s of the budget left, the phase needs about {need_s:.0f} s"}
            print(f"[{name}] skipped: {row['why']}", flush=True)
            data = None
        else:
            if js is not None:
                js.unlink(missing_ok=True)
            try:
                cmd = command()
            except Exception:  # building the shape's model folders failed: this phase fails, the check goes on
                import traceback

                row = {"phase": name, "status": "failed", "tail": traceback_tail(traceback.format_exc())}
                print(f"[{name}] FAILED before it started:\n{row['tail']}", flush=True)
                with log.open("a", encoding="utf-8") as f:
                    f.write(f"{LOG_HEADER}{name}: status=failed before it started\n{row['tail']}\n\n")
            else:
                row, _ = run_phase(name, cmd, env, budget, limit_s, log)
            data = read_json(js) if js is not None else None
            if data and data.get("failed"):  # a side that failed: its traceback; the other side is kept
                row["failed_sides"] = data["failed"]
            if data:
                row["bench"] = data
        rows.append(row)
        save()
        return row, data

    save()
    # 1. pytest -m gpu over every test file with GPU tests. The dry run collects them all (they
    # import here without the store) and runs tests/test_gpu.py's on the CPU (RLHF_TEST_DEVICE=cpu;
    # about 15 s on a 2-core machine); the others name cuda themselves
    if "pytest" in phases:
        xml = work / "pytest.xml"
        xml.unlink(missing_ok=True)
        cmd = [py, "-m", "pytest", "--noconftest", "-p", "tests.fixtures_models", "-m", "gpu", "-q",
               "-p", "no:cacheprovider", f"--junitxml={xml}", *gpu_test_files()]
        cmd += ["-k", "test_gpu.py"] if args.dry_run else []  # pytest's keywords include the file name
        row, _ = phase("pytest", plan["seconds"]["pytest"], lambda: cmd, {**ours_env, "RLHF_TEST_DEVICE": device})
        if row["status"] != "skipped":
            row.update(pytest_counts(xml))
            counts = " ".join(f"{k}={row[k]}" for k in ("passed", "failed", "skipped") if k in row)
            results.append(f"RESULT gpu_tests status={row['status']} {counts} seconds={row['seconds']:.0f} "
                           f"device={device}".replace("  ", " "))
            save()

    # 2-4 per shape, the small one first: PPO (ours and TRL), reward training, sampling
    bench_args = ["--device", device, "--dtype", args.dtype]
    for shape in shapes:
        if "ppo" in phases:
            js = work / f"ppo-{shape}.json"

            def ppo_cmd(shape=shape, js=js):
                normal, noeos = folders(shape)
                cmd = [py, "bench/ppo_bench.py", *bench_args, "--model", str(noeos), "--reward-base", str(normal),
                       "--reps", str(reps), "--threads", threads, "--work", str(work / f"ppo-{shape}"),
                       "--json", str(js), *plan["ppo"][shape].split()]
                return cmd + ([] if run_trl else ["--only", "ours"])

            row, data = phase(f"ppo-{shape}", plan["seconds"][f"ppo-{shape}"], ppo_cmd, js=js)
            if data:
                row["figures"] = ppo_figures(data, shape)
            if row["status"] != "skipped":
                results.append(result_line("ppo", row, PPO_KEYS, device))
                save()

        if "reward" in phases:
            js = work / f"reward-{shape}.json"

            def reward_cmd(shape=shape, js=js):
                cmd = [py, "bench/reward_bench.py", *bench_args, "--model", str(folders(shape)[0]),
                       "--threads", threads, "--json", str(js), *plan["reward"].split()]
                return cmd + ([] if run_trl else ["--only", "ours"])

            row, data = phase(f"reward-{shape}", plan["seconds"][f"reward-{shape}"], reward_cmd, js=js)
            if data and data.get("results"):
                row["figures"] = reward_figures(data, shape)
            if row["status"] != "skipped":
                results.append(result_line("reward", row, REWARD_KEYS, device))
                save()

        for batch in plan["batches"] if "generate" in phases else []:
            js = work / f"generate-{shape}-b{batch}.json"

            def generate_cmd(shape=shape, batch=batch, js=js):
                return [py, "bench/generate_bench.py", *bench_args, "--model", str(folders(shape)[1]),
                        "--batches", str(batch), "--threads", threads,
                        "--json", str(js), *plan["generate"].split()]

            row, data = phase(f"generate-{shape}-b{batch}", plan["seconds"][f"generate-{shape}"], generate_cmd, js=js)
            if data:
                row["figures"] = generate_figures(data, shape, batch)
            if row["status"] != "skipped":
                results.append(result_line("generate", row, GENERATE_KEYS, device))
                save()

    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "failed", "cut", "skipped")}
    results.append(f"RESULT gpu_check ok={counts['ok']} failed={counts['failed']} cut={counts['cut']} "
                   f"skipped={counts['skipped']} trl={'run' if run_trl else 'skipped'} dtype={args.dtype} "
                   f"seconds={time.perf_counter() - t_start:.0f} dry_run={args.dry_run} "
                   f"device={machine['device'].replace(' ', '_')}")
    save()
    report["out_problems"] = problems = out_problems(out)  # [] when all of OUT comes back
    save()
    if problems:
        print("OUT would not come back whole: " + "; ".join(problems), flush=True)
    print("\n" + summary_table(report))
    if args.work == "":
        shutil.rmtree(work, ignore_errors=True)
    return 0 if counts["failed"] == 0 and not problems else 1


def _figures_text(row: dict) -> str:
    figs = row.get("figures") or {k: row[k] for k in ("passed", "failed", "skipped") if k in row}
    text = ", ".join(f"{k} {v}" for k, v in figs.items() if k not in ("shape", "batch"))
    notes = [row["why"]] if "why" in row else []
    for side, why in row.get("failed_sides", {}).items():
        notes.append(f"{side} failed: {why.strip().splitlines()[-1]}")
    if row.get("status") == "failed" and "tail" in row and not row.get("failed_sides"):
        notes.append("failed: " + row["tail"].strip().splitlines()[-1])
    return "; ".join([t for t in [text, *notes] if t]).replace("|", "/")


def summary_table(report: dict) -> str:
    """The markdown the GPU run's results are committed as (docs/results/gpu.md): the table, then
    the RESULT lines."""
    m = report["machine"]
    lines = [f"GPU check {'(dry run, CPU) ' if report['dry_run'] else ''}started {report['started']}, "
             f"{report.get('seconds', 0):.0f} s of a {report['budget_s']:.0f} s budget; {m['device']}, torch "
             f"{m['torch']} (CUDA {m['cuda']}), transformers {m['transformers']}, peft {m['peft']}, Python "
             f"{m['python']}; {m['trl']}; TRL side {report['trl_side']}; benches in {report['dtype']}. MFU: "
             f"update-phase model FLOPs against the H200's dense bf16 peak ({H200_BF16_DENSE_TFLOPS:.0f} TFLOP/s).",
             "", "| phase | status | s | figures |", "|---|---|---|---|"]
    for r in report["phases"]:
        lines.append(f"| {r['phase']} | {r['status']} | {r.get('seconds', '-')} | {_figures_text(r)} |")
    if report.get("results"):
        lines += ["", "```", *report["results"], "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
