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
expected best-of-n of each prompt's N responses: the mean over every n-subset of the one the proxy
scores highest (`expected_best_of_n`; the unbiased estimator of Nakano et al. 2021, WebGPT,
appendix, that Gao et al. use), so n = 1 is the start policy's mean and each n uses all N samples,
not one draw of n. Also recorded: the best-of-n of the gold judge itself (the oracle: what a
perfect proxy would reach with the same samples).

Tables in the results directory: eval/bon_samples.jsonl (every sampled response, with its scores)
and eval/bon_nN.jsonl (per prompt, the expected scores of the response kept), which the report pairs by prompt with
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


def expected_best_of_n(rows: list[dict], n: int, key: str = PROXY) -> list[dict]:
    """One row per prompt: the expected value of every numeric field of the response best-of-n
    keeps, over all n-subsets of the prompt's N responses. Sorted by `key` (of a tie, the first sampled last),
    the i-th lowest (from 0) is the best of a random n-subset with probability C(i, n-1) / C(N, n)."""
    picked = []
    for prompt, group in by_prompt(rows).items():
        if len(group) < n:
            raise ValueError(f"best-of-{n}: the prompt {prompt[:40]!r} has only {len(group)} responses")
        ranked = [r for _, r in sorted(enumerate(group), key=lambda ir: (ir[1][key], -ir[0]))]  # a tie: the first wins
        weights = [math.comb(i, n - 1) / math.comb(len(group), n) for i in range(len(group))]
        fields = [k for k, v in group[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        picked.append({"prompt": prompt, "n": n, **{k: sum(w * r[k] for w, r in zip(weights, ranked)) for k in fields}})
    return picked


def best_of_n(rows: list[dict], n: int, key: str = PROXY) -> list[dict]:
    """One row per prompt: the highest `key` among the prompt's first n responses (first wins a tie)."""
    picked = []
    for prompt, group in by_prompt(rows).items():
        if len(group) < n:
            raise ValueError(f"best-of-{n}: the prompt {prompt[:40]!r} has only {len(group)} responses")
        picked.append(max(group[:n], key=lambda r: r[key]))
    return picked


def bon_table(rows: list[dict], ns: list[int]) -> list[dict]:
    """Per n: the analytic KL, the expected gold, proxy and length of the kept response, the
    oracle's expected gold, and distinct-2 of one draw (each prompt's first n responses)."""
    table = []
    for n in ns:
        picked, oracle = expected_best_of_n(rows, n), expected_best_of_n(rows, n, key="gold")
        table.append({"n": n, "kl": bon_kl(n), "eval/gold": sum(r["gold"] for r in picked) / len(picked),
                      "eval/proxy:rm1": sum(r[PROXY] for r in picked) / len(picked),
                      "oracle/gold": sum(r["gold"] for r in oracle) / len(oracle),
                      "eval/length": sum(r["tokens"] for r in picked) / len(picked),
                      "eval/distinct_2": distinct_n([r["response"] for r in best_of_n(rows, n)], 2),
                      "prompts": len(picked)})
    return table


def run_bon(ctx, base_path: str | None, reward1_path: str, ns: list[int]) -> dict:
    """Sample max(ns) responses per held-out prompt from the start policy, score them, and record
    results["bon"] (one row per n) with the eval tables described in the module docstring."""
    ns = sorted(set(ns))
    eval_cfg = dataclasses.replace(ctx.exp.eval, samples=max(ns))
    _, rows = ctx.evaluate(base_path, {"rm1": reward1_path}, "bon_samples", eval_cfg)
    for n in ns:
        write_rows(ctx.out / "eval" / f"bon_n{n}.jsonl", expected_best_of_n(rows, n))
    table = bon_table(rows, ns)
    with ctx.lock:
        ctx.results["bon"] = {"samples": max(ns), "rows": table}
    ctx.log("best-of-n: " + ", ".join(f"n={r['n']} gold={r['eval/gold']:.3f}" for r in table))
    return ctx.results["bon"]
