"""The closed-loop experiment's report (bench/gold/closed_loop.py), from results.json and raw.json alone.

    python bench/gold/closed_report.py RESULTS_DIR     # report.md again

Per seed and round, the gold gain is the mean over the locked test prompts of (the round's policy's
mean gold - the base policy's, same seed, same sampling seed). Per round, over seeds: the mean gain,
the between-seed standard error (s.d. over seeds / sqrt(seeds): what a new run of the whole loop,
with its own annotators, prompts and reward models, would move) and the 95% Student's t interval
(seeds - 1 degrees of freedom). The last line is `RESULT gold_loop ...`.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
from pathlib import Path

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}
"""Two-sided 95% quantiles of Student's t by degrees of freedom (t_{0.975, df})."""


def t95(df: int) -> float:
    """t_{0.975, df}; between tabulated values the next smaller df's (a wider interval)."""
    if df < 1:
        raise ValueError("a t interval needs at least two seeds")
    return T95[max(k for k in T95 if k <= df)]


def t_interval(values: list[float]) -> dict:
    """{mean, se, lo, hi, n}: the mean of per-seed values with its 95% t interval (se, lo and hi
    None below two values)."""
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return {"mean": mean, "se": None, "lo": None, "hi": None, "n": n}
    se = statistics.stdev(values) / math.sqrt(n)
    half = t95(n - 1) * se
    return {"mean": mean, "se": se, "lo": mean - half, "hi": mean + half, "n": n}


def load(folder: Path) -> tuple[dict, dict]:
    folder = Path(folder)
    results = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    raw = json.loads((folder / "raw.json").read_text(encoding="utf-8"))["evals"]
    return results, raw


def seed_gain(raw_seed: dict, tag: str, key: str = "gold") -> float:
    """Mean over prompts of (evaluation `tag` - base) for one seed."""
    base, table = raw_seed["base"], raw_seed[tag]
    diffs = [table[p][key] - base[p][key] for p in base if p in table]
    return statistics.fmean(diffs)


def rounds_table(results: dict, raw: dict) -> list[dict]:
    """Per round with every seed measured: the gain's t interval, mean KL, reward-model accuracy,
    gate refusals and CPU minutes per seed-round."""
    seeds = [s for s in results["seeds"] if s in raw and "base" in raw[s]]
    out = []
    for n in range(1, results["settings"]["sizes"]["rounds"] + 1):
        have = [s for s in seeds if str(n) in results["seeds"][s]["rounds"] and f"round{n}" in raw[s]]
        if not have:
            break
        entries = [results["seeds"][s]["rounds"][str(n)] for s in have]
        gains = [seed_gain(raw[s], f"round{n}") for s in have]
        kls = [statistics.fmean(v["kl"] for v in raw[s][f"round{n}"].values()) for s in have]
        accs = [e["reward"]["eval/accuracy"] for e in entries if e.get("reward") and e["reward"].get("eval/accuracy")
                is not None]
        out.append({"round": n, "seeds": have, "gains": gains, **{f"gain_{k}": v for k, v in t_interval(gains).items()},
                    "kl_mean": statistics.fmean(kls), "rm_accuracy": accs,
                    "gated": sum(bool(e.get("gate")) for e in entries),
                    "machines": sorted({e.get("machine") or "not recorded" for e in entries}),
                    **cpu_minutes([e for e in entries if "cpu_parts" in e])})
    return out


def cpu_minutes(entries: list[dict]) -> dict:
    """{cpu_min, cpu_parts_min} over the seed-rounds whose CPU was measured by part (a round run
    before its jobs' CPU was counted has no cpu_parts: it is left out, None when none is left)."""
    if not entries:
        return {"cpu_min": None, "cpu_parts_min": {}}
    kinds = sorted({k for e in entries for k in e["cpu_parts"]})
    return {"cpu_min": statistics.fmean(e["cpu_s"] / 60 for e in entries),
            "cpu_parts_min": {k: statistics.fmean(e["cpu_parts"].get(k, 0.0) / 60 for e in entries) for k in kinds}}


def leaderboard_check(results: dict) -> dict:
    """Per seed with a blind evaluation: is the last round's policy rated above the base with
    separated 95% intervals (its low above the base's high)?"""
    out = {}
    for seed, entry in results["seeds"].items():
        rows = {r["policy"]: r for r in (entry.get("leaderboard") or {}).get("rows", [])}
        last = max((p for p in rows if p.startswith("round")), key=lambda p: int(p[5:]), default=None)
        if last and "base" in rows:
            out[seed] = {"last": last, "separated": rows[last]["low"] > rows["base"]["high"],
                         "above": rows[last]["rating"] > rows["base"]["rating"]}
    return out


