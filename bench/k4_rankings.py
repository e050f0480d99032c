"""Rankings of K = 4 responses as a round makes them, for the reward and DPO benches.

    python bench/k4_rankings.py --prompts 160 --out tests/data/k4_rankings.jsonl

A `generate` job at the product's defaults (SmolLM2-135M-Instruct, K = 4, GenerateConfig's
sampling) answers prompts of the bundled pool (store/data/prompts.jsonl, from row --skip on,
leaving out the gold experiments' development and locked prompts, bench/gold/prompt_sets.py), and
the simulated annotators' judge (pipeline/oracle.py `embedding`, noise 0.1, seed 0) ranks each
prompt's four: every ordered pair of a ranking is one row of the output, as an export writes pairs
(prompt, chosen, rejected, ranking_id). A prompt whose four responses are not distinct and
non-blank is left out, so every ranking gives C(4, 2) = 6 pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gold.prompt_sets import dev_indices, locked_hashes, prompt_hash  # noqa: E402
from pipeline.oracle import make_oracle, simulated_ranking  # noqa: E402

PROMPTS = ROOT / "store" / "data" / "prompts.jsonl"  # MIT, store/data/LICENSE.md
K = 4


def pool_prompts(n: int, skip: int) -> list[str]:
    """n prompts of the bundled pool from row `skip` on, none of the gold experiments' held-out ones."""
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    held, locked = dev_indices(len(rows)), locked_hashes()
    picked = [r["prompt"] for i, r in enumerate(rows) if i >= skip and i not in held
              and prompt_hash(r["prompt"]) not in locked]
    if len(picked) < n:
        raise SystemExit(f"only {len(picked)} prompts from row {skip} on")
    return picked[:n]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=160)
    parser.add_argument("--skip", type=int, default=1200, help="first row of the pool to use")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in pool_prompts(args.prompts, args.skip)),
                           encoding="utf-8")
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
        subprocess.run([sys.executable, "-m", "pipeline", "generate", "--prompts", str(prompts), "--out", tmp,
                        "--k", str(K)], cwd=ROOT, env=env, check=True)
        by_prompt: dict[str, list[str]] = {}
        for line in (Path(tmp) / "responses.jsonl").read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            by_prompt.setdefault(row["prompt"], []).append(row["text"])
    oracle, rng = make_oracle("embedding"), random.Random(0)
    rows, kept = [], 0
    for prompt, texts in by_prompt.items():
        if len(texts) != K or not all(t.strip() for t in texts) or len({t.strip() for t in texts}) != K:
            continue
        order = [g[0] for g in simulated_ranking(oracle.score([prompt] * K, texts), noise=0.1, rng=rng)]
        kept += 1
        rows += [{"prompt": prompt, "chosen": texts[a], "rejected": texts[b], "ranking_id": kept}
                 for a, b in combinations(order, 2)]
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{kept} rankings of {K} ({len(rows)} pairs) of {len(by_prompt)} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
