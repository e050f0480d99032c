"""Load test of the annotation app: simulated annotators ranking through the HTTP API.

The app runs as its own process (`python app.py --no-generate`, as users start it) on a temporary
DuckDB file seeded with enough items. N annotator threads each hold a gradio_client session logged
in with their own account and loop like a person in the browser: read the item for a while (the
think time), then submit a random ranking (timed: from Submit until the next item's HTML is back;
the first 20% of each phase, at most 5 s, warms up and is not counted).
The app fetches each annotator's next item ahead in the background after every action.

Think time: a person needs 10-30 s per K=4 ranking (the Data tab shows the median); the default
1 s (uniform 0.5-1.5 s) makes 20 simulated annotators offer the load of a few hundred people. With
no think time every thread submits back to back, so latency is just N / throughput (Little's law);
that saturated phase is run last, to show the capacity.

Phases, N threads each:
- handlers:        the same loop calling annotate/handlers.py in this process (no HTTP): the app's
                   own cost;
- http:            the app as users run it, measured with the stock gradio_client: the headline;
- http, woken client: the same with gradio_client's 50 ms result poll woken on arrival (below);
- http, no prefetch: the app started with --no-prefetch: each Submit asks the queue itself;
- http, saturated: no think time;
- http, no-op (only when asked for): the same clients against a Gradio app with the same
                   queue and sign-in whose handlers do nothing (serve_noop): what Gradio and
                   gradio_client cost on this machine whatever the handlers do, the floor under the
                   headline.
The ratio rows show what HTTP + Gradio + gradio_client add, and what prefetching buys. The load
average of the machine is printed too: on a shared machine the figures move with it.

gradio_client polls for each result every 50 ms, a delay of the measuring client that a browser
does not have. The headline and every other HTTP phase use gradio_client as it ships; the
"woken client" phase wakes that poll when the result arrives (`wake_client_on_messages`) to show
how much of the latency is the client's poll rather than the app.

    python bench/ui_bench.py            # 20 annotators, 60 s per phase
    python bench/ui_bench.py --quick    # 20 annotators, 10 s per phase
    python bench/ui_bench.py --annotators 50 --seconds 300 --phases http   # load run
"""

from __future__ import annotations

import argparse
import json
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
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from store import Store  # noqa: E402

TARGET_P95_MS = 150.0


def seed(db: Path, annotators: int, items: int, k: int) -> None:
    """Accounts ann0..ann{N-1} (password 'bench-pass-<i>') and `items` items of K responses."""
    from concurrent.futures import ThreadPoolExecutor

    store = Store(db)
    # each account costs a scrypt hash (most of a second, GIL released): hash them side by side
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(lambda i: store.add_annotator(f"ann{i}", f"bench-pass-{i}"), range(annotators)))
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


def start_app(db: Path, port: int, timings: Path, prefetch: bool = True) -> subprocess.Popen:
    """`python app.py` on the seeded file, recording its server-side timings to `timings` (written
    when it stops); its output goes to app.log beside it."""
    cmd = [sys.executable, str(ROOT / "app.py"), "--db", str(db), "--port", str(port), "--no-generate",
           "--timings", str(timings)]
    return start_server(cmd + ([] if prefetch else ["--no-prefetch"]), port, db.parent / "app.log")


def start_noop_app(port: int, log: Path) -> subprocess.Popen:
    """The no-op app (serve_noop) as its own process."""
    return start_server([sys.executable, str(Path(__file__).resolve()), "--serve-noop", str(port)], port, log)


