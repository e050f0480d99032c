"""The gold experiments' three prompt sets, all drawn from the bundled pool (store/data/prompts.jsonl):

- **development** (24 prompts, `split_prompts(..., 24, seed 0)`): every page before the locked set
  evaluated on these, and settings were chosen by looking at them. They stay for development.
- **locked test** (64 prompts, `LOCKED`, committed in bench/gold/locked_prompts.jsonl): chosen
  once, before any run evaluated on them, by a stable hash of each prompt's text (the 64 smallest
  SHA-256 values of `SALT + text`, development prompts skipped). No setting is chosen by looking at
  them; a claim is reported on them once, after the defaults it measures were fixed.
- **the pool**: every other prompt. Runs import only the pool (`split_prompts` leaves the locked
  prompts out of it), so no run ranks, trains on or evaluates with a locked prompt before its report.

    python bench/gold/prompt_sets.py     # rewrite locked_prompts.jsonl (the same file: the choice is a hash)
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "store" / "data" / "prompts.jsonl"
LOCKED = Path(__file__).with_name("locked_prompts.jsonl")
SALT = "rlhf-loop locked test set v1\n"
LOCKED_SIZE = 64
DEV_SIZE, DEV_SEED = 24, 0


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def prompt_hash(text: str) -> str:
    return hashlib.sha256((SALT + text).encode("utf-8")).hexdigest()


def dev_indices(n_rows: int, n_dev: int = DEV_SIZE, seed: int = DEV_SEED) -> set[int]:
    """The rows held out for development: a seeded sample of the whole file's row numbers."""
    return set(random.Random(seed).sample(range(n_rows), n_dev))


def choose_locked(rows: list[dict], n: int = LOCKED_SIZE) -> list[dict]:
    """The n rows with the smallest hash, development rows skipped, in hash order."""
    dev = {rows[i]["prompt"] for i in dev_indices(len(rows))}
    ranked = sorted((prompt_hash(r["prompt"]), r) for r in rows if r["prompt"] not in dev)
    return [{**r, "sha256": h} for h, r in ranked[:n]]


def locked_prompts() -> list[str]:
    """The locked test prompts, as committed."""
    return [r["prompt"] for r in read_rows(LOCKED)]


def locked_hashes() -> set[str]:
    return {r["sha256"] for r in read_rows(LOCKED)}


def split_prompts(path: Path, n_eval: int, seed: int, out_dir: Path) -> tuple[list[str], Path]:
    """(development prompts, pool file): a seeded sample of n_eval prompts of the file is held out
    for development; the pool file holds the rest but the locked test prompts (for
    store.io.import_prompts)."""
    rows = read_rows(path)
    if len(rows) <= n_eval:
        raise ValueError(f"{path}: {len(rows)} prompts, need more than the {n_eval} held out")
    held, locked = dev_indices(len(rows), n_eval, seed), locked_hashes()
    out_dir.mkdir(parents=True, exist_ok=True)
    pool = out_dir / "pool.jsonl"
    with open(pool, "w", encoding="utf-8") as fh:
        for i, row in enumerate(rows):
            if i not in held and prompt_hash(row["prompt"]) not in locked:
                fh.write(json.dumps(row) + "\n")
    heldout = [rows[i]["prompt"] for i in sorted(held)]
    (out_dir / "heldout.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in heldout))
    return heldout, pool


if __name__ == "__main__":
    chosen = choose_locked(read_rows(PROMPTS))
    LOCKED.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen), encoding="utf-8")
    print(f"{LOCKED}: {len(chosen)} prompts")
    sys.exit(0)
