"""Experiment tracking: the lines of metrics.jsonl, also as TensorBoard event files.

A trainer's CLI opens a tracker for its run directory once (`pipeline.rundir.open_tracker`, with
the `--report-to` option added by `add_report_to`); from then on every `append_metrics` line is
also one TensorBoard event in RUN_DIR/tensorboard/, with the same namespaced keys (`train/loss`,
`objective/kl` ...) as scalar tags at the same step. So

    tensorboard --logdir runs/          # one TensorBoard run per run directory

shows every job. Only rank 0 of a multi-process job writes (rundir's writer flag), and
metrics.jsonl stays the record the app reads.

Resume. TensorBoard never rewrites an event file: each process that writes appends a new file,
and the readers read a folder's files in name (= creation time) order. The first event of each
file is a `SessionLog.START` at the step the process begins from (the first step it logs, or the
checkpoint's step + 1 when `truncate_metrics` drops the lines after a checkpoint); TensorBoard's
loaders then discard every event of the earlier files at that step or later ("purge orphaned
data", tensorboard/backend/event_processing/event_accumulator.py). A resumed run therefore shows
each step once, with the values of the run that trained it last, exactly as metrics.jsonl does
(tests/test_tracking.py reads both back). Values metrics.jsonl writes as null (NaN, inf) and
non-numbers are not written.

tensorboard is imported when the first event is written, in the job process only: importing
this module (the app does, through rundir) loads nothing of it.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

REPORT_TO = ("tensorboard", "none")
EVENTS_DIR = "tensorboard"
"""The event files' folder inside a run directory."""


def add_report_to(parser: argparse.ArgumentParser) -> None:
    """The `--report-to` option every trainer's CLI takes (then: rundir.open_tracker(out, args.report_to))."""
    parser.add_argument("--report-to", choices=REPORT_TO, default="tensorboard",
                        help="also write the metrics as TensorBoard event files in RUN_DIR/tensorboard/ "
                             "(default), or 'none'")


class TensorBoardWriter:
    """Scalars into one event file of `logdir`, created on first use; flushed after every step,
    so a TensorBoard open on the run follows it live."""

    def __init__(self, logdir: Path):
        self.logdir = Path(logdir)
        self._writer = None

    def begin(self, step: int) -> None:
        """Open the event file (once per process), starting with SessionLog.START at `step`:
        what earlier files hold at `step` or later is discarded by TensorBoard's readers."""
        if self._writer is not None:
            return
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(str(self.logdir))
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                               session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
        self._writer.flush()

    def scalars(self, step: int, metrics: dict) -> None:
        """One event holding every finite number of `metrics` as a scalar tag."""
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self.begin(step)
        values = [summary_pb2.Summary.Value(tag=key, simple_value=float(value)) for key, value in metrics.items()
                  if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)]
        if values:
            self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                                   summary=summary_pb2.Summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
