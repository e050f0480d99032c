"""Start a blind evaluation from the command line, as the Models tab does, and wait for its answers.

    python -m pipeline evaluate --versions policy-v0,policy-v1 --prompts 32 [--name NAME] [--db PATH]

Each version answers the same held-out prompts once, with the same seed (a sample-versions job,
pipeline/sample_versions.py); one item per prompt then joins the annotation queue with no model
names shown (store/evaluations.py). People rank them in the app (or simulated annotators do:
`python -m pipeline simulate-annotators`); `python -m store evaluations` prints the win rates and
the leaderboard. Exit 0 once the items are queued; 1 if the evaluation is refused or its job fails.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.config import GenerateConfig, ModelConfig, add_arguments, from_args
from pipeline.orchestrate.loop import make_runner
from pipeline.orchestrate.steps import LoopSettings, submit_evaluation


def main(argv: list[str] | None = None) -> int:
    from store import Store, default_db_path
    from store.errors import StoreError

    parser = argparse.ArgumentParser(prog="python -m pipeline evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", default=str(default_db_path()), help="the DuckDB file (default: %(default)s)")
    parser.add_argument("--versions", required=True, help="comma-separated names of two or more policy versions")
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts each version answers")
    parser.add_argument("--name", default="", help="the evaluation's name (default: 'A vs B')")
    parser.add_argument("--seed", type=int, default=1234, help="the sampling seed, the same for every version")
    add_arguments(parser, GenerateConfig, "gen_")  # --gen-max-new-tokens, --gen-temperature
    add_arguments(parser, ModelConfig)
    args = parser.parse_args(argv)
    settings = LoopSettings(model=from_args(ModelConfig, args), generate=from_args(GenerateConfig, args, "gen_"))
    store = Store(args.db)
    runner = make_runner(store, Path(args.db).resolve().parent / "runs")
    try:
        names = [n.strip() for n in args.versions.split(",") if n.strip()]
        versions = [store.find_model_version(n) for n in names]
        unknown = [n for n, v in zip(names, versions) if v is None]
        if unknown:
            print(f"error: no model version named {', '.join(unknown)}")
            return 1
        try:
            run, ev = submit_evaluation(store, runner, args.name or " vs ".join(names), versions, args.prompts, settings,
                                        seed=args.seed)
        except (ValueError, StoreError) as exc:
            print(f"error: {exc}")
            return 1
        print(f"evaluation {ev.name!r}: {len(ev.prompt_ids)} held-out prompts, job #{run.id} sampling "
              f"{', '.join(names)}")
        run = runner.wait(run.id)
        if run.status != "done":
            print(f"error: job #{run.id} {run.status}: {run.error}")
            return 1
        ev = store.get_evaluation(ev.id)
        print(f"{ev.items} items queued for ranking; results: python -m store evaluations {ev.name!r}")
        return 0
    finally:
        runner.shutdown()
        store.close()
