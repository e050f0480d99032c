"""The gold-loop experiment's plots (matplotlib, Agg), drawn from results.json alone.

Gao et al. 2022 draw gold and proxy against d = sqrt(KL), the distance from the start:
- gold_vs_sqrt_kl.png: held-out gold score against sqrt(KL to the reference), one line per setting
  through the start policy and each round; thin lines: the PPO steps (gold of each step's sample
  table, smoothed, against the rollout's KL); best-of-n with the proxy against its KL bound, and
  dotted, the best-of-n of the gold judge itself (what a perfect proxy would give).
- proxy_vs_gold.png: along the PPO steps of all rounds, the proxy (reward-model) score, the gold
  score and the KL, per setting; markers: held-out evaluations at the end of each round.
- learning_curve.png: the proxy's held-out pair accuracy against the number of pairs it learned
  from (log scale), simulated and HH, with its 95% interval, the length baseline and the ceiling.
"""

from __future__ import annotations

import math
from pathlib import Path

COLORS = {"adaptive": "tab:blue", "fixed": "tab:green", "beta0": "tab:red", "control": "tab:grey",
          "dpo": "tab:purple", "bon": "tab:orange", "judge_adaptive2": "tab:brown"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def smooth(values: list[float], window: int = 4) -> list[float]:
    """Trailing moving average (the sample tables hold only a few responses per step)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def sqrt_kl(kl: float) -> float:
    """sqrt of a KL estimate; the k1 estimate of a tiny KL can dip below 0 by sampling noise."""
    return math.sqrt(max(kl, 0.0))


def plot_gold_vs_sqrt_kl(results: dict, path: Path) -> Path:
    plt = _pyplot()
    base = results["base"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, v in results["variants"].items():
        color = COLORS.get(name)
        xs = [0.0] + [sqrt_kl(r["eval/kl"]) for r in v["rounds"]]
        ys = [base["eval/gold"]] + [r["eval/gold"] for r in v["rounds"]]
        ax.plot(xs, ys, "o-", color=color, label=v["label"], lw=2)
        for r, x, y in zip(v["rounds"], xs[1:], ys[1:]):
            ax.annotate(f"r{r['round']}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        steps = [s for s in v["steps"] if "gold" in s]
        if steps:
            ax.plot([sqrt_kl(s["kl"]) for s in steps], smooth([s["gold"] for s in steps]), "-", color=color,
                    alpha=0.3, lw=1)
    bon = results.get("bon", {}).get("rows", [])
    if bon:
        xs = [sqrt_kl(r["kl"]) for r in bon]
        ax.plot(xs, [r["eval/gold"] for r in bon], "s-", color=COLORS["bon"], label="best-of-n, proxy (RM 1)", lw=2)
        ax.plot(xs, [r["oracle/gold"] for r in bon], "s:", color=COLORS["bon"], alpha=0.6, label="best-of-n, gold judge")
        for r, x in zip(bon, xs):
            ax.annotate(f"n={r['n']}", (x, r["eval/gold"]), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.axhline(base["eval/gold"], color="grey", lw=0.8, ls="--", label="start policy")
    ax.set_xlabel("sqrt(KL to the reference)  [sqrt(nats per response)]")
    ax.set_ylabel("gold score (embedding judge)")
    ax.set_title("Gold score against distance from the start policy\n"
                 "thick: held-out evaluation after each round; thin: PPO steps (sample tables, smoothed)",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_proxy_vs_gold(results: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    rounds_at = []
    for name, v in results["variants"].items():
        color, steps = COLORS.get(name), v["steps"]
        if not steps:  # DPO: no PPO steps to draw
            continue
        x = list(range(1, len(steps) + 1))
        axes[0].plot(x, [s["proxy"] for s in steps], color=color, label=v["label"])
        gold = [(i, s["gold"]) for i, s in zip(x, steps) if "gold" in s]
        if gold:
            axes[1].plot([i for i, _ in gold], smooth([g for _, g in gold]), color=color)
        axes[2].plot(x, [s["kl"] for s in steps], color=color)
        # held-out evaluations at the end of each round
        ends = [max(i for i, s in zip(x, steps) if s["round"] == r["round"]) for r in v["rounds"]]
        axes[0].plot(ends, [r["eval/proxy:own"] for r in v["rounds"]], "o", color=color, mfc="white")
        axes[1].plot(ends, [r["eval/gold"] for r in v["rounds"]], "o", color=color, mfc="white")
        axes[2].plot(ends, [r["eval/kl"] for r in v["rounds"]], "o", color=color, mfc="white")
        rounds_at = ends
    for ax in axes:
        for end in rounds_at[:-1]:
            ax.axvline(end + 0.5, color="grey", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    axes[1].axhline(results["base"]["eval/gold"], color="grey", lw=0.8, ls="--")
    axes[0].set_ylabel("proxy score\n(reward model of the round)")
    axes[1].set_ylabel("gold score\n(smoothed)")
    axes[2].set_ylabel("KL to reference\n(nats per response)")
    axes[2].set_xlabel("PPO step (all rounds; dotted: new round, new reward model)")
    axes[0].set_title("Proxy and gold along PPO (lines: rollouts; circles: held-out evaluation)", fontsize=9)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_learning_curve(results: dict, path: Path) -> Path | None:
    """Held-out pair accuracy against training pairs; None when no curve was run."""
    curves = [(key, label) for key, label in (("curve_simulated", "simulated pairs (gold judge + noise)"),
                                                ("curve_hh", "HH-RLHF dev pairs")) if results.get(key)]
    if not curves:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], curves):
        curve, pts = results[key], results[key]["points"]
        xs = [p["pairs"] for p in pts]
        ys = [p["eval/accuracy"] for p in pts]
        ax.errorbar(xs, ys, yerr=[[y - p["acc_lo"] for y, p in zip(ys, pts)], [p["acc_hi"] - y for y, p in zip(ys, pts)]],
                    fmt="o-", capsize=3, label="reward model (95% interval)")
        ax.plot(xs, [p["length_baseline"] for p in pts], "x--", color="tab:brown", label="longer response wins")
        if curve.get("ceiling"):
            ax.axhline(curve["ceiling"]["agreement"], color="tab:green", ls=":", label="gold judge (ceiling)")
        ax.axhline(0.5, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("training pairs")
        ax.set_ylabel(f"held-out pair accuracy ({curve['heldout_pairs']} pairs)")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)
