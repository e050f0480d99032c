"""Three ways to learn the same rankings: Bradley-Terry on their C(K, 2) pairs one by one, Bradley-
Terry on each ranking's pairs as one batch element, and Plackett-Luce on each ranking once. Which
generalises best, and at which data sizes?

    python bench/listwise_bench.py                          # tiny model, 3 sizes x 3 seeds (minutes)
    python bench/listwise_bench.py --quick                  # one size, one seed (seconds; the suite's smoke test)
    python bench/listwise_bench.py --sizes 50,100,200,400 --seeds 0,1,2,3,4 --json out.json
    python bench/listwise_bench.py --model default --lr 3e-4 --epochs 1 --json out.json   # SmolLM2-135M with LoRA (hours)
    python bench/listwise_bench.py ... --json out.json --resume   # the same run after a stop: the seeds done are kept

The task is tests/test_ppo_learned_reward.py's, one a tiny model learns with certainty: prompts of a
few words, K = 4 responses per prompt sampled from the starting policy (tests/tiny.py's random
model), and a gold utility per response, its count of the letter 'e'. Simulated annotators rank
each prompt's K responses with listwise noise: a Plackett-Luce draw with utilities gold /
`temperature` (the best picked from all K by softmax, the next from the rest, ...), so the noise
is in the whole ranking at once, not drawn pair by pair. Each seed draws its own prompts,
responses, annotators' rankings, held-out set and training order.

Per seed and size N (the first N rankings of the seed's pool): the rankings are written as
store/export.py writes a snapshot (a pairs file of every ordered pair of each ranking, its
rankings beside it), and `train-reward` runs once per arm (--arms) on that snapshot:

    bt        --loss bt --grouped false: its pairs, shuffled one by one, batches of --batch-pairs
    grouped   --loss bt (the default): each ranking's pairs as one batch element, its responses
              forwarded once, batches of --batch-pairs / C(K, 2) rankings
    pl        --loss plackett-luce: its rankings, batches of --batch-pairs / C(K, 2)

with the same model, learning rate and epochs and the same data per optimiser step (the rankings
whose pairs bt's batch holds), so the same number of steps. All are evaluated on the same held-out
pairs: every pair of a held-out prompt's responses whose gold differs, ordered by gold (no noise).

Reported per size: held-out pairwise accuracy and loss of each arm, mean over seeds with a 95%
Student-t interval, and each arm's paired difference from bt with its own t-interval (each seed's
runs share their data). RESULT line: `RESULT listwise n{N}_acc_bt= n{N}_acc_grouped= n{N}_acc_pl=
n{N}_grouped_diff= n{N}_grouped_diff_lo= n{N}_grouped_diff_hi= n{N}_pl_diff= ... seeds=`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gold.closed_report import t_interval  # noqa: E402  (the one Student-t interval over seeds)
from tests.test_ppo_learned_reward import gold, prompts_for  # noqa: E402  (the task, as the test defines it)

K = 4
ARMS = {"bt": ("bt", False, "pairs"), "grouped": ("bt", True, "rankings"), "pl": ("plackett-luce", False, "rankings")}
"""Each arm's (RewardConfig.loss, RewardConfig.grouped, what its batch counts)."""


def listwise_order(utilities: list[float], temperature: float, rng: random.Random) -> list[int]:
    """A Plackett-Luce draw: indices best first, each picked from the rest by softmax(u / T)."""
    rest, order = list(range(len(utilities))), []
    while rest:
        top = max(utilities[i] for i in rest) / temperature
        weights = [math.exp(utilities[i] / temperature - top) for i in rest]
        pick = rng.choices(rest, weights)[0]
        order.append(pick)
        rest.remove(pick)
    return order


def sample_responses(model_dir: Path, prompts: list[str], seed: int, max_new_tokens: int) -> list[list[str]]:
    """K responses per prompt from the starting policy (the base model)."""
    from pipeline.config import GenerateConfig, ModelConfig
    from pipeline.policy import load_policy
    from pipeline.responses import generate_responses

    policy, tok = load_policy(ModelConfig(model=str(model_dir), device="cpu", dtype="fp32", lora=False))
    gens = generate_responses(policy, tok, prompts, K, GenerateConfig(k=K, temperature=0.7, max_new_tokens=max_new_tokens,
                                                                      seed=seed))
    return [[g.text for g in gg] for gg in gens]


