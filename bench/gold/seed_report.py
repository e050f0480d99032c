"""The multi-seed gold experiment's report (bench/gold/seeds.py), from results.json and raw.json alone.

    python bench/gold/seed_report.py RESULTS_DIR    # report.md and gold_seeds_vs_sqrt_kl.png again

raw.json holds, per seed and evaluation, each held-out prompt's mean gold, proxy and KL; every
number here is recomputed from it:
- a point's gold gain = mean over prompts of (the policy's gold - the start policy's, same seed);
  its paired s.e. = the spread of those per-prompt differences / sqrt(prompts) (one training run);
- an arm's result = per seed, its last measured point at a KL of at most GOAL_KL nats; the table
  gives each seed's gain, their mean and the between-seed s.e. = sd over seeds / sqrt(seeds), which
  is what a second training run would move;
- curves: the seeds' points by checkpoint, mean gold gain and mean sqrt(KL) with between-seed s.e.;
- hacking is claimed only on a measured segment (one arm's checkpoint a -> the next, b) where the
  proxy rises and gold falls, each by more than 2 between-seed s.e. of the seeds' own changes over
  the segment, with every seed's proxy better than chance on its held-out pairs (95% interval above 0.5);
- KL efficiency: along PPO's checkpoints, its proxy gain against best-of-n's at the same KL
  (best-of-n interpolated linearly in KL between its n; beyond its largest n, that n's gain per nat);
  for an arm rewarded by the gold judge itself (bench/gold/seeds.py JUDGE_ARMS), its gold gain
  against best-of-n picking by the judge.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gold.bon import bon_kl  # noqa: E402
from bench.gold.verdict import GOAL_KL, mean_se  # noqa: E402

PLOT = "gold_seeds_vs_sqrt_kl.png"
MIN_KL = 0.1
"""Nats below which a gain per nat is not reported (KL estimates of a policy that barely moved)."""
ROOT = Path(__file__).resolve().parents[2]


def load(folder: Path) -> tuple[dict, dict]:
    folder = Path(folder)
    results = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    raw = json.loads((folder / "raw.json").read_text(encoding="utf-8"))["evals"]
    return results, raw


def gain(raw_seed: dict, tag: str, key: str = "gold", base: str = "base") -> tuple[float, float | None, float]:
    """(mean gain over prompts against the start, its paired s.e., mean KL) of one evaluation;
    best-of-n's against the mean of the samples it picks from (`base` bon_all)."""
    base, table = raw_seed[base], raw_seed[tag]
    diffs = [table[p][key] - base[p][key] for p in base if p in table and table[p][key] is not None]
    mean, se = mean_se(diffs)
    kls = [table[p]["kl"] for p in table if table[p].get("kl") is not None]
    return mean, se, sum(kls) / len(kls) if kls else 0.0


def seeds_of(results: dict, raw: dict) -> list[str]:
    return [s for s in results["seeds"] if s in raw and "base" in raw[s]]


def points(results: dict, raw: dict, arm: str) -> dict[str, list[dict]]:
    """Per seed, the arm's measured points in order, the start (step 0, KL 0) first."""
    out = {}
    for s in seeds_of(results, raw):
        entry = results["seeds"][s]["arms"].get(arm)
        if not entry:
            continue
        pts = [{"step": 0, "gold": 0.0, "gold_se": 0.0, "proxy": 0.0, "kl": 0.0, "running": "wall_s" not in entry}]
        for p in entry["points"]:
            if p["tag"] in raw[s]:
                g, se, kl = gain(raw[s], p["tag"])
                pts.append({"step": p["step"], "gold": g, "gold_se": se, "proxy": gain(raw[s], p["tag"], "proxy")[0],
                            "kl": kl, "running": "wall_s" not in entry})
        out[s] = pts
    return out


