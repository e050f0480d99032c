"""Load test of the annotation app: simulated annotators submitting rankings through the HTTP API.

The app runs as its own process (`python app.py --no-generate`, as users start it) on a temporary
DuckDB file seeded with enough items; N annotator threads each hold a gradio_client session logged
in with their own account and loop: submit a random ranking of the item on screen (timed: from
submit to the next item's HTML being back), then do what the browser does right after, fetch the
item after that (/prefetch, untimed). No think time: this is the worst case for the server.

Three phases, the same N threads each:
- handlers: the same loop calling annotate/handlers.py directly in this process (no HTTP), the
  app's own cost;
- http + prefetch: the app as users run it (the headline figure);
- http, no prefetch: each submit must take the next item from the queue itself.
The ratio rows show what HTTP + Gradio + gradio_client add, and what prefetching buys. The machine's
load average is printed too: on a shared machine the figures move with it.

    python bench/ui_bench.py            # 20 annotators, 60 s per phase
    python bench/ui_bench.py --quick    # 20 annotators, 10 s per phase
"""

from __future__ import annotations

import argparse
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from store import Store  # noqa: E402

TARGET_P95_MS = 150.0


def seed(db: Path, annotators: int, items: int, k: int) -> None:
    """Accounts ann0..ann{N-1} (password 'bench-pass-<i>') and `items` items of K responses."""
    store = Store(db)
    for i in range(annotators):
        store.add_annotator(f"ann{i}", f"bench-pass-{i}")
    mv = store.register_model_version("policy", "bench-policy", base_model="none")
    prompt_ids = store.add_prompts([f"\n\nHuman: benchmark question {i}?\n\nAssistant:" for i in range(items)])
    for start in range(0, items, 2000):
        chunk = prompt_ids[start:start + 2000]
        store.add_responses_bulk(mv.id, [(pid, [(f"answer {j} to question {pid}. " * 8, 40, "eos", {})
                                                for j in range(k)]) for pid in chunk])
    store.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(db: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "app.py"), "--db", str(db), "--port", str(port), "--no-generate"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the app did not start within 120 s")


def annotator(url: str, i: int, seconds: float, prefetch: bool, start: threading.Barrier,
              latencies: list, errors: list) -> None:
    from gradio_client import Client

    rng = random.Random(i)
    try:
        # ssl_verify=False: the app is plain HTTP on localhost, so there is nothing to verify, and
        # gradio_client would otherwise load the CA bundle again for every request (a new httpx
        # client each time): on 2 cores that costs more CPU than the server spends on the request.
        client = Client(url, auth=(f"ann{i}", f"bench-pass-{i}"), verbose=False, ssl_verify=False,
                        httpx_kwargs={"timeout": 60})
        html = client.predict(api_name="/refresh")[0]
        if prefetch:
            client.predict(api_name="/prefetch")
    except Exception as exc:
        errors.append(f"connect: {type(exc).__name__}: {exc}")
        start.abort()
        return
    try:
        start.wait()
    except threading.BrokenBarrierError:
        return
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        m = re.search(r'data-k="(\d+)"', html or "")
        if not m or m.group(1) == "0":
            errors.append("queue ran dry")
            return
        positions = list(range(1, int(m.group(1)) + 1))
        rng.shuffle(positions)
        ranking = ">".join(map(str, positions))
        t0 = time.perf_counter()
        try:
            html = client.predict(ranking, False, "", "", api_name="/submit")[0]
        except Exception as exc:  # counted, not fatal: the table shows them
            errors.append(f"{type(exc).__name__}: {exc}")
            html = client.predict(api_name="/refresh")[0]
            continue
        latencies.append(time.perf_counter() - t0)
        if prefetch:
            client.predict(api_name="/prefetch")


def in_process(store, i: int, seconds: float, prefetch: bool, start: threading.Barrier,
               latencies: list, errors: list) -> None:
    """The same loop as `annotator`, calling the handlers directly (what one request costs the app)."""
    from types import SimpleNamespace

    from annotate import handlers
    from annotate.context import AppContext

    rng = random.Random(i)
    ctx, request = AppContext(store=store), SimpleNamespace(username=f"ann{i}")
    state, html, *_ = handlers.load(ctx, None, request)
    if prefetch:
        state = handlers.prefetch(ctx, state, request)
    start.wait()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and state.current is not None:
        positions = list(range(1, state.current.k + 1))
        rng.shuffle(positions)
        t0 = time.perf_counter()
        state, html, *_ = handlers.submit(ctx, state, ">".join(map(str, positions)), False, "", "", request)
        latencies.append(time.perf_counter() - t0)
        if prefetch:
            state = handlers.prefetch(ctx, state, request)
    if state.current is None:
        errors.append("queue ran dry")


