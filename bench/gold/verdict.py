"""What the gold-loop experiment shows, computed from results.json and the eval tables alone.

- every method on round 1's pairs side by side (best-of-n, the PPO settings, DPO, the control),
  each gold change against the start policy with its standard error paired by prompt;
- the best method at a KL of at most 6 nats, and whether it raises gold by more than 2 s.e.
  (the goal of issue 16);
- the drift control: what PPO loses in gold against a reward model that learned nothing, at the
  adaptive setting's KL budget, and whether beta = 0 loses clearly more at that same KL (only
  then is it called reward hacking);
- the learning curve: at which number of annotated pairs the proxy becomes good enough;
- `RESULT gold ...`, the last line of the report.

Comparisons at the same KL interpolate a setting's per-prompt gold changes linearly in
d = sqrt(KL) between its evaluations (the start policy is d = 0): Gao et al. 2022 fit gold as a
smooth function of d, close to linear for small d.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.gold.bon import bon_kl

GOAL_KL = 6.0
"""Issue 16's goal: a gold rise of more than 2 paired standard errors at a KL of at most this."""


def load_eval(out_dir: Path, tag: str) -> list[dict]:
    """The per-response rows of one evaluation (eval/TAG.jsonl), [] when it is not there."""
    path = Path(out_dir) / "eval" / f"{tag}.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def per_prompt(rows: list[dict]) -> dict[str, float]:
    """Mean gold of each prompt's responses."""
    groups: dict[str, list[float]] = {}
    for row in rows:
        groups.setdefault(row["prompt"], []).append(row["gold"])
    return {p: sum(g) / len(g) for p, g in groups.items()}


def mean_se(diffs: list[float]) -> tuple[float, float | None]:
    """(mean, its standard error); the error is None below two values."""
    mean = sum(diffs) / len(diffs) if diffs else float("nan")
    if len(diffs) < 2:
        return mean, None
    return mean, math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))


def changes(base_rows: list[dict], rows: list[dict]) -> dict[str, float]:
    """Per prompt the policy's mean gold minus the start's, on the prompts both answered."""
    a, b = per_prompt(base_rows), per_prompt(rows)
    return {p: b[p] - a[p] for p in a if p in b}


def paired_se(base_rows: list[dict], rows: list[dict]) -> float | None:
    """Standard error of the mean gold change against the start policy, paired by prompt.

    Every policy answers the same held-out prompts, so the prompt-to-prompt spread cancels: the
    change is the mean over prompts of (mean gold of the policy's responses - the start's), and
    its noise is the spread of those per-prompt differences / sqrt(prompts).
    """
    return mean_se(list(changes(base_rows, rows).values()))[1]


def at_kl(points: list[tuple[float, dict[str, float]]], kl: float) -> dict[str, float] | None:
    """Per-prompt changes at `kl`, linear in sqrt(KL) between the two evaluations around it;
    None when no evaluation reaches that far. points: (KL, per-prompt change), the start's (0, 0s) included."""
    d = math.sqrt(max(kl, 0.0))
    pts = sorted(((math.sqrt(max(k, 0.0)), c) for k, c in points), key=lambda p: p[0])
    for (d0, c0), (d1, c1) in zip(pts, pts[1:]):
        if d0 <= d <= d1:
            w = 0.0 if d1 == d0 else (d - d0) / (d1 - d0)
            return {p: c0[p] + w * (c1[p] - c0[p]) for p in c0 if p in c1}
    return None


# --------------------------------------------------------------------------- the methods side by side


def methods(results: dict, out_dir: Path) -> list[dict]:
    """Every evaluated method: tag, label, KL, gold, change against the start and its paired s.e.,
    the change in s.e. (z), proxy under reward model 1, length, distinct-2."""
    base_rows, base = load_eval(out_dir, "base"), results["base"]
    rows = []

    def add(tag, label, kl, m, round_no=1):
        table = load_eval(out_dir, tag)
        delta = m["eval/gold"] - base["eval/gold"]
        se = paired_se(base_rows, table) if table and base_rows else None
        rows.append({"tag": tag, "label": label, "round": round_no, "kl": kl, "gold": m["eval/gold"], "delta": delta,
                     "se": se, "z": delta / se if se else None, "proxy_rm1": m.get("eval/proxy:rm1"),
                     "length": m.get("eval/length"), "distinct_2": m.get("eval/distinct_2")})

    for r in results.get("bon", {}).get("rows", []):
        add(f"bon_n{r['n']}", f"best-of-{r['n']} (RM 1)", bon_kl(r["n"]), r)
    for name, v in results["variants"].items():
        for r in v["rounds"]:
            add(f"{name}_round{r['round']}", v["label"], r["eval/kl"], r, r["round"])
    return rows


def best_method(rows: list[dict], max_kl: float = GOAL_KL) -> dict | None:
    """The method (not the control, not best-of-1) with the largest gold change in s.e. at KL <= max_kl."""
    ok = [r for r in rows if r["z"] is not None and r["kl"] <= max_kl and not r["tag"].startswith("control")
          and r["tag"] != "bon_n1"]
    return max(ok, key=lambda r: r["z"]) if ok else None


# --------------------------------------------------------------------------- the drift control


