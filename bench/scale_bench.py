"""1 process against N: the same train-reward and ppo jobs launched plainly and under torchrun.

    python bench/scale_bench.py                       # tiny model, CPU, 1 vs 2 processes
    python bench/scale_bench.py --model default --device cuda --procs 4 --reps 2

Each job is the job runner's command (`python -m pipeline <stage> ...` for 1 process,
`python -m torch.distributed.run --nproc_per_node N -m pipeline <stage> ...` for N), with the same
options, so both sides do the same work (sizes are global: pipeline/distributed.py). Timed: the
whole job (launch, imports, loading, training) and the steady-state throughput read from its
metrics.jsonl (median over steps after the first). The order of the sides alternates over the
repetitions; medians and ranges are printed, then the N/1 ratios, and the commit.

On a CPU machine the processes share the cores and the tiny model's steps are dominated by
communication and Python overhead: the table there shows what the launch and the all-reduces cost,
not what N GPUs gain.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def command(procs: int, port: int) -> list[str]:
    if procs == 1:
        return [sys.executable, "-m", "pipeline"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
            "--master_port", str(port), "-m", "pipeline"]


def run_job(stage_args: list[str], procs: int, out: Path, port: int) -> tuple[float, list[dict], float]:
    """(job wall seconds, metrics lines, peak resident memory in GB of the largest process)."""
    # one thread per process on both sides (torchrun's default for its workers): the 1-process side
    # with every core's threads would measure OpenMP contention on a shared machine, not scaling
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w+") as log:
        proc = subprocess.Popen([*command(procs, port), *stage_args, "--out", str(out)], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        # wait4's ru_maxrss covers the child and the descendants it waited for (getrusage(2)): the
        # largest of the launcher and its workers, i.e. the peak of one process
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            log.seek(0)
            raise SystemExit(f"{' '.join(stage_args[:1])} on {procs} process(es) failed:\n{log.read()[-3000:]}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return wall, lines, usage.ru_maxrss / 1e6  # kB on Linux


def throughput(lines: list[dict], key: str) -> float:
    values = [m[key] for m in lines if key in m][1:]  # the first step pays warm-up
    return statistics.median(values) if values else float("nan")


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})"

# --------------------------------------------------------------------------- memory per setting

# Architectures: SmolLM2-135M is read from the default model's config.json; the other two are
# SmolLM2-1.7B's and Llama-2-7B's published configs (huggingface.co/HuggingFaceTB/SmolLM2-1.7B,
# meta-llama/Llama-2-7b-hf: hidden, intermediate, layers, heads, KV heads, vocabulary, tied).
ARCHS = {
    "SmolLM2-1.7B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=49152, tie_word_embeddings=True),
    "Llama-2-7B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False),
}
GB = 1e9


def param_counts(c: dict, lora_r: int = 16) -> tuple[int, int]:
    """(parameters, LoRA parameters) of a Llama-style decoder; LoRA on q,k,v,o,gate,up,down with
    rank r (pipeline.config defaults): r * (in + out) per adapted matrix."""
    h, i, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two RMSNorms
    params = L * layer + V * h * (1 if c["tie_word_embeddings"] else 2) + h
    lora = L * lora_r * (2 * (h + h) + 2 * (h + kv) + 3 * (h + i))
    return params, lora


def activation_bytes(c: dict, checkpointing: bool) -> int:
    """Bytes of activations kept for the backward pass per token (bf16). Per layer: the saved
    inputs of its matmuls and norms, ~8h + 2kv + 4i elements (attention by SDPA/flash keeps no
    T x T scores); with checkpointing only each layer's input (h) plus one layer recomputed."""
    h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    per_layer = 2 * (8 * h + 2 * kv + 4 * i)
    return 2 * h * L + per_layer if checkpointing else per_layer * L


