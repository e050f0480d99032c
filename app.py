"""The annotation app: open the store, build the UI, launch.

    python app.py                      # ./data/rlhf.duckdb, login, default model, first batch
    python app.py --no-auth            # single user, no login, bound to 127.0.0.1 only
    python app.py --db my.duckdb --port 7861 --no-generate

On a first start the store is empty: an admin account is created (its one-time password is printed
here), the bundled prompts are imported, and a job generates K responses for a first batch of
prompts; the Annotate tab shows them chunk by chunk as they arrive. The app process itself never
loads a model: generation, training and comparison run as subprocess jobs (pipeline/orchestrate),
and the Chat tab's replies come from a sampler process of their own, started at the first message
(pipeline/orchestrate/chat.py), or from an OpenAI-compatible server set in Data > Team (or by
--chat-url).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

for _key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_key, "1")  # nothing is downloaded at run time
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def parse_args(argv=None) -> argparse.Namespace:
    from pipeline.config import GenerateConfig
    from store import default_db_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", default=str(default_db_path()),
                   help="DuckDB file, created on first start (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; 0.0.0.0 serves the network (default: %(default)s)")
    p.add_argument("--port", type=int, default=7860, help="port (default: %(default)s)")
    p.add_argument("--no-auth", action="store_true",
                   help="no login: one local admin user; binds 127.0.0.1 only")
    p.add_argument("--model", default="default",
                   help="policy base model: 'default' (SmolLM2-135M-Instruct) or a local HF folder")
    p.add_argument("--k", type=int, default=4, help="responses per prompt (default: %(default)s)")
    p.add_argument("--first-batch", type=int, default=16, metavar="N",
                   help="prompts to generate for on a first start, 0 = none (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=GenerateConfig.max_new_tokens,
                   help="response length limit for generation (default: %(default)s)")
    p.add_argument("--no-generate", action="store_true",
                   help="no first batch on a first start: rank what is in the store")
    p.add_argument("--device", default="auto", help="jobs' device: auto, cpu, cuda (default: %(default)s)")
    p.add_argument("--chat-url", default="",
                   help="set the Chat tab to ask this OpenAI-compatible server (vLLM, llama.cpp's server, TGI: "
                        "a base URL such as http://localhost:8000/v1; its key in $RLHF_LOOP_CHAT_API_KEY) instead "
                        "of starting its own sampler on the active policy: the store's setting, as Data > Team "
                        "sets it (default: keep the stored one)")
    p.add_argument("--chat-model", default="",
                   help="with --chat-url: the model name sent to its server (default: none, the server's own)")
    p.add_argument("--chat-timeout", type=float, default=120.0, metavar="S",
                   help="seconds an annotator waits for a turn's replies before the message is given back "
                        "unanswered (default: %(default)s)")
    p.add_argument("--no-chat", action="store_true", help="no Chat tab replies: no sampler is ever started")
    p.add_argument("--session-hours", type=float, default=12.0,
                   help="a sign-in lasts this long, then the login form is shown again (default: %(default)s)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="do not fetch the next item ahead (only to measure what it buys: bench/ui_bench.py)")
    p.add_argument("--timings", metavar="FILE", default=None,
                   help="record where each action's time goes on the server and write it to FILE as JSON "
                        "on exit (annotate/timing.py; bench/ui_bench.py reads it)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.session_hours > 0 or not args.chat_timeout > 0:
        print(f"error: --session-hours and --chat-timeout must be positive, not {args.session_hours} and "
              f"{args.chat_timeout}", file=sys.stderr)
        return 2
    from annotate import bootstrap
    from annotate.context import AppContext
    from annotate.timing import Timings
    from annotate.ui import build_ui, launch
    from pipeline.config import GenerateConfig, ModelConfig
    from pipeline.orchestrate.chat import API_KEY_ENV, ChatService
    from pipeline.orchestrate.loop import make_runner
    from pipeline.orchestrate.steps import LoopSettings
    from store import Store, StoreError, StoreLockedError

    # 1. the store (one owner process per DuckDB file)
    try:
        store = Store(args.db)
    except StoreLockedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.chat_url:  # the store's setting, as Data > Team sets it
        try:
            store.set_chat_settings(server_url=args.chat_url, server_model=args.chat_model)
        except StoreError as exc:
            print(f"error: --chat-url: {exc}", file=sys.stderr)
            store.close()
            return 2
    auth = not args.no_auth
    host = "127.0.0.1" if args.no_auth else args.host
    if args.no_auth and args.host not in ("127.0.0.1", "localhost"):
        print(f"--no-auth: ignoring --host {args.host}; serving on 127.0.0.1 only", flush=True)

    # 2. the job queue: every model runs in a subprocess job writing a run directory beside the
    #    database; jobs and rounds a previous app left in flight are recovered here
    data_dir = Path(args.db).resolve().parent
    settings = LoopSettings(model=ModelConfig(model=args.model, device=args.device),
                            generate=GenerateConfig(k=args.k, max_new_tokens=args.max_new_tokens))
    jobs = make_runner(store, data_dir / "runs")

    # 3. first start: an admin, the bundled prompts, a first batch of responses (a generate job)
    password = bootstrap.ensure_admin(store, auth=auth)
    if password is not None:
        print("\n" + "=" * 64 + f"\n  First start: created admin account 'admin'\n  one-time password: {password}\n"
              "  (sign in, then add annotators in Data > Users)\n" + "=" * 64 + "\n", flush=True)
    added = bootstrap.ensure_prompts(store)
    if added:
        print(f"Imported {added} bundled prompts.", flush=True)
    if not args.no_generate:
        started = bootstrap.first_batch(store, jobs, settings, args.first_batch)
        if started:
            print(f"Generating K={args.k} responses for {started} prompts in a background job.", flush=True)

    # 4. the Chat tab's replies: building the service starts nothing; the local sampler (a process
    #    of its own, serving the active policy) starts at the first message, an outside server is
    #    only asked
    chat = None if args.no_chat else ChatService(
        store, data_dir / "runs", api_key=os.environ.get(API_KEY_ENV, ""), timeout_s=args.chat_timeout,
        model_cfg=settings.model, generate=settings.generate)

    # 5. the UI (the queue's in-memory index is built now, not on the first annotator's request)
    store.warm_queue()
    ctx = AppContext(store=store, auth=auth, data_dir=data_dir, jobs=jobs, chat=chat, train_settings=settings,
                     generate_defaults={"k": args.k, "max_new_tokens": args.max_new_tokens},
                     prefetch=not args.no_prefetch, session_hours=args.session_hours,
                     timings=Timings() if args.timings else None)
    demo = build_ui(ctx)
    # `kill` (SIGTERM) stops the app like Ctrl-C, so the store is closed and checkpointed.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        launch(demo, ctx, host=host, port=args.port)
    finally:
        if chat is not None:
            chat.close()
        jobs.shutdown()
        store.close()
        if ctx.timings is not None:
            ctx.timings.write(args.timings)
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
