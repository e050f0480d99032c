"""Run every benchmark under bench/ and write one results table: docs/results/benchmarks.md.

    python bench/run_all.py            # each bench in its --quick mode (about half an hour on 2 CPU cores)
    python bench/run_all.py --full     # each bench in its full mode (hours on CPU)
    python bench/run_all.py --only store_bench,ui_bench
    python bench/run_all.py --only reward_bench --full --keep   # rerun one, keep the others' last logs

Each bench runs as its own process, one after the other (a shared machine gives each bench all of
it); its output goes to bench/out/run_all/<bench>.log, and its last line `RESULT name key=value
...` is collected. The table has one row per headline figure: the figure, what it is compared
with, and the ratio (how many times better ours is; for scores, the difference), and for each row
the commit it was measured at (`git describe --always --dirty`: a `-dirty` suffix says the working
tree differed from it), the date and the machine's load average (1 minute, at the bench's start and
end). A figure measured over repetitions is printed as its median [min-max]; an accuracy with its
95% interval. Below the table: the machine and every RESULT line as printed.

--keep: benches left out by --only are taken from their last log in bench/out/run_all/ (its first
line names the command that wrote it), so one table can collect benches run at different times or
in different modes; the table lists each bench's command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHES = ["store_bench", "generate_bench", "reward_bench", "ppo_bench", "dpo_bench", "ui_bench", "chat_bench",
           "gold_loop"]
LOGS = ROOT / "bench" / "out" / "run_all"
TABLE = ROOT / "docs" / "results" / "benchmarks.md"


@dataclass(frozen=True)
class Row:
    """One headline figure of a bench's RESULT line and what it is compared with."""

    bench: str  # RESULT name
    figure: str  # what is measured
    key: str  # RESULT key of our figure
    comparison: str  # what it is compared with
    comparison_key: str  # RESULT key of the comparison ('' = none)
    better: str = "higher"  # 'higher' / 'lower': the ratio is how many times better ours is; 'diff': ours - theirs
    ratio_key: str = ""  # the bench's own ratio (from unrounded figures), used when present
    spread: str = ""  # suffix of the min/max keys ('_min', '_max' after each key) or 'interval' ('_lo', '_hi')


ROWS = [
    Row("store", "rankings stored/s (bulk, one transaction per batch)", "rankings_per_s",
        "one ranking per transaction", "single_rankings_per_s", ratio_key="ratio"),
    Row("store", "submit + next item p95 (ms)", "submit_next_p95_ms", "", "", "lower"),
    Row("store", "pairs exported/s (Parquet)", "parquet_pairs_per_s", "JSONL", "jsonl_pairs_per_s"),
    Row("generate", "sampling tokens/s (our KV-cache loop)", "ours_tok_s", "HF generate", "hf_tok_s",
        ratio_key="ratio", spread="ratio"),
    Row("generate", "sampling tokens/s with log-probs", "ours_tok_s", "HF generate + log-probs",
        "hf_logprobs_tok_s", ratio_key="ratio_logprobs"),
    Row("generate", "sampling tokens/s at the decode default batch", "ours_tok_s", "ours at batch 16",
        "ours_base_tok_s", ratio_key="batch_gain", spread="ratio"),
    Row("reward", "reward-model training pairs/s", "ours_pairs_s", "TRL RewardTrainer", "trl_pairs_s",
        ratio_key="ratio", spread="minmax"),
    Row("reward", "reward-model training pairs/s", "ours_pairs_s", "TRL RewardTrainer, group_by_length",
        "trl_grouped_pairs_s", ratio_key="ratio_grouped", spread="minmax"),
    Row("reward", "held-out pair accuracy [95% CI]", "ours_acc", "TRL RewardTrainer", "trl_acc", "diff",
        spread="interval"),
    Row("ppo", "PPO episodes/s", "ours_eps", "TRL PPOTrainer", "trl_eps", ratio_key="ratio", spread="minmax"),
    Row("ppo", "PPO peak memory (MB)", "ours_peak_mb", "TRL PPOTrainer", "trl_peak_mb", "lower"),
    Row("dpo", "DPO training pairs/s", "ours_pairs_s", "TRL DPOTrainer", "trl_pairs_s", ratio_key="ratio",
        spread="minmax"),
    Row("dpo", "DPO peak memory (MB)", "ours_peak_mb", "TRL DPOTrainer", "trl_peak_mb", "lower"),
    Row("ui", "annotate round trip p95 (ms), stock gradio_client", "p95_ms", "without prefetch",
        "no_prefetch_p95_ms", "lower"),
    Row("ui", "annotate round trip p95 (ms), client poll woken (removes gradio_client's 0-50 ms result poll)",
        "woken_p95_ms", "stock gradio_client", "p95_ms", "lower"),
    Row("ui", "rankings submitted/s", "submissions_per_s", "", ""),
    Row("chat", "seconds from a chat message to K = 4 replies, p95", "p95_s",
        "through the OpenAI-compatible client", "openai_p95_s", "lower"),
    Row("gold_loop", "gold gain over the base policy after round 1, the default round", "r1_gain_mean", "", ""),
    Row("gold_loop", "gold gain over the base policy after round 2, the default round", "r2_gain_mean", "", ""),
    Row("gold_loop", "KL to the base policy after round 2 (nats)", "r2_kl", "", "", "lower"),
]
BENCH_RESULT_NAMES = {"store_bench": "store", "generate_bench": "generate", "reward_bench": "reward",
                      "ppo_bench": "ppo", "dpo_bench": "dpo", "ui_bench": "ui", "chat_bench": "chat",
                      "gold_loop": "gold_loop"}


