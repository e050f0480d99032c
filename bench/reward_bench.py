"""Pairs/s of our reward trainer (pipeline.train_reward) against TRL's RewardTrainer.

Same model (default SmolLM2-135M-Instruct), the same pairs (--data k4, the default: rankings of
K = 4 responses as a round makes them, tests/data/k4_rankings.jsonl, 6 pairs each; --data hh:
HH-RLHF's 2-response pairs), the same token ids (both take the
pairs as tokenised by pipeline.pairs_data: chat template, left truncation of the prompt to
--max-length, so TRL filters nothing out), the same pairs per optimiser step (the pairs sides: 6
pairs x 2 accumulated on k4, 4 x 2 on hh; 8 pairs of 512 tokens in one pass need about 20 GB of
activations on CPU), one epoch, learning rate and linear decay, LoRA settings, precision and
threads. Each trainer runs in its own subprocess, one after the
other, so peak RSS is each one's own; --rounds repeats them, the order rotating each round, and
pairs/s is printed as the median over rounds with its range. Held-out accuracy: both models score
the same held-out pairs (split by prompt) at the EOS token of prompt+response, printed only with
its 95% interval (Wilson score; on 400 pairs it is about +-5 points, on the quick mode's 16 about
+-23, so the quick mode's accuracies say nothing beyond "the run trained").

Two TRL baselines: RewardTrainer as configured by default (random batches), and with its best
setting for speed, `train_sampling_strategy="group_by_length"` (transformers' LengthGroupedSampler
over the pair's longer side; `group_by_length=True` before transformers 5), which removes most of
the padding our length-grouped batches remove.

TRL settings that are not its defaults, and why:
- gradient_checkpointing=False (TRL's RewardConfig defaults to True): ours does not checkpoint,
  so both do the same arithmetic. --trl-gradient-checkpointing restores TRL's default.
- pad token '<|endoftext|>' for TRL: SmolLM2 pads with its EOS token, and a sequence-classification
  model looks for the last token that is not the pad id, which would score TRL one token early.
- save_strategy='no', report_to=[], logging every 10 steps: no checkpoint I/O in the timing.

Three sides of ours and TRL's: `ours` (the default: each ranking's pairs as one batch element, its
prompt once and each of its responses once, a step's rankings in one micro-batch), `ours_pairs`
(`--grouped false`: pair by pair, as TRL), and the two TRL baselines.

Where ours gains: each ranking's (or pair's) prompt runs once and its responses continue from its KV cache
(in HH-RLHF pairs the prompt, with SmolLM2's system prompt, is about 80% of the tokens), and
length-grouped batches (pairs of similar length share a batch, so dynamic padding pads little;
TRL samples batches at random). The bench prints the tokens each one pushes through the model.

    python bench/reward_bench.py            # k4: 240 train / 240 held-out pairs, max length 512, 2 rounds
    python bench/reward_bench.py --data hh  # HH-RLHF: 400 / 400
    python bench/reward_bench.py --quick    # 36 / 18 pairs (hh: 32 / 16), 2 rounds
    python bench/reward_bench.py --model FOLDER --device cuda --json out.json   # a GPU (bench/gpu_check.py)
    python bench/reward_bench.py --quick --model tiny --threads 1   # smoke test of the bench (seconds)

--dtype bf16 runs both trainers under bf16 autocast, on the CPU too (bench/gpu_check.py's dry run).
--json is rewritten after every trainer's run; a trainer that fails is recorded with its traceback
(`failed`), not run again, and the others are still reported (exit code 1).

CPU seconds are reported beside wall-clock seconds because on a machine busy with other work the
wall clock follows the load more than the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run_all import traceback_tail, write_json  # noqa: E402
from pipeline.config import ModelConfig, RewardConfig  # noqa: E402
from pipeline.orchestrate.gate import wilson  # noqa: E402
from pipeline.pairs_data import collate, encode_pairs, read_pairs, split_by_prompt  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "hh_dev_pairs.jsonl"  # provenance: tests/data/README.md
K4 = DATA.with_name("k4_rankings.jsonl")  # rankings of K = 4 as a round makes them (tests/data/README.md)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def model_path(name: str) -> str:
    from pipeline.models import resolve_model_path

    return resolve_model_path(name)


# --------------------------------------------------------------------------- workers (subprocesses)


def worker_ours(spec: dict, grouped: bool = True) -> dict:
    """Our trainer: each ranking's pairs as one batch element (the default; a step of the rankings
    whose pairs the pairs sides' step holds, in one micro-batch), or pair by pair (grouped False)."""
    from pipeline.train_reward import train_reward

    batch, accum = spec["batch_size"], spec["grad_accum"]
    if grouped:
        batch, accum = max(1, batch * accum // spec["pairs_per_ranking"]), 1
    cfg = RewardConfig(epochs=1, lr=spec["lr"], batch_size=batch, grad_accum=accum, grouped=grouped,
                       max_length=spec["max_length"], max_tokens=0, norm_samples=0, eval_data=spec["eval"],
                       seed=spec["seed"])
    model_cfg = ModelConfig(model=spec["model"], device=spec["device"], dtype=spec["dtype"], lora=spec["lora"],
                            lora_r=spec["lora_r"], lora_alpha=2 * spec["lora_r"])
    # a new run directory per round: train_reward refuses to overwrite a finished run
    out = tempfile.mkdtemp(prefix="ours-", dir=spec["workdir"])
    report = train_reward(spec["train"], out, cfg, model_cfg)
    return {"pairs_per_s": report["train/pairs"] / report["train/seconds"], "seconds": report["train/seconds"],
            "cpu_seconds": report["train/cpu_seconds"],
            "pairs": report["train/pairs"], "accuracy": report["eval/accuracy"],
            "length_baseline": report["eval/length_baseline_accuracy"]}


def worker_trl(spec: dict, grouped: bool = False) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig as TRLRewardConfig
    from trl import RewardTrainer

    from pipeline.models import load_tokenizer, pick_dtype, pick_device

    path = model_path(spec["model"])
    device = pick_device(spec["device"])
    tok = load_tokenizer(path)
    train_pairs, _ = read_pairs(spec["train"])
    eval_pairs, _ = read_pairs(spec["eval"])
    train_items, _ = encode_pairs(train_pairs, tok, spec["max_length"])  # the ids ours trains on
    eval_items, _ = encode_pairs(eval_pairs, tok, spec["max_length"])
    if "<|endoftext|>" in tok.get_vocab() and tok.pad_token_id == tok.eos_token_id:
        tok.pad_token = "<|endoftext|>"  # see the module docstring
    tok.padding_side = "right"
    dtype = pick_dtype(spec["dtype"], device)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32 if not spec["lora"] else dtype)
    model.config.pad_token_id = tok.pad_token_id
    peft_config = None
    if spec["lora"]:
        targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj".split(",")
        peft_config = LoraConfig(task_type="SEQ_CLS", r=spec["lora_r"], lora_alpha=2 * spec["lora_r"],
                                 lora_dropout=0.0, target_modules=targets)
    columns = {"chosen_ids": [it.chosen_ids for it in train_items],
               "rejected_ids": [it.rejected_ids for it in train_items]}
    grouping = {}
    if grouped:  # transformers' LengthGroupedSampler, on the longer side of each pair
        columns["length"] = [max(len(it.chosen_ids), len(it.rejected_ids)) for it in train_items]
        import dataclasses

        names = {f.name for f in dataclasses.fields(TRLRewardConfig)}
        grouping = ({"train_sampling_strategy": "group_by_length"} if "train_sampling_strategy" in names
                    else {"group_by_length": True})
        grouping["remove_unused_columns"] = False  # keep 'length' for the sampler; the collator ignores it
    ds = Dataset.from_dict(columns)
    args = TRLRewardConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"), per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["grad_accum"], num_train_epochs=1, learning_rate=spec["lr"],
        lr_scheduler_type="linear",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_length=spec["max_length"],
        bf16=dtype == torch.bfloat16, fp16=False, use_cpu=device.type == "cpu",  # bf16: autocast, on the CPU too
        gradient_checkpointing=spec["trl_gradient_checkpointing"], save_strategy="no", report_to=[],
        logging_steps=10, seed=spec["seed"], dataloader_num_workers=0, disable_tqdm=True, **grouping,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=peft_config)
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    model = trainer.model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(eval_items), 2 * spec["batch_size"]):
            chunk = eval_items[start:start + 2 * spec["batch_size"]]
            batch = collate(chunk, tok.pad_token_id)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                scores = model(input_ids=batch["input_ids"].to(device),
                               attention_mask=batch["attention_mask"].to(device)).logits[:, 0].float()
            correct += (scores[: len(chunk)] > scores[len(chunk):]).sum().item()
    return {"pairs_per_s": len(train_items) / seconds, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "pairs": len(train_items),
            "accuracy": correct / len(eval_items)}