def _f(x, digits=3, sign=False) -> str:
    if x is None:
        return "-"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def result_line(folder: Path) -> str:
    results, raw = load(folder)
    rows = rounds_table(results, raw)
    parts = [f"rounds={len(rows)}", f"seeds={min((len(r['seeds']) for r in rows), default=0)}",
             f"test_prompts={results['settings']['test_prompts_n']}"]
    for r in rows:
        n = r["round"]
        parts += [f"r{n}_gain_mean={_f(r['gain_mean'], 4)}", f"r{n}_gain_se_seeds={_f(r['gain_se'], 4)}",
                  f"r{n}_ci95_lo={_f(r['gain_lo'], 4)}", f"r{n}_ci95_hi={_f(r['gain_hi'], 4)}",
                  f"r{n}_kl={_f(r['kl_mean'], 2)}"]
    check = leaderboard_check(results)
    if check:
        parts.append(f"leaderboard_separated={sum(c['separated'] for c in check.values())}/{len(check)}")
    return "RESULT gold_loop " + " ".join(parts)


def write_report(folder: Path) -> Path:
    folder = Path(folder)
    results, raw = load(folder)
    rows = rounds_table(results, raw)
    sizes = results["settings"]["sizes"]
    lines = [
        "# The product's default round, as a loop, on the gold judge", "",
        f"Command: `{results.get('command', '')}` (commit {results.get('commit', '?')}). "
        f"Every setting is `LoopSettings()`'s but {', '.join(results['settings']['sizes_differ_from_defaults'])}; "
        f"{sizes['prompts_per_round']} prompts ranked a round (K responses each) by simulated annotators "
        f"(noise {sizes['noise']}), each seed with its own annotators, prompts, reward models and sampling.", "",
        f"Evaluated on the **locked test set** ({results['settings']['test_prompts_n']} prompts, "
        f"`{results['settings']['test_prompts']}`), {sizes['eval_samples']} responses per prompt.", "",
        "| round | seeds | gold gain (mean) | between-seed s.e. | 95% t interval | per seed | KL (nats) | "
        "reward-model held-out accuracy | gate refused | CPU min / seed | machine |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['round']} | {len(r['seeds'])} | {_f(r['gain_mean'], 4, True)} | {_f(r['gain_se'], 4)} | "
                     f"[{_f(r['gain_lo'], 4, True)}, {_f(r['gain_hi'], 4, True)}] | "
                     f"{', '.join(_f(g, 3, True) for g in r['gains'])} | {_f(r['kl_mean'], 2)} | "
                     f"{', '.join(_f(a, 3) for a in r['rm_accuracy']) or '-'} | {r['gated']} | {_f(r['cpu_min'], 1)} | "
                     f"{'; '.join(r['machines'])} |")
    if not rows:
        lines.append("| (no round measured yet) ||||||||||")
    elif any(r["cpu_parts_min"] for r in rows):
        lines += ["", "CPU minutes per part of a round (mean over its seeds; each job's user + system time, "
                      "\"this process\": the evaluation, the blind answers and the simulated annotators):", "",
                  "| round | " + " | ".join(kinds := sorted({k for r in rows for k in r["cpu_parts_min"]})) + " |",
                  "|---|" + "---|" * len(kinds)]
        for r in rows:
            lines.append(f"| {r['round']} | " + " | ".join(_f(r["cpu_parts_min"].get(k), 1) for k in kinds) + " |")
    boards = {s: e["leaderboard"] for s, e in results["seeds"].items() if e.get("leaderboard", {}).get("rows")}
    if boards:
        lines += ["", "## Blind evaluation (the Models tab's, ranked by the simulated annotators)", "",
                  "| seed | policy | rating | 95% interval | comparisons |", "|---|---|---|---|---|"]
        for seed, board in boards.items():
            for r in board["rows"]:
                lines.append(f"| {seed} | {r['policy']} | {r['rating']:.0f} | [{r['low']:.0f}, {r['high']:.0f}] | "
                             f"{r['comparisons']} |")
        check = leaderboard_check(results)
        lines += ["", "Last round above the base with separated intervals: " +
                  ", ".join(f"seed {s} {'yes' if c['separated'] else 'no'}" for s, c in check.items()) + "."]
    machines = [r.get("machine") for r in results.get("resumed", [])] + [results.get("machine")]
    lines += ["", "Machines, each stretch of the run in order (stopped, packed and resumed): " +
              "; ".join(f"{i + 1}. {m or 'not recorded'}" for i, m in enumerate(machines)) + "."]
    cpu = results.get("cpu_s")  # None: a part of the run counted no job's CPU
    cpu_text = f"CPU {_f(cpu / 3600, 2)} h (this process and its jobs)" if cpu is not None else "CPU not known"
    lines += ["", f"Wall {_f(results.get('wall_s', 0) / 3600, 2)} h, {cpu_text}.", "", result_line(folder), ""]
    path = folder / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def publish(folder: Path, target: Path) -> list[Path]:
    """report.md, results.json and raw.json to `target` (raw results beside the report)."""
    target.mkdir(parents=True, exist_ok=True)
    out = []
    for name in ("report.md", "results.json", "raw.json"):
        out.append(Path(shutil.copy2(Path(folder) / name, target / ("README.md" if name == "report.md" else name))))
    return out


if __name__ == "__main__":
    print(write_report(Path(sys.argv[1])))
    print(result_line(Path(sys.argv[1])))