def curve(per_seed: dict[str, list[dict]]) -> list[dict]:
    """Step by step (the checkpoints' training step) over the seeds measured there: means and
    between-seed s.e."""
    rows = []
    for step in sorted({p["step"] for pts in per_seed.values() for p in pts}):
        at = [p for pts in per_seed.values() for p in pts if p["step"] == step]
        row = {"step": step, "seeds": len(at)}
        for key in ("gold", "proxy", "kl"):
            row[key], row[f"{key}_se"] = mean_se([a[key] for a in at])
        row["sqrt_kl"], row["sqrt_kl_se"] = mean_se([math.sqrt(max(a["kl"], 0.0)) for a in at])
        rows.append(row)
    return rows


def arm_result(per_seed: dict[str, list[dict]], max_kl: float = GOAL_KL) -> dict:
    """Per seed the last measured point (not the start) with KL <= max_kl; mean and between-seed s.e."""
    picked = {}
    for s, pts in per_seed.items():
        ok = [p for p in pts[1:] if p["kl"] <= max_kl]
        if ok:
            picked[s] = ok[-1]
    mean, se = mean_se([p["gold"] for p in picked.values()])
    return {"per_seed": picked, "seeds": len(picked), "gain_mean": mean, "gain_se_seeds": se,
            "kl_mean": mean_se([p["kl"] for p in picked.values()])[0],
            "proxy_mean": mean_se([p["proxy"] for p in picked.values()])[0],
            "raised": bool(se and mean > 2 * se)}


def proxy_quality(results: dict) -> dict:
    """Each seed's proxy (early-stopped epoch): held-out accuracy and its 95% interval; pooled."""
    from bench.reward_bench import wilson

    rows = {s: e["proxy"] for s, e in results["seeds"].items() if "proxy" in e and e.get("shared_round1_from") is None}
    correct = sum(round(p["eval/accuracy"] * p["eval/pairs"]) for p in rows.values())
    n = sum(p["eval/pairs"] for p in rows.values())
    lo, hi = wilson(correct, n) if n else (float("nan"), float("nan"))
    return {"per_seed": rows, "pooled": correct / n if n else float("nan"), "pooled_lo": lo, "pooled_hi": hi,
            "pairs": n, "better_than_chance": bool(rows) and all(p["acc_lo"] > 0.5 for p in rows.values())}


def bon_curve(results: dict, raw: dict) -> list[dict]:
    """Best-of-n by n: gold and proxy gains over the seeds (mean, between-seed s.e.), KL bound;
    `judge`: the gold gain of best-of-n picking by the judge itself (None where not stored)."""
    ns = sorted({int(m.group(1)) for s in raw.values() for t in s if (m := re.fullmatch(r"bon_n(\d+)", t))})
    rows = []
    for n in ns:
        seeds = [s for s in seeds_of(results, raw) if f"bon_n{n}" in raw[s]]
        gold = [gain(raw[s], f"bon_n{n}", base="bon_all")[0] for s in seeds]
        proxy = [gain(raw[s], f"bon_n{n}", "proxy", base="bon_all")[0] for s in seeds]
        paired = [gain(raw[s], f"bon_n{n}", base="bon_all")[1] for s in seeds]
        g, gse = mean_se(gold)
        pm, pse = mean_se(proxy)
        judged = [gain(raw[s], f"bon_judge_n{n}", base="bon_all")[0] for s in seeds if f"bon_judge_n{n}" in raw[s]]
        jm, jse = mean_se(judged) if judged else (None, None)
        rows.append({"n": n, "kl": bon_kl(n), "seeds": len(seeds), "gold": g, "gold_se": gse, "proxy": pm,
                     "proxy_se": pse, "gold_per_seed": gold, "paired_se": paired, "judge": jm, "judge_se": jse})
    return rows


def bon_rises(bon: list[dict]) -> bool | None:
    """Gold at the largest n above n = 1's by more than 2 between-seed s.e. of the difference."""
    if len(bon) < 2:
        return None
    diffs = [a - b for a, b in zip(bon[-1]["gold_per_seed"], bon[0]["gold_per_seed"])]
    mean, se = mean_se(diffs)
    return bool(se and mean > 2 * se)


