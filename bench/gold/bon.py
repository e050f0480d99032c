"""Best-of-n with the proxy reward model: the cheapest way to use a reward model, and the yardstick.

Gao et al. 2022 ("Scaling Laws for Reward Model Overoptimization", section 2.3) compare every
optimiser with best-of-n sampling: draw n responses from the start policy, keep the one the proxy
reward model scores highest. Its distance from the start policy has the closed form they use,

    KL(best-of-n || start) <= log n - (n - 1) / n   nats

(an upper bound, tight when the n responses are distinct: Beirami et al. 2024, "Theoretical
guarantees on the best-of-n alignment policy"), so its gold score can be drawn on the same KL
axis as PPO's and DPO's, at most that far from the start.

Here, on the held-out prompts of bench/gold/loop.py: the start policy samples max(n) responses per
prompt once (the same evaluation settings as every policy: bench/gold/eval.py); reward model 1
(the round-1 proxy every setting starts from) and the gold judge score them; best-of-n takes the
first n of each prompt's responses (prefixes, so n = 1, 2, 4, 8, 16 share their samples) and keeps
the proxy's favourite. Also recorded: the best-of-n of the gold judge itself (the oracle: what a
perfect proxy would reach with the same samples).

Tables in the results directory: eval/bon_samples.jsonl (every sampled response, with its scores)
and eval/bon_nN.jsonl (the response picked for each prompt), which the report pairs by prompt with
the start policy's evaluation for the standard error of the gold change.
"""

from __future__ import annotations

import dataclasses
import math

from bench.gold.eval import distinct_n
from bench.gold.steps import write_rows

DEFAULT_NS = (1, 2, 4, 8, 16)
PROXY = "proxy:rm1"


def bon_kl(n: int) -> float:
    """The bound on KL(best-of-n || start policy) in nats: log n - (n - 1) / n (0 for n = 1)."""
    if n < 1:
        raise ValueError(f"best-of-n needs n >= 1, not {n}")
    return math.log(n) - (n - 1) / n


def by_prompt(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by prompt, each group in sampling order."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["prompt"], []).append(row)
    return groups


def best_of_n(rows: list[dict], n: int, key: str = PROXY) -> list[dict]:
    """One row per prompt: the highest `key` among the prompt's first n responses (first wins a tie)."""
    picked = []
    for prompt, group in by_prompt(rows).items():
        if len(group) < n:
            raise ValueError(f"best-of-{n}: the prompt {prompt[:40]!r} has only {len(group)} responses")
        picked.append(max(group[:n], key=lambda r: r[key]))
    return picked


def bon_table(rows: list[dict], ns: list[int]) -> list[dict]:
    """Per n: the analytic KL, mean gold and proxy of the picked responses, the oracle's mean gold,
    length and distinct-2 of the picked responses."""
    table = []
    for n in ns:
        picked, oracle = best_of_n(rows, n), best_of_n(rows, n, key="gold")
        table.append({"n": n, "kl": bon_kl(n), "eval/gold": sum(r["gold"] for r in picked) / len(picked),
                      "eval/proxy:rm1": sum(r[PROXY] for r in picked) / len(picked),
                      "oracle/gold": sum(r["gold"] for r in oracle) / len(oracle),
                      "eval/length": sum(r["tokens"] for r in picked) / len(picked),
                      "eval/distinct_2": distinct_n([r["response"] for r in picked], 2), "prompts": len(picked)})
    return table


def run_bon(ctx, base_path: str | None, reward1_path: str, ns: list[int]) -> dict:
    """Sample max(ns) responses per held-out prompt from the start policy, score them, and record
    results["bon"] (one row per n) with the eval tables described in the module docstring."""
    ns = sorted(set(ns))
    eval_cfg = dataclasses.replace(ctx.exp.eval, samples=max(ns))
    _, rows = ctx.evaluate(base_path, {"rm1": reward1_path}, "bon_samples", eval_cfg)
    for n in ns:
        write_rows(ctx.out / "eval" / f"bon_n{n}.jsonl", best_of_n(rows, n))
    table = bon_table(rows, ns)
    with ctx.lock:
        ctx.results["bon"] = {"samples": max(ns), "rows": table}
    ctx.log("best-of-n: " + ", ".join(f"n={r['n']} gold={r['eval/gold']:.3f}" for r in table))
    return ctx.results["bon"]
