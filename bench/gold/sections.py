"""The gold-loop report's sections on the parts beside PPO's rounds, as markdown lines, computed
from results.json and bench/gold/verdict.py's verdict (never typed numbers):

- methods_section: every method on round 1's pairs side by side, with paired standard errors
- drift_section: the shuffled-label control, and whether beta = 0's loss is reward hacking
- curve_section: the proxy's learning curve (simulated and HH pairs)
- conclusion_section: the goal of issue 16 met or not, and the next step
- parts_section: the wall and CPU time each part took
"""

from __future__ import annotations

import json
import math

from bench.gold.verdict import GOAL_KL


def _f(x, digits=3, sign=False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def methods_section(results: dict, v: dict) -> list[str]:
    """The table of every method from round 1's pairs (later rounds are in the table above)."""
    rows = [r for r in v["rows"] if r["round"] == 1]
    if not rows:
        return []
    base = results["base"]
    s = results["settings"]
    lines = ["## Every method on round 1's pairs, side by side", "",
             f"All start from the start policy and round 1's {results.get('annotators', {}).get('round1', {}).get('pairs', '?')} "
             "ranked pairs: best-of-n picks with reward model 1 among responses of the start policy; the PPO "
             "settings optimise reward model 1; DPO "
             + (f"(`{json.dumps(s.get('dpo', {}))}`) " if s.get("dpo") else "")
             + "trains on its pairs; the control optimises a reward model trained on them with shuffled labels. "
             "Gold change against the start policy ± its standard error paired by prompt, and the change in "
             "standard errors. Best-of-n's KL is the bound log n - (n-1)/n.", "",
             "| method | KL (nats) | gold | gold - start (± s.e.) | in s.e. | proxy (RM 1) | length | distinct-2 |",
             "|---|---|---|---|---|---|---|---|",
             f"| start policy | 0 | {_f(base['eval/gold'])} | - | - | {_f(base.get('eval/proxy:rm1'), 2)} | "
             f"{_f(base.get('eval/length'), 1)} | {_f(base.get('eval/distinct_2'))} |"]
    for r in rows:
        kl = ("<= " if r["tag"].startswith("bon_n") else "") + _f(r["kl"], 2)
        lines.append(f"| {r['label']} | {kl} | {_f(r['gold'])} | {_f(r['delta'], sign=True)} ± {_f(r['se'])} | "
                     f"{_f(r['z'], 1, sign=True)} | {_f(r['proxy_rm1'], 2)} | {_f(r['length'], 1)} | {_f(r['distinct_2'])} |")
    bon = results.get("bon", {}).get("rows", [])
    if bon:
        lines += ["", "Best-of-n with the gold judge itself on the same samples (what a perfect proxy would pick): "
                  + ", ".join(f"n = {r['n']}: {_f(r['oracle/gold'])}" for r in bon)
                  + f" ({results['bon']['samples']} responses per held-out prompt)."]
    best = v["best"]
    lines += ["", (f"Best at KL <= {GOAL_KL:g} nats (all rounds): **{best['label']}** (`{best['tag']}`), gold "
                   f"{_f(best['delta'], sign=True)} ± {_f(best['se'])} = {_f(best['z'], 1, sign=True)} s.e. at KL "
                   f"{_f(best['kl'], 2)}." if best else f"No method has a measured gold change at KL <= {GOAL_KL:g} nats."),
              ""]
    return lines


def drift_section(results: dict, d: dict) -> list[str]:
    control = results["variants"].get("control")
    if not d.get("verdict") or not control:
        return []
    sh = control.get("shuffled", {})
    lines = ["## The drift control", "",
             f"A reward model trained like reward model 1 on the same {sh.get('pairs', '?')} pairs with "
             f"{sh.get('swapped', '?')} of them swapped (seed {sh.get('seed', '?')}; its own held-out accuracy "
             f"{_f(sh.get('reward_eval', {}).get('eval/accuracy'))}) has nothing to learn, so PPO against it at the "
             "adaptive setting's KL budget measures what drifting costs by itself.", "",
             f"- control: gold {_f(d['control_delta'], sign=True)} ± {_f(d['control_se'])} at KL {_f(d['control_kl'], 2)} nats."]
    if "adaptive_minus_control" in d:
        lines.append(f"- adaptive KL (round 1) minus the control: {_f(d['adaptive_minus_control'], sign=True)} ± "
                     f"{_f(d['adaptive_minus_control_se'])} (paired by prompt): what reward model 1's signal adds "
                     "at the same budget.")
    if "beta0_minus_control" in d:
        lines.append(f"- beta = 0 at the control's KL (interpolated in sqrt(KL) between its evaluations): gold "
                     f"{_f(d['beta0_at_control_kl'], sign=True)}; minus the control: {_f(d['beta0_minus_control'], sign=True)}"
                     f" ± {_f(d['beta0_minus_control_se'])}.")
    lines += ["", {"hacking": "**Reward hacking**: at the same KL, beta = 0 loses more than 2 s.e. more gold than "
                              "drift without signal.",
                   "drift": "**No reward hacking shown**: at the same KL, beta = 0 does not lose clearly more gold "
                            "than drift without signal.",
                   "undecided": "**Undecided**: beta = 0 was not evaluated at or beyond the control's KL."}[d["verdict"]],
              ""]
    return lines


def _curve_table(curve: dict) -> list[str]:
    lines = ["| pairs | prompts | held-out accuracy [95% interval] | longer response wins | train (min) |",
             "|---|---|---|---|---|"]
    for p in curve["points"]:
        lines.append(f"| {p['pairs']} | {p['prompts']} | {_f(p['eval/accuracy'])} [{_f(p['acc_lo'])}, {_f(p['acc_hi'])}] "
                     f"| {_f(p['length_baseline'])} | {p['train_s'] / 60:.1f} |")
    return lines


def curve_section(results: dict, ge: dict, plot) -> list[str]:
    sim, hh = results.get("curve_simulated"), results.get("curve_hh")
    if not sim and not hh:
        return []
    lines = ["## The proxy's learning curve", "",
             "A fresh reward model per size on nested subsets, scored on one fixed set of pairs whose prompts "
             "it never saw (bench/gold/curve.py).", ""]
    if sim:
        r, c = sim["reward"], sim["ceiling"]
        lines += [f"Simulated pairs ({sim['pairs_available']} ranked pairs of the start policy's responses, "
                  f"{sim['heldout_pairs']} held out; lr {r['lr']}, {r['epochs']} epoch(s), batch {r['batch_size']}). "
                  f"Ceiling: the gold judge agrees with {_f(c.get('agreement'))} of the held-out pairs' noisy labels.", "",
                  *_curve_table(sim), ""]
        if ge.get("pairs") and ge.get("measured"):
            lines.append(f"Good enough (accuracy >= {_f(ge['threshold'])}, halfway from chance to the ceiling, "
                         f"interval above 0.5) from **{ge['pairs']} pairs** (measured).")
        elif ge.get("pairs"):
            lines.append(f"Good enough (accuracy >= {_f(ge['threshold'])}, halfway from chance to the ceiling) at "
                         f"about **{ge['pairs']} pairs**: extrapolated along the fitted line in log(pairs) "
                         f"({_f(ge['slope'])} per e-fold), beyond the largest measured size.")
        else:
            lines.append(f"Good enough: not reached and not extrapolable ({ge.get('why', '?')}).")
        lines.append("")
    if hh:
        r = hh["reward"]
        lines += [f"HH-RLHF dev pairs ({hh['data']}, {hh['heldout_pairs']} held out; lr {r['lr']}, {r['epochs']} "
                  f"epoch(s), max length {r['max_length']}):", "", *_curve_table(hh), ""]
    if plot is not None:
        lines += ["![learning curve](learning_curve.png)", ""]
    return lines


def conclusion_section(results: dict, v: dict) -> list[str]:
    best, ge, s = v["best"], v["good_enough"], results["settings"]
    lines = ["## Verdict", ""]
    if v["goal_met"]:
        return lines + [f"Goal met: **{best['label']}** raises the gold score by {_f(best['z'], 1)} paired standard "
                        f"errors at a KL of {_f(best['kl'], 2)} nats (<= {GOAL_KL:g}).", ""]
    lines.append(f"Goal not met: no method raises the gold score by more than 2 paired standard errors at a KL of "
                 f"at most {GOAL_KL:g} nats" + (f" (best: {best['label']}, {_f(best['z'], 1, sign=True)} s.e.)." if best else "."))
    rm1 = results.get("reward_models", {}).get("rm1", {})
    lines.append(f"Reward model 1 trained on {rm1.get('train/pairs', '?')} pairs (held-out accuracy "
                 f"{_f(rm1.get('eval/accuracy'))} on {rm1.get('eval/pairs', '?')}).")
    if ge.get("pairs"):
        per_prompt = math.comb(s["k"], 2)
        prompts = math.ceil(ge["pairs"] / per_prompt / (1 - s["reward"].get("eval_fraction", 0.2)))
        epochs = s.get("curve", {}).get("reward", {}).get("epochs", 1)
        lines.append(f"The learning curve puts a good-enough proxy at {'' if ge['measured'] else 'about '}{ge['pairs']} "
                     f"pairs ({'measured' if ge['measured'] else 'extrapolated'}). Next step: round 1 with that much "
                     f"data ({per_prompt} pairs per prompt, {prompts} prompts with the held-out share), the reward "
                     f"model trained on every pair as on the curve: `python bench/gold/loop.py --prompts-per-round "
                     f"{prompts} --reward-steps 0 --reward-epochs {epochs} --parallel --threads 1`.")
    elif ge:
        lines.append("The learning curve gives no size at which the proxy becomes good enough "
                     f"({ge.get('why', '?')}): next step is a larger reward model, or full fine-tuning of it (GPU).")
    else:
        lines.append("No learning curve was run (--curve-sizes none): it is what says how much data the proxy needs.")
    return lines + [""]


def parts_section(results: dict) -> list[str]:
    parts = results.get("parts", {})
    if not parts:
        return []
    lines = ["## Time per part", "",
             "CPU = user + system seconds of this process and of the jobs it ran"
             + (" (the parts ran side by side: their CPU times overlap, only the total is exact)."
                if results.get("parallel") else ", part by part."), "",
             "| part | wall (min) | CPU (min) |", "|---|---|---|"]
    lines += [f"| {name} | {p['wall_s'] / 60:.1f} | {p['cpu_s'] / 60:.1f} |" for name, p in parts.items()]
    if results.get("skipped") or results.get("failed"):
        lines.append("")
    lines += [f"Skipped: {name}: {why}." for name, why in results.get("skipped", {}).items()]
    lines += [f"**Failed**: {name}: {why} (the run's log has the traceback)." for name, why in results.get("failed", {}).items()]
    return lines + [""]