# --------------------------------------------------------------------------- RESULT lines


def _value(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def parse_result_line(line: str) -> tuple[str, dict]:
    """'RESULT name a=1 b=x' -> ('name', {'a': 1.0, 'b': 'x'}); raises ValueError on anything else."""
    parts = line.strip().split()
    if len(parts) < 2 or parts[0] != "RESULT":
        raise ValueError(f"not a RESULT line: {line!r}")
    values = {}
    for part in parts[2:]:
        key, sep, val = part.partition("=")
        if not sep or not key:
            raise ValueError(f"RESULT {parts[1]}: {part!r} is not key=value")
        values[key] = _value(val)
    return parts[1], values


def last_result(output: str) -> str | None:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return lines[-1] if lines else None


def _num(x) -> float | None:
    return x if isinstance(x, float) and math.isfinite(x) else None


def _fmt(x: float | None) -> str:
    if x is None:
        return "n/a"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}" if abs(x) >= 1 else f"{x:.3f}"


def ratio_text(row: Row, ours: float | None, theirs: float | None, given: float | None = None) -> str:
    if given is not None:
        return f"{given:.2f}x"
    if ours is None or theirs is None:
        return "n/a"
    if row.better == "diff":
        return f"{ours - theirs:+.3f}"
    if row.better == "lower":
        return f"{theirs / ours:.2f}x" if ours else "n/a"
    return f"{ours / theirs:.2f}x" if theirs else "n/a"


def _with_spread(text: str, values: dict, key: str, spread: str, fmt=None) -> str:
    """'0.66' -> '0.66 [0.60-0.70]' when the RESULT line has key_min/key_max (or key_lo/key_hi)."""
    lo_key, hi_key = (f"{key}_lo", f"{key}_hi") if spread == "interval" else (f"{key}_min", f"{key}_max")
    lo, hi = _num(values.get(lo_key)), _num(values.get(hi_key))
    if not spread or lo is None or hi is None:
        return text
    fmt = fmt or _fmt
    return f"{text} [{fmt(lo)}-{fmt(hi)}]" if spread != "interval" else f"{text} [{fmt(lo)}, {fmt(hi)}]"


def build_table(results: dict[str, dict], failures: dict[str, str] | None = None,
                runs: dict[str, dict] | None = None) -> list[str]:
    """Markdown rows for the parsed RESULT values {name: {key: value}}; a bench in `failures`
    ({name: why}) gets one row saying so. Keys a RESULT line lacks are left out. runs: {name:
    {'commit', 'date', 'load'}} for the last three columns."""
    failures, runs = failures or {}, runs or {}
    lines = ["| bench | figure | ours | compared with | theirs | ratio | commit | date | load |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r.bench for r in ROWS):
        run = runs.get(name, {})
        where = f"{run.get('commit', '?')} | {run.get('date', '?')} | {run.get('load', '?')}"
        if name in failures:
            lines.append(f"| {name} | **failed**: {failures[name]} | | | | | {where} |")
            continue
        if name not in results:
            continue
        values = results[name]
        for row in (r for r in ROWS if r.bench == name):
            if row.key not in values:
                continue
            ours = _num(values.get(row.key))
            theirs = _num(values.get(row.comparison_key)) if row.comparison_key else None
            ours_text = _with_spread(_fmt(ours), values, row.key, row.spread if row.spread != "ratio" else "")
            theirs_text = (_with_spread(_fmt(theirs), values, row.comparison_key, row.spread)
                           if row.comparison_key and row.spread in ("minmax", "interval") else _fmt(theirs))
            ratio = ratio_text(row, ours, theirs, _num(values.get(row.ratio_key))) if row.comparison_key else "-"
            if row.ratio_key and row.spread in ("minmax", "ratio") and ratio.endswith("x"):
                ratio = _with_spread(ratio, values, row.ratio_key, "minmax", lambda x: f"{x:.2f}")
            lines.append(f"| {name} | {row.figure} | {ours_text} | {row.comparison or '-'} | "
                         f"{theirs_text if row.comparison_key else '-'} | {ratio} | {where} |")
    return lines


# --------------------------------------------------------------------------- the machine


def machine_info() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "os": f"{platform.system()} {platform.release()}"}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["ram_gb"] = round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError:
        info["torch"] = "not installed"
    return info


