"""How fast this machine reads 540 MB (the fp32 weights a decode step of SmolLM2-135M uses) at 2 threads.

    python docs/results/chat/read_bandwidth.py
"""
import time, torch
torch.set_num_threads(2)
x = torch.randn(135_000_000 // 1)  # 540 MB fp32, the policy's weights
for _ in range(2): x.sum()
best = min((lambda t: (x.sum(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
print(f"read 540 MB at 2 threads: {best*1e3:.0f} ms = {0.54/best:.1f} GB/s")