def padded_tokens(spec: dict) -> tuple[int, float]:
    """Tokens one epoch pushes through the model, padding included: ours (length-grouped batches)
    and random batches as TRL draws them (mean over 20 shuffles). Explains most of the ratio."""
    import random

    from pipeline.models import load_tokenizer
    from pipeline.pairs_data import length_grouped_batches

    items, _ = encode_pairs(read_pairs(spec["train"])[0], load_tokenizer(model_path(spec["model"])), spec["max_length"])
    lengths, bs = [it.length for it in items], spec["batch_size"]
    ours = 0
    for b in length_grouped_batches(lengths, bs, spec["seed"]):  # each prompt once, then both responses
        resp = max(max(len(items[i].chosen_response), len(items[i].rejected_response)) for i in b)
        ours += len(b) * max(items[i].prompt_len for i in b) + 2 * len(b) * resp
    random_total = 0
    for seed in range(20):
        order = list(range(len(lengths)))
        random.Random(seed).shuffle(order)
        random_total += sum(2 * len(order[k:k + bs]) * max(lengths[i] for i in order[k:k + bs])
                            for k in range(0, len(order), bs))
    return ours, random_total / 20


def median_result(results: list[dict]) -> dict:
    """Pairs/s and seconds: the median over rounds, with the pairs/s range; peak memory the
    largest; accuracy from the first round (every round trains the same model from the same seed)."""
    import statistics

    out = dict(results[0])
    for key in ("pairs_per_s", "seconds", "cpu_seconds"):
        out[key] = statistics.median(r[key] for r in results)
    out["pairs_per_s_min"] = min(r["pairs_per_s"] for r in results)
    out["pairs_per_s_max"] = max(r["pairs_per_s"] for r in results)
    for key in ("peak_rss_mb", "peak_gpu_mb"):
        if key in results[0]:
            out[key] = max(r[key] for r in results)
    return out


