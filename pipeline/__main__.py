"""The pipeline CLI: `python -m pipeline <stage> --help`.

Each stage module owns its argument parser (`main(argv)`); this file only dispatches, so adding a
stage is one line in STAGES.
"""

from __future__ import annotations

import importlib
import sys

# stage name -> module with a `main(argv: list[str]) -> int`
STAGES = {
    "generate": "pipeline.generate",
    "train-reward": "pipeline.train_reward",
    "ppo": "pipeline.train_ppo",
    "simulate-annotators": "pipeline.orchestrate.simulate",
    "loop": "pipeline.orchestrate.loop",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        names = "\n  ".join(STAGES)
        print(f"usage: python -m pipeline <stage> [options]\n\nstages:\n  {names}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(STAGES[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
