"""Store benchmark: N rankings (K=4, each item ranked by `overlap` annotators) in, the pages an
admin opens on the full store, every pair out to Parquet, a datasets folder and JSONL, a backup.

    python bench/store_bench.py                       # 100,000 rankings (a few minutes on 2 cores)
    python bench/store_bench.py --quick               # 10,000 rankings
    python bench/store_bench.py --rankings 1000000    # a team's months (8 minutes on 2 cores)

Phases (each timed; resident memory sampled every 20 ms):
 1. setup: N / overlap prompts, one item of K responses each (Store.add_prompts / add_responses_bulk);
 2. bulk rankings: N rankings, `overlap` by distinct annotators per item, with some ties and "all
    bad" flags via Store.save_rankings_bulk;
 3. the single path the UI uses, on the full database: save_ranking + next_item one at a time;
    then 20 threads (simulated annotators) doing submit -> next item as fast as they can (the
    store's capacity: no one ranks 4 responses in no time); then the 20 reading 1-5 s before each
    submission (still faster than people), next item and submit timed apart;
 4. what an admin's pages compute on it: the agreement table brought up to date once after the
    bulk load (store/agreement_table.py; rankings that arrive one by one cost a refresh a few
    items each), then the Team tab's refresh (annotate/team.py team_tables: agreement, per
    annotator, per item) and the Data tab's Overview (annotate/admin.py statistics), each the
    median of 3 calls of the handler itself;
 5. export every pair to Parquet, a datasets folder and JSONL (store.io.export_dataset);
 6. a backup (store/backup.py) and the database file's size.
The comparison ratio is bulk vs one-at-a-time rankings/s. The last line is `RESULT store ...`.
"""

from __future__ import annotations

import argparse
import random
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store import RankingIn, Store  # noqa: E402
from store.io import ExportOptions, export_dataset  # noqa: E402


class RssSampler:
    """Peak resident memory (MiB) per phase, from /proc/self/statm (Linux); ru_maxrss elsewhere."""

    def __init__(self):
        self.peak = 0.0
        self._stop = threading.Event()
        self._page = resource.getpagesize()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> float:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page / 2**20
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    def phase_peak(self) -> float:
        """The peak since the last call, then start a new phase."""
        peak, self.peak = max(self.peak, self._rss()), self._rss()
        return peak

    def stop(self):
        self._stop.set()
        self._thread.join()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def make_rankings(items, annotator_ids, rng, overlap: int = 1) -> list[RankingIn]:
    """`overlap` rankings per item by distinct annotators: a random order, 1 in 5 with a tie of the
    middle two, 1 in 20 all bad."""
    out = []
    for i, (prompt_id, response_ids) in enumerate(items):
        for copy in range(overlap):
            ids = list(response_ids)
            rng.shuffle(ids)
            order = [[ids[0]], [ids[1], ids[2]], ids[3:]] if rng.random() < 0.2 else [[x] for x in ids]
            out.append(RankingIn(annotator_ids[(i * overlap + copy) % len(annotator_ids)], prompt_id, order,
                                 all_bad=rng.random() < 0.05, duration_s=rng.uniform(3, 30),
                                 client_token=f"bench-{i}-{copy}"))
    return out