def drift_check(results: dict, out_dir: Path) -> dict:
    """The control's gold change and KL; adaptive PPO against it; beta = 0 against it at its KL.
    verdict: 'hacking' (beta = 0 loses more than the control by over 2 s.e. at the same KL),
    'drift' (it does not), 'undecided' (beta = 0 never reached the control's KL), '' (no control)."""
    control = results["variants"].get("control")
    base_rows, c_rows = load_eval(out_dir, "base"), load_eval(out_dir, "control_round1")
    if not control or not control["rounds"] or not c_rows or not base_rows:
        return {"verdict": ""}
    c_change = changes(base_rows, c_rows)
    kl = control["rounds"][0]["eval/kl"]
    out = {"control_kl": kl, "control_delta": mean_se(list(c_change.values()))[0],
           "control_se": mean_se(list(c_change.values()))[1], "verdict": "undecided"}
    a_rows = load_eval(out_dir, "adaptive_round1")
    if a_rows:
        a_change = changes(base_rows, a_rows)
        out["adaptive_minus_control"], out["adaptive_minus_control_se"] = mean_se(
            [a_change[p] - c_change[p] for p in c_change if p in a_change])
    beta0 = results["variants"].get("beta0")
    if beta0 and beta0["rounds"]:
        points = [(0.0, {p: 0.0 for p in c_change})]
        points += [(r["eval/kl"], changes(base_rows, load_eval(out_dir, f"beta0_round{r['round']}")))
                   for r in beta0["rounds"]]
        b0 = at_kl(points, kl)
        if b0:
            diff, se = mean_se([b0[p] - c_change[p] for p in c_change if p in b0])
            out.update(beta0_at_control_kl=mean_se(list(b0.values()))[0], beta0_minus_control=diff,
                       beta0_minus_control_se=se, verdict="hacking" if se and diff < -2 * se else "drift")
    return out


# --------------------------------------------------------------------------- the learning curve


def good_enough(curve: dict) -> dict:
    """The number of pairs at which the proxy is good enough: held-out accuracy at least halfway
    from chance to the ceiling (the gold judge's own accuracy on the same noisy labels) with its
    95% interval above 0.5. Measured at a point of the curve, else extrapolated along a straight
    line in log(pairs) through the points (least squares); pairs None when the curve does not rise."""
    points, ceiling = curve.get("points", []), curve.get("ceiling", {}).get("agreement")
    if not points or ceiling is None or ceiling <= 0.5:
        return {"pairs": None, "why": "no ceiling above chance to measure against"}
    threshold = 0.5 + (ceiling - 0.5) / 2
    for p in sorted(points, key=lambda p: p["pairs"]):
        if p["eval/accuracy"] >= threshold and p["acc_lo"] > 0.5:
            return {"pairs": p["pairs"], "measured": True, "threshold": threshold}
    xs = [math.log(p["pairs"]) for p in points]
    ys = [p["eval/accuracy"] for p in points]
    if len(points) < 2:
        return {"pairs": None, "threshold": threshold, "why": "one point: no trend to extrapolate"}
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope <= 0:
        return {"pairs": None, "threshold": threshold, "slope": slope,
                "why": "held-out accuracy does not rise with more pairs"}
    pairs = math.exp(mx + (threshold - my) / slope)
    return {"pairs": int(round(pairs, -1 if pairs < 1000 else -2)), "measured": False, "threshold": threshold,
            "slope": slope}


# --------------------------------------------------------------------------- RESULT gold


def _v(x, digits=3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def verdict(results: dict, out_dir: Path) -> dict:
    """Everything the RESULT line and the report's conclusion need, in one dict."""
    rows = methods(results, out_dir)
    best = best_method(rows)
    by_tag = {r["tag"]: r for r in rows}
    curve = results.get("curve_simulated") or {}
    return {"rows": rows, "best": best, "by_tag": by_tag, "drift": drift_check(results, out_dir),
            "goal_met": bool(best and best["z"] > 2), "good_enough": good_enough(curve) if curve else {}}


HACKING = {"hacking": "yes", "drift": "no"}


def gold_result_line(results: dict, out_dir: Path) -> str:
    """`RESULT gold best=<method> best_gain_se=<x> ... control_gold_delta=... control_kl=...`."""
    v = verdict(results, out_dir)
    best, drift, by_tag, ge = v["best"], v["drift"], v["by_tag"], v["good_enough"]
    bon = [r for r in v["rows"] if r["tag"].startswith("bon_n")]
    parts = [f"best={best['tag'] if best else 'n/a'}", f"best_gain_se={_v(best and best['z'], 2)}",
             f"best_gain={_v(best and best['delta'], 4)}", f"best_kl={_v(best and best['kl'], 2)}",
             f"goal={'met' if v['goal_met'] else 'not_met'}"]
    if bon:
        parts.append(f"bon{bon[-1]['tag'][5:]}_gain_se={_v(bon[-1]['z'], 2)}")
    for tag in ("dpo_round1", "adaptive_round1", "beta0_round1"):
        if tag in by_tag:
            parts.append(f"{tag.removesuffix('_round1')}_gain_se={_v(by_tag[tag]['z'], 2)}")
    parts += [f"control_gold_delta={_v(drift.get('control_delta'), 4)}", f"control_se={_v(drift.get('control_se'), 4)}",
              f"control_kl={_v(drift.get('control_kl'), 2)}", f"hacking={HACKING.get(drift['verdict'], 'undecided')}"]
    for key, name in (("curve_simulated", "curve"), ("curve_hh", "hh")):
        pts = (results.get(key) or {}).get("points")
        if pts:
            parts += [f"{name}_pairs={pts[-1]['pairs']}", f"{name}_accuracy={_v(pts[-1]['eval/accuracy'])}",
                      f"{name}_length_baseline={_v(pts[-1]['length_baseline'])}"]
    if ge:
        parts.append(f"good_enough_pairs={ge.get('pairs') or 'none'}"
                     + ("" if ge.get("pairs") is None else f" good_enough_measured={'yes' if ge['measured'] else 'no'}"))
    return "RESULT gold " + " ".join(parts)
