"""Tokens/s of our sampler (pipeline.generate) against a plain `model.generate` loop.

Same model, prompts, chat template, left padding and sampling settings (temperature, top-p,
top-k, max new tokens) for all three rows:
- ours: generate_responses (prefill once per prompt, finished rows dropped, log-probs recorded);
- hf generate: model.generate(num_return_sequences=K), text and tokens only;
- hf generate + logprobs: the same with output_logits, log-probs computed afterwards, i.e. what
  our sampler returns.
Rounds alternate the order of the three so load changes on a shared machine hit all alike, and
both wall-clock and process CPU time are reported: on a busy machine CPU time (one thread by
default) is the steadier measure. Tokens counted: response tokens up to and including EOS.
Duplicate re-sampling is off for the comparison (max_resample=0).

    python bench/generate_bench.py            # default model, 4 rounds of 8 prompts x K=4, 64 tokens
    python bench/generate_bench.py --quick    # 3 rounds of 4 prompts x K=4, 32 tokens
    python bench/generate_bench.py --model FOLDER --device cuda --prompts-per-batch 16   # batch 64 on a GPU

--dtype sets the model's weights (bf16 on a GPU by default); --json is rewritten after every round.
The ratios printed are those of the tokens/s the table shows (all rounds' tokens over all rounds'
seconds), with the per-round ratios' range beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run_all import write_json  # noqa: E402
from pipeline.config import GenerateConfig, ModelConfig  # noqa: E402
from pipeline.generate import generate_responses  # noqa: E402
from pipeline.text import encode_prompts  # noqa: E402
from pipeline.models import pick_device, pick_dtype  # noqa: E402
from pipeline.policy import load_policy  # noqa: E402

# the app's bundled prompt pool (license: store/data/LICENSE.md)
DATA = Path(__file__).resolve().parents[1] / "store" / "data" / "prompts.jsonl"


def load_model(name: str, device: str, dtype: str = "auto"):
    if name == "tiny":
        from tests.tiny import build_tiny_model, build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        tokenizer.padding_side = "left"
        device = pick_device(device)
        return build_tiny_model(tokenizer).to(device, pick_dtype(dtype, device)), tokenizer
    # no adapter: generation from the base weights, as `python -m pipeline generate` does
    return load_policy(ModelConfig(model=name, device=device, dtype=dtype, lora=False))


def response_lengths(tokens: torch.Tensor, eos: int) -> list[int]:
    """Tokens up to and including the first EOS, per row of (B, R)."""
    is_eos = tokens == eos
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, torch.full_like(tokens[:, 0], tokens.shape[1]))
    return first.tolist()


def run_ours(model, tokenizer, prompts, cfg) -> int:
    results = generate_responses(model, tokenizer, prompts, cfg.k, cfg)
    return sum(len(g.token_ids) for gens in results for g in gens)


def run_hf(model, tokenizer, prompts, cfg, logprobs: bool) -> int:
    device = next(model.parameters()).device
    ids, mask = encode_prompts(tokenizer, prompts, cfg.max_prompt_tokens, device)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens, num_return_sequences=cfg.k,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            output_logits=logprobs, return_dict_in_generate=True)
    tokens = out.sequences[:, ids.shape[1]:]  # (B*K, R)
    lengths = response_lengths(tokens, tokenizer.eos_token_id)
    if logprobs:
        logits = torch.stack(out.logits, dim=1).float() / cfg.temperature  # (B*K, R, V)
        lp = torch.log_softmax(logits, -1).gather(2, tokens[:, :, None]).squeeze(2)
        [lp[i, :n].tolist() for i, n in enumerate(lengths)]
    [tokenizer.decode(tokens[i, :n], skip_special_tokens=True) for i, n in enumerate(lengths)]
    return sum(lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 short rounds: 4 prompts x K, 32 new tokens")
    ap.add_argument("--model", default="default", help="'default', a model folder, or 'tiny' (random)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts-per-batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = steadiest timings)")
    ap.add_argument("--dtype", default="auto", help="the model's weights: auto (bf16 on a GPU that has it, else "
                                                    "fp32), fp32 or bf16")
    ap.add_argument("--json", default="", help="write the figures to this JSON file, after every round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:  # an eighth of the work per round: a few minutes on a busy two-core machine
        args.rounds = 3
        args.prompts_per_batch, args.max_new_tokens = min(args.prompts_per_batch, 4), min(args.max_new_tokens, 32)

    model, tokenizer = load_model(args.model, args.device, args.dtype)
    model.eval()
    cfg = GenerateConfig(k=args.k, max_new_tokens=args.max_new_tokens, batch_size=args.prompts_per_batch * args.k,
                         max_resample=0)
    pool = [json.loads(line)["prompt"] for line in DATA.open(encoding="utf-8")]
    n = args.prompts_per_batch
    methods = {
        "ours": lambda ps: run_ours(model, tokenizer, ps, cfg),
        "hf generate": lambda ps: run_hf(model, tokenizer, ps, cfg, logprobs=False),
        "hf generate + logprobs": lambda ps: run_hf(model, tokenizer, ps, cfg, logprobs=True),
    }
    for name in methods:  # warm-up (allocator, kernels) outside the timings
        methods[name](pool[-2:])
    # per round and method: (tokens, wall s, cpu s)
    runs: list[dict[str, tuple[int, float, float]]] = []
    device = next(model.parameters()).device
    for r in range(args.rounds):
        prompts = pool[r * n : (r + 1) * n]
        names = list(methods)
        names = names[r % 3 :] + names[: r % 3]  # rotate the order each round
        runs.append({})
        for name in names:
            torch.manual_seed(r)
            cfg.seed = r
            t0, c0 = time.perf_counter(), time.process_time()
            tokens = methods[name](prompts)
            runs[-1][name] = (tokens, time.perf_counter() - t0, time.process_time() - c0)
            print(f"round {r + 1}/{args.rounds}  {name:<24} {tokens:5d} tokens  {runs[-1][name][1]:7.1f} s wall  "
                  f"{runs[-1][name][2]:7.1f} s cpu", flush=True)
        if args.json:  # after every round: a bench stopped half-way keeps the rounds it finished
            figures = summarise(runs, list(methods))
            write_json(args.json, {
                "figures": figures, "rounds_done": r + 1, "rounds": args.rounds, "complete": r + 1 == args.rounds,
                "result_line": result_line(figures, args.rounds, n * args.k, device.type),
                "runs": [{k: list(v) for k, v in run.items()} for run in runs]})

    figures = summarise(runs, list(methods))
    print(f"\nmodel={args.model} device={device} dtype={next(model.parameters()).dtype} threads={args.threads} "
          f"batch={n} prompts x K={args.k} max_new_tokens={args.max_new_tokens} temperature={cfg.temperature} "
          f"rounds={args.rounds}")
    print(f"{'method':<24}{'tokens':>7}{'wall s':>8}{'tok/s':>7}{'cpu s':>8}{'tok/cpu-s':>10}"
          f"{'ours/this (wall)':>18}{'ours/this (cpu)':>17}{'per-round range (wall)':>24}")
    for name, row in figures["methods"].items():
        print(f"{name:<24}{row['tokens']:>7.0f}{row['wall_s']:>8.1f}{row['tok_s']:>7.1f}{row['cpu_s']:>8.1f}"
              f"{row['tok_cpu_s']:>10.1f}{row['ratio']:>17.2f}x{row['ratio_cpu']:>16.2f}x"
              f"{row['ratio_min']:>17.2f}-{row['ratio_max']:.2f}x")
    print("(ratios: the table's tokens/s over all rounds, ours over this; the range: the same ratio round by round)")
    print(result_line(figures, args.rounds, n * args.k, device.type))


def summarise(runs: list[dict[str, tuple[int, float, float]]], methods: list[str]) -> dict:
    """Per method over the rounds so far: tokens, wall and CPU seconds, tokens/s, and ours over it
    (all rounds' tokens over all rounds' seconds; the range: the same ratio round by round)."""
    rows = {}
    for name in methods:
        tok, wall, cpu = (sum(run[name][i] for run in runs) for i in range(3))
        rows[name] = {"tokens": tok, "wall_s": wall, "cpu_s": cpu, "tok_s": tok / wall, "tok_cpu_s": tok / cpu}
    for name, row in rows.items():
        per_round = [(run["ours"][0] / run["ours"][1]) / (run[name][0] / run[name][1]) for run in runs]
        row.update(ratio=rows["ours"]["tok_s"] / row["tok_s"], ratio_cpu=rows["ours"]["tok_cpu_s"] / row["tok_cpu_s"],
                   ratio_min=min(per_round), ratio_max=max(per_round))
    return {"methods": rows}


def result_line(figures: dict, rounds: int, batch: int, device: str) -> str:
    m = figures["methods"]
    ours, hf, hf_lp = m["ours"], m["hf generate"], m["hf generate + logprobs"]
    return (f"RESULT generate ours_tok_s={ours['tok_s']:.1f} hf_tok_s={hf['tok_s']:.1f} ratio={hf['ratio']:.2f} "
            f"ratio_min={hf['ratio_min']:.2f} ratio_max={hf['ratio_max']:.2f} cpu_ratio={hf['ratio_cpu']:.2f} "
            f"hf_logprobs_tok_s={hf_lp['tok_s']:.1f} ratio_logprobs={hf_lp['ratio']:.2f} rounds={rounds} "
            f"batch={batch} device={device}")


if __name__ == "__main__":
    main()