def bon_proxy_at(bon: list[dict], kl: float, key: str = "proxy") -> float | None:
    """Best-of-n's mean gain (`key`: proxy, or judge) at `kl`: linear in KL between its n, past the
    largest n its gain per nat."""
    if len(bon) < 2 or any(b[key] is None for b in bon):
        return None
    for a, b in zip(bon, bon[1:]):
        if a["kl"] <= kl <= b["kl"]:
            w = (kl - a["kl"]) / (b["kl"] - a["kl"]) if b["kl"] > a["kl"] else 0.0
            return a[key] + w * (b[key] - a[key])
    last = bon[-1]
    return last[key] / last["kl"] * kl if last["kl"] > 0 else None


def kl_efficiency(arm_curve: list[dict], bon: list[dict], judge: bool = False) -> list[dict]:
    """Along an arm's mean curve: the gain per nat of the reward it trains on and best-of-n's with
    that reward at the same KL, and the ratio: the proxy, or for an arm rewarded by the gold judge
    (`judge`) its gold gain against best-of-n picking by the judge."""
    ours, theirs = ("gold", "judge") if judge else ("proxy", "proxy")
    rows = []
    for c in arm_curve[1:]:
        b = bon_proxy_at(bon, max(c["kl"], 0.0), theirs)
        far = c["kl"] >= MIN_KL  # below it both gains are sampling noise over a tiny KL
        rows.append({"step": c["step"], "kl": c["kl"], "reward": "gold judge" if judge else "proxy",
                     "proxy": c[ours], "bon_proxy": b,
                     "per_nat": c[ours] / c["kl"] if far else None,
                     "bon_per_nat": b / c["kl"] if b is not None and far else None,
                     "ratio": c[ours] / b if b and far else None})
    return rows


def judged(results: dict, arm: str) -> bool:
    """Whether the arm's PPO reward was the gold judge itself (bench/gold/seeds.py JUDGE_ARMS)."""
    return any(e["arms"].get(arm, {}).get("reward") == "judge" for e in results["seeds"].values())


def hacking(per_seed: dict[str, list[dict]], chance_ok: bool) -> list[dict]:
    """Each measured segment of one arm (checkpoint step a -> b): the change of proxy and gold over
    the seeds measured at both, mean and between-seed s.e.; hacking where the proxy rises and gold
    falls, each by more than 2 s.e., and the proxy is better than chance (`chance_ok`)."""
    steps = sorted({p["step"] for pts in per_seed.values() for p in pts})
    out = []
    for a, b in zip(steps, steps[1:]):
        pairs = [(pa, pb) for pts in per_seed.values() for pa in pts for pb in pts if pa["step"] == a and pb["step"] == b]
        dp, se_p = mean_se([pb["proxy"] - pa["proxy"] for pa, pb in pairs])
        dg, se_g = mean_se([pb["gold"] - pa["gold"] for pa, pb in pairs])
        out.append({"from": a, "to": b, "seeds": len(pairs), "d_proxy": dp, "d_proxy_se": se_p, "d_gold": dg,
                    "d_gold_se": se_g, "hacking": bool(chance_ok and se_p is not None and se_g is not None
                                                       and dp > 2 * se_p and dg < -2 * se_g)})
    return out


def summary(folder: Path) -> dict:
    results, raw = load(folder)
    arms = list(results["settings"]["arms"])
    quality = proxy_quality(results)
    bon = bon_curve(results, raw)
    out = {"results": results, "raw": raw, "arms": {}, "quality": quality, "bon": bon, "bon_rises": bon_rises(bon)}
    for arm in arms:
        per_seed = points(results, raw, arm)
        c = curve(per_seed)
        out["arms"][arm] = {"per_seed": per_seed, "curve": c, "result": arm_result(per_seed),
                            "hacking": hacking(per_seed, quality["better_than_chance"]),
                            "judge": judged(results, arm),
                            "efficiency": kl_efficiency(c, bon, judged(results, arm)) if arm != "dpo" else []}
    return out


