"""Soak and kill: the app under simulated annotators, SIGKILLed at random moments and restarted.

The app runs as users start it (`python app.py --no-generate --db ...`, a subprocess) on a
temporary store seeded with items. N annotator threads rank through the HTTP API with
gradio_client, each submission carrying a unique comment; a submission counts as *acknowledged*
when the app answered it. An admin thread exports the pairs (JSONL) over and over. The main
thread SIGKILLs the app at random moments (uniform over `--gap` seconds) and starts it again on
the same port; the clients carry on with the sessions they had (a restart signs no one out:
annotate/accounts.py), fetching their item again when the app lost their page's state.

At the end the store is opened and checked:
- lost:            acknowledged rankings that are not in the store (must be 0);
- orphan pairs:    pairs whose ranking is not in the store (must be 0);
- pairless:        rankings without all of their pairs (must be 0; each strict order of K
                   responses gives K(K-1)/2 pairs);
- failed restarts: starts of the app that did not serve within 120 s (must be 0);
- signed out:      requests refused as signed out (401) after a restart (must be 0);
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
        self.db, self.proc = db, None
        self.port = free_port()  # every start on the same address: clients keep their sessions
        self.url = f"http://127.0.0.1:{self.port}/"
        self.generation = 0  # bumped at every start
        self.failed_restarts = 0

    def start(self) -> None:
        for _ in range(3):
            try:
                self.proc = start_app(self.db, self.port, self.db.parent / f"timings-{self.generation + 1}.json")
            except RuntimeError as exc:
                self.failed_restarts += 1
                print(f"  restart failed: {exc}", flush=True)
                continue
            self.generation += 1
            return
        raise RuntimeError("the app failed to start three times in a row")

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no clean shutdown, no checkpoint
        self.proc.wait(30)


def _client(app: App, name: str, password: str):
    from gradio_client import Client

    return Client(app.url, auth=(name, password), verbose=False, ssl_verify=False, httpx_kwargs={"timeout": 30})


def _signed_out(exc: Exception) -> bool:
    return "401" in str(exc) or "Unauthorized" in str(exc)


def annotator(app: App, i: int, stop: threading.Event, acked: list, errors: list, signed_out: list) -> None:
    """Rank until stopped. One sign-in for the whole soak: a 401 after a restart is counted in
    `signed_out` (then it signs in again); any other failure (the app down or starting, or a
    restarted app without this client's state) fetches the item again."""
    rng = random.Random(i)
    client, seq, k = None, 0, 0
    while not stop.is_set():
        try:
            if client is None:
                client = _client(app, f"ann{i}", f"bench-pass-{i}")
            if k == 0:
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
        except Exception as exc:  # the app was killed under us (or is starting)
            if client is not None and _signed_out(exc):
                signed_out.append(f"ann{i}: {str(exc)[:300]}")
                client = None
            k = 0
            time.sleep(0.3)


def exporter(app: App, stop: threading.Event, done: list, signed_out: list) -> None:
    client = None
    while not stop.is_set():
        try:
            if client is None:
                client = _client(app, *ADMIN)
            # Data > Export's inputs in order (annotate/ui_admin.py): JSONL, no all-bad, imports in,
            # every annotator, no date, no agreement floor, no test split, conversational, no margin,
            # license unknown, no quality floor, no quality weights
            client.predict("jsonl", False, True, [], "", 0.0, 0.0, "conversational", False, "unknown", 0.0, False,
                           api_name="/export")
            done.append(1)
            time.sleep(0.5)
        except Exception as exc:
            if client is not None and _signed_out(exc):
                signed_out.append(f"admin: {str(exc)[:300]}")
                client = None
            time.sleep(0.3)


def _k(html: str) -> int:
    import re

    m = re.search(r'data-k="(\d+)"', html or "")
    return int(m.group(1)) if m else 0


def check(db: Path, acked: list[str], k: int) -> dict:
    """Open the store the killed app left (through the Store, as any reader) and count what must be zero."""
    from collections import Counter

    from formats.hashing import snapshot_sha256

    with Store(db) as store:
        rankings = store.list_rankings()
        pairs_of = Counter(pair.ranking_id for pair in store.list_pairs())
        snapshots = {Path(s.path).name: s.sha256 for s in store.list_snapshots()}
    ids = {r.id for r in rankings}
    comments = {r.comment for r in rankings}
    orphans = sum(n for ranking_id, n in pairs_of.items() if ranking_id is not None and ranking_id not in ids)
    pairless = sum(pairs_of[r.id] != k * (k - 1) // 2 for r in rankings)  # every soak ranking is a strict order
    # Data > Export writes a folder per export (its pairs.jsonl, rankings/, card and manifest)
    export_dir = db.parent / "exports"
    folders = sorted(p for p in export_dir.glob("export-*") if p.is_dir()) if export_dir.exists() else []
    half = 0
    for folder in folders:
        try:
            rows = [json.loads(line) for line in (folder / "pairs.jsonl").read_text(encoding="utf-8").splitlines()
                    if line.strip()]
            whole = bool(rows) and all({"prompt", "chosen", "rejected"} <= set(r) for r in rows)
        except (OSError, ValueError, UnicodeDecodeError):
            whole = False
        recorded = snapshots.get(folder.name)
        if not whole or (recorded is not None and recorded != snapshot_sha256(folder)):
            half += 1
    return {"rankings": len(rankings), "lost": len(set(acked) - comments), "orphans": orphans,
            "pairless": pairless, "exports": len(folders), "half_exports": half}


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
        stop, acked, errors, exports, signed_out = threading.Event(), [], [], [], []
        threads = [threading.Thread(target=annotator, args=(app, i, stop, acked, errors, signed_out), daemon=True)
                   for i in range(args.annotators)]
        threads.append(threading.Thread(target=exporter, args=(app, stop, exports, signed_out), daemon=True))
        for t in threads:
            t.start()
        try:
            for n in range(kills):
                # let the clients submit for a while, then kill at a random moment
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
        and app.failed_restarts == 0 and not errors and not signed_out
    print(f"\n{args.annotators} annotators, {kills} SIGKILLs, {time.time() - t_start:.0f} s in all, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'acknowledged rankings':<34}{len(acked):>8}")
    print(f"{'rankings in the store':<34}{result['rankings']:>8}")
    for label, key in (("acknowledged rankings lost", "lost"), ("pairs without their ranking", "orphans"),
                       ("rankings without their pairs", "pairless"), ("export files", "exports"),
                       ("half-written export files", "half_exports")):
        print(f"{label:<34}{result[key]:>8}")
    print(f"{'failed restarts':<34}{app.failed_restarts:>8}")
    print(f"{'signed out by a restart':<34}{len(signed_out):>8}")
    if errors:
        print(f"annotator errors: {errors[:3]}")
    if signed_out:
        print(f"signed out: {signed_out[:3]}")
    print(f"RESULT soak kills={kills} acked={len(acked)} lost={result['lost']} orphans={result['orphans']} "
          f"pairless={result['pairless']} failed_restarts={app.failed_restarts} signed_out={len(signed_out)} "
          f"exports={result['exports']} "
          f"half_exports={result['half_exports']} ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
