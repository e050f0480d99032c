"""Soak and kill: the app under simulated annotators, SIGKILLed at random moments and restarted.

The app runs as users start it (`python app.py --no-generate --db ...`, a subprocess) on a
temporary store seeded with items. N annotator threads rank through the HTTP API with
gradio_client, each submission carrying a unique comment; a submission counts as *acknowledged*
when the app answered it. An admin thread exports the pairs (JSONL) over and over. The main
thread SIGKILLs the app at random moments (uniform over `--gap` seconds) and starts it again;
the clients sign in again (a restart ends every session) and carry on.

At the end the store is opened and checked:
- lost:            acknowledged rankings that are not in the store (must be 0);
- orphan pairs:    pairs whose ranking is not in the store (must be 0);
- pairless:        rankings without all of their pairs (must be 0; each strict order of K
                   responses gives K(K-1)/2 pairs);
- failed restarts: starts of the app that did not serve within 120 s (must be 0);
- half exports:    export files under their final name that do not read back whole, or whose
                   recorded hash does not match (must be 0; exports are written under a
                   temporary name and renamed).

    python bench/soak.py            # 10 annotators, 30 kills
    python bench/soak.py --quick    # 10 annotators, 5 kills (about 2-3 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ui_bench import free_port, seed, start_app  # noqa: E402

from store import Store  # noqa: E402

ADMIN = ("soak-admin", "soak-admin-password")


class App:
    """The app process, killed and restarted by the main thread; clients read its URL."""

    def __init__(self, db: Path):
        self.db, self.proc, self.url = db, None, None
        self.generation = 0  # bumped at every start: clients sign in again when it moves
        self.failed_restarts = 0

    def start(self) -> None:
        for _ in range(3):
            port = free_port()
            try:
                self.proc = start_app(self.db, port, self.db.parent / f"timings-{self.generation + 1}.json")
            except RuntimeError as exc:
                self.failed_restarts += 1
                print(f"  restart failed: {exc}", flush=True)
                continue
            self.url = f"http://127.0.0.1:{port}/"
            self.generation += 1
            return
        raise RuntimeError("the app failed to start three times in a row")

    def kill(self) -> None:
        self.url = None
        self.proc.kill()  # SIGKILL: no clean shutdown, no checkpoint
        self.proc.wait(30)


def _client(app: App, name: str, password: str):
    from gradio_client import Client

    return Client(app.url, auth=(name, password), verbose=False, ssl_verify=False, httpx_kwargs={"timeout": 30})


def annotator(app: App, i: int, stop: threading.Event, acked: list, errors: list) -> None:
    rng = random.Random(i)
    client, generation, seq, k = None, None, 0, 0
    while not stop.is_set():
        try:
            if client is None or generation != app.generation:
                generation = app.generation
                if app.url is None:
                    time.sleep(0.2)
                    continue
                client = _client(app, f"ann{i}", f"bench-pass-{i}")
                k = _k(client.predict(api_name="/refresh")[0])
            if k == 0:
                errors.append("queue ran dry")
                return
            time.sleep(rng.uniform(0.05, 0.4))  # reading
            positions = list(range(1, k + 1))
            rng.shuffle(positions)
            seq += 1
            comment = f"soak ann{i} #{seq}"
            html = client.predict(">".join(map(str, positions)), False, comment, "", api_name="/submit")[0]
            acked.append(comment)  # the app answered: this ranking must survive any kill
            k = _k(html)
        except Exception:  # the app was killed under us (or is starting): sign in again
            client = None
            generation = None
            time.sleep(0.3)


def exporter(app: App, stop: threading.Event, done: list) -> None:
    client, generation = None, None
    while not stop.is_set():
        try:
            if client is None or generation != app.generation:
                generation = app.generation
                if app.url is None:
                    time.sleep(0.2)
                    continue
                client = _client(app, *ADMIN)
            # Data > Export's inputs in order (annotate/ui_admin.py): JSONL, no all-bad, imports in,
            # every annotator, no date, no agreement floor, no test split, conversational, no margin,
            # license unknown, no quality floor, no quality weights
            client.predict("jsonl", False, True, [], "", 0.0, 0.0, "conversational", False, "unknown", 0.0, False,
                           api_name="/export")
            done.append(1)
            time.sleep(0.5)
        except Exception:
            client, generation = None, None
            time.sleep(0.3)


def _k(html: str) -> int:
    import re

    m = re.search(r'data-k="(\d+)"', html or "")
    return int(m.group(1)) if m else 0


def check(db: Path, acked: list[str], k: int) -> dict:
    """Open the store the killed app left and count what must be zero."""
    with Store(db) as store:
        cur = store._cur()
        comments = {r[0] for r in cur.execute("SELECT comment FROM rankings").fetchall()}
        orphans = cur.execute("SELECT count(*) FROM pairs p WHERE p.ranking_id IS NOT NULL AND NOT EXISTS "
                              "(SELECT 1 FROM rankings r WHERE r.id = p.ranking_id)").fetchone()[0]
        pairless = cur.execute("SELECT count(*) FROM rankings r WHERE (SELECT count(*) FROM pairs p "
                               "WHERE p.ranking_id = r.id) <> ?", [k * (k - 1) // 2]).fetchone()[0]
        rankings = len(comments)
        snapshots = {Path(s.path).name: s.sha256 for s in store.list_snapshots()}
    export_dir = db.parent / "exports"
    half = 0
    files = sorted(p for p in export_dir.glob("pairs-*.jsonl")) if export_dir.exists() else []
    from formats.hashing import snapshot_sha256

    for f in files:
        try:
            rows = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
            whole = bool(rows) and all({"prompt", "chosen", "rejected"} <= set(r) for r in rows)
        except (ValueError, UnicodeDecodeError):
            whole = False
        recorded = snapshots.get(f.name)
        if not whole or (recorded is not None and recorded != snapshot_sha256(f)):
            half += 1
    return {"rankings": rankings, "lost": len(set(acked) - comments), "orphans": orphans,
            "pairless": pairless, "exports": len(files), "half_exports": half}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="5 kills instead of 30")
    p.add_argument("--kills", type=int, default=None)
    p.add_argument("--annotators", type=int, default=10)
    p.add_argument("--gap", type=float, nargs=2, default=(2.0, 8.0), metavar=("MIN_S", "MAX_S"),
                   help="seconds of running between a (re)start and the next kill (uniform)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    kills = args.kills if args.kills is not None else (5 if args.quick else 30)
    rng = random.Random(args.seed)
    t_start = time.time()

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        db = Path(tmp) / "soak.duckdb"
        seed(db, args.annotators, 3000 + 400 * kills, args.k)
        with Store(db) as s:
            s.add_annotator(*ADMIN, role="admin")
        print(f"seeded {args.annotators} annotators in {time.time() - t_start:.0f} s", flush=True)

        app = App(db)
        app.start()
        stop, acked, errors, exports = threading.Event(), [], [], []
        threads = [threading.Thread(target=annotator, args=(app, i, stop, acked, errors), daemon=True)
                   for i in range(args.annotators)]
        threads.append(threading.Thread(target=exporter, args=(app, stop, exports), daemon=True))
        for t in threads:
            t.start()
        try:
            for n in range(kills):
                # let the clients sign in again and submit for a while, then kill at a random moment
                time.sleep(rng.uniform(*args.gap))
                before = len(acked)
                app.kill()
                print(f"  kill {n + 1}/{kills}: {before} acknowledged so far", flush=True)
                app.start()
            time.sleep(rng.uniform(*args.gap))
        finally:
            stop.set()
            for t in threads:
                t.join(60)
            if app.proc is not None and app.proc.poll() is None:
                app.kill()  # the last one too: the check opens what a kill left
        result = check(db, acked, args.k)

    ok = all(result[key] == 0 for key in ("lost", "orphans", "pairless", "half_exports")) \
        and app.failed_restarts == 0 and not errors
    print(f"\n{args.annotators} annotators, {kills} SIGKILLs, {time.time() - t_start:.0f} s in all, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'acknowledged rankings':<34}{len(acked):>8}")
    print(f"{'rankings in the store':<34}{result['rankings']:>8}")
    for label, key in (("acknowledged rankings lost", "lost"), ("pairs without their ranking", "orphans"),
                       ("rankings without their pairs", "pairless"), ("export files", "exports"),
                       ("half-written export files", "half_exports")):
        print(f"{label:<34}{result[key]:>8}")
    print(f"{'failed restarts':<34}{app.failed_restarts:>8}")
    if errors:
        print(f"annotator errors: {errors[:3]}")
    print(f"RESULT soak kills={kills} acked={len(acked)} lost={result['lost']} orphans={result['orphans']} "
          f"pairless={result['pairless']} failed_restarts={app.failed_restarts} exports={result['exports']} "
          f"half_exports={result['half_exports']} ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