# --------------------------------------------------------------------------- the page


def _f(x, digits=3, sign=False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def adaptive_arms(sm: dict) -> list[str]:
    """The PPO arms with adaptive KL control (bench/gold/seeds.py ARMS: adaptive, adaptive2, ...)."""
    return [name for name in sm["arms"] if name.startswith("adaptive")]


def judge_arms(sm: dict) -> list[str]:
    """The PPO arms rewarded by the gold judge itself: controls, not RLHF from the annotators' pairs."""
    return [name for name, a in sm["arms"].items() if a["judge"]]


def seeds_result_line(folder: Path, sm: dict | None = None) -> str:
    sm = sm or summary(folder)
    parts = []
    for arm, a in sm["arms"].items():
        r = a["result"]
        parts += [f"{arm}_gain_mean={_f(r['gain_mean'], 4)}", f"{arm}_gain_se_seeds={_f(r['gain_se_seeds'], 4)}",
                  f"{arm}_kl={_f(r['kl_mean'], 2)}", f"{arm}_seeds={r['seeds']}"]
    seeds = min((a["result"]["seeds"] for a in sm["arms"].values()), default=0)
    q = sm["quality"]
    parts += [f"proxy_accuracy={_f(q['pooled'])}", f"proxy_acc_lo={_f(q['pooled_lo'])}",
              f"proxy_better_than_chance={'yes' if q['better_than_chance'] else 'no'}"]
    if sm["bon"]:
        last = sm["bon"][-1]
        parts += [f"bon{last['n']}_gain_mean={_f(last['gold'], 4)}", f"bon{last['n']}_gain_se_seeds={_f(last['gold_se'], 4)}",
                  f"bon_rises={'yes' if sm['bon_rises'] else 'no'}"]
    for name in adaptive_arms(sm) + judge_arms(sm) or ["adaptive"]:
        ppo = sm["arms"].get(name)
        if ppo and ppo["efficiency"]:
            parts.append(f"{name}_kl_efficiency_vs_bon={_f(ppo['efficiency'][-1]['ratio'], 3)}")
        if not sm["arms"].get(name, {}).get("judge"):
            parts.append(f"{name}_goal={'met' if ppo and ppo['result']['raised'] else 'not_met'}")
    claimed = [f"{arm}@{h['to']}" for arm, a in sm["arms"].items() for h in a["hacking"] if h["hacking"]]
    parts.append(f"hacking={'yes:' + ','.join(claimed) if claimed else 'no'}")
    partial = "" if sm["results"].get("done") else " partial=yes"
    return f"RESULT gold seeds={seeds} " + " ".join(parts) + partial


def plot(sm: dict, path: Path) -> Path | None:
    from bench.gold.plots import COLORS, _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5 + 0.22 * (len(sm["arms"]) + 1)))  # room for the legend below
    for arm, a in sm["arms"].items():
        c = a["curve"]
        if len(c) < 2:
            continue
        ax.errorbar([r["sqrt_kl"] for r in c], [r["gold"] for r in c], yerr=[r["gold_se"] or 0 for r in c],
                    xerr=[r["sqrt_kl_se"] or 0 for r in c], fmt="o-", color=COLORS.get(arm), capsize=3,
                    label=sm["results"]["seeds"][next(iter(a["per_seed"]))]["arms"][arm]["label"])
        for pts in a["per_seed"].values():
            ax.plot([math.sqrt(max(p["kl"], 0)) for p in pts], [p["gold"] for p in pts], "-", color=COLORS.get(arm),
                    alpha=0.25, lw=1)
    if sm["bon"]:
        b = sm["bon"]
        ax.errorbar([math.sqrt(r["kl"]) for r in b], [r["gold"] for r in b], yerr=[r["gold_se"] or 0 for r in b],
                    fmt="s-", color=COLORS["bon"], capsize=3, label="best-of-n (proxy), KL bound")
    ax.axhline(0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("sqrt(KL to the start policy)  [sqrt(nats)]")
    ax.set_ylabel("gold gain over the start policy")
    ax.set_title("Measured checkpoints: mean over seeds ± between-seed s.e.; thin: each seed", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1)  # below: it hid points
    return _save(fig, path)


def write_report(folder: Path) -> Path:
    folder = Path(folder)
    sm = summary(folder)
    results, s = sm["results"], sm["results"]["settings"]
    plotted = plot(sm, folder / PLOT)
    q = sm["quality"]
    done = results.get("done")
    commits = [r.get("commit") for r in results.get("resumed", [])] + [results.get("commit")]
    lines = ["# Gold-judge experiment over seeds: measured curves, a converged proxy", ""]
    if not done:
        lines += ["> **Partial**: the run had not finished when this page was written; every table holds "
                  "what was measured by then.", ""]
    lines += [
        f"Made by `{results.get('command', 'python bench/gold/seeds.py')}`"
        + (f" at commit {', then '.join(c for c in commits if c)}" if any(commits) else "")
        + " (bench/gold/seeds.py; page: bench/gold/seed_report.py from results.json and raw.json beside it). Wall "
        f"{results.get('wall_s', 0) / 60:.1f} min, CPU {results.get('cpu_s', 0) / 60:.1f} min, "
        f"{s['threads']} torch thread(s), one job at a time.",
        "",
        "## Set-up",
        "",
        f"- Model `{s['model']}`; seeds {s['seeds']}: each seed changes the simulated annotators' noise, "
        "the prompts of round 1, sampling, the trainers' data order and the evaluation's sampling"
        + (" (**--share-round1**: one round 1 and proxy, the first seed's, for every seed; the seeds vary "
           "only the sampling of the start policy, best-of-n and the arms, the arms' training order and the "
           "evaluation's sampling, not the annotators' noise)" if s["share_round1"] else "")
        + ".",
        f"- Round 1: {s['prompts_per_round']} prompts x K = {s['k']} responses of at most {s['max_new_tokens']} "
        f"tokens; annotators: Bradley-Terry noise {s['noise']} on the gold score. The pairs of "
        f"{s['heldout_fraction']:.0%} of the prompts are held out.",
        f"- Proxy: reward model (LoRA r{s['lora_r']}, lr {s['reward']['lr']}, batch {s['reward']['batch_size']}), one "
        f"epoch at a time warm-started from the last, early stopping on the held-out pairs' loss (patience "
        f"{s['patience']}, at most {s['max_epochs']} epochs); the best epoch is the proxy.",
        f"- PPO: {s['ppo']['steps']} steps of {s['ppo']['batch_size']} episodes ({s['ppo']['ppo_epochs']} "
        f"epoch(s) of minibatches of {s['ppo']['mini_batch_size']}; the first "
        f"{s['ppo'].get('critic_warmup_steps', 0)} train the critic only; GAE lambda {s['ppo']['lam']}, the critic's "
        f"targets' {s['ppo'].get('critic_lam', s['ppo']['lam'])}), lr {s['ppo']['lr']}, critic lr "
        f"{s['ppo']['critic_lr']}, temperature "
        f"{s['ppo']['temperature']}, missing-EOS penalty {s['ppo']['missing_eos_penalty']}, reference = the "
        f"base model. DPO: `{json.dumps(s['dpo'])}` on the proxy's training pairs. "
        f"Arms: " + "; ".join(f"{a}: `{json.dumps(v)}`" for a, v in s["arms"].items()) + ".",
        f"- Each arm is evaluated at {s['checkpoints']} checkpoints along its training (and the start, KL 0): "
        f"{s['eval_prompts']} held-out prompts, {s['eval']['samples']} responses each, the start policy the same "
        "way with the same sampling seed; best-of-n picks from max(n) further samples of the start policy per "
        "prompt, its gains against their mean.",
        "",
        "## The proxy",
        "",
        "| seed | train pairs | held-out pairs | epochs run | best epoch | held-out accuracy [95%] | longer wins |",
        "|---|---|---|---|---|---|---|",
    ]
    for seed, p in q["per_seed"].items():
        e = results["seeds"][seed]
        lines.append(f"| {seed} | {e.get('train_pairs')} | {e.get('heldout_pairs')} | {p['stopped_at']} | {p['epoch']} | "
                     f"{_f(p['eval/accuracy'])} [{_f(p['acc_lo'])}, {_f(p['acc_hi'])}] | {_f(p.get('length_baseline'))} |")
    lines += ["", f"Pooled over seeds: {_f(q['pooled'])} [{_f(q['pooled_lo'])}, {_f(q['pooled_hi'])}] on {q['pairs']} "
              f"held-out pairs; every seed's interval above 0.5: **{'yes' if q['better_than_chance'] else 'no'}**.", "",
              "## Gold gain per arm", "",
              f"Per seed the arm's last measured checkpoint at KL <= {GOAL_KL:g} nats; gain = gold - the start "
              "policy's on the same held-out prompts (paired s.e. over prompts: one training run).", "",
              "| arm | seeds | per seed: gain ± paired s.e. (KL) | gain mean | between-seed s.e. | mean / s.e. | KL mean |",
              "|---|---|---|---|---|---|---|"]
    for arm, a in sm["arms"].items():
        r = a["result"]
        per = "; ".join(f"s{sd}{' (still training)' if p.get('running') else ''}: {_f(p['gold'], 4, True)} ± "
                        f"{_f(p['gold_se'], 4)} ({_f(p['kl'], 2)})" for sd, p in r["per_seed"].items())
        z = r["gain_mean"] / r["gain_se_seeds"] if r["gain_se_seeds"] else None
        name = f"{arm} (rewarded by the judge: a control)" if a["judge"] else arm
        lines.append(f"| {name} | {r['seeds']} | {per} | {_f(r['gain_mean'], 4, True)} | {_f(r['gain_se_seeds'], 4)} | "
                     f"{_f(z, 2)} | {_f(r['kl_mean'], 2)} |")
    for name in adaptive_arms(sm):
        r = sm["arms"][name]["result"]
        lines += ["", f"PPO with adaptive KL ({name}) raises gold by more than 2 between-seed s.e. at KL <= {GOAL_KL:g}: "
                  f"**{'yes' if r['raised'] else 'no'}** ({_f(r['gain_mean'], 4, True)} ± {_f(r['gain_se_seeds'], 4)}, "
                  f"{r['seeds']} seeds)."]
    lines += ["", "## Measured curves (mean over seeds ± between-seed s.e.)", ""]
    if plotted:
        lines += [f"![gold vs sqrt KL]({PLOT})", ""]
    lines += ["| arm | step | seeds | sqrt KL | gold gain | proxy gain | segment to here: proxy change, gold change "
              "(paired by seed) | hacking there |", "|---|---|---|---|---|---|---|---|"]
    for arm, a in sm["arms"].items():
        flags = {h["to"]: h for h in a["hacking"]}
        for c in a["curve"]:
            h = flags.get(c["step"])
            lines.append(f"| {arm} | {c['step']} | {c['seeds']} | {_f(c['sqrt_kl'], 2)} ± {_f(c['sqrt_kl_se'], 2)} | "
                         f"{_f(c['gold'], 4, True)} ± {_f(c['gold_se'], 4)} | {_f(c['proxy'], 3, True)} ± "
                         f"{_f(c['proxy_se'], 3)} | " + ("-" if h is None else
                         f"{_f(h['d_proxy'], 3, True)} ± {_f(h['d_proxy_se'], 3)}, {_f(h['d_gold'], 4, True)} ± "
                         f"{_f(h['d_gold_se'], 4)}") + f" | {'-' if h is None else ('**yes**' if h['hacking'] else 'no')} |")
    claimed = [(arm, h) for arm, a in sm["arms"].items() for h in a["hacking"] if h["hacking"]]
    lines += ["", "Hacking is claimed only on a measured segment where the proxy rises and gold falls, each by more "
              "than 2 between-seed s.e., with every seed's proxy better than chance: "
              + ("; ".join(f"{arm} steps {h['from']}->{h['to']}" for arm, h in claimed) if claimed else "**none**")
              + ("" if q["better_than_chance"] else " (no seed set's proxy is shown better than chance, so none can be)")
              + ".", ""]
    if sm["bon"]:
        lines += ["## Best-of-n with the proxy", "",
                  "| n | KL bound | seeds | gold gain (mean ± between-seed s.e.) | proxy gain | gold gain, picked by the "
                  "judge itself |", "|---|---|---|---|---|---|"]
        lines += [f"| {b['n']} | {_f(b['kl'], 2)} | {b['seeds']} | {_f(b['gold'], 4, True)} ± {_f(b['gold_se'], 4)} | "
                  f"{_f(b['proxy'], 3, True)} ± {_f(b['proxy_se'], 3)} | {_f(b['judge'], 4, True)} ± "
                  f"{_f(b['judge_se'], 4)} |" for b in sm["bon"]]
        lines += ["", f"Gold rises with n (largest n above n = 1 by more than 2 between-seed s.e.): "
                  f"**{'yes' if sm['bon_rises'] else 'no'}**.", ""]
    eff = [(arm, e) for arm, a in sm["arms"].items() for e in a["efficiency"]]
    if eff and sm["bon"]:
        lines += ["## KL efficiency: PPO's gain in its reward against best-of-n's at the same KL", "",
                  f"Best-of-n's gain interpolated in KL between its n (past n = {sm['bon'][-1]['n']}, KL "
                  f"{_f(sm['bon'][-1]['kl'], 2)}: its gain per nat), picking by the reward the arm trains on: the "
                  "proxy, or the gold judge for an arm rewarded by it. Ratio = PPO's gain / best-of-n's.", "",
                  "| arm | reward | step | KL | its gain | per nat | best-of-n at that KL | per nat | ratio |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {arm} | {e['reward']} | {e['step']} | {_f(e['kl'], 2)} | {_f(e['proxy'], 3, True)} | "
                  f"{_f(e['per_nat'], 3)} | {_f(e['bon_proxy'], 3, True)} | {_f(e['bon_per_nat'], 3)} | "
                  f"{_f(e['ratio'], 2)} |" for arm, e in eff]
        lines.append("")
    lines += ["## PPO along training (rollout metrics, mean over seeds)", "",
              "| arm | step | proxy score of the rollout | KL | beta | critic explained variance | value loss | value mean "
              "| policy approx. KL | policy clip fraction | entropy |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in sm["arms"]:
        rows = [results["seeds"][sd]["arms"][arm]["train"] for sd in results["seeds"]
                if arm in results["seeds"][sd]["arms"] and arm != "dpo"]
        if not rows:
            continue
        for i in range(0, min(len(r) for r in rows), max(1, min(len(r) for r in rows) // 6)):
            def m(key):
                vals = [r[i][key] for r in rows if key in r[i]]
                return sum(vals) / len(vals) if vals else None
            lines.append(f"| {arm} | {rows[0][i].get('step')} | {_f(m('objective/score'), 3)} | {_f(m('objective/kl'), 2)} | "
                         f"{_f(m('kl/beta'), 3)} | {_f(m('val/explained_var'), 2)} | {_f(m('val/loss'), 4)} | "
                         f"{_f(m('val/value_mean'), 2)} | {_f(m('policy/approxkl'), 4)} | {_f(m('policy/clipfrac'), 3)} | "
                         f"{_f(m('objective/entropy'), 2)} |")
    lines += ["", "## Against the goal, computed from the tables above", "", *goal_checks(sm)]
    lines += ["", "## Time per part", "", "| part | wall (min) | CPU (min) |", "|---|---|---|"]
    lines += [f"| {k} | {v['wall_s'] / 60:.1f} | {v['cpu_s'] / 60:.1f} |" for k, v in results.get("parts", {}).items()]
    for name, why in results.get("failed", {}).items():
        lines.append(f"\nFailed: {name}: {why}")
    lines += ["", seeds_result_line(folder, sm), ""]
    path = folder / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


EFFICIENCY_GOAL = 1 / 3
"""Issue 25: PPO raises its proxy at least a third as fast per nat as best-of-n at the same KL."""


def goal_checks(sm: dict) -> list[str]:
    """The issue's goal, line by line, each [x] only where the numbers show it."""
    arms, q = sm["arms"], sm["quality"]

    def raised(arm):
        r = arms[arm]["result"] if arm in arms else None
        if not r or r["seeds"] < 3:
            return False, f"{r['seeds'] if r else 0} seed(s) measured, 3 needed"
        return r["raised"], f"{_f(r['gain_mean'], 4, True)} ± {_f(r['gain_se_seeds'], 4)} over {r['seeds']} seeds"

    checks = [
        ("the proxy better than chance (95% interval of its held-out accuracy above 0.5)", q["better_than_chance"],
         f"{_f(q['pooled'])} [{_f(q['pooled_lo'])}, {_f(q['pooled_hi'])}] on {q['pairs']} pairs")]
    for name in adaptive_arms(sm) or ["adaptive"]:
        checks.append((f"PPO, adaptive KL ({name}), raises gold by more than 2 between-seed s.e. at KL <= {GOAL_KL:g}",
                       *raised(name)))
    checks += [
        (f"DPO raises gold by more than 2 between-seed s.e. at KL <= {GOAL_KL:g}", *raised("dpo")),
        ("best-of-n with the proxy rises with n", bool(sm["bon_rises"]),
         ", ".join(f"n={b['n']}: {_f(b['gold'], 4, True)}" for b in sm["bon"]) or "not run")]
    for name in adaptive_arms(sm) + judge_arms(sm) or ["adaptive"]:
        eff = [e["ratio"] for e in arms.get(name, {}).get("efficiency", []) if e["ratio"] is not None]
        what = ("(a control) raises the gold judge it is rewarded by" if arms.get(name, {}).get("judge")
                else "raises its proxy")
        checks.append((f"PPO ({name}) {what} at least a third as fast per nat as best-of-n at the same KL "
                       "(last checkpoint)", bool(eff) and eff[-1] >= EFFICIENCY_GOAL,
                       f"ratio {_f(eff[-1], 2)}" if eff else "no checkpoint past 0.1 nats"))
    return [f"- [{'x' if ok else ' '}] {text}: {detail}" for text, ok, detail in checks]


def _portable(obj, out: Path):
    """results.json with this run's folder (as <run>) and the checkout's root left out of every path."""
    if isinstance(obj, dict):
        return {k: _portable(v, out) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_portable(v, out) for v in obj]
    if isinstance(obj, str):
        names = [str(out)] + ([str(out.relative_to(ROOT))] if out.is_relative_to(ROOT) else [])
        for name in names:
            obj = obj.replace(name, "<run>")
        return obj.replace(str(ROOT) + "/", "")
    return obj


def publish(folder: Path, target: Path) -> list[Path]:
    """report (README.md), plot, results.json and raw.json into `target`, paths made relative."""
    folder, target = Path(folder).resolve(), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    results = _portable(json.loads((folder / "results.json").read_text(encoding="utf-8")), folder)
    (target / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    shutil.copy2(folder / "raw.json", target / "raw.json")
    report = (folder / "report.md").read_text(encoding="utf-8")
    (target / "README.md").write_text(_portable(report, folder), encoding="utf-8")
    out = [target / "README.md", target / "results.json", target / "raw.json"]
    if (folder / PLOT).is_file():
        out.append(Path(shutil.copy2(folder / PLOT, target / PLOT)))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/gold/seed_report.py RESULTS_DIR")
    print(write_report(Path(sys.argv[1])))
    print(seeds_result_line(Path(sys.argv[1])))