# --------------------------------------------------------------------------- running


COMMAND_PREFIX = "# command: "
SECONDS_PREFIX = "# seconds: "
RUN_PREFIX = "# run: "


def git_commit() -> str:
    """The commit the benches run at; '-dirty' when tracked files differ from it."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=10"], cwd=ROOT,
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_meta(commit: str, load_start: float, load_end: float) -> dict:
    return {"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M"), "load": f"{load_start:.1f}-{load_end:.1f}"}


def format_meta(meta: dict) -> str:
    return " ".join(f"{k}={str(v).replace(' ', '_')}" for k, v in meta.items())


def parse_meta(text: str) -> dict:
    meta = dict(part.split("=", 1) for part in text.split() if "=" in part)
    if "date" in meta:
        meta["date"] = meta["date"].replace("_", " ")
    return meta


QUICK_SIZES = {"gold_loop": "--seeds 0 --rounds 2 --prompts-per-round 4 --eval-samples 2 --leaderboard-prompts 3"}
"""What --quick of a bench leaves at its full size and this table runs small."""


def bench_args(name: str, full: bool, extra: str = "") -> list[str]:
    return ([] if full else ["--quick", *shlex.split(QUICK_SIZES.get(name, ""))]) + shlex.split(extra)


def script(name: str) -> str:
    """The bench's script, relative to the repository (the gold-judge experiment, the product's
    default round measured by a judge it never trains on, has its own folder)."""
    return "bench/gold/closed_loop.py" if name == "gold_loop" else f"bench/{name}.py"


def bench_command(name: str, full: bool, extra: str = "") -> str:
    return shlex.join(["python", script(name), *bench_args(name, full, extra)])


def run_command(cmd: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """(exit code, stdout + stderr) of cmd run in the repository; exit 124 and what it printed when
    it runs past timeout (bench/gpu_check.py runs its phases with it too). The command runs in its
    own session, so a timeout ends its whole process group: a bench's worker processes too, not
    only the process started here."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out + err
    except subprocess.TimeoutExpired:
        end_group(proc)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside the group still holds the pipes
            out, err = "", ""
        return 124, out + err + f"\n(timed out after {timeout:.0f} s; its process group was ended)"


