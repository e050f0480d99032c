"""Simulated annotators: rank queued items through the store's API with an oracle
(pipeline/oracle.py).

    python -m pipeline simulate-annotators --db data/rlhf.duckdb --oracle embedding --noise 0.1

The annotator takes items exactly as a person in the app does (`next_item` with its lease,
`save_ranking` with a client token and the display order shown), so demos, load tests and
end-to-end tests of the loop exercise the real queue. Scores become rankings through
`oracle.simulated_ranking` (Bradley-Terry / Plackett-Luce noise).
"""

from __future__ import annotations

import argparse
import random
import time
import uuid

from pipeline.oracle import make_oracle, simulated_ranking


def simulate_annotations(store, oracle, name: str = "sim-gold", noise: float = 0.0, limit: int | None = None,
                         seed: int = 0, on_progress=None) -> int:
    """Rank up to `limit` items as annotator `name` (created if missing); returns how many."""
    from store import RankingIn

    annotator = store.ensure_annotator(name)
    rng = random.Random(seed)
    done = 0
    while limit is None or done < limit:
        item = store.next_item(annotator.id)
        if item is None:
            break
        started = time.perf_counter()
        texts = [r.text for r in item.responses]
        scores = oracle.score([item.prompt.text] * len(texts), texts)
        groups = simulated_ranking(scores, noise=noise, rng=rng)
        order = [[item.responses[i].id for i in group] for group in groups]
        store.save_ranking(RankingIn(annotator.id, item.prompt.id, order, display_order=item.display_order,
                                     duration_s=time.perf_counter() - started, client_token=uuid.uuid4().hex,
                                     comment=f"simulated by {oracle.name}"))
        done += 1
        if on_progress is not None:
            on_progress(done)
    return done


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from store import Store, default_db_path

    parser = argparse.ArgumentParser(prog="python -m pipeline simulate-annotators", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", default=str(default_db_path()), help="the DuckDB file (default: %(default)s)")
    parser.add_argument("--oracle", "--judge", dest="oracle", default="embedding",
                        help="rule:length, rule:contains:WORD, embedding, embedding:TARGET|OPPOSITE "
                             "(--judge: its earlier name)")
    parser.add_argument("--name", default="sim-gold", help="annotator name (created if missing)")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="Bradley-Terry temperature: 0 ranks by gold score exactly")
    parser.add_argument("--limit", type=int, default=None, help="rank at most this many items")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    oracle = make_oracle(args.oracle)
    store = Store(args.db)
    try:
        bar = tqdm(desc=f"ranking as {args.name}", unit="item",
                   total=args.limit or store.remaining_count(store.ensure_annotator(args.name).id))
        n = simulate_annotations(store, oracle, args.name, args.noise, args.limit, args.seed,
                                 on_progress=lambda done: bar.update(done - bar.n))
        bar.close()
        print(f"{args.name} ranked {n} items with {oracle.name}")
    finally:
        store.close()
    return 0
