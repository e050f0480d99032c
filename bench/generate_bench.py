"""Tokens/s of our sampler (pipeline.responses) against a plain `model.generate` loop, at batch 16
and at the device's decode default (pipeline/sampling.py decode_batch_size: 64 on CPU, 256 on a
GPU), the batch `python -m pipeline generate` runs at unless told otherwise.

Same model, prompts, chat template, left padding and sampling settings (temperature, top-p,
top-k, max new tokens) for every row; at each batch B (sequences per forward pass):
- ours: generate_responses at batch_size B (prefill once per prompt, finished rows dropped,
  log-probs recorded, the KV cache allocated once);
- hf generate: model.generate(num_return_sequences=K) on B / K prompts at a time, text and tokens only;
- hf generate + logprobs: the same with output_logits, log-probs computed afterwards, i.e. what
  our sampler returns.
Every method samples the same prompts each round (enough to fill the largest batch: its B / K),
taken longest first by every method, so a round's tokens/s compare across methods and batches.
Rounds rotate the order of the methods so load changes on a shared machine hit all alike, and
both wall-clock and process CPU time are reported: on a busy machine CPU time (one thread by
default) is the steadier measure. Tokens counted: response tokens up to and including EOS.
Duplicate re-sampling is off for the comparison (max_resample=0).

    python bench/generate_bench.py            # default model, 4 rounds, batches 16 and the default, K=4, 64 tokens
    python bench/generate_bench.py --quick    # 2 rounds, 32 tokens
    python bench/generate_bench.py --model FOLDER --device cuda --batches 64   # one batch, on a GPU

--dtype sets the model's weights (bf16 on a GPU by default); --json is rewritten after every round.
The ratios printed are those of the tokens/s the table shows (all rounds' tokens over all rounds'
seconds), with the per-round ratios' range beside them: ours over each method at the same batch,
and each method at the last batch over itself at the first (the batch gain).
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
from pipeline.text import encode_prompts, prompt_token_ids  # noqa: E402
from pipeline.models import pick_device, pick_dtype  # noqa: E402
from pipeline.policy import load_policy  # noqa: E402
from pipeline.responses import generate_responses  # noqa: E402
from pipeline.sampling import decode_batch_size  # noqa: E402

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


METHODS = ("ours", "hf generate", "hf generate + logprobs")


def run_ours(model, tokenizer, prompts, cfg) -> int:
    results = generate_responses(model, tokenizer, prompts, cfg.k, cfg)
    return sum(len(g.token_ids) for gens in results for g in gens)


def run_hf(model, tokenizer, prompts, cfg, logprobs: bool) -> int:
    """model.generate on cfg.batch_size / K prompts at a time, longest first (as generate_responses
    takes them): the response tokens sampled."""
    lengths = [len(prompt_token_ids(tokenizer, p, cfg.max_prompt_tokens)) for p in prompts]
    ordered = [p for _, p in sorted(zip(lengths, prompts), key=lambda x: -x[0])]
    step = max(1, cfg.batch_size // cfg.k)
    return sum(_hf_batch(model, tokenizer, ordered[i:i + step], cfg, logprobs) for i in range(0, len(ordered), step))


def _hf_batch(model, tokenizer, prompts, cfg, logprobs: bool) -> int:
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


def parse_batches(text: str, device: torch.device) -> list[int]:
    """'16,default' -> [16, decode_batch_size(device)]: sequences per batch, each once, in order."""
    batches = [decode_batch_size(device) if b.strip() == "default" else int(b) for b in text.split(",")]
    return list(dict.fromkeys(batches))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 short rounds: 32 new tokens")
    ap.add_argument("--model", default="default", help="'default', a model folder, or 'tiny' (random)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batches", default="16,default",
                    help="sequences per batch, comma-separated; 'default' = the device's decode_batch_size. "
                         "Ratios across batches: the last over the first")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per round (0 = the largest batch / K)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = steadiest timings)")
    ap.add_argument("--dtype", default="auto", help="the model's weights: auto (bf16 on a GPU that has it, else "
                                                    "fp32), fp32 or bf16")
    ap.add_argument("--json", default="", help="write the figures to this JSON file, after every round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:  # half the rounds, half the tokens
        args.rounds, args.max_new_tokens = min(args.rounds, 2), min(args.max_new_tokens, 32)

    model, tokenizer = load_model(args.model, args.device, args.dtype)
    model.eval()
    device = next(model.parameters()).device
    batches = parse_batches(args.batches, device)
    n = args.prompts or max(1, max(batches) // args.k)
    cfgs = {b: GenerateConfig(k=args.k, max_new_tokens=args.max_new_tokens, batch_size=b, max_resample=0)
            for b in batches}
    pool = [json.loads(line)["prompt"] for line in DATA.open(encoding="utf-8")]
    run = {"ours": lambda ps, cfg: run_ours(model, tokenizer, ps, cfg),
           "hf generate": lambda ps, cfg: run_hf(model, tokenizer, ps, cfg, logprobs=False),
           "hf generate + logprobs": lambda ps, cfg: run_hf(model, tokenizer, ps, cfg, logprobs=True)}
    names = [(b, m) for b in batches for m in METHODS]
    for m in METHODS:  # warm-up (allocator, kernels) outside the timings
        run[m](pool[-2:], cfgs[batches[0]])
    # per round, per (batch, method): (tokens, wall s, cpu s)
    runs: list[dict[tuple[int, str], tuple[int, float, float]]] = []
    for r in range(args.rounds):
        prompts = pool[r * n : (r + 1) * n]
        order = names[r % len(names):] + names[: r % len(names)]  # rotate the order each round
        runs.append({})
        for b, m in order:
            torch.manual_seed(r)
            cfgs[b].seed = r
            t0, c0 = time.perf_counter(), time.process_time()
            tokens = run[m](prompts, cfgs[b])
            runs[-1][b, m] = (tokens, time.perf_counter() - t0, time.process_time() - c0)
            print(f"round {r + 1}/{args.rounds}  batch {b:<4} {m:<24} {tokens:5d} tokens  {runs[-1][b, m][1]:7.1f} s wall  "
                  f"{runs[-1][b, m][2]:7.1f} s cpu", flush=True)
        if args.json:  # after every round: a bench stopped half-way keeps the rounds it finished
            figures = summarise(runs, batches)
            write_json(args.json, {
                "figures": figures, "rounds_done": r + 1, "rounds": args.rounds, "complete": r + 1 == args.rounds,
                "result_line": result_line(figures, args.rounds, device.type),
                "runs": [{f"{b} {m}": list(v) for (b, m), v in run_.items()} for run_ in runs]})

    figures = summarise(runs, batches)
    print(f"\nmodel={args.model} device={device} dtype={next(model.parameters()).dtype} threads={args.threads} "
          f"prompts={n} x K={args.k} per round, batches={','.join(map(str, batches))} "
          f"max_new_tokens={args.max_new_tokens} temperature={cfgs[batches[0]].temperature} rounds={args.rounds}")
    gain = len(batches) > 1
    print(f"{'batch':>5}  {'method':<24}{'tokens':>7}{'wall s':>8}{'tok/s':>7}{'cpu s':>8}{'tok/cpu-s':>10}"
          f"{'ours/this (wall)':>18}{'ours/this (cpu)':>17}{'per-round range (wall)':>24}"
          + (f"{f'b{batches[-1]}/b{batches[0]} (wall)':>18}" if gain else ""))
    for b in batches:
        for m, row in figures["batches"][str(b)].items():
            print(f"{b:>5}  {m:<24}{row['tokens']:>7.0f}{row['wall_s']:>8.1f}{row['tok_s']:>7.1f}{row['cpu_s']:>8.1f}"
                  f"{row['tok_cpu_s']:>10.1f}{row['ratio']:>17.2f}x{row['ratio_cpu']:>16.2f}x"
                  f"{row['ratio_min']:>17.2f}-{row['ratio_max']:.2f}x"
                  + (f"{row['batch_gain']:>17.2f}x" if gain and b == batches[-1] else ""))
    print("(ratios: the table's tokens/s over all rounds, ours over this at the same batch; the range: the same "
          "ratio round by round" + ("; the last column: this method at the last batch over itself at the first)"
                                     if gain else ")"))
    print(result_line(figures, args.rounds, device.type))


def summarise(runs: list[dict[tuple[int, str], tuple[int, float, float]]], batches: list[int]) -> dict:
    """Per batch and method over the rounds so far: tokens, wall and CPU seconds, tokens/s, and ours
    over it at the same batch (all rounds' tokens over all rounds' seconds; the range: the same
    ratio round by round); at the last batch, with two or more, each method's batch_gain: its
    tokens/s there over its tokens/s at the first batch. "methods" is the last batch's rows."""
    tok_s = lambda run, key: run[key][0] / run[key][1]  # noqa: E731
    table: dict[str, dict] = {}
    for b in batches:
        rows = {}
        for m in METHODS:
            tok, wall, cpu = (sum(run[b, m][i] for run in runs) for i in range(3))
            rows[m] = {"tokens": tok, "wall_s": wall, "cpu_s": cpu, "tok_s": tok / wall, "tok_cpu_s": tok / cpu}
        for m, row in rows.items():
            per_round = [tok_s(run, (b, "ours")) / tok_s(run, (b, m)) for run in runs]
            row.update(ratio=rows["ours"]["tok_s"] / row["tok_s"], ratio_cpu=rows["ours"]["tok_cpu_s"] / row["tok_cpu_s"],
                       ratio_min=min(per_round), ratio_max=max(per_round))
        table[str(b)] = rows
    first, last = table[str(batches[0])], table[str(batches[-1])]
    if len(batches) > 1:
        for m in METHODS:
            per_round = [tok_s(run, (batches[-1], m)) / tok_s(run, (batches[0], m)) for run in runs]
            last[m].update(batch_gain=last[m]["tok_s"] / first[m]["tok_s"], batch_gain_min=min(per_round),
                           batch_gain_max=max(per_round))
    return {"batches": table, "methods": last, "batch": batches[-1], "base_batch": batches[0]}