def start_server(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    """Run `cmd` (its output to `log`) and wait until it answers on `port`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the app did not start within 120 s")


def serve_noop(port: int) -> None:
    """Gradio's own cost, the floor under any handler: an app with the annotation app's queue
    (annotate/ui.py queue_events) and a sign-in page, whose /refresh and /submit take the same
    values and return an item's HTML at once, touching no store (the `http, no-op` phase)."""
    import gradio as gr

    from annotate.ui import queue_events

    html = '<div class="item" data-k="4">an item</div>'
    with gr.Blocks() as demo:
        shown, note = gr.HTML(html), gr.HTML("")
        ranking, all_bad, comment, strength = gr.Textbox(), gr.Checkbox(), gr.Textbox(), gr.Textbox()
        gr.Button("refresh").click(lambda: (html, ""), None, [shown, note], api_name="refresh")
        gr.Button("submit").click(lambda *values: (html, ""), [ranking, all_bad, comment, strength],
                                  [shown, note], api_name="submit")
    queue_events(demo)
    demo.launch(server_name="127.0.0.1", server_port=port, auth=lambda user, password: True,
                ssr_mode=False, quiet=True)


@dataclass(frozen=True)
class Phase:
    name: str
    http: bool
    prefetch: bool
    think_s: float
    woken: bool = False  # gradio_client's result poll woken on arrival (wake_client_on_messages)
    noop: bool = False  # against the no-op app (serve_noop), not the annotation app
    annotators: int | None = None  # None: --annotators


def wake_client_on_messages():
    """Make gradio_client hand a result over when it arrives, as a browser does.

    gradio_client reads the server's SSE stream on one thread and queues each message on a deque;
    the thread waiting for the result polls that deque every 50 ms (`stream_sse_v1plus` in
    gradio_client/utils.py), which adds 0-50 ms (25 ms on average) to every call it times, a delay
    the app never causes and a browser (which handles SSE events as they come) never sees. Here the
    deques notify on append and that one poll waits for the notification instead (still at most
    50 ms). Everything else (login, queue join, SSE stream) is gradio_client's own.
    Returns a function that puts the stock client back.
    """
    import types
    from collections import deque

    from gradio_client import client as gc_client
    from gradio_client import utils as gc_utils

    class NotifyingDeque(deque):
        def __init__(self, *args):
            super().__init__(*args)
            self.ready = threading.Condition()

        def append(self, x):
            with self.ready:
                super().append(x)
                self.ready.notify_all()

        def wait(self, timeout: float) -> None:
            with self.ready:
                if not self:
                    self.ready.wait(timeout)

    poll_code = gc_utils.stream_sse_v1plus.__code__

    def sleep(seconds: float) -> None:
        caller = sys._getframe(1)
        pending = caller.f_locals.get("pending_messages") if caller.f_code is poll_code else None
        if isinstance(pending, NotifyingDeque):
            pending.wait(seconds)
        else:
            time.sleep(seconds)

    stock = gc_client.deque, gc_utils.time
    gc_client.deque = NotifyingDeque  # the per-event message queues (gradio_client/client.py)
    gc_utils.time = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
    gc_utils.time.sleep = sleep

    def restore() -> None:
        gc_client.deque, gc_utils.time = stock

    return restore


class HttpSession:
    """One annotator's browser tab, through gradio_client."""

    def __init__(self, url: str, i: int):
        from gradio_client import Client

        # ssl_verify=False: the app is plain HTTP on localhost, so there is nothing to verify, and
        # gradio_client would otherwise load the CA bundle again for every request (it makes a new
        # httpx client each time): on 2 cores that cost more CPU than the server's whole request.
        self.client = Client(url, auth=(f"ann{i}", f"bench-pass-{i}"), verbose=False, ssl_verify=False,
                             httpx_kwargs={"timeout": 60})
        self.k = self._k(self.client.predict(api_name="/refresh")[0])

    @staticmethod
    def _k(html: str) -> int:
        m = re.search(r'data-k="(\d+)"', html or "")
        return int(m.group(1)) if m else 0

    def submit(self, ranking: str) -> None:
        self.k = self._k(self.client.predict(ranking, False, "", "", api_name="/submit")[0])


class LocalSession:
    """The same, calling the handlers directly (what a request costs the app itself)."""

    def __init__(self, ctx, i: int):
        from annotate import handlers

        self.h, self.ctx, self.request = handlers, ctx, SimpleNamespace(username=f"ann{i}")
        self.state = handlers.load(self.ctx, None, self.request)[0]

    @property
    def k(self) -> int:
        return self.state.current.k if self.state.current is not None else 0

    def submit(self, ranking: str) -> None:
        self.state = self.h.submit(self.ctx, self.h.Submission(ranking, False, "", ""), self.state, self.request)[0]


def annotator(target, i: int, phase: Phase, seconds: float, start: threading.Barrier,
              latencies: list, errors: list, done: list) -> None:
    rng = random.Random(i)
    try:
        session = HttpSession(target, i) if phase.http else LocalSession(target, i)
    except Exception as exc:
        errors.append(f"connect: {type(exc).__name__}: {exc}")
        start.abort()
        return
    try:
        start.wait()
    except threading.BrokenBarrierError:
        return
    begin = time.perf_counter()
    deadline = begin + seconds
    warm = begin + min(5.0, 0.2 * seconds)  # the first seconds after start-up are not counted
    while True:
        if phase.think_s:
            time.sleep(phase.think_s * rng.uniform(0.5, 1.5))  # reading the responses
        if time.perf_counter() >= deadline:
            return
        if session.k == 0:
            errors.append("queue ran dry")
            return
        positions = list(range(1, session.k + 1))
        rng.shuffle(positions)
        t0 = time.perf_counter()
        try:
            session.submit(">".join(map(str, positions)))
        except Exception as exc:  # counted, not fatal: the table shows them
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        done.append(t0)
        if t0 >= warm:
            latencies.append(time.perf_counter() - t0)


def run_phase(target, n: int, seconds: float, phase: Phase, server_pid: int | None = None) -> dict:
    """Run one phase; besides the latencies, the CPU each submission took over the whole phase
    (warm-up included) in the server process (server_pid) and in this one (the clients); without
    a server process (the handlers phase) this process's CPU is the server's, and the clients' is
    not told apart (NaN)."""
    latencies: list[float] = []
    errors: list[str] = []
    done: list[float] = []
    barrier = threading.Barrier(n + 1)
    threads = [threading.Thread(target=annotator, args=(target, i, phase, seconds, barrier, latencies, errors, done),
                                daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        barrier.wait(timeout=300)  # every annotator signed in, with an item on screen
    except threading.BrokenBarrierError:
        raise RuntimeError(f"the annotators could not all connect: {errors[:3]}") from None
    t0, counted_from = time.perf_counter(), time.time() + min(5.0, 0.2 * seconds)
    cpu0 = (cpu_seconds(server_pid), time.process_time())
    for t in threads:
        t.join(seconds + 120)
    server_cpu, client_cpu = cpu_seconds(server_pid) - cpu0[0], time.process_time() - cpu0[1]
    if server_pid is None:
        server_cpu, client_cpu = client_cpu, float("nan")
    wall = time.perf_counter() - t0 - min(5.0, 0.2 * seconds)  # the counted part of the phase
    print(f"  {phase.name}: {len(latencies)} submissions", flush=True)
    per = 1000 / len(done) if done else float("nan")
    return {"submissions": len(latencies), "per_s": len(latencies) / wall, **percentiles(latencies),
            "server_cpu_ms": server_cpu * per, "client_cpu_ms": client_cpu * per,
            "errors": len(errors), "first_error": errors[0] if errors else "", "counted_from": counted_from}


def cpu_seconds(pid: int | None) -> float:
    """CPU seconds (user + system, all threads) a process has used: Linux's /proc; NaN elsewhere."""
    if pid is None:
        return float("nan")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def percentiles(seconds: list[float]) -> dict:
    q = statistics.quantiles(sorted(seconds), n=100) if len(seconds) >= 2 else [float("nan")] * 99
    return {"n": len(seconds), "p50_ms": q[49] * 1000, "p95_ms": q[94] * 1000, "p99_ms": q[98] * 1000}


BREAKDOWN = (("join", "POST /queue/join in the server"), ("queued", "waiting in Gradio's queue"),
             ("handler", "our handler"), ("account", "  account look-up"), ("store", "  store write"),
             ("deliver", "result out through SSE"), ("server", "server total"),
             ("prefetch", "prefetch (background)"))


def breakdown(path: Path, counted_from: float) -> dict:
    """Per phase of the request path (annotate/timing.py), the samples of the counted part of the
    bench phase: phase -> percentiles."""
    samples = json.loads(path.read_text())["samples"] if path.exists() else []
    by_phase: dict[str, list[float]] = {}
    for phase, secs, end in samples:
        if end >= counted_from:
            by_phase.setdefault(phase, []).append(secs)
    return {phase: percentiles(v) for phase, v in by_phase.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="10 s per phase instead of 60 s")
    p.add_argument("--annotators", type=int, default=20)
    p.add_argument("--seconds", type=float, default=None, help="seconds per phase (default 60, --quick 10)")
    p.add_argument("--think", type=float, default=1.0, help="mean seconds between items (default 1.0)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--phases", default=None,
                   help="comma-separated phases to run, of handlers, http, http-woken, http-no-prefetch, "
                        "saturated, http-50, http-no-op (default: all but http-no-op; --quick: nor http-50; "
                        "e.g. --annotators 50 --seconds 300 --phases http for a long load run)")
    p.add_argument("--serve-noop", type=int, metavar="PORT", help=argparse.SUPPRESS)  # start_noop_app
    args = p.parse_args(argv)
    if args.serve_noop:
        serve_noop(args.serve_noop)
        return 0
    seconds = args.seconds or (10.0 if args.quick else 60.0)
    n = args.annotators
    every = {"handlers": Phase("handlers", False, True, args.think), "http": Phase("http", True, True, args.think),
             "http-woken": Phase("http, woken client", True, True, args.think, woken=True),
             "http-no-prefetch": Phase("http, no prefetch", True, False, args.think),
             "saturated": Phase("http, saturated", True, True, 0.0),
             "http-50": Phase("http, 50 annotators", True, True, args.think, annotators=50),
             "http-no-op": Phase("http, no-op", True, True, args.think, noop=True)}
    default = [x for x in every if x != "http-no-op" and not (args.quick and x == "http-50")]
    chosen = (args.phases or ",".join(default)).split(",")
    unknown = [x for x in chosen if x not in every]
    if unknown:
        p.error(f"unknown phases {unknown}: choose from {', '.join(every)}")
    phases = [every[x] for x in every if x in chosen]
    most = max(ph.annotators or n for ph in phases)
    # Enough items that the queue never runs dry (overlap 1: each item is ranked once).
    items = int(2000 + seconds * sum(3 * (ph.annotators or n) / max(ph.think_s, 0.5) + 100 for ph in phases))
    load_before = os.getloadavg()[0]

    results = {}
    with tempfile.TemporaryDirectory(prefix="ui-bench-") as tmp:
        db = Path(tmp) / "bench.duckdb"
        t0 = time.time()
        seed(db, most, items, args.k)
        print(f"seeded {items} items (K={args.k}) and {most} annotators in {time.time() - t0:.1f} s", flush=True)
        # 1. the handlers alone, in this process (which owns the DuckDB file meanwhile), with
        # background prefetching as in the app
        from concurrent.futures import ThreadPoolExecutor

        from annotate.context import AppContext

        if not phases[0].http:
            store = Store(db)
            try:
                with ThreadPoolExecutor(max_workers=4) as pool:
                    ctx = AppContext(store=store, background=pool)
                    results[phases[0].name] = run_phase(ctx, n, seconds, phases[0])
            finally:
                store.close()
        # 2. the app as its own process, through the HTTP API (a fresh start per setting)
        for i, phase in enumerate(ph for ph in phases if ph.http):
            port, timings = free_port(), Path(tmp) / f"timings-{i}.json"
            proc = (start_noop_app(port, Path(tmp) / f"noop-{i}.log") if phase.noop
                    else start_app(db, port, timings, prefetch=phase.prefetch))
            restore = wake_client_on_messages() if phase.woken else None
            try:
                results[phase.name] = run_phase(f"http://127.0.0.1:{port}/", phase.annotators or n, seconds, phase,
                                                server_pid=proc.pid)
            finally:
                if restore is not None:
                    restore()
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            results[phase.name]["server"] = breakdown(timings, results[phase.name]["counted_from"])

    load_after = os.getloadavg()[0]
    print(f"\n{os.cpu_count()} cpu cores, {seconds:.0f} s per phase, load average {load_before:.1f} before / "
          f"{load_after:.1f} after; gradio_client as it ships (its 50 ms result poll) except in 'woken client'; "
          f"target p95 <= {TARGET_P95_MS:.0f} ms at {n} annotators")
    print(f"{'phase':<22}{'annotators':>11}{'think s':>8}{'submissions':>12}{'per s':>8}{'p50 ms':>9}{'p95 ms':>9}"
          f"{'p99 ms':>9}{'errors':>7}{'server cpu ms':>14}{'client cpu ms':>14}")
    for phase in phases:
        r = results[phase.name]
        print(f"{phase.name:<22}{phase.annotators or n:>11}{phase.think_s:>8.1f}{r['submissions']:>12}"
              f"{r['per_s']:>8.1f}{r['p50_ms']:>9.1f}{r['p95_ms']:>9.1f}{r['p99_ms']:>9.1f}{r['errors']:>7}"
              f"{r['server_cpu_ms']:>14.1f}{r['client_cpu_ms']:>14.1f}")
    print("(cpu ms: CPU per submission over the whole phase, warm-up included, in the app's process and in this "
          "one's clients; the handlers phase's is this process's, handlers and clients together)")
    for name, r in results.items():
        if r["first_error"]:
            print(f"first error ({name}): {r['first_error']}")
    print_breakdown([ph for ph in phases if ph.http], results)
    full = all(x in chosen for x in ("handlers", "http", "http-woken", "http-no-prefetch", "saturated"))
    # a partial run: a result line per phase, no ratios between phases; a full run: its own line
    # (below), and one for each phase outside it
    for phase in [ph for ph in phases if not full or ph.noop]:
        r = results[phase.name]
        server = r.get("server", {})
        print(f"RESULT ui phase={phase.name.replace(' ', '').replace(',', '-')} annotators={phase.annotators or n} "
              f"seconds={seconds:.0f} think_s={phase.think_s} submissions={r['submissions']} "
              f"submissions_per_s={r['per_s']:.1f} p50_ms={r['p50_ms']:.1f} p95_ms={r['p95_ms']:.1f} "
              f"p99_ms={r['p99_ms']:.1f} server_p95_ms={server.get('server', {}).get('p95_ms', float('nan')):.1f} "
              f"errors={r['errors']} server_cpu_ms={r['server_cpu_ms']:.1f} client_cpu_ms={r['client_cpu_ms']:.1f} "
              f"load_avg={load_before:.1f} client={'woken' if phase.woken else 'stock'}")
    if not full:
        return 0 if all(r["errors"] == 0 for r in results.values()) else 1
    h, a, w, b, sat = (results[every[x].name] for x in ("handlers", "http", "http-woken", "http-no-prefetch",
                                                       "saturated"))
    for label, x, y in (("ratio http/handlers", a, h), ("ratio stock client/woken client", a, w),
                        ("ratio no prefetch/prefetch", b, a)):
        print(f"{label:<70}{x['p50_ms'] / y['p50_ms']:>9.2f}{x['p95_ms'] / y['p95_ms']:>9.2f}"
              f"{x['p99_ms'] / y['p99_ms']:>9.2f}")
    ok = a["p95_ms"] <= TARGET_P95_MS
    fifty = results.get(every["http-50"].name)
    print(f"\np95 from Submit to the next item through HTTP, stock gradio_client: {a['p95_ms']:.1f} ms "
          f"({'meets' if ok else 'misses'} the {TARGET_P95_MS:.0f} ms target); {w['p95_ms']:.1f} ms with its 50 ms "
          f"result poll woken on arrival; capacity without think time: {sat['per_s']:.1f} submissions/s"
          + (f"; 50 annotators: {fifty['p95_ms']:.1f} ms" if fifty else ""))
    srv = a["server"]
    print(f"RESULT ui annotators={n} seconds={seconds:.0f} think_s={args.think} submissions_per_s={a['per_s']:.1f} "
          f"p50_ms={a['p50_ms']:.1f} p95_ms={a['p95_ms']:.1f} p99_ms={a['p99_ms']:.1f} handlers_p95_ms={h['p95_ms']:.1f} "
          + " ".join(f"{k}_p95_ms={srv[k]['p95_ms']:.1f}" for k in ("queued", "handler", "deliver", "server") if k in srv)
          + f" woken_p95_ms={w['p95_ms']:.1f} no_prefetch_p95_ms={b['p95_ms']:.1f} saturated_per_s={sat['per_s']:.1f} "
          f"saturated_p95_ms={sat['p95_ms']:.1f} ratio_http_over_handlers_p95={a['p95_ms'] / h['p95_ms']:.2f} "
          + (f"p95_ms_50={fifty['p95_ms']:.1f} per_s_50={fifty['per_s']:.1f} " if fifty else "")
          + f"errors={sum(r['errors'] for r in results.values())} load_avg={load_before:.1f} client=stock "
          f"target_met={ok}")
    return 0


def print_breakdown(http_phases: list, results: dict) -> None:
    """Where the time of an HTTP round trip goes, per phase of the request path, p50 / p95 in ms;
    the client's row is what the annotator threads measured (its gap to `server total` is the
    client and the connection: gradio_client's poll, HTTP, JSON)."""
    if not http_phases:
        return
    print("\nserver-side breakdown, p50 / p95 ms (annotate/timing.py; the counted part of each phase)")
    print(f"{'':<32}" + "".join(f"{ph.name:>24}" for ph in http_phases))
    for key, label in BREAKDOWN:
        cells = []
        for ph in http_phases:
            x = results[ph.name]["server"].get(key)
            cells.append(f"{x['p50_ms']:.1f} / {x['p95_ms']:.1f}" if x else "-")
        print(f"{label:<32}" + "".join(f"{c:>24}" for c in cells))
    print(f"{'round trip at the client':<32}"
          + "".join(f"{results[ph.name]['p50_ms']:.1f} / {results[ph.name]['p95_ms']:.1f}".rjust(24)
                    for ph in http_phases))


if __name__ == "__main__":
    sys.exit(main())