def memory_rows(archs: dict, tokens: int = 4096) -> list[dict]:
    """GB per process for reward training and PPO (the four roles), LoRA and full fine-tuning.

    Weights bf16 (2 B/param) when frozen; trained full weights as fp32 masters + fp32 gradients +
    AdamW's two fp32 moments (16 B/param); LoRA: a bf16 base + the adapters at 16 B/param. PPO:
    policy + reference (LoRA: the adapter disabled, no memory; full: a frozen fp32 copy, as
    pipeline/policy.py deep-copies the fp32 master) + reward model (bf16, frozen) + critic (a
    trained model of the same size); with LoRA, the reward model and critic are LoRA models of the
    policy's base (train-reward's default), whose frozen weights are the policy's
    (pipeline/models.py share_frozen_weights). Activations for `tokens` tokens per micro-batch, plus the
    (tokens, V) bf16 logits. FSDP over N: the weight and optimiser terms divided by N (ZeRO-3),
    except `whole_gb`, kept whole on every process: PPO's reward model under FSDP (frozen, not
    sharded: pipeline/ppo_state.py). `sampling_gb`: what sampling holds instead of the activations,
    PPO with LoRA's merged copy of the adapted matrices (pipeline/policy.py merged_lora)."""
    rows = []
    for name, c in archs.items():
        P, Pl = param_counts(c)
        act = {gc: activation_bytes(c, gc) * tokens + 2 * tokens * c["vocab_size"] for gc in (False, True)}
        states = {
            ("reward", "lora"): 2 * P + 16 * Pl, ("reward", "full"): 16 * P,
            ("ppo", "lora"): 2 * P + 2 * 16 * Pl,  # one base: reward and critic LoRA on the policy's (+ adapters)
            ("ppo", "full"): 16 * P + 4 * P + 2 * P + 16 * P,  # policy, reference, reward, critic
        }
        whole = {("ppo", "full"): 2 * P}  # the reward model, not sharded under FSDP
        h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
        merged = 2 * L * (2 * h * h + 2 * h * kv + 3 * h * i)  # PPO with LoRA samples with the adapted matrices merged
        for (stage, mode), weights in states.items():
            rows.append({"model": name, "params": P, "lora_params": Pl, "stage": stage, "mode": mode,
                         "weights_gb": weights / GB, "whole_gb": whole.get((stage, mode), 0) / GB,
                         "sampling_gb": (merged if (stage, mode) == ("ppo", "lora") else 0) / GB,
                         "act_gb": act[False] / GB, "act_gc_gb": act[True] / GB})
    return rows


def fits(weights_gb: float, act_gb: float, card_gb: float, shards: int = 1, whole_gb: float = 0.0,
         sampling_gb: float = 0.0) -> bool:
    """With 10% of the card left for the CUDA context, allocator slack and sampling's KV cache;
    `whole_gb` of the weights is not sharded (held by every process); sampling holds `sampling_gb`
    where training holds the activations."""
    return (weights_gb - whole_gb) / shards + whole_gb + max(act_gb, sampling_gb) <= 0.9 * card_gb


