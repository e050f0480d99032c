"""What an annotator waits in the Chat tab: seconds from a message to its K replies.

    python bench/chat_bench.py                       # the default model, K = 4, 20 turns, 2 threads
    python bench/chat_bench.py --threads 1 --turns 40
    python bench/chat_bench.py --quick               # 4 turns (bench/run_all.py)
    python bench/chat_bench.py --model PATH --turns 3 --max-new-tokens 8   # the suite's smoke test

Two sides ask the same sampler process (pipeline/chat_server.py on the model, started as the app
starts it: pipeline/orchestrate/chat.py ChatService, its own process with --threads torch threads):

- `app`: the app's client of its local sampler (ChatService with no URL: the active policy's
  check, then the request);
- `openai`: the same client pointed at that sampler as an outside OpenAI-compatible server
  (ChatService with its URL, as app.py --chat-url does for vLLM or llama.cpp's server).

A turn is a message in a conversation (the bundled prompts' first questions, then follow-ups, 4
turns a conversation, the history growing with the first reply), answered with K replies at the
default length (GenerateConfig.max_new_tokens) and temperature, each timed from the call to its
replies. Both sides answer every turn, in alternating order. The first request, which starts the
sampler and loads the model, is timed apart (`load_s`) and counted in neither side.

Prints a table and `RESULT chat p50_s= p95_s= openai_p50_s= openai_p95_s= load_s= k= turns=
max_new_tokens= threads= model=` (p95 of the `app` side against the issue's target: 10 s or less
on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import GenerateConfig, ModelConfig  # noqa: E402
from pipeline.orchestrate.chat import ChatService  # noqa: E402
from store import Store  # noqa: E402

PROMPTS = ROOT / "store" / "data" / "prompts.jsonl"
FOLLOW_UPS = ["Can you say more about that?", "Why is that?", "Thanks. Is there anything else I should know?"]
TURNS_PER_CONVERSATION = 1 + len(FOLLOW_UPS)
TARGET_P95_S = 10.0


def messages_of_turns(turns: int) -> list[str]:
    """The annotator's message at each turn: a bundled prompt opens each conversation, the
    follow-ups go on."""
    openings = [json.loads(line)["prompt"] for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    return [openings[t // TURNS_PER_CONVERSATION] if t % TURNS_PER_CONVERSATION == 0
            else FOLLOW_UPS[t % TURNS_PER_CONVERSATION - 1] for t in range(turns)]


def timed(service: ChatService, messages: list[dict], k: int) -> tuple[float, list]:
    t0 = time.perf_counter()
    replies = service.replies(0, messages, k).replies
    return time.perf_counter() - t0, replies


def quantile(seconds: list[float], q: int) -> float:
    """The q-th percentile (statistics.quantiles, inclusive of the extremes)."""
    return statistics.quantiles(seconds, n=100, method="inclusive")[q - 1] if len(seconds) > 1 else seconds[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="the policy's base model: 'default' or a folder")
    parser.add_argument("--k", type=int, default=4, help="replies per turn (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=20, help="turns timed on each side (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=GenerateConfig.max_new_tokens,
                        help="reply length limit (default: the generation default, %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in the sampler (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="4 turns a side (one conversation)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one turn may take")
    args = parser.parse_args(argv)
    if args.quick:
        args.turns = TURNS_PER_CONVERSATION
    if args.turns < 1 or args.k < 1 or args.threads < 1:
        parser.error("--turns, --k and --threads must be at least 1")
    # the sampler process inherits them: torch reads them when it is imported there
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    work = Path(tempfile.mkdtemp(prefix="chat_bench_"))
    gen = GenerateConfig(k=args.k, max_new_tokens=args.max_new_tokens)
    app = ChatService(None, work / "runs", timeout_s=args.timeout, start_timeout_s=args.timeout,
                      model_cfg=ModelConfig(model=args.model, device="cpu"), generate=gen)
    times: dict[str, list[float]] = {"app": [], "openai": []}
    outside_store = Store(work / "outside.duckdb")  # names the local sampler as an outside server
    try:
        # 1. the first request starts the sampler and loads the model: timed apart
        load_s, _ = timed(app, [{"role": "user", "content": "Hello!"}], args.k)
        endpoint = app.local.endpoint
        outside_store.set_chat_settings(server_url=endpoint.root + "/v1", server_model=endpoint.model)
        sides = {"app": app, "openai": ChatService(outside_store, work / "unused", api_key=endpoint.api_key,
                                                   timeout_s=args.timeout, generate=gen)}
        # 2. every turn on both sides, in alternating order; the history goes on from the app side's first reply
        history: list[dict] = []
        lengths = []
        for t, text in enumerate(messages_of_turns(args.turns)):
            if t % TURNS_PER_CONVERSATION == 0:
                history = []
            messages = [*history, {"role": "user", "content": text}]
            order = ("app", "openai") if t % 2 == 0 else ("openai", "app")
            for name in order:
                seconds, replies = timed(sides[name], messages, args.k)
                times[name].append(seconds)
                if name == "app":
                    history = [*messages, {"role": "assistant", "content": replies[0].text}]
                    lengths.append(sum(len(r.text) for r in replies) / len(replies))
            print(f"turn {t + 1}: {len(messages)} messages, app {times['app'][-1]:.2f} s, "
                  f"openai {times['openai'][-1]:.2f} s", flush=True)
    finally:
        app.close()
        outside_store.close()

    # 3. the table and the RESULT line
    print(f"\nchat, K = {args.k}, max_new_tokens {args.max_new_tokens}, {args.turns} turns a side, "
          f"{args.threads} thread(s), model {args.model}; replies of {statistics.mean(lengths):.0f} characters "
          "on average")
    print("| side | p50 s | p95 s | min | max |")
    print("|---|---|---|---|---|")
    for name in ("app", "openai"):
        s = times[name]
        print(f"| {name} | {quantile(s, 50):.2f} | {quantile(s, 95):.2f} | {min(s):.2f} | {max(s):.2f} |")
    print(f"| first request (starts the sampler, loads the model) | {load_s:.2f} | | | |")
    p95 = quantile(times["app"], 95)
    print(f"target: p95 <= {TARGET_P95_S:.0f} s: {'met' if p95 <= TARGET_P95_S else 'not met'}")
    print(f"RESULT chat p50_s={quantile(times['app'], 50):.3f} p95_s={p95:.3f} "
          f"openai_p50_s={quantile(times['openai'], 50):.3f} openai_p95_s={quantile(times['openai'], 95):.3f} "
          f"load_s={load_s:.3f} k={args.k} turns={args.turns} max_new_tokens={args.max_new_tokens} "
          f"threads={args.threads} model={Path(args.model).name if args.model != 'default' else 'default'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
