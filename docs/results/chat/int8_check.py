"""Could the chat sampler meet a 10 s turn on 2 CPU cores in int8? Three ways of running
SmolLM2-135M-Instruct's linear layers in int8 against fp32, on the same prompt and seeds:

- dynamic, per tensor / per channel: torch.ao.quantization.quantize_dynamic (int8 weights and
  activations, fbgemm);
- weight only: torch._weight_int8pack_mm (int8 weights per output channel, fp32 activations),
  timed on one [4 x 576] x [576 x 1536] product and the LM head.

Fidelity: KL(fp32 || int8) per response token at the chat's temperature 0.7 along the fp32
model's own 4 replies, and how often the two agree on the most likely token.
Speed: CPU seconds of generate_responses (K = 4, 32 new tokens) at --threads, fp32 and int8
alternating, twice each.

    python docs/results/chat/int8_check.py --threads 2
"""
import argparse
import copy
import time
import warnings

import torch

warnings.filterwarnings("ignore")
ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
torch.set_num_threads(args.threads)

from pipeline.config import GenerateConfig, ModelConfig  # noqa: E402
from pipeline.policy import sampling_policy  # noqa: E402
from pipeline.responses import generate_responses  # noqa: E402
from pipeline.text import prompt_token_ids  # noqa: E402
from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig  # noqa: E402

policy, tok, _ = sampling_policy("", ModelConfig(device="cpu", dtype="fp32"))
policy.eval()
messages = [{"role": "user", "content": "How do I keep basil alive on a windowsill?"}]
gen = GenerateConfig(k=4, max_new_tokens=32, seed=0, max_resample=0)
variants = {name: torch.ao.quantization.quantize_dynamic(copy.deepcopy(policy), {torch.nn.Linear: qc}, dtype=torch.qint8)
            for name, qc in (("dynamic per tensor", default_dynamic_qconfig),
                             ("dynamic per channel", per_channel_dynamic_qconfig))}
prompt = prompt_token_ids(tok, messages)
with torch.no_grad():
    replies = generate_responses(policy, tok, [messages], 4, gen)[0]
    print(f"threads {args.threads}; fp32 replies: {[g.text[:60] for g in replies]}")
    print("| int8 | KL per token (4 replies) | top-token agreement | fp32 CPU s | int8 CPU s | fp32 / int8 |")
    print("|---|---|---|---|---|---|")
    for name, q in variants.items():
        kls, agree = [], []
        for g in replies:
            ids = torch.tensor([prompt + g.token_ids])
            a = torch.log_softmax(policy(ids).logits[0, len(prompt) - 1:-1].float() / 0.7, -1)
            b = torch.log_softmax(q(ids).logits[0, len(prompt) - 1:-1].float() / 0.7, -1)
            kls.append((a.exp() * (a - b)).sum(-1).mean().item())
            agree.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
        cpu = {"fp32": [], "int8": []}
        for _ in range(2):
            for side, m in (("fp32", policy), ("int8", q)):
                t = time.process_time()
                generate_responses(m, tok, [messages], 4, gen)
                cpu[side].append(time.process_time() - t)
        f, i = min(cpu["fp32"]), min(cpu["int8"])
        print(f"| {name} | {', '.join(f'{k:.2f}' for k in kls)} | {sum(agree) / len(agree):.2f} | {f:.2f} | {i:.2f} | "
              f"{f / i:.2f} |")
    print("\n| weight-only int8 product | fp32 ms | int8 ms | fp32 / int8 | relative error |\n|---|---|---|---|---|")
    for M, K, N in ((4, 576, 1536), (4, 576, 49152)):
        W = torch.randn(N, K) * 0.02
        s = W.abs().amax(1) / 127
        Wq = torch.round(W / s[:, None]).clamp(-127, 127).to(torch.int8)
        x = torch.randn(M, K)

        def ms(fn, reps=20):
            fn()
            t = time.process_time()
            for _ in range(reps):
                fn()
            return (time.process_time() - t) / reps * 1e3

        a = min(ms(lambda: torch.nn.functional.linear(x, W)) for _ in range(2))
        b = min(ms(lambda: torch._weight_int8pack_mm(x, Wq, s)) for _ in range(2))
        ref = x @ W.t()
        err = float((torch._weight_int8pack_mm(x, Wq, s) - ref).norm() / ref.norm())
        print(f"| [{M} x {K}] x [{K} x {N}] | {a:.2f} | {b:.2f} | {a / b:.2f} | {err:.4f} |")