def write_snapshot(folder: Path, prompts: list[str], responses: list[list[str]], orders: list[list[int]]) -> Path:
    """A pairs file (every ordered pair of each ranking) and its rankings beside it, as a round's
    snapshot is laid out (store/export.py: `<stem>.rankings.<ext>`). Returns the pairs file."""
    folder.mkdir(parents=True, exist_ok=True)
    pairs, rankings = folder / "pairs.jsonl", folder / "pairs.rankings.jsonl"
    with open(pairs, "w", encoding="utf-8") as fp, open(rankings, "w", encoding="utf-8") as fr:
        for n, (prompt, texts, order) in enumerate(zip(prompts, responses, orders)):
            ids = [n * K + i for i in range(K)]
            for a, b in combinations(order, 2):  # a is ranked above b
                fp.write(json.dumps({"prompt": prompt, "chosen": texts[a], "rejected": texts[b], "ranking_id": n}) + "\n")
            fr.write(json.dumps({"ranking_id": n, "prompt": prompt, "order": [[ids[i]] for i in order],
                                 "responses": [{"response_id": ids[i], "text": texts[i]} for i in range(K)]}) + "\n")
    return pairs


def held_out_pairs(path: Path, prompts: list[str], responses: list[list[str]]) -> Path:
    """Every pair of a held-out prompt's responses with different gold, the higher gold chosen."""
    with open(path, "w", encoding="utf-8") as f:
        for prompt, texts in zip(prompts, responses):
            for a, b in combinations(texts, 2):
                if gold(a) != gold(b) and a.strip() and b.strip():
                    chosen, rejected = (a, b) if gold(a) > gold(b) else (b, a)
                    f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return path


def usable(texts: list[str]) -> bool:
    """A prompt whose K responses are all non-blank and distinct (train-reward refuses blank ones
    and drops identical pairs, which would make the two losses see different data)."""
    return all(t.strip() for t in texts) and len({t.strip() for t in texts}) == K