def memory_table(tokens: int = 4096) -> str:
    from pipeline.models import resolve_model_path

    with open(Path(resolve_model_path("default")) / "config.json") as f:
        archs = {"SmolLM2-135M": json.load(f), **ARCHS}
    lines = [f"| model | params | LoRA params | stage | training | weights+optimiser GB | activations GB "
             f"({tokens} tokens) | with checkpointing | 1 GPU: 24 / 80 / 141 GB | FSDP over 8: 24 / 80 / 141 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in memory_rows(archs, tokens):
        one = " / ".join("yes" if fits(r["weights_gb"], r["act_gc_gb"], g, sampling_gb=r["sampling_gb"]) else "no"
                         for g in (24, 80, 141))
        eight = " / ".join("yes" if fits(r["weights_gb"], r["act_gc_gb"], g, 8, r["whole_gb"], r["sampling_gb"])
                           else "no" for g in (24, 80, 141))
        lines.append(f"| {r['model']} | {r['params'] / 1e9:.3g}B | {r['lora_params'] / 1e6:.3g}M | {r['stage']} | "
                     f"{r['mode']} | {r['weights_gb']:.1f} | {r['act_gb']:.1f} | {r['act_gc_gb']:.1f} | {one} | "
                     f"{eight} |")
    return "\n".join(lines)



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model folder or 'default' ('' = a tiny random model)")
    parser.add_argument("--memory-table", action="store_true",
                        help="print the memory each setting needs (docs/scaling.md) and exit")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--procs", type=int, default=2, help="N, compared with 1")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each side (order alternates)")
    parser.add_argument("--reward-steps", type=int, default=12)
    parser.add_argument("--ppo-steps", type=int, default=6)
    args = parser.parse_args()
    if args.memory_table:
        print(memory_table())
        return 0

    from tests.test_train_ppo import PROMPTS
    from tests.test_train_reward import marker_pairs
    from tests.tiny import save_tiny_model_dir

    work = Path(tempfile.mkdtemp(prefix="scale_bench-"))
    model = args.model or str(save_tiny_model_dir(work / "tiny"))
    pairs = work / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in marker_pairs(16 * args.reward_steps + 40)))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    common = ["--model", model, "--device", args.device]
    jobs = {
        "train-reward": (["train-reward", "--data", str(pairs), "--batch-size", "16", "--max-steps",
                          str(args.reward_steps), "--norm-samples", "0", "--eval-fraction", "0.1", *common],
                         "train/pairs_per_s", "pairs/s"),
        "ppo": (["ppo", "--policy", model, "--reward", "script:count:e", "--prompts", str(prompts),
                 "--steps", str(args.ppo_steps), "--batch-size", "16", "--mini-batch-size", "8",
                 "--micro-batch-size", "4", "--max-new-tokens", "16", "--sample-every", "0", *common],
                "time/episodes_per_s", "episodes/s"),
    }
    results: dict = {}
    port = 29650
    for stage, (stage_args, key, _) in jobs.items():
        for rep in range(args.reps):
            order = (1, args.procs) if rep % 2 == 0 else (args.procs, 1)
            for procs in order:
                port += 1
                out = work / f"{stage}-{procs}-{rep}"
                wall, lines, peak = run_job(stage_args, procs, out, port)
                row = results.setdefault((stage, procs), {"wall": [], "rate": [], "peak": []})
                row["wall"].append(wall)
                row["rate"].append(throughput(lines, key))
                row["peak"].append(peak)
                print(f"  {stage} x{procs} rep {rep}: {wall:.1f} s, {row['rate'][-1]:.2f} {jobs[stage][2]}, "
                      f"peak {peak:.2f} GB per process", flush=True)

    print(f"\nscale_bench  model={args.model or 'tiny (random, ~30k parameters)'}  device={args.device}  "
          f"commit={commit()}  reps={args.reps}")
    print(f"{'stage':<13}{'procs':>6}  {'job wall s, median (range)':<30}{'steady throughput, median (range)':<40}"
          "peak GB per process")
    for (stage, procs), row in sorted(results.items()):
        rate = f"{summary(row['rate'])} {jobs[stage][2]}"
        print(f"{stage:<13}{procs:>6}  {summary(row['wall']):<30}{rate:<40}{max(row['peak']):.2f}")
    for stage in jobs:
        one, many = results[(stage, 1)], results[(stage, args.procs)]
        print(f"{stage}: {args.procs} processes / 1: wall x{statistics.median(many['wall']) / statistics.median(one['wall']):.2f}, "
              f"throughput x{statistics.median(many['rate']) / statistics.median(one['rate']):.2f}")
    ratios = " ".join(
        f"{stage}_throughput_x{args.procs}={statistics.median(results[(stage, args.procs)]['rate']) / statistics.median(results[(stage, 1)]['rate']):.2f} "
        f"{stage}_peak_gb_1={max(results[(stage, 1)]['peak']):.2f} "
        f"{stage}_peak_gb_{args.procs}={max(results[(stage, args.procs)]['peak']):.2f}" for stage in jobs)
    print(f"RESULT scale model={args.model or 'tiny'} device={args.device} procs={args.procs} {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
