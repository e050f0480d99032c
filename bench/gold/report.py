"""The gold-loop experiment's report: a markdown page and its plots, from results.json and the eval tables.

    python bench/gold/report.py RESULTS_DIR    # rebuild report.md and the plots of a finished run

Every number on the page is computed here from the run's files (bench/gold/verdict.py for the
conclusions, bench/gold/sections.py for the parts beside PPO, bench/gold/plots.py for the plots);
its last line is `RESULT gold ...`.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository's packages

from bench.gold.plots import plot_gold_vs_sqrt_kl, plot_learning_curve, plot_proxy_vs_gold, sqrt_kl  # noqa: E402
from bench.gold.sections import (conclusion_section, curve_section, drift_section, methods_section,  # noqa: E402
                                 parts_section)
from bench.gold.verdict import gold_result_line, load_eval, paired_se, verdict  # noqa: E402

PLOTS = ("gold_vs_sqrt_kl.png", "proxy_vs_gold.png", "learning_curve.png")
__all__ = ["paired_se", "publish", "result_line", "write_report", "merge"]


# --------------------------------------------------------------------------- markdown


def _f(x, digits=3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def gold_errors(results: dict, out_dir: Path) -> dict[str, float | None]:
    """{f"{setting}_round{n}": paired s.e. of its gold change} from the eval tables in out_dir."""
    base_rows = load_eval(out_dir, "base")
    tags = [f"{name}_round{r['round']}" for name, v in results["variants"].items() for r in v["rounds"]]
    return {tag: paired_se(base_rows, load_eval(out_dir, tag)) for tag in tags}


def _change(m: dict, base: dict, se: float | None) -> str:
    d = m["eval/gold"] - base["eval/gold"]
    return f"{'+' if d >= 0 else ''}{_f(d)}" + (f" ± {_f(se)}" if se is not None else "")


def results_table(results: dict, errors: dict[str, float | None]) -> list[str]:
    """The table; errors: gold_errors' paired standard errors ({} when the eval tables are gone)."""
    base = results["base"]
    lines = ["| setting | after round | gold | gold - start (± s.e.) | proxy (RM 1) | proxy (own RM) | KL | sqrt KL "
             "| length | EOS rate | distinct-1 | distinct-2 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(label, rnd, m, own, se=None):
        return (f"| {label} | {rnd} | {_f(m['eval/gold'])} | {_change(m, base, se)} | "
                f"{_f(m.get('eval/proxy:rm1'), 2)} | {own} | {_f(m['eval/kl'], 2)} | {_f(sqrt_kl(m['eval/kl']), 2)} | "
                f"{_f(m['eval/length'], 1)} | {_f(m['eval/eos_rate'], 2)} | {_f(m['eval/distinct_1'])} | "
                f"{_f(m['eval/distinct_2'])} |")

    lines.append(row("start policy", "-", base, _f(base.get("eval/proxy:rm1"), 2)))
    for name, v in results["variants"].items():
        for r in v["rounds"]:
            lines.append(row(v["label"], r["round"], r, _f(r.get("eval/proxy:own"), 2),
                             errors.get(f"{name}_round{r['round']}")))
    return lines


def observations(results: dict, errors: dict[str, float | None]) -> list[str]:
    """What the numbers say, computed (the expected picture is checked, not assumed): a gold
    change counts as a rise only when it is more than two paired standard errors."""
    base, out = results["base"], []
    finals = {name: v["rounds"][-1] for name, v in results["variants"].items() if v["rounds"]}

    def se(name):  # of the setting's last policy; None when its eval table is not there
        return errors.get(f"{name}_round{finals[name]['round']}")

    for name, last in finals.items():
        v = results["variants"][name]
        out.append(f"- **{v['label']}**: gold {_f(base['eval/gold'])} -> {_f(last['eval/gold'])} "
                   f"({_change(last, base, se(name))}), "
                   f"proxy under RM 1 {_f(base.get('eval/proxy:rm1'), 2)} -> {_f(last.get('eval/proxy:rm1'), 2)}, "
                   f"KL {_f(last['eval/kl'], 2)} nats, distinct-2 {_f(base['eval/distinct_2'])} -> "
                   f"{_f(last['eval/distinct_2'])}, length {_f(base['eval/length'], 1)} -> {_f(last['eval/length'], 1)} tokens.")
    controlled = [n for n in ("adaptive", "fixed") if n in finals]
    if "beta0" in finals and controlled:
        b0 = finals["beta0"]
        best = max(controlled, key=lambda n: finals[n]["eval/gold"])
        checks = [
            ("gold rises under KL control (by more than 2 s.e.)",
             finals[best]["eval/gold"] - base["eval/gold"] > 2 * (se(best) or 0.0)),
            ("beta = 0 drifts further (higher KL)", b0["eval/kl"] > max(finals[n]["eval/kl"] for n in controlled)),
            ("beta = 0 reaches a higher proxy (RM 1) than its gold gain would suggest: proxy above the "
             "KL-controlled runs' while gold is not", (b0.get("eval/proxy:rm1", 0) > finals[best].get("eval/proxy:rm1", 0))
             and b0["eval/gold"] <= finals[best]["eval/gold"]),
            ("beta = 0 loses diversity (distinct-2 below the start and below KL control)",
             b0["eval/distinct_2"] < base["eval/distinct_2"]
             and b0["eval/distinct_2"] < min(finals[n]["eval/distinct_2"] for n in controlled)),
        ]
        out.append("")
        out.append("Checks of the expected picture (computed from the table):")
        out += [f"- [{'x' if ok else ' '}] {text}" for text, ok in checks]
    return out


def samples_section(out_dir: Path, results: dict, n_prompts: int = 2) -> list[str]:
    """The first held-out prompts, one response each from the start and each setting's last policy."""
    tags = ["base"] + [f"{name}_round{v['rounds'][-1]['round']}" for name, v in results["variants"].items()
                       if v["rounds"]]
    tables = {tag: rows for tag in tags if (rows := load_eval(out_dir, tag))}
    if "base" not in tables:
        return []
    lines = []
    prompts = list(dict.fromkeys(r["prompt"] for r in tables["base"]))[:n_prompts]
    for prompt in prompts:
        lines += ["", f"**Prompt:** {prompt}", "", "| policy | gold | response |", "|---|---|---|"]
        for tag, rows in tables.items():
            row = next((r for r in rows if r["prompt"] == prompt), None)
            if row:
                text = row["response"].replace("|", "\\|").replace("\n", " ")
                lines.append(f"| {tag} | {_f(row['gold'])} | {text} |")
    return lines


def write_report(results: dict, out_dir: Path) -> Path:
    """report.md + its plots in out_dir; returns the report's path."""
    out_dir = Path(out_dir)
    errors = gold_errors(results, out_dir)
    plot_gold_vs_sqrt_kl(results, out_dir / PLOTS[0])
    plot_proxy_vs_gold(results, out_dir / PLOTS[1])
    curve_plot = plot_learning_curve(results, out_dir / PLOTS[2])
    v = verdict(results, out_dir)
    s, t = results["settings"], results.get("timings", {})
    agree = results.get("annotators", {}).get("round1", {})
    rm1 = results.get("reward_models", {}).get("rm1", {})
    wall = results.get("wall_s", t.get("total_s", 0.0))
    reused = results.get("reused_round1")
    if reused:  # round 1 ran in an earlier process: its time counts too
        wall += reused.get("seconds_there") or 0.0
    how = (f" (round 1 and the start policy's evaluation {reused['seconds_there'] / 60:.1f} min in a first "
           f"process, then the settings {results.get('wall_s', 0) / 60:.1f} min"
           f"{', side by side' if results.get('parallel') else ''})" if reused else "")
    lines = [
        "# Gold-judge experiment: does the loop improve a measure it was not trained on?",
        "",
        f"Mode: **{results.get('mode', '?')}**, model `{Path(s['model']).name if results.get('mode') == 'quick' else s['model']}`, "
        f"wall time **{wall / 60:.1f} min** ({wall:.0f} s){how}, {s['threads']} torch thread(s) per process. "
        + (f"Made by `{results['command']}`" + (f" after `{reused['command']}` ran round 1" if reused and reused.get("command")
                                                 else "") + ". " if results.get("command") else "")
        + "Reproduce in one process: `python bench/gold/loop.py --parallel --threads 1` (full) or "
        "`python bench/gold/loop.py --quick` (tiny models).",
        "",
        "## Set-up",
        "",
        f"- Gold judge: {s['judge']}: cos(response, helpful description) - cos(response, unhelpful description) "
        "+ 0.5 cos(response, prompt). The pipeline never trains on it.",
        f"- Simulated annotators rank each prompt's K = {s['k']} responses by gold score with Bradley-Terry "
        f"(Plackett-Luce) noise, temperature {s['noise']}; their pairs agree with the gold order in "
        f"{_f(agree.get('agreement'), 3)} of {agree.get('pairs', 0)} round-1 pairs.",
        f"- {s['rounds']} rounds of {s['prompts_per_round']} new prompts, responses of at most "
        f"{s['max_new_tokens']} tokens (generation temperature {s['generate_temperature']}). Reward model: LoRA "
        f"r{s['lora_r']}, lr {s['reward']['lr']}, {s['reward']['epochs']} epoch(s)"
        + (f" capped at {s['reward']['max_steps']} optimiser steps" if s["reward"].get("max_steps") else "")
        + ", warm-started each round from "
        f"the previous one on all pairs so far; round-1 held-out pair accuracy {_f(rm1.get('eval/accuracy'))}.",
        f"- PPO per round: {s['ppo']['steps']} steps of {s['ppo']['batch_size']} episodes, {s['ppo']['ppo_epochs']} "
        f"epochs, minibatch {s['ppo']['mini_batch_size']}, lr {s['ppo']['lr']}, temperature "
        f"{s['ppo']['temperature']}, missing-EOS penalty {s['ppo']['missing_eos_penalty']}; the reference is "
        "always the start policy (KL accumulates over rounds).",
        "- Settings, all from the same start and sharing round 1's responses, rankings and reward model: "
        + "; ".join(f"{name}: `{json.dumps(v)}`" for name, v in s["variants"].items()) + ".",
        f"- Evaluation: {s['eval_prompts']} held-out prompts (never in the store), {s['eval']['samples']} "
        f"responses each at temperature {s['eval']['temperature']}, the same seed for every policy. "
        "KL = mean over responses of sum_t log pi(y_t)/pi_ref(y_t) (k1, nats per response). "
        "Proxy (RM 1) = round-1 reward model, comparable across settings; proxy (own RM) = the reward "
        "model that trained the policy (normalised on start-policy samples).",
        "",
        "## Results (held-out prompts)",
        "",
        *results_table(results, errors),
        "",
        "![gold vs sqrt KL](gold_vs_sqrt_kl.png)",
        "",
        "![proxy and gold along PPO](proxy_vs_gold.png)",
        "",
        "## Observations",
        "",
        *observations(results, errors),
        "",
        *methods_section(results, v),
        *drift_section(results, v["drift"]),
        *curve_section(results, v["good_enough"], curve_plot),
        *conclusion_section(results, v),
        "## Samples",
        *samples_section(out_dir, results),
        "",
        *parts_section(results),
        "## Timings of the evaluations and settings",
        "",
        "| phase | seconds |",
        "|---|---|",
        *[f"| {k.removesuffix('_s')} | {v:.0f} |" for k, v in t.items() if k != "total_s"],
        *([f"| total (this process) | {t['total_s']:.0f} |"] if "total_s" in t else []),
        "",
        gold_result_line(results, out_dir),
        "",
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def publish(out_dir: Path, target: Path) -> list[Path]:
    """Copy the report (as gold_loop.md) and the plots to a well-known folder (docs/results)."""
    target.mkdir(parents=True, exist_ok=True)
    copied = [Path(shutil.copy2(out_dir / "report.md", target / "gold_loop.md"))]
    copied += [Path(shutil.copy2(out_dir / name, target / name)) for name in PLOTS if (out_dir / name).is_file()]
    return copied


def result_line(results: dict) -> str:
    """`RESULT gold_loop key=value ...` for bench/run_all.py."""
    parts = [f"mode={results.get('mode', '?')}", f"wall_s={results.get('wall_s', 0):.0f}",
             f"base_gold={results['base']['eval/gold']:.4f}"]
    for name, v in results["variants"].items():
        if v["rounds"]:
            last = v["rounds"][-1]
            parts += [f"{name}_gold={last['eval/gold']:.4f}", f"{name}_kl={last['eval/kl']:.3f}",
                      f"{name}_proxy_rm1={last.get('eval/proxy:rm1', float('nan')):.3f}",
                      f"{name}_distinct2={last['eval/distinct_2']:.3f}"]
    return "RESULT gold_loop " + " ".join(parts)


def merge(folders: list[Path], out_dir: Path) -> dict:
    """One results dict from runs that share round 1 (--reuse-round1 of the same first run), each
    contributing its settings; their eval tables are copied into out_dir/eval."""
    runs = [json.loads((Path(f) / "results.json").read_text(encoding="utf-8")) for f in folders]
    merged = {**runs[0], "variants": {}, "timings": {}, "merged_from": [Path(f).name for f in folders]}
    (out_dir / "eval").mkdir(parents=True, exist_ok=True)
    for folder, run in zip(folders, runs):
        if run["base"] != runs[0]["base"]:
            raise ValueError(f"{folder}: another start policy evaluation; merge only runs sharing round 1")
        merged["variants"].update({k: v for k, v in run["variants"].items() if v.get("rounds")})
        merged["timings"].update({f"{Path(folder).name}/{k}": v for k, v in run["timings"].items()
                                  if folder == folders[0] or k not in ("round1_shared_s", "eval_base_s")})
        for table in (Path(folder) / "eval").glob("*.jsonl"):
            shutil.copy2(table, out_dir / "eval" / table.name)
    return merged


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python bench/gold/report.py RESULTS_DIR  |  "
                         "python bench/gold/report.py --merge OUT_DIR WALL_SECONDS RESULTS_DIR...")
    if sys.argv[1] == "--merge":  # --merge OUT_DIR WALL_SECONDS RESULTS_DIR...: the merged runs' end-to-end time
        out = Path(sys.argv[2])
        results = merge([Path(f) for f in sys.argv[4:]], out)
        results.update(wall_s=float(sys.argv[3]), mode=results.get("mode", "full"))
        (out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
        print(write_report(results, out))
    else:
        folder = Path(sys.argv[1])
        print(write_report(json.loads((folder / "results.json").read_text()), folder))