def result_line(figures: dict, rounds: int, device: str) -> str:
    """The last batch's figures under the keys run_all reads; with a first batch too, its figures
    (*_base_*) and the batch gains."""
    m = figures["methods"]
    ours, hf, hf_lp = m["ours"], m["hf generate"], m["hf generate + logprobs"]
    line = (f"RESULT generate ours_tok_s={ours['tok_s']:.1f} hf_tok_s={hf['tok_s']:.1f} ratio={hf['ratio']:.2f} "
            f"ratio_min={hf['ratio_min']:.2f} ratio_max={hf['ratio_max']:.2f} cpu_ratio={hf['ratio_cpu']:.2f} "
            f"hf_logprobs_tok_s={hf_lp['tok_s']:.1f} ratio_logprobs={hf_lp['ratio']:.2f}")
    if "batch_gain" in ours:
        base = figures["batches"][str(figures["base_batch"])]
        line += (f" base_batch={figures['base_batch']} ours_base_tok_s={base['ours']['tok_s']:.1f} "
                 f"hf_base_tok_s={base['hf generate']['tok_s']:.1f} ratio_base={base['hf generate']['ratio']:.2f} "
                 f"ratio_logprobs_base={base['hf generate + logprobs']['ratio']:.2f} "
                 f"batch_gain={ours['batch_gain']:.2f} batch_gain_min={ours['batch_gain_min']:.2f} "
                 f"batch_gain_max={ours['batch_gain_max']:.2f} hf_batch_gain={hf['batch_gain']:.2f}")
    return line + f" rounds={rounds} batch={figures['batch']} device={device}"


if __name__ == "__main__":
    main()