def run_seed(seed: int, sizes: list[int], model_dir: Path, work: Path, args) -> list[dict]:
    from pipeline.config import ModelConfig, RewardConfig
    from pipeline.train_reward import train_reward

    n_pool, n_held = max(sizes), args.held_out
    prompts = prompts_for(seed, 0, 2 * (n_pool + n_held))  # twice what is needed: some prompts are unusable
    responses = sample_responses(model_dir, prompts, seed, args.max_new_tokens)
    keep = [i for i, texts in enumerate(responses) if usable(texts)]
    if len(keep) < n_pool + n_held:
        raise SystemExit(f"seed {seed}: only {len(keep)} prompts with {K} distinct responses, "
                         f"{n_pool + n_held} needed")
    rng = random.Random(seed)
    rng.shuffle(keep)
    held, pool = keep[:n_held], keep[n_held:n_held + n_pool]
    eval_file = held_out_pairs(work / f"s{seed}_heldout.jsonl", [prompts[i] for i in held], [responses[i] for i in held])
    annotators = random.Random(seed * 1_000_003 + 1)
    orders = [listwise_order([gold(t) for t in responses[i]], args.temperature, annotators) for i in pool]
    # the tiny random model trains fully (a LoRA r4 on it learns this task to only about 0.78); a
    # real model trains as the product's reward model does, with LoRA
    model = ModelConfig(model=str(model_dir), device="cpu", dtype="fp32", lora=args.model != "tiny")
    rows = []
    for n in sizes:
        data = write_snapshot(work / f"s{seed}_n{n}", [prompts[i] for i in pool[:n]], [responses[i] for i in pool[:n]],
                              orders[:n])
        row = {"seed": seed, "rankings": n}
        per_ranking = max(1, args.batch_pairs // math.comb(K, 2))
        for name in args.arms.split(","):
            loss, grouped, batch = ARMS[name]
            cfg = RewardConfig(loss=loss, grouped=grouped, epochs=args.epochs, lr=args.lr,
                               batch_size=args.batch_pairs if batch == "pairs" else per_ranking,
                               max_length=96 if args.model == "tiny" else 256,
                               eval_data=str(eval_file), norm_samples=0, seed=seed)
            t = time.perf_counter()
            report = train_reward(str(data), str(work / f"s{seed}_n{n}_{name}"), cfg, model)
            row.update({f"acc_{name}": report["eval/accuracy"], f"loss_{name}": report["eval/loss"],
                        f"s_{name}": time.perf_counter() - t, "eval_pairs": report["eval/pairs"]})
        print(f"seed {seed} n={n}: " + " | ".join(f"{name} acc {row['acc_' + name]:.3f} loss {row['loss_' + name]:.3f}"
                                                  for name in args.arms.split(","))
              + f" ({row['eval_pairs']} held-out pairs)", flush=True)
        rows.append(row)
    return rows


def _num(x) -> str:
    return "nan" if x is None else f"{x:.4f}"


def _ci(t: dict, sign: str = "") -> str:
    """A mean with its 95% t interval (closed_report.t_interval); the mean alone for one seed."""
    if t["lo"] is None:
        return f"{t['mean']:{sign}.3f}"
    return f"{t['mean']:{sign}.3f} [{t['lo']:{sign}.3f}, {t['hi']:{sign}.3f}]"


def summarise(rows: list[dict], sizes: list[int], arms: list[str]) -> tuple[list[str], str]:
    """(the table's lines, the RESULT line); differences are from bt, when it is an arm."""
    seeds = sorted({r["seed"] for r in rows})
    others = [a for a in arms if a != "bt"] if "bt" in arms else []
    lines = ["| rankings | " + " | ".join(f"{a} accuracy [95% t]" for a in arms) + "".join(
        f" | {a} - bt [95% t]" for a in others) + " | " + " | ".join(f"{a} loss" for a in arms) + " |",
        "|---|" + "---|" * (2 * len(arms) + len(others))]
    fields = []
    for n in sizes:
        at = [r for r in rows if r["rankings"] == n]
        acc = {a: t_interval([r["acc_" + a] for r in at]) for a in arms}
        diff = {a: t_interval([r["acc_" + a] - r["acc_bt"] for r in at]) for a in others}
        loss = {a: statistics.fmean(r["loss_" + a] for r in at) for a in arms}
        lines.append(f"| {n} | " + " | ".join(_ci(acc[a]) for a in arms) + "".join(f" | {_ci(diff[a], '+')}" for a in others)
                     + " | " + " | ".join(f"{loss[a]:.3f}" for a in arms) + " |")
        fields += [f"n{n}_acc_{a}={acc[a]['mean']:.4f}" for a in arms]
        for a in others:
            fields += [f"n{n}_{a}_diff={diff[a]['mean']:.4f}", f"n{n}_{a}_diff_lo={_num(diff[a]['lo'])}",
                       f"n{n}_{a}_diff_hi={_num(diff[a]['hi'])}"]
        fields += [f"n{n}_loss_{a}={loss[a]:.4f}" for a in arms]
    return lines, "RESULT listwise " + " ".join(fields) + f" seeds={len(seeds)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one size (40 rankings), one seed: seconds")
    parser.add_argument("--sizes", default="50,100,200", help="rankings per training set, comma-separated")
    parser.add_argument("--seeds", default="0,1,2", help="seeds, comma-separated")
    parser.add_argument("--held-out", type=int, default=100, help="held-out prompts (their pairs are the evaluation)")
    parser.add_argument("--temperature", type=float, default=1.0, help="the annotators' Plackett-Luce temperature")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-pairs", type=int, default=12,
                        help="bt's batch in pairs (grouped and pl: / C(K, 2) rankings)")
    parser.add_argument("--arms", default="bt,grouped,pl", help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="tiny", help="'tiny' (tests/tiny.py's random model), 'default' "
                        "(SmolLM2-135M-Instruct) or a model folder")
    parser.add_argument("--json", default="", help="write the per-seed rows and the settings here (after each seed)")
    parser.add_argument("--resume", action="store_true", help="keep the seeds --json already holds (a run with the "
                        "same settings stopped part-way) and run the others")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.arms.split(",")) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {', '.join(unknown)} (known: {', '.join(ARMS)})")
    import torch

    from tests.tiny import save_tiny_model_dir

    torch.set_num_threads(args.threads)
    sizes = [40] if args.quick else [int(x) for x in args.sizes.split(",")]
    seeds = [0] if args.quick else [int(x) for x in args.seeds.split(",")]
    if args.quick:
        args.held_out = 20
    t0 = time.perf_counter()
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "resume")}
    rows = resumed_rows(args, settings) if args.resume else []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = save_tiny_model_dir(work / "tiny") if args.model == "tiny" else args.model
        for seed in seeds:
            if any(r["seed"] == seed for r in rows):
                continue
            rows += run_seed(seed, sizes, model_dir, work, args)
            if args.json:  # after every seed: a stopped run keeps the seeds it finished (--resume)
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({"settings": settings, "sizes": sizes, "rows": rows}, indent=1))
    lines, result = summarise(rows, sizes, args.arms.split(","))
    print("\n".join(lines))
    print(result)
    print(f"{time.perf_counter() - t0:.0f} s on {args.threads} thread(s)")
    return 0


def resumed_rows(args, settings: dict) -> list[dict]:
    """The rows of the seeds a stopped run's --json holds; refused when it ran other settings."""
    if not args.json or not Path(args.json).is_file():
        raise SystemExit("--resume needs --json naming the stopped run's file")
    saved = json.loads(Path(args.json).read_text())
    if saved["settings"] != settings:
        differ = sorted(k for k in settings.keys() | saved["settings"].keys()
                        if settings.get(k) != saved["settings"].get(k))
        raise SystemExit(f"--resume: {args.json} was run with other settings ({', '.join(differ)})")
    return saved["rows"]


if __name__ == "__main__":
    sys.exit(main())
