"""The pipeline CLI: `python -m pipeline <stage> --help`.

Each stage module owns its argument parser (`main(argv)`); this file only dispatches, so adding a
stage is one line in STAGES. The same command runs under a launcher, one process per device
(pipeline/distributed.py):

    python -m torch.distributed.run --nproc_per_node N -m pipeline <stage> ... --out RUN_DIR
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time

from pipeline.rundir import OWNER_ENV

# stage name -> module with a `main(argv: list[str]) -> int`, or "module:function" for another entry
STAGES = {
    "generate": "pipeline.generate",
    "chat-server": "pipeline.chat_server",
    "train-reward": "pipeline.train_reward",
    "train-dpo": "pipeline.train_dpo",
    "sft": "pipeline.train_sft",
    "ppo": "pipeline.train_ppo",
    "rloo": "pipeline.train_ppo:main_rloo",
    "compare": "pipeline.compare",
    "sample-versions": "pipeline.sample_versions",
    "export-model": "pipeline.export_model",
    "simulate-annotators": "pipeline.orchestrate.simulate",
    "evaluate": "pipeline.orchestrate.evaluate",
    "loop": "pipeline.orchestrate.loop",
}


def watch_owner(interval_s: float = 1.0) -> None:
    """A job started by a store's owner (pipeline/orchestrate/jobs.py sets $OWNER_ENV,
    RLHF_LOOP_OWNER_PID) stops when that owner dies: SIGTERM to itself, which a trainer answers by
    saving a checkpoint and exiting. So a killed app leaves no job running that nobody watches."""
    owner = os.environ.get(OWNER_ENV)
    if not owner or not owner.isdigit():
        return

    def watch():
        while True:
            time.sleep(interval_s)
            try:
                os.kill(int(owner), 0)
            except ProcessLookupError:
                print(f"the owner process {owner} is gone: stopping", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            except PermissionError:
                pass  # alive, another user's

    threading.Thread(target=watch, name="watch-owner", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        names = "\n  ".join(STAGES)
        print(f"usage: python -m pipeline <stage> [options]\n\nstages:\n  {names}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module, _, entry = STAGES[argv[0]].partition(":")
    return int(getattr(importlib.import_module(module), entry or "main")(argv[1:]) or 0)


def run() -> int:
    """The process entry: watch the owner, then run the stage. Under torchrun each rank runs this;
    torchrun's @record writes a failing rank's traceback where the launcher's error summary
    (in the job's log) shows it."""
    watch_owner()
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # started by torchrun (or accelerate launch)
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(main)()
    return main()


if __name__ == "__main__":
    sys.exit(run())