def median_seconds(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_annotators(store, annotators, overlap: int, seconds: float, *, think, into, errors) -> float:
    """Each annotator in its own thread for `seconds`: next item, (think), submit, next item...
    think None: no pause, `into` gets each submit -> next item latency (ms); think (lo, hi): a
    seeded uniform pause before each submission, `into` {'next': [...], 'submit': [...]} gets each
    call's latency apart. Returns the wall time; the first error is raised."""
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def timed(fn, key):
        t = time.perf_counter()
        out = fn()
        with lock:
            into[key].append((time.perf_counter() - t) * 1000)
        return out

    def loop(aid: int):
        rng = random.Random(aid)
        try:
            item = store.next_item(aid, overlap=overlap)
            while item is not None and time.perf_counter() < stop_at:
                if think is None:
                    t = time.perf_counter()
                    store.save_ranking(RankingIn(aid, item.prompt.id, item.display_order,
                                                 display_order=item.display_order))
                    item = store.next_item(aid, overlap=overlap)
                    with lock:
                        into.append((time.perf_counter() - t) * 1000)
                    continue
                time.sleep(rng.uniform(*think))
                timed(lambda: store.save_ranking(RankingIn(aid, item.prompt.id, item.display_order,
                                                           display_order=item.display_order)), "submit")
                item = timed(lambda: store.next_item(aid, overlap=overlap), "next")
        except BaseException as exc:  # raised below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(aid,)) for aid in annotators]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10,000 rankings instead of 100,000")
    ap.add_argument("--rankings", type=int, default=None, help="number of rankings (overrides --quick)")
    ap.add_argument("--k", type=int, default=4, help="responses per item")
    ap.add_argument("--chunk", type=int, default=10_000, help="rankings per bulk transaction")
    ap.add_argument("--annotators", type=int, default=20, help="simulated annotators")
    ap.add_argument("--overlap", type=int, default=2, help="annotators per item (the queue's overlap)")
    ap.add_argument("--concurrent-seconds", type=float, default=None,
                    help="length of each phase of annotators at once (no think time; 1-5 s think time)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed after)")
    args = ap.parse_args(argv)
    n = args.rankings or (10_000 if args.quick else 100_000)
    seconds = args.concurrent_seconds or (5.0 if args.quick else 15.0)
    think_seconds = args.concurrent_seconds or (15.0 if args.quick else 40.0)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="store_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    mem = RssSampler()
    rows: list[tuple[str, str]] = []
    try:
        store = Store(work / "bench.duckdb")
        # 1. setup ------------------------------------------------------------------
        t0 = time.perf_counter()
        policy = store.register_model_version("policy", "bench-policy")
        extra = 2_000 if n >= 10_000 else 800  # items left for the one-at-a-time phases
        n_items = -(-n // args.overlap)
        prompt_ids = store.add_prompts([f"Prompt {i}: explain topic {i % 977} in two sentences."
                                        for i in range(n_items + extra)], source="bench")
        item_ids = []
        for start in tqdm(range(0, len(prompt_ids), 20_000), desc="responses", unit="chunk"):
            chunk = prompt_ids[start:start + 20_000]
            item_ids += store.add_responses_bulk(policy.id, [
                (pid, [(f"Response {j} to prompt {pid}: " + "lorem ipsum " * (5 + j), 40 + j, "eos",
                        {"temperature": 0.7}) for j in range(args.k)]) for pid in chunk])
        responses = store.response_ids_by_item(item_ids)
        annotators = [store.add_annotator(f"bench{i}", f"password-{i}").id for i in range(args.annotators)]
        setup_s = time.perf_counter() - t0
        setup_mb = mem.phase_peak()
        rows.append(("setup: prompts + items + responses", f"{len(item_ids):,} items, {len(item_ids) * args.k:,} "
                     f"responses in {setup_s:.1f} s (peak {setup_mb:.0f} MiB)"))

        # 2. bulk rankings ---------------------------------------------------------------
        bulk_items = [(prompt_ids[i], responses[item_ids[i]]) for i in range(n_items)]
        todo = make_rankings(bulk_items, annotators, rng, args.overlap)[:n]
        t0 = time.perf_counter()
        for start in tqdm(range(0, n, args.chunk), desc="rankings (bulk)", unit="chunk"):
            store.save_rankings_bulk(todo[start:start + args.chunk])
        bulk_s = time.perf_counter() - t0
        bulk_mb = mem.phase_peak()
        n_pairs = store.counts()["pairs"]
        bulk_rps = n / bulk_s
        rows.append(("bulk rankings/s", f"{bulk_rps:,.0f}  ({n:,} rankings, {n_pairs:,} pairs in {bulk_s:.1f} s, "
                     f"peak {bulk_mb:.0f} MiB)"))

        # 3. the single path on the full database ---------------------------------------------
        a = annotators[0]
        save_ms, next_ms, both_ms, cpu_ms = [], [], [], []
        got = store.next_item(a, overlap=args.overlap)
        for i in tqdm(range(200 if n <= 10_000 else 400), desc="save_ranking + next_item", unit="item"):
            t, c = time.perf_counter(), time.thread_time()
            store.save_ranking(RankingIn(a, got.prompt.id, [[x] for x in got.display_order],
                                         display_order=got.display_order,
                                         duration_s=5.0, client_token=f"single-{i}"))
            t1 = time.perf_counter()
            got = store.next_item(a, overlap=args.overlap)
            t2 = time.perf_counter()
            cpu_ms.append((time.thread_time() - c) * 1000)
            save_ms.append((t1 - t) * 1000)
            next_ms.append((t2 - t1) * 1000)
            both_ms.append((t2 - t) * 1000)
        single_rps = 1000 / statistics.mean(save_ms)
        rows.append(("save_ranking p50 / p95 (ms)", f"{pct(save_ms, .5):.1f} / {pct(save_ms, .95):.1f}"))
        rows.append(("next_item p50 / p95 (ms)", f"{pct(next_ms, .5):.1f} / {pct(next_ms, .95):.1f}"))
        rows.append(("submit -> next item, 1 annotator, p50 / p95 (ms)",
                     f"{pct(both_ms, .5):.1f} / {pct(both_ms, .95):.1f} (CPU of this thread: "
                     f"{pct(cpu_ms, .5):.1f} ms p50)"))

        # 20 annotators at once, as fast as they can (no time to read: the store's capacity) ...
        latencies, errors = [], []
        conc_s = run_annotators(store, annotators, args.overlap, seconds, think=None, into=latencies,
                                errors=errors)
        conc_rate = len(latencies) / conc_s
        rows.append((f"{len(annotators)} annotators, no think time: submissions/s, submit -> next p50 / p95 (ms)",
                     f"{conc_rate:.0f}/s, {pct(latencies, .5):.1f} / {pct(latencies, .95):.1f}"))
        # ... and reading for 1-5 s before each submission (faster than people rank 4 responses)
        waits: dict[str, list[float]] = {"next": [], "submit": []}
        run_annotators(store, annotators, args.overlap, think_seconds, think=(1.0, 5.0), into=waits, errors=errors)
        rows.append((f"{len(annotators)} annotators, 1-5 s think time: next item / submit p50 / p95 (ms)",
                     f"{pct(waits['next'], .5):.1f} / {pct(waits['next'], .95):.1f}, "
                     f"{pct(waits['submit'], .5):.1f} / {pct(waits['submit'], .95):.1f} "
                     f"({len(waits['submit'])} submissions)"))
        store.release_lease(a)
        mem.phase_peak()  # the single path's phase ends here

        # 4. an admin's pages on the full store -------------------------------------------------------
        from annotate import admin as data_tab
        from annotate import team
        from annotate.context import AppContext

        store.add_annotator("bench-admin", "bench-admin-password", role="admin")
        ctx = AppContext(store=store, auth=False, local_user="bench-admin", data_dir=work)
        t0 = time.perf_counter()
        caught_up = store.refresh_agreement()  # once after a bulk load: every item's agreement row
        catch_up_s = time.perf_counter() - t0
        rows.append(("agreement table after the bulk load (s, once)", f"{catch_up_s:.1f}  ({caught_up:,} items)"))
        team_s = median_seconds(lambda: team.team_tables(ctx, None))
        overview_s = median_seconds(lambda: data_tab.statistics(ctx, None))
        rows.append(("Team tab refresh / Data tab Overview (s, median of 3)", f"{team_s:.2f} / {overview_s:.2f}  "
                     f"(peak {mem.phase_peak():.0f} MiB)"))

        # 5. export ----------------------------------------------------------------------------
        exports = {}
        for fmt, name in (("parquet", "pairs.parquet"), ("datasets", "pairs_ds"), ("jsonl", "pairs.jsonl")):
            t0 = time.perf_counter()
            snap = export_dataset(store, work / name, ExportOptions(format=fmt, include_all_bad=True, test_fraction=0.05))
            secs = time.perf_counter() - t0
            exports[fmt] = (snap.counts["pairs"] / secs, mem.phase_peak(), secs, snap.counts["pairs"])
            rows.append((f"export {fmt}: pairs/s", f"{exports[fmt][0]:,.0f}  ({exports[fmt][3]:,} pairs in "
                         f"{secs:.1f} s, peak {exports[fmt][1]:.0f} MiB)"))
        # 6. a backup and the file's size ------------------------------------------------------------
        from store.backup import backup

        t0 = time.perf_counter()
        backup(store, work / "backup.duckdb")
        backup_s = time.perf_counter() - t0
        store.close()
        db_mb = sum(f.stat().st_size for f in work.glob("bench.duckdb*")) / 2**20
        rows.append(("backup (s), database file (MiB)", f"{backup_s:.1f}, {db_mb:.0f}  (peak {mem.phase_peak():.0f} MiB)"))
    finally:
        mem.stop()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    peak_mb = max(mem.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    ratio = bulk_rps / single_rps
    rows.append(("bulk vs one-at-a-time rankings/s (ratio)", f"{bulk_rps:,.0f} vs {single_rps:,.0f} = {ratio:.0f}x"))
    rows.append(("peak resident memory (MiB)", f"{peak_mb:.0f}"))
    width = max(len(k) for k, _ in rows)
    print(f"\nstore bench: {n:,} rankings, K={args.k}, {len(annotators)} annotators, overlap {args.overlap}")
    print("-" * (width + 40))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("-" * (width + 40))
    print(f"RESULT store rankings={n} rankings_per_s={bulk_rps:.0f} single_rankings_per_s={single_rps:.0f} "
          f"ratio={ratio:.1f} pairs={exports['parquet'][3]} parquet_pairs_per_s={exports['parquet'][0]:.0f} "
          f"datasets_pairs_per_s={exports['datasets'][0]:.0f} jsonl_pairs_per_s={exports['jsonl'][0]:.0f} "
          f"submit_next_p50_ms={pct(both_ms, .5):.1f} submit_next_p95_ms={pct(both_ms, .95):.1f} "
          f"concurrent_p95_ms={pct(latencies, .95):.1f} concurrent_per_s={conc_rate:.0f} "
          f"next_item_p95_ms={pct(next_ms, .95):.1f} think_next_p95_ms={pct(waits['next'], .95):.1f} "
          f"think_submit_p95_ms={pct(waits['submit'], .95):.1f} catch_up_s={catch_up_s:.1f} team_s={team_s:.2f} overview_s={overview_s:.2f} "
          f"backup_s={backup_s:.1f} db_mb={db_mb:.0f} overlap={args.overlap} peak_mb={peak_mb:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