def run_phase(target, n: int, seconds: float, prefetch: bool) -> dict:
    """N threads running `annotator` against a URL, or `in_process` against an open Store."""
    latencies: list[float] = []
    errors: list[str] = []
    barrier = threading.Barrier(n + 1)
    loop = annotator if isinstance(target, str) else in_process
    threads = [threading.Thread(target=loop, args=(target, i, seconds, prefetch, barrier, latencies, errors),
                                daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        barrier.wait(timeout=300)  # every annotator logged in and has an item on screen
    except threading.BrokenBarrierError:
        raise RuntimeError(f"the annotators could not all connect: {errors[:3]}") from None
    t0 = time.perf_counter()
    for t in threads:
        t.join(seconds + 60)
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else [float("nan")] * 99
    return {"submissions": len(lat), "per_s": len(lat) / wall, "p50_ms": q[49] * 1000, "p95_ms": q[94] * 1000,
            "errors": len(errors), "first_error": errors[0] if errors else ""}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="10 s per phase instead of 60 s")
    p.add_argument("--annotators", type=int, default=20)
    p.add_argument("--seconds", type=float, default=None, help="seconds per phase (default 60, --quick 10)")
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args(argv)
    seconds = args.seconds or (10.0 if args.quick else 60.0)
    # Enough items that the queue never runs dry at a few hundred submissions per second.
    items = int(max(4000, 300 * seconds * 3))
    load_before = os.getloadavg()[0]

    results = {}
    with tempfile.TemporaryDirectory(prefix="ui-bench-") as tmp:
        db = Path(tmp) / "bench.duckdb"
        t0 = time.time()
        seed(db, args.annotators, items, args.k)
        print(f"seeded {items} items (K={args.k}) and {args.annotators} annotators in {time.time() - t0:.1f} s")
        # 1. the handlers alone, in this process (it owns the DuckDB file meanwhile)
        store = Store(db)
        try:
            results["handlers"] = run_phase(store, args.annotators, seconds, True)
        finally:
            store.close()
        print(f"  phase 'handlers' done: {results['handlers']['submissions']} submissions")
        # 2. and 3. the app as its own process, through the HTTP API
        port = free_port()
        proc = start_app(db, port)
        url = f"http://127.0.0.1:{port}/"
        try:
            for name, prefetch in (("http+prefetch", True), ("http, no pref.", False)):
                results[name] = run_phase(url, args.annotators, seconds, prefetch)
                print(f"  phase '{name}' done: {results[name]['submissions']} submissions")
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()

    load_after = os.getloadavg()[0]
    print(f"\n{args.annotators} simulated annotators, {seconds:.0f} s per phase, {os.cpu_count()} cpu cores, "
          f"load average {load_before:.1f} before / {load_after:.1f} after; target p95 <= {TARGET_P95_MS:.0f} ms")
    print(f"{'phase':<16}{'submissions':>12}{'per s':>9}{'p50 ms':>9}{'p95 ms':>9}{'errors':>8}")
    for name, r in results.items():
        print(f"{name:<16}{r['submissions']:>12}{r['per_s']:>9.1f}{r['p50_ms']:>9.1f}{r['p95_ms']:>9.1f}"
              f"{r['errors']:>8}")
    h, a, b = results["handlers"], results["http+prefetch"], results["http, no pref."]

    def ratio_row(label, x, y):
        print(f"{label:<16}{'':>12}{x['per_s'] / y['per_s']:>9.2f}{x['p50_ms'] / y['p50_ms']:>9.2f}"
              f"{x['p95_ms'] / y['p95_ms']:>9.2f}")

    ratio_row("http / handlers", a, h)
    ratio_row("no pref./pref.", b, a)
    for name, r in results.items():
        if r["first_error"]:
            print(f"first error ({name}): {r['first_error']}")
    ok = a["p95_ms"] <= TARGET_P95_MS
    print(f"\np95 submit-to-next-item through HTTP with prefetch: {a['p95_ms']:.1f} ms "
          f"({'meets' if ok else 'misses'} the {TARGET_P95_MS:.0f} ms target)")
    print(f"RESULT ui annotators={args.annotators} seconds={seconds:.0f} submissions_per_s={a['per_s']:.1f} "
          f"p50_ms={a['p50_ms']:.1f} p95_ms={a['p95_ms']:.1f} handlers_p95_ms={h['p95_ms']:.1f} "
          f"no_prefetch_p95_ms={b['p95_ms']:.1f} ratio_http_over_handlers={a['p95_ms'] / h['p95_ms']:.2f} "
          f"errors={a['errors'] + b['errors'] + h['errors']} load_avg={load_before:.1f} target_met={ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
