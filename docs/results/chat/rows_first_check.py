"""The chat sampler's linear layers at K rows, both ways, side by side in one run (threads: argv[1], default 2):

1. every linear shape of the policy at 1-4 rows: F.linear(x, W) against (W @ x^T)^T, the same products;
2. K = 4 replies of up to 128 tokens to 3 prompts, each sampled with plain F.linear and with
   pipeline/rows_first.py installed (the chat sampler's way), alternating, the same seed for both.

    python docs/results/chat/rows_first_check.py 2
"""
import sys, time, warnings
import torch
warnings.filterwarnings("ignore")
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
import torch.nn.functional as F
from pipeline.config import GenerateConfig, ModelConfig
from pipeline.policy import sampling_policy
from pipeline.responses import generate_responses
from pipeline.rows_first import rows_first

policy, tok, _ = sampling_policy("", ModelConfig(device="cpu", dtype="fp32"))
policy.eval()
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


def best_ms(fn, reps=20, tries=3):
    fn()
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps * 1e3)
    return best


print("\n| weight | rows | F.linear ms | (W @ x^T)^T ms | ratio |\n|---|---|---|---|---|")
with torch.no_grad():
    for shape in sorted({tuple(m.weight.shape) for m in policy.modules() if type(m) is torch.nn.Linear}):
        W = next(m.weight for m in policy.modules() if type(m) is torch.nn.Linear and tuple(m.weight.shape) == shape)
        for rows in (1, 2, 3, 4):
            x = torch.randn(rows, shape[1])
            a, b = best_ms(lambda: F.linear(x, W)), best_ms(lambda: W @ x.T)
            print(f"| {shape[0]} x {shape[1]} | {rows} | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)

linears = [m for m in policy.modules() if type(m) is torch.nn.Linear]
prompts = ["How do I keep basil alive on a windowsill?", "What should I pack for a week of hiking?",
           "Can you explain how a mortgage works?"]
choices = rows_first(policy, 16)
fast_forwards = {id(m): m.__dict__["forward"] for m in linears}


def use(fast: bool) -> None:
    for m in linears:
        if fast:
            m.forward = fast_forwards[id(m)]
        else:
            m.__dict__.pop("forward", None)


print("\n| prompt | way | seconds | tokens (longest reply) | ms a step | same replies |\n|---|---|---|---|---|---|")
totals = {"F.linear": 0.0, "rows_first": 0.0}
with torch.no_grad():
    use(True)
    generate_responses(policy, tok, [[{"role": "user", "content": "Hello!"}]], 4,
                       GenerateConfig(k=4, max_new_tokens=128, seed=99))  # warm-up; makes rows_first's choices
    for i, text in enumerate(prompts):
        gen = GenerateConfig(k=4, max_new_tokens=128, seed=i, max_resample=0)
        texts = {}
        for way in (("F.linear", "rows_first") if i % 2 == 0 else ("rows_first", "F.linear")):
            use(way == "rows_first")
            t = time.perf_counter()
            out = generate_responses(policy, tok, [[{"role": "user", "content": text}]], 4, gen)[0]
            s = time.perf_counter() - t
            totals[way] += s
            steps = max(len(g.token_ids) for g in out)
            texts[way] = [g.text for g in out]
            print(f"| {i} | {way} | {s:.2f} | {steps} | {s / steps * 1e3:.0f} | "
                  f"{'' if len(texts) < 2 else texts['F.linear'] == texts['rows_first']} |", flush=True)
print(f"\nchoices made (weight shape, rows -> (W @ x^T)^T): "
      + ", ".join(f"{s[0]}x{s[1]}@{r}: {'yes' if v else 'no'}" for (s, _, r), v in sorted(choices.items())))
print(f"RESULT rows_first flinear_s={totals['F.linear']:.2f} rows_first_s={totals['rows_first']:.2f} "
      f"ratio={totals['F.linear'] / totals['rows_first']:.2f} threads={torch.get_num_threads()}")
