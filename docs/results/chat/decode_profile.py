"""Where a chat turn's decode step goes: K = 4 replies of 32 new tokens at the given threads (default 2), profiled;
then the tied LM head at batches 1, 4 and 16 as F.linear(x, W) and as (W @ x^T)^T, the same products.

    python docs/results/chat/decode_profile.py 2
"""
import sys, time, torch, warnings
warnings.filterwarnings("ignore")
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
from pipeline.config import ModelConfig, GenerateConfig
from pipeline.policy import sampling_policy
from pipeline.responses import generate_responses
policy, tok, _ = sampling_policy("", ModelConfig(device="cpu", dtype="fp32"))
policy.eval()
msgs = [{"role": "user", "content": "How do I keep basil alive on a windowsill?"}]
gen = GenerateConfig(k=4, max_new_tokens=32, seed=0, max_resample=0)
with torch.no_grad():
    generate_responses(policy, tok, [msgs], 4, gen)
    t, c = time.perf_counter(), time.process_time()
    out = generate_responses(policy, tok, [msgs], 4, gen)[0]
    steps = max(len(g.token_ids) for g in out)
    print(f"threads {torch.get_num_threads()}: {steps} steps, wall {time.perf_counter() - t:.2f} s "
          f"({(time.perf_counter() - t) / steps * 1e3:.0f} ms a step with the prefill), CPU {time.process_time() - c:.2f} s")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate_responses(policy, tok, [msgs], 4, gen)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
lm = policy.lm_head.weight.detach()
for M in (1, 4, 16):
    x = torch.randn(M, lm.shape[1])
    def ms(fn, reps=30):
        fn(); t = time.perf_counter()
        for _ in range(reps): fn()
        return (time.perf_counter() - t) / reps * 1e3
    a = min(ms(lambda: torch.nn.functional.linear(x, lm)) for _ in range(3))
    b = min(ms(lambda: (lm @ x.t()).t()) for _ in range(3))
    print(f"LM head at batch {M}: F.linear {a:.2f} ms, (W @ x^T)^T {b:.2f} ms, ratio {a / b:.2f}")
