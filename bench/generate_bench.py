"""Tokens/s of our sampler (pipeline.generate) against a plain `model.generate` loop.

Same model, prompts, chat template, left padding and sampling settings (temperature, top-p,
top-k, max new tokens) for all three rows:
- ours: generate_responses (prefill once per prompt, finished rows dropped, log-probs recorded);
- hf generate: model.generate(num_return_sequences=K), text and tokens only;
- hf generate + logprobs: the same with output_logits, log-probs computed afterwards, i.e. what
  our sampler returns.
Rounds alternate the order of the three so load changes on a shared machine hit all alike.
Tokens counted: response tokens up to and including EOS. Duplicate re-sampling is off for the
comparison (max_resample=0).

    python bench/generate_bench.py            # default model, 3 rounds of 8 prompts x K=4, 64 tokens
    python bench/generate_bench.py --quick    # 1 round of 4 prompts x K=4, 32 tokens
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config import GenerateConfig, ModelConfig  # noqa: E402
from pipeline.generate import encode_prompts, generate_responses  # noqa: E402
from pipeline.models import load_policy  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts.jsonl"
FALLBACK = ["What are some hot dog toppings besides ketchup or mustard?", "How can I shop for the lowest prices?",
            "How do I bake bread?", "What is a good way to learn the guitar?", "Why is the sky blue?",
            "How do I write a cover letter?", "What should I pack for a beach trip?", "How do plants grow?"]


def load_model(name: str, device: str):
    if name == "tiny":
        from pipeline.tiny import build_tiny_model, build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        tokenizer.padding_side = "left"
        return build_tiny_model(tokenizer).to(device), tokenizer
    # no adapter: generation from the base weights, as `python -m pipeline generate` does
    return load_policy(ModelConfig(model=name, device=device, lora=False))


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
    ap.add_argument("--quick", action="store_true", help="one round instead of three")
    ap.add_argument("--model", default="default", help="'default', a model folder, or 'tiny' (random)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts-per-batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rounds = 1 if args.quick else args.rounds
    if args.quick:  # a quarter of the work: a couple of minutes on two CPU cores
        args.prompts_per_batch, args.max_new_tokens = min(args.prompts_per_batch, 4), min(args.max_new_tokens, 32)

    model, tokenizer = load_model(args.model, args.device)
    model.eval()
    cfg = GenerateConfig(k=args.k, max_new_tokens=args.max_new_tokens, batch_size=args.prompts_per_batch * args.k,
                         max_resample=0)
    pool = [json.loads(line)["prompt"] for line in DATA.open()] if DATA.is_file() else FALLBACK * 8
    n = args.prompts_per_batch
    methods = {
        "ours": lambda ps: run_ours(model, tokenizer, ps, cfg),
        "hf generate": lambda ps: run_hf(model, tokenizer, ps, cfg, logprobs=False),
        "hf generate + logprobs": lambda ps: run_hf(model, tokenizer, ps, cfg, logprobs=True),
    }
    run_hf(model, tokenizer, pool[:2], GenerateConfig(k=1, max_new_tokens=4), logprobs=False)  # warm-up
    totals = {name: [0, 0.0] for name in methods}
    for r in range(rounds):
        prompts = pool[r * n : (r + 1) * n]
        names = list(methods)
        names = names[r % 3 :] + names[: r % 3]  # rotate the order each round
        for name in names:
            torch.manual_seed(r)
            cfg.seed = r
            t0 = time.perf_counter()
            tokens = methods[name](prompts)
            totals[name][0] += tokens
            totals[name][1] += time.perf_counter() - t0
            print(f"round {r + 1}/{rounds}  {name:<24} {tokens:5d} tokens  {totals[name][1]:7.1f} s total", flush=True)

    rate = {name: tok / sec for name, (tok, sec) in totals.items()}
    device = next(model.parameters()).device
    print(f"\nmodel={args.model} device={device} threads={args.threads} batch={n} prompts x K={args.k} "
          f"max_new_tokens={args.max_new_tokens} temperature={cfg.temperature} rounds={rounds}")
    print(f"{'method':<26}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}{'ours / this':>13}")
    for name, (tok, sec) in totals.items():
        print(f"{name:<26}{tok:>8d}{sec:>10.1f}{rate[name]:>10.1f}{rate['ours'] / rate[name]:>12.2f}x")
    print(f"RESULT generate ours_tok_s={rate['ours']:.1f} hf_tok_s={rate['hf generate']:.1f} "
          f"ratio={rate['ours'] / rate['hf generate']:.2f} hf_logprobs_tok_s={rate['hf generate + logprobs']:.1f} "
          f"ratio_logprobs={rate['ours'] / rate['hf generate + logprobs']:.2f}")


if __name__ == "__main__":
    main()
