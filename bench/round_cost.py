"""What one round of the product's defaults costs in CPU: an earlier revision's path beside this one's.

    python bench/round_cost.py                       # a 256-prompt round, K = 4, against b5298eb
    python bench/round_cost.py --before REV --prompts 64 --json out.json
    python bench/round_cost.py --model FOLDER --quick  # smoke test: a tiny model, a few prompts

A round, as the loop runs it at its defaults (LoopSettings()): a `generate` job writes K responses
to each of --prompts prompts; people rank them, and every ranking gives C(K, 2) pairs; a
`train-reward` job trains on those pairs and samples the reference policy for the reward's
normalisation; a `ppo` job runs PPOConfig.steps steps; the new policy answers the blind
evaluation's --eval-prompts prompts once. Each part runs here as the app's own job command line
(`python -m pipeline ...`), in its own process, with no options beyond the data and the sizes
below, so each side runs its own revision's defaults. The earlier revision runs from a copy of
its tree (`git archive`), in the same environment, on the same data.

A part may be timed on a fraction of its work and scaled by its count, as the table says:

    generate      --measure-prompts prompts x K responses, scaled by prompts / measure-prompts
    reward        train-reward on the pairs of --measure-prompts fully ranked prompts, with no
                  normalisation samples, scaled by the same factor (loading scaled with it);
                  plus the normalisation: the same job with its default samples, minus that one
    ppo           `ppo --steps 1` and `--steps 3`: per step (C3 - C1) / 2, the rest once; scaled
                  to PPOConfig.steps
    evaluation    `generate` of one response to each of --eval-prompts prompts

CPU seconds are the job process's own (user + system, its children's included: os.wait4), so
two threads busy for a second count two. The rankings are a stand-in (responses ordered by
length): this times the jobs, it does not judge the responses. Both sides train on the same
pairs, and both PPO runs score with the same reward model (this revision's).

It prints one table (part, CPU seconds each side, ratio) and

    RESULT round_cost prompts=256 k=4 before=REV before_cpu_s=... after_cpu_s=... ratio=... cpu=...

Results: docs/results/round_cost.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from math import comb
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "store" / "data" / "prompts.jsonl"  # the app's bundled pool (license: store/data/LICENSE.md)
OUT = ROOT / "bench" / "out" / "round_cost"
BEFORE = "b5298eb"
"""The last revision whose reward model and DPO trained pair by pair and whose sampler decoded at
batch 16 with a growing KV cache."""


def cpu_model() -> str:
    """The CPU's model name (figures from different machines are not comparable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def job(tree: Path, stage: str, args: list[str], threads: int, log: Path) -> tuple[float, float]:
    """Run `python -m pipeline STAGE ARGS` from `tree` with `threads` torch threads: (its CPU seconds,
    user + system of the process and its children; its wall seconds). Output goes to `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = str(tree)  # `-m pipeline` from the tree's own packages, never the installed ones
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"\n$ ({tree.name}) python -m pipeline {stage} {' '.join(args)}\n")
        out.flush()
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "pipeline", stage, *args], cwd=tree, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{stage} ({tree.name}) failed (exit {proc.returncode}):\n"
                         + log.read_text(encoding="utf-8")[-3000:])
    return usage.ru_utime + usage.ru_stime, wall


def checkout(rev: str, folder: Path) -> Path:
    """The tree of `rev` (git archive) in `folder`, made once."""
    if not (folder / "pipeline" / "__main__.py").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        data = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(folder, filter="data")
    return folder


def write_prompts(path: Path, n: int, skip: int = 0) -> Path:
    """The bundled pool's prompts skip..skip+n as a job's prompts file ({"id", "prompt"} a line)."""
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[skip: skip + n]
    if len(lines) < n:
        raise SystemExit(f"the bundled pool has {skip + len(lines)} prompts; asked for {skip + n}")
    path.write_text("".join(json.dumps({"id": skip + i + 1, "prompt": json.loads(line)["prompt"]}) + "\n"
                            for i, line in enumerate(lines)), encoding="utf-8")
    return path


def ranked_pairs(responses: Path, out: Path) -> tuple[Path, int]:
    """Every pair of each prompt's responses, as one ranking per prompt gives them (its id in
    `ranking_id`, the longer response preferred: a stand-in order), written to `out`."""
    by_prompt: dict[str, list[str]] = {}
    for line in responses.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        by_prompt.setdefault(json.dumps(row["prompt"]), []).append(row["text"])
    rows = []
    for n, (prompt, texts) in enumerate(by_prompt.items()):
        texts = sorted({t.strip(): t for t in texts if t.strip()}.values(), key=lambda t: (-len(t), t))
        rows += [{"prompt": json.loads(prompt), "chosen": a, "rejected": b, "ranking_id": n + 1}
                 for i, a in enumerate(texts) for b in texts[i + 1:]]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return out, len(rows)


def measure(tree: Path, work: Path, args, model: list[str], pairs: Path | None) -> dict:
    """Every part of the round on one side: {part: {"cpu_s", "wall_s" (as measured), "scale"}}, and
    the pairs and reward model it trained on."""
    work.mkdir(parents=True, exist_ok=True)
    log, t = work / "jobs.log", args.threads
    scale = args.prompts / args.measure_prompts

    def part(times: tuple[float, float], factor: float) -> dict:
        return {"cpu_s": times[0], "wall_s": times[1], "scale": factor}

    gen_prompts = write_prompts(work / "prompts.jsonl", args.measure_prompts, skip=1000)
    gen = work / "generate"
    parts = {"generate": part(job(tree, "generate", ["--prompts", str(gen_prompts), "--out", str(gen),
                                                     "--k", str(args.k), *model], t, log), scale)}
    if pairs is None:
        pairs, _ = ranked_pairs(gen / "responses.jsonl", work / "pairs.jsonl")
    plain = job(tree, "train-reward", ["--data", str(pairs), "--out", str(work / "reward-plain"),
                                       "--norm-samples", "0", "--report-to", "none", *model], t, log)
    full = job(tree, "train-reward", ["--data", str(pairs), "--out", str(work / "reward"),
                                      "--report-to", "none", *model], t, log)
    parts["reward"] = part(plain, scale)
    parts["reward normalisation"] = part((max(full[0] - plain[0], 0.0), max(full[1] - plain[1], 0.0)), 1.0)
    reward = str(args.reward or work / "reward" / "checkpoint")
    ppo_prompts = write_prompts(work / "ppo_prompts.jsonl", args.ppo_prompts)
    ppo = {n: job(tree, "ppo", ["--prompts", str(ppo_prompts), "--reward", reward, "--out", str(work / f"ppo-{n}"),
                                "--steps", str(n), "--report-to", "none", *model], t, log) for n in (1, 3)}
    step = tuple(max(c3 - c1, 0.0) / 2 for c1, c3 in zip(ppo[1], ppo[3]))
    parts["ppo (once)"] = part(tuple(max(c1 - s, 0.0) for c1, s in zip(ppo[1], step)), 1.0)
    parts["ppo (per step)"] = part(step, float(args.ppo_steps))
    eval_prompts = write_prompts(work / "eval_prompts.jsonl", args.eval_prompts, skip=2000)
    parts["evaluation"] = part(job(tree, "generate", ["--prompts", str(eval_prompts), "--out",
                                                      str(work / "evaluation"), "--k", "1", *model], t, log), 1.0)
    return {"parts": parts, "pairs": str(pairs), "reward": str(work / "reward" / "checkpoint")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help="the earlier revision (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=256, help="prompts the round generates for")
    parser.add_argument("--k", type=int, default=4, help="responses per prompt (GenerateConfig.k's default: 4)")
    parser.add_argument("--measure-prompts", type=int, default=32, help="prompts actually generated and ranked")
    parser.add_argument("--ppo-steps", type=int, default=20, help="PPO steps of the round (PPOConfig.steps)")
    parser.add_argument("--ppo-prompts", type=int, default=256, help="PPO's prompts (LoopSettings.ppo_prompts)")
    parser.add_argument("--eval-prompts", type=int, default=64, help="prompts the blind evaluation asks")
    parser.add_argument("--model", default="", help="base model (default: the product's)")
    parser.add_argument("--reward", default="", help="a reward model folder for both PPO runs (default: "
                                                     "the one this revision's side trains)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per job")
    parser.add_argument("--work", default=str(OUT), help="work folder (the earlier tree is kept there)")
    parser.add_argument("--quick", action="store_true", help="4 prompts, 2 PPO steps, 4 evaluation prompts")
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.measure_prompts, args.ppo_steps, args.ppo_prompts, args.eval_prompts = 8, 4, 2, 16, 4
    work = Path(args.work).resolve() / time.strftime("%Y%m%d-%H%M%S")
    model = ["--model", args.model] if args.model else []
    before = checkout(args.before, Path(args.work).resolve() / f"tree-{args.before}")

    # this revision first: its pairs and reward model are the data of both sides
    after = measure(ROOT, work / "after", args, model, None)
    if not args.reward:
        args.reward = after["reward"]
    earlier = measure(before, work / "before", args, model, Path(after["pairs"]))

    def total(side: dict, key: str = "cpu_s") -> float:
        return sum(p[key] * p["scale"] for p in side["parts"].values())

    print(f"\nOne round: {args.prompts} prompts x {args.k} responses ({args.prompts * comb(args.k, 2)} pairs at most), "
          f"{args.ppo_steps} PPO steps, {args.eval_prompts} evaluation answers; {args.threads} threads; {cpu_model()}")
    print(f"{'part':<22} {'scale':>6} {'before cpu s':>13} {'after cpu s':>12} {'after/before':>13}")
    for name, b in earlier["parts"].items():
        a = after["parts"][name]
        ratio = f"{a['cpu_s'] / b['cpu_s']:.3f}" if b["cpu_s"] > 0 else "-"
        print(f"{name:<22} {b['scale']:>6.2f} {b['cpu_s'] * b['scale']:>13.1f} {a['cpu_s'] * a['scale']:>12.1f} {ratio:>13}")
    tb, ta = total(earlier), total(after)
    print(f"{'round':<22} {'':>6} {tb:>13.1f} {ta:>12.1f} {ta / tb:>13.3f}")
    result = {"prompts": args.prompts, "k": args.k, "before": args.before, "before_cpu_s": round(tb, 1),
              "after_cpu_s": round(ta, 1), "ratio": round(ta / tb, 4), "before_wall_s": round(total(earlier, "wall_s"), 1),
              "after_wall_s": round(total(after, "wall_s"), 1), "threads": args.threads,
              "cpu": cpu_model().replace(" ", "_")}
    print("RESULT round_cost " + " ".join(f"{k}={v}" for k, v in result.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "before_parts": earlier["parts"], "after_parts": after["parts"],
                                               "measure_prompts": args.measure_prompts, "ppo_steps": args.ppo_steps,
                                               "ppo_prompts": args.ppo_prompts, "eval_prompts": args.eval_prompts},
                                              indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