def report_worker(side, spec_path: Path) -> None:
    """Inside a worker subprocess: run one trainer `side(spec)` on the spec file's settings (threads,
    seed) and print its result, with the process's peak memory, as one 'BENCH_JSON {...}' line."""
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    result = side(spec)
    result["peak_rss_mb"] = peak_rss_mb()
    if torch.cuda.is_available():
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("BENCH_JSON " + json.dumps(result), flush=True)


def run_worker(name: str, spec_path: Path) -> tuple[dict | None, str]:
    """(result, '') of one trainer run in a fresh interpreter (it prints one 'BENCH_JSON {...}'
    line), or (None, why: its exit code and traceback) when it fails."""
    env = dict(os.environ)
    if name != "ours":  # the TRL side needs datasets, which bench/gpu_check.py refuses to our side
        env.pop("RLHF_BLOCK_IMPORTS", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", name, "--spec", str(spec_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            return json.loads(line[len("BENCH_JSON "):]), ""
    why = f"exit {proc.returncode}\n" + traceback_tail(proc.stdout)
    print(f"{name} worker FAILED ({why})", flush=True)
    return None, why


# --------------------------------------------------------------------------- driver


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 train / 16 held-out pairs")
    parser.add_argument("--model", default="default", help="'default', a model folder, or 'tiny' (smoke test)")
    parser.add_argument("--data", default="k4", choices=["k4", "hh"],
                        help="k4: rankings of K = 4 (tests/data/k4_rankings.jsonl, 6 pairs each); hh: HH-RLHF's pairs")
    parser.add_argument("--train-pairs", type=int, default=0, help="default: 240 (k4), 400 (hh)")
    parser.add_argument("--eval-pairs", type=int, default=0, help="default: 240 (k4), 400 (hh)")
    parser.add_argument("--batch-size", type=int, default=0, help="pairs per forward pass (micro-batch) of the "
                        "pairs sides; default: 6 (k4), 4 (hh). ours: the step's rankings in one micro-batch")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimiser step")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lora", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each trainer, the order rotating each round")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL's default; off by default here")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    parser.add_argument("--only", default="", help="comma-separated trainers to run, of " + ", ".join(SIDES))
    parser.add_argument("--worker", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:  # inside a subprocess: run one trainer and report
        report_worker(SIDES[args.worker], Path(args.spec))
        return 0

    k4 = args.data == "k4"
    per_ranking = 6 if k4 else 1  # a step's pairs are whole rankings: cut every size to a multiple
    args.batch_size = args.batch_size or (6 if k4 else 4)
    if args.quick:  # at 512 tokens almost nothing is truncated (at 256, half the pairs would be)
        args.train_pairs, args.eval_pairs = (36, 18) if k4 else (32, 16)
    args.train_pairs = args.train_pairs or (240 if k4 else 400)
    args.eval_pairs = args.eval_pairs or (240 if k4 else 400)
    args.train_pairs -= args.train_pairs % per_ranking
    data = K4 if k4 else DATA
    if not data.is_file():
        sys.exit(f"{data} is missing: the benchmark needs it (tests/data/)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pairs, _ = read_pairs(data)
    # a quarter of the prompts held out: about 500 of the 2000 HH dev pairs, so 400 fit; 240 of k4's 960
    train, held = split_by_prompt(pairs, 0.25, seed=args.seed)
    if len(held) < args.eval_pairs or len(train) < args.train_pairs:
        sys.exit(f"{data} splits into {len(train)} train / {len(held)} held-out pairs: fewer than asked")
    train, held = train[: args.train_pairs], held[: args.eval_pairs]
    with tempfile.TemporaryDirectory(prefix="reward-bench-") as work:
        work = Path(work)
        for name, rows in (("train", train), ("eval", held)):
            (work / f"{name}.jsonl").write_text("".join(
                json.dumps({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected,
                            **({"ranking_id": p.ranking} if p.ranking else {})}) + "\n" for p in rows))
        model = args.model
        if model == "tiny":  # a random tiny model: a smoke test of the bench itself, not a measurement
            from tests.tiny import save_tiny_model_dir

            model = str(save_tiny_model_dir(work / "tiny"))
        spec = {"model": model, "train": str(work / "train.jsonl"), "eval": str(work / "eval.jsonl"),
                "workdir": str(work), "batch_size": args.batch_size, "grad_accum": args.grad_accum,
                "max_length": args.max_length,
                "lr": args.lr, "lora": args.lora, "lora_r": args.lora_r, "threads": args.threads,
                "device": args.device, "dtype": args.dtype, "seed": args.seed, "pairs_per_ranking": per_ranking,
                "trl_gradient_checkpointing": args.trl_gradient_checkpointing}
        (work / "spec.json").write_text(json.dumps(spec))
        print(f"reward bench: {len(train)} train / {len(held)} held-out {args.data} pairs, batch {args.batch_size} pairs x "
              f"{args.grad_accum} accumulated, "
              f"max length {args.max_length}, LoRA {args.lora} (r={args.lora_r}), {args.threads} threads, "
              f"device {args.device}, TRL gradient checkpointing {args.trl_gradient_checkpointing}, "
              f"{args.rounds} round(s)", flush=True)
        tokens_ours, tokens_random = padded_tokens(spec)
        # Rounds rotate the order, so load changes on a shared machine hit every trainer alike.
        names = args.only.split(",") if args.only else list(SIDES)
        runs = {name: [] for name in names}
        failed: dict[str, str] = {}  # trainer -> its exit code and traceback; not run again after a failure
        output = {"results": {}, "runs": runs, "failed": failed, "rounds": args.rounds, "complete": False}

        def save() -> None:  # after every run: a bench stopped half-way keeps the runs it finished
            output["results"] = {name: median_result(rs) for name, rs in runs.items() if rs}
            if args.json:
                write_json(args.json, output)

        save()
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                if name in failed:
                    continue
                run, why = run_worker(name, work / "spec.json")
                if run is None:
                    failed[name] = why
                else:
                    runs[name].append(run)
                    print(f"round {r + 1}/{args.rounds} {name}: {run['pairs_per_s']:.3f} pairs/s", flush=True)
                save()
        output["complete"] = True
        res = {name: median_result(runs[name]) for name in names if runs[name]}

    n_eval = len(held)
    for r in res.values():
        r["acc_lo"], r["acc_hi"] = wilson(round(r["accuracy"] * n_eval), n_eval)
    output["results"] = res
    if set(res) != set(SIDES):  # a partial run: the table, no ratios
        report(res, args, n_eval)
        for name, why in failed.items():
            print(f"{name}: FAILED: {why.strip().splitlines()[-1]}")
        line = ("RESULT reward" + "".join(f" {name}_pairs_s={r['pairs_per_s']:.3f}" for name, r in res.items())
                + "".join(f" {name}=failed" for name in failed) + f" rounds={args.rounds}")
        print(line)
        output["result_line"] = line
        if args.json:
            write_json(args.json, output)
        return 1 if failed else 0
    ours, pairwise, trl, grouped = res["ours"], res["ours_pairs"], res["trl"], res["trl_grouped"]
    report(res, args, n_eval)
    ratio = ours["pairs_per_s"] / trl["pairs_per_s"]
    ratio_grouped = ours["pairs_per_s"] / grouped["pairs_per_s"]
    ratio_pairs = ours["pairs_per_s"] / pairwise["pairs_per_s"]
    ratio_cpu = trl["cpu_seconds"] / ours["cpu_seconds"]  # pairs per CPU-second, same pairs
    print(f"ratio ours/trl pairs/s: {ratio:.2f}x wall clock, {ratio_cpu:.2f}x per CPU-second; against TRL with "
          f"group_by_length {ratio_grouped:.2f}x; against our pair-by-pair path {ratio_pairs:.2f}x; "
          f"longer-response baseline accuracy {ours['length_baseline']:.3f}")
    print("(on a machine shared with other work, wall-clock pairs/s follow the load; CPU seconds much less so)")
    print(f"tokens per epoch incl. padding: ours pair by pair {tokens_ours} (prompt once, length-grouped), TRL about "
          f"{tokens_random:.0f} (whole sequences, random batches): {tokens_random / tokens_ours:.2f}x")
    peak = "gpu" if "peak_gpu_mb" in ours else "rss"
    line = (f"RESULT reward ours_pairs_s={ours['pairs_per_s']:.3f} ours_pairs_s_min={ours['pairs_per_s_min']:.3f} "
            f"ours_pairs_s_max={ours['pairs_per_s_max']:.3f} trl_pairs_s={trl['pairs_per_s']:.3f} "
            f"trl_pairs_s_min={trl['pairs_per_s_min']:.3f} trl_pairs_s_max={trl['pairs_per_s_max']:.3f} "
            f"trl_grouped_pairs_s={grouped['pairs_per_s']:.3f} ours_pairs_pairs_s={pairwise['pairs_per_s']:.3f} "
            f"ratio={ratio:.2f} ratio_grouped={ratio_grouped:.2f} ratio_pairs={ratio_pairs:.2f} "
            f"ratio_cpu={ratio_cpu:.2f} n_eval={n_eval} ours_acc={ours['accuracy']:.3f} "
            f"ours_acc_lo={ours['acc_lo']:.3f} ours_acc_hi={ours['acc_hi']:.3f} trl_acc={trl['accuracy']:.3f} "
            f"trl_acc_lo={trl['acc_lo']:.3f} trl_acc_hi={trl['acc_hi']:.3f} "
            f"ours_peak_mb={ours[f'peak_{peak}_mb']:.0f} trl_peak_mb={trl[f'peak_{peak}_mb']:.0f} "
            f"ours_pairs_peak_mb={pairwise[f'peak_{peak}_mb']:.0f} peak={peak} "
            f"length_baseline={ours['length_baseline']:.3f} data={args.data} rounds={args.rounds}")
    print(line)
    output.update(ratio=ratio, ratio_grouped=ratio_grouped, ratio_pairs=ratio_pairs, result_line=line)
    if args.json:
        write_json(args.json, output)
    return 0


def report(res: dict, args, n_eval: int) -> None:
    print()
    print(f"{args.rounds} round(s), the order rotating; pairs/s: median [min-max]; accuracy on {n_eval} held-out "
          "pairs with its 95% Wilson interval")
    print(f"{'trainer':<13}{'pairs':>7}{'seconds':>10}{'pairs/s':>26}{'CPU s':>10}{'peak RSS MB':>13}"
          f"{'peak GPU MB':>13}{'accuracy [95% CI]':>26}")
    for name, r in res.items():
        rate = f"{r['pairs_per_s']:.3f} [{r['pairs_per_s_min']:.3f}-{r['pairs_per_s_max']:.3f}]"
        print(f"{name:<13}{r['pairs']:>7}{r['seconds']:>10.1f}{rate:>26}{r['cpu_seconds']:>10.1f}"
              f"{r['peak_rss_mb']:>13.0f}{r.get('peak_gpu_mb', float('nan')):>13.0f}"
              f"{r['accuracy']:>10.3f} [{r['acc_lo']:.3f}, {r['acc_hi']:.3f}]")


SIDES = {"ours": worker_ours, "ours_pairs": lambda spec: worker_ours(spec, grouped=False), "trl": worker_trl,
         "trl_grouped": lambda spec: worker_trl(spec, grouped=True)}


if __name__ == "__main__":
    sys.exit(main())