def write_json(path: str | Path, data) -> None:
    """Write JSON whole or not at all (a temporary file renamed over it): a bench ended half-way
    through a write leaves its previous results readable."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def traceback_tail(output: str, limit: int = 6000) -> str:
    """What to report of a failed process's output: from its last traceback on (the whole chained
    traceback, 'During handling...' included), else its last lines; at most limit characters, the
    end kept."""
    text = output.rstrip()
    at = text.rfind("Traceback (most recent call last):")
    while at > 0:  # a chained exception: keep the traceback it was raised from too
        before = text.rfind("Traceback (most recent call last):", 0, at)
        between = text[before:at] if before >= 0 else ""
        if before < 0 or not ("During handling of the above exception" in between
                              or "The above exception was the direct cause" in between):
            break
        at = before
    tail = text[at:] if at >= 0 else "\n".join(text.splitlines()[-20:])
    return tail if len(tail) <= limit else "...\n" + tail[-limit:]


def end_group(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM to the process group proc leads (start_new_session), SIGKILL to what is left after
    grace_s seconds."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        if sig == signal.SIGTERM:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and _group_alive(proc.pid):
                proc.poll()  # reaps the leader, so only the rest of the group keeps it alive
                time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def run_bench(name: str, full: bool, timeout: float, extra: str = "", commit: str = "") -> tuple[int, str, float, dict]:
    """(exit code, output, seconds, {commit, date, load}) of `python SCRIPT [--quick] [extra]` (script(name)),
    logged to bench/out/run_all with the command on the log's first line, the seconds it took on the
    second and the commit, date and load on the third."""
    LOGS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / script(name)), *bench_args(name, full, extra)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    rc, output = run_command(cmd, env, timeout)
    took = time.perf_counter() - start
    meta = run_meta(commit or git_commit(), load_start, os.getloadavg()[0])
    header = (f"{COMMAND_PREFIX}{bench_command(name, full, extra)}\n{SECONDS_PREFIX}{took:.0f} exit={rc}\n"
              f"{RUN_PREFIX}{format_meta(meta)}\n")
    (LOGS / f"{name}.log").write_text(header + output, encoding="utf-8")
    return rc, output, took, meta


def kept_log(name: str) -> tuple[str, int, str, float, dict] | None:
    """(command, exit code, output, seconds, {commit, date, load}) of a bench's last log written by
    run_bench, or None. A log without the run line (an older one) has an empty dict."""
    path = LOGS / f"{name}.log"
    if not path.is_file():
        return None
    lines = path.read_text(encoding="utf-8").splitlines()
    if len(lines) < 2 or not lines[0].startswith(COMMAND_PREFIX) or not lines[1].startswith(SECONDS_PREFIX):
        return None
    seconds, exit_code = lines[1][len(SECONDS_PREFIX):].split()
    meta, body = {}, lines[2:]
    if body and body[0].startswith(RUN_PREFIX):
        meta, body = parse_meta(body[0][len(RUN_PREFIX):]), body[1:]
    return (lines[0][len(COMMAND_PREFIX):], int(exit_code.removeprefix("exit=")), "\n".join(body), float(seconds),
            meta)


def write_markdown(path: Path, table: list[str], machine: dict, raw: list[str],
                   runs: dict[str, tuple[str, float]]) -> Path:
    """runs: {bench: (command, seconds)}."""
    lines = [
        "# Benchmarks", "",
        f"Collected with `python bench/run_all.py`, {time.strftime('%Y-%m-%d')}; each bench's command is "
        "listed below the table. Ratio: how many times better ours is (for scores: ours minus the "
        "comparison). A figure measured over repetitions is its median [min-max] (the ratio: of the "
        "medians, [the range of the per-repetition ratios]); an accuracy has its 95% interval. Commit, "
        "date and load (1-minute load average at the bench's start and end) are each row's own. Each "
        "bench's docstring explains its set-up (`python bench/<name>.py --help`).", "",
        *table, "",
        "## Machine", "",
        f"- CPU: {machine.get('cpu')}, {machine.get('cores')} cores; RAM {machine.get('ram_gb', '?')} GB; "
        f"GPU: {machine.get('gpu', 'none')}",
        f"- torch {machine.get('torch')}, Python {machine.get('python')}, {machine.get('os')}", "",
        "## RESULT lines", "", "```", *raw, "```", "",
        "| bench | command | seconds |", "|---|---|---|",
        *[f"| {k} | `{cmd}` | {sec:.0f} |" for k, (cmd, sec) in runs.items()], "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="full modes instead of --quick")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(BENCHES)}")
    parser.add_argument("--out", default=str(TABLE), help="the markdown table (default: docs/results/benchmarks.md)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per bench before it is stopped")
    parser.add_argument("--keep", action="store_true",
                        help="benches left out by --only: take their last log from bench/out/run_all")
    parser.add_argument("--bench-args", action="append", default=[], metavar="NAME=ARGS",
                        help="extra arguments for one bench, e.g. gold_loop='--ppo-steps 24' (repeatable)")
    args = parser.parse_args(argv)
    bad = [item for item in args.bench_args if "=" not in item]
    if bad:
        raise SystemExit(f"--bench-args: {bad[0]!r} is not NAME=ARGS")
    extra = dict(item.split("=", 1) for item in args.bench_args)
    names = args.only.split(",") if args.only else BENCHES
    unknown = [n for n in [*names, *extra] if n not in BENCHES]
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; choose from {', '.join(BENCHES)}")
    results, failures, raw, runs, metas = {}, {}, [], {}, {}
    commit = git_commit()  # once: every bench of this invocation runs at it
    for name in BENCHES:
        if name in names:
            print(f"running {name} ({'full' if args.full else 'quick'}) at {commit} ...", flush=True)
            rc, output, took, meta = run_bench(name, args.full, args.timeout, extra.get(name, ""), commit)
            command = bench_command(name, args.full, extra.get(name, ""))
        elif args.keep and (kept := kept_log(name)) is not None:
            command, rc, output, took, meta = kept
            print(f"keeping the last {name} log ({command})", flush=True)
        else:
            continue
        runs[name] = (command, took)
        result_name = BENCH_RESULT_NAMES[name]
        metas[result_name] = meta
        line = last_result(output)
        if rc != 0 or line is None:
            tail = " ".join(output.strip().splitlines()[-1:])[:160].replace("|", "/")
            failures[result_name] = f"exit code {rc}; see bench/out/run_all/{name}.log ({tail})"
            print(f"  failed: {failures[result_name]}")
            continue
        result_name, values = parse_result_line(line)
        results[result_name] = values
        raw.append(line)
        print(f"  {line}  ({took:.0f} s)")
    path = write_markdown(Path(args.out), build_table(results, failures, metas), machine_info(), raw, runs)
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
