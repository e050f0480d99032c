"""One training run's lifecycle, the same for train-reward, train-dpo and sft (and, where it applies, ppo).

The algorithm files keep what is theirs (data, models, the loss of one step, evaluation); this file
holds what every trainer does around them, written once so a fix reaches all of them:

    claim(out_dir, resume=..., results=..., dist=..., unchanged={key: value})
                               the run directory's rules: never write over another run's results
                               without --resume; a resume is refused where what it must not change
                               (config.json's `unchanged` keys: the data's hash; PPO's prompts,
                               reward model and settings) changed (returns its config.json)
    guarded(out_dir, dist)     status.json 'running' while the body runs; 'failed' with the error,
                               or 'cancelled' on a second Ctrl-C, if it raises (a Cancelled the body
                               raises passes through: the trainer has saved and marked the run)
    recover(folder, dist)      put back the last good checkpoint after a kill mid-write; one rank
                               renames while the others wait (two renaming one folder would race)
    load_state(out_dir) / save_state(out_dir, state)
                               trainer_state.pt: optimiser, scheduler, step (memory-mapped on load,
                               written whole or not at all; rank 0 writes)
    run_steps(...)             the step loop: epochs of length-grouped batches, the steps done
                               before --resume skipped, metrics, status, progress bar, on_step,
                               SIGTERM / Ctrl-C (every rank stops at the same step), save_every.
                               The algorithm gives one function: a step's micro-batches in, the
                               step's metrics out (TRL's compute_loss idea, without a class).
    cancelled(...)             save, wait for rank 0, mark the run 'cancelled' (--resume continues)
    AfterTraining(...)         the phases after a loop that ran to the end (held-out evaluation,
                               normalisation, the final save): the trained weights saved first, so
                               a stop in them loses no training (--resume runs only them again)
    start_training(...)        the model wrapped for N processes, AdamW and the linear decay over
                               the run's steps (adamw_schedule: how many), restored on --resume: a
                               Training, whose optimizer_step ends every trainer's step and whose
                               state() is what save_state writes
    write_run_config(...)      config.json: the trainer's own fields, then the data's and the run's
    write_report(...)          eval_report.json (the trainer's figures and the common part: time,
                               steps, data, truncation), then the run marked 'done'
    stage_main(body, summary)  every trainer's `main`: errors on stderr (exit code 2), a cancel 130

The dataset trainers (train-reward, train-dpo, sft) run these in one order, written once in
pipeline/trainer.py; each algorithm gives only what is its own.

PPO's loop is its own (a rollout, then epochs over it: pipeline/train_ppo.py); it shares `claim`
(its trainer state in checkpoint/, a finished run continued to a larger --steps), `recover`,
`guarded`, `stage_main` and STATE_FILE, the trainer state's file name.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from formats.hashing import snapshot_sha256
from pipeline.distributed import Dist, clip_grad_norm, load_optimizer_state
from pipeline.models import autocast
from pipeline.pairs_data import length_grouped_batches
from pipeline.rundir import (STATE_FILE, Cancelled, StopFlag, append_metrics, is_writer, read_status,
                             truncate_metrics, write_json, write_status)
from pipeline.saving import recover_folder


def claim(out_dir: Path, *, resume: bool, results: tuple[str, ...], dist, unchanged: dict[str, object],
          state: str = STATE_FILE, finished_continues: bool = False) -> dict | None:
    """Phase 0, before anything loads. A folder holding only logs or a failed start is reused (job
    runners create the run directory and its log before launching a trainer); one holding any of
    `results` needs --resume. Resuming needs `state` (the trainer state's file, relative to
    out_dir), an unfinished run (with `finished_continues`, PPO's, a finished one too: a larger
    --steps extends it) and, for each of config.json's `unchanged` keys, the value it has now (the
    data's SHA-256; PPO's prompts, reward model and settings): a change is refused naming it. A
    key the saved config lacks (a run from before it was recorded) is not compared. Returns the
    run's config.json. A new run starts with no metrics."""
    found = [name for name in results if (out_dir / name).exists()]
    if resume:
        if not (out_dir / state).is_file():
            raise FileNotFoundError(f"--resume: {out_dir} has no {state} to continue from")
        if read_status(out_dir).get("state") == "done" and not finished_continues:
            raise ValueError(f"--resume: the run in {out_dir} already finished")
        saved = json.loads((out_dir / "config.json").read_text())
        changed = [change for key, value in unchanged.items() if key in saved
                   for change in _changes(key, saved[key], value)]
        if changed:
            raise ValueError(f"--resume: the run in {out_dir} continues only as it started, but its "
                             f"{'; '.join(changed)} changed: resume with the run's own inputs and settings, "
                             "or start a new run in another folder")
        return saved
    if found:
        raise FileExistsError(f"--out {out_dir} already holds a run ({', '.join(found)}): pass --resume to "
                              "continue it, or choose a new folder")
    if dist.is_main:
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    return None


def _changes(key: str, was, now) -> list[str]:
    """How config.json's `key` differs from its value now, a dict's (a config's) entry by entry."""
    if isinstance(was, dict) and isinstance(now, dict):
        return [f"{key}.{name} (was {was.get(name)!r}, now {now.get(name)!r})"
                for name in sorted(was.keys() | now.keys()) if was.get(name) != now.get(name)]
    return [] if was == now else [f"{key} (was {was!r}, now {now!r})"]


@contextlib.contextmanager
def guarded(out_dir: Path, dist):
    """status.json through the run: 'running' (loading) now; if the body raises, 'cancelled' for a
    second Ctrl-C (stopped at once, nothing saved) or 'failed' with the error, at the last step the
    body reported in the yielded dict ({"step", "total"})."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_status(out_dir, "running", 0, 0, phase="loading")
    progress = {"step": 0, "total": 0}
    try:
        yield progress
    except Cancelled:
        raise  # the trainer saved and marked the run 'cancelled' itself (PPO's loop)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            write_status(out_dir, "cancelled", **progress, error="interrupted twice: stopped without saving")
        else:
            write_status(out_dir, "failed", **progress, error=dist.describe_failure(exc))
        raise


def recover(folder: Path, dist) -> None:
    """After a kill in the middle of a checkpoint write, the last good folder is put back (rank 0
    renames, every rank waits for it)."""
    if dist.is_main:
        recover_folder(folder)
    dist.barrier()


def load_state(out_dir: Path) -> dict:
    """trainer_state.pt, memory-mapped: the processes of one machine share its pages."""
    return torch.load(out_dir / STATE_FILE, map_location="cpu", mmap=True, weights_only=False)


def save_state(out_dir: Path, state: dict, dist) -> None:
    """trainer_state.pt written whole or not at all, by rank 0."""
    if not dist.is_main:
        return
    tmp = out_dir / f".{STATE_FILE}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, out_dir / STATE_FILE)


@dataclass
class Steps:
    """What the step loop did: the last step, the signal that stopped it (None: it ran to the
    end), pairs trained on, wall and CPU seconds."""
    step: int
    stopped: str | None
    pairs: int
    seconds: float
    cpu_seconds: float


@dataclass
class Schedule:
    """A pairs trainer's optimiser and learning-rate schedule, and the steps they span
    (adamw_schedule)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    steps_per_epoch: int
    total: int


@dataclass
class Training:
    """A pairs trainer's training side, made once its model is loaded (`start_training`): the
    processes, the model and its wrapper for training forwards (gradients averaged across ranks),
    autocast, the trainable parameters, optimiser and schedule, and the steps done before a --resume."""
    dist: Dist
    model: torch.nn.Module
    wrapped: torch.nn.Module
    amp: Callable[[], contextlib.AbstractContextManager]
    params: list
    schedule: Schedule
    start: int
    max_grad_norm: float

    def optimizer_step(self, sums: dict) -> tuple[dict, float, int]:
        """The end of a step, once its micro-batches have accumulated gradients and `sums` (with
        "pairs"): the sums over every rank, gradients clipped (sharded: one all-reduce), one
        optimiser and scheduler step. Returns (reduced sums, grad norm, pairs)."""
        sums = self.dist.reduce_sum(sums)
        grad_norm = clip_grad_norm(self.params, self.max_grad_norm)
        self.schedule.optimizer.step()
        self.schedule.scheduler.step()
        self.schedule.optimizer.zero_grad(set_to_none=True)
        return sums, grad_norm, int(sums["pairs"])

    def state(self, step: int, **extra) -> dict:
        """trainer_state.pt's contents at `step` (save_state; every rank calls it: a sharded
        optimiser state is gathered), with the trainer's `extra` entries."""
        return {"optimizer": self.dist.optimizer_state(self.model, self.schedule.optimizer),
                "scheduler": self.schedule.scheduler.state_dict(), "step": step, "total": self.schedule.total, **extra}


def start_training(model, n_items: int, cfg, out_dir: Path, resume: bool, dist, dtype) -> Training:
    """Wrap the model for N processes (before the optimiser: FSDP replaces the parameters by their
    shards), build AdamW and its schedule (adamw_schedule) over `n_items` training items, and on
    --resume restore them (resume_from). cfg gives the schedule's sizes and max_grad_norm."""
    wrapped = dist.wrap(model)
    params = [p for p in model.parameters() if p.requires_grad]
    schedule = adamw_schedule(params, n_items, cfg)
    start = resume_from(out_dir, schedule, lambda saved: load_optimizer_state(model, schedule.optimizer, saved)) \
        if resume else 0
    return Training(dist=dist, model=model, wrapped=wrapped, amp=functools.partial(autocast, dist.device, dtype),
                    params=params, schedule=schedule, start=start, max_grad_norm=cfg.max_grad_norm)


@dataclass
class StepLoop:
    """A pairs trainer's side of run_steps: its training side (processes, schedule, the steps done
    before --resume) and what it does."""
    training: Training
    lengths: list[int]
    """Each training item's length in tokens: batches group similar lengths."""
    train_step: Callable[[list[list[int]]], tuple[dict, int, int]]
    """A step's micro-batches (item indices) in; (its metrics, items, tokens) out, optimiser stepped."""
    save: Callable[[int], None]
    """Checkpoint at a step (every rank calls it)."""
    desc: str
    """The progress bar's name."""
    shown: tuple[str, str]
    """(metric key, label) the bar shows beside train/loss."""
    on_step: Callable[[int, dict], None] | None = None
    """Called after each step with (step, metrics)."""


def run_steps(out_dir: Path, cfg, loop: StepLoop, progress: dict) -> Steps:
    """The step loop of a pairs trainer. One optimiser step takes cfg.grad_accum batches of
    cfg.batch_size items (length-grouped, reshuffled per epoch by cfg.seed); loop.train_step(micro)
    runs them, steps optimiser and scheduler, and returns (its metrics, items, tokens), to which the
    loop adds train/lr, train/epoch, train/pairs_per_s and train/tokens. cfg also gives epochs and
    save_every. After each step: metrics.jsonl, status.json, the bar, `progress` (step and total),
    loop.on_step; a stop (any rank's signal) ends the loop at that step, every rank alike."""
    dist, schedule, start = loop.training.dist, loop.training.schedule, loop.training.start
    total, steps_per_epoch, scheduler, shown = schedule.total, schedule.steps_per_epoch, schedule.scheduler, loop.shown
    bar = tqdm(total=total, initial=start, desc=loop.desc, unit="step", dynamic_ncols=True, disable=not dist.is_main)
    write_status(out_dir, "running", start, total, phase="training")
    step, stopped, pairs = start, None, 0
    t_start, cpu_start = time.perf_counter(), time.process_time()
    with StopFlag() as stop:
        for epoch in range(step // steps_per_epoch, cfg.epochs):
            if step >= total or stopped:
                break
            batches = length_grouped_batches(loop.lengths, cfg.batch_size, seed=cfg.seed * 1000 + epoch)
            for k in range(step - epoch * steps_per_epoch, steps_per_epoch):  # skip steps done before --resume
                if step >= total:
                    break
                micro = batches[k * cfg.grad_accum:(k + 1) * cfg.grad_accum]
                t0 = time.perf_counter()
                metrics, n, tokens = loop.train_step(micro)
                metrics.update({"train/lr": scheduler.get_last_lr()[0], "train/epoch": epoch + (k + 1) / steps_per_epoch,
                                "train/pairs_per_s": n / (time.perf_counter() - t0), "train/tokens": int(tokens)})
                step += 1
                pairs += n
                append_metrics(out_dir, step, metrics)
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", **{shown[1]: f"{metrics[shown[0]]:.2f}"})
                write_status(out_dir, "running", step, total, phase="training")
                progress.update(step=step, total=total)
                if loop.on_step is not None:
                    loop.on_step(step, metrics)
                if dist.stop_requested(stop.signal):  # any rank's signal stops every rank here
                    stopped = stop.signal or "a signal to another rank"
                    break
                if cfg.save_every and step % cfg.save_every == 0 and step < total:
                    loop.save(step)
    bar.close()
    return Steps(step, stopped, pairs, time.perf_counter() - t_start, time.process_time() - cpu_start)


def cancelled(out_dir: Path, steps: Steps, total: int, save: Callable[[int], None], dist) -> dict:
    """A signal stopped the loop: save a usable checkpoint, let the other ranks leave only once rank 0
    has, mark the run cancelled; `--resume` continues it."""
    save(steps.step)
    dist.barrier()
    return _mark_cancelled(out_dir, steps.step, total, f"cancelled by {steps.stopped}; --resume continues")


def _mark_cancelled(out_dir: Path, step: int, total: int, error: str) -> dict:
    """status.json 'cancelled' with why; what a stopped trainer returns."""
    write_status(out_dir, "cancelled", step, total, error=error)
    return {"state": "cancelled", "step": step, "total": total}


class AfterTraining:
    """The phases after a step loop that ran to the end (held-out evaluation, normalisation, the
    final save) lose no training to a stop. Entering checkpoints the trained weights at the last
    step (unless this process trained nothing: a resumed run that had finished its steps), so
    `--resume` finds every step done and runs only these phases again. A SIGTERM or Ctrl-C while
    they run is seen at the start of a phase (`check()`, or making a phase's `on_progress`: every
    rank at the same point) and, in a one-process run, wherever a phase reports progress: the block
    stops there, the run is marked 'cancelled' and `result` is what the trainer returns.

        with AfterTraining(out_dir, steps, total, save, dist) as after:
            report = evaluate(..., on_progress=after.on_progress("evaluating", "held-out pairs"))
            after.check()
            ...
        if after.result:
            return after.result
    """

    def __init__(self, out_dir: Path, steps: Steps, total: int, save: Callable[[int], None], dist):
        self.out_dir, self.steps, self.total, self.save, self.dist = out_dir, steps, total, save, dist
        self.result: dict | None = None
        self._stop = StopFlag()

    def __enter__(self) -> "AfterTraining":
        self._stop.__enter__()  # from here a signal is held, not fatal: the save below is never cut short
        if self.steps.pairs:
            self.save(self.steps.step)
        self.dist.barrier()
        return self

    def check(self) -> None:
        """Between phases: a stop any rank saw ends the phases here (every rank calls it at the same point)."""
        self.dist.check_stop(self._stop)

    def phase(self, phase: str) -> None:
        """A phase starts: a stop any rank saw ends the phases here (`check()`), else the status file
        names the phase."""
        self.check()
        write_status(self.out_dir, "running", self.steps.step, self.total, phase=phase)

    def on_progress(self, phase: str, unit: str) -> Callable[[int, int], None]:
        """An on_progress(done, n) for one phase, made as the phase starts (`phase()`): the status
        file shows the phase and how far it got, and in a one-process run a stop ends the phases there."""
        self.phase(phase)

        def report(done: int, n: int) -> None:
            write_status(self.out_dir, "running", self.steps.step, self.total, phase=f"{phase}: {done}/{n} {unit}")
            if self.dist.world == 1:
                self._stop.check()
        return report

    def __exit__(self, kind, exc, tb) -> bool:
        self._stop.__exit__(kind, exc, tb)
        if kind is not Cancelled:
            return False
        self.result = _mark_cancelled(self.out_dir, self.steps.step, self.total,
                                      f"{exc} after the last step (the trained weights are saved); --resume evaluates")
        return True


def adamw_schedule(params: list, n_items: int, cfg) -> Schedule:
    """A pairs trainer's Schedule: AdamW without weight decay, the learning rate decaying linearly
    to 0 over the run (TRL's default); one step = cfg.grad_accum batches of cfg.batch_size,
    cfg.epochs epochs, at most cfg.max_steps (when > 0); the peak rate cfg.lr."""
    steps_per_epoch = math.ceil(math.ceil(n_items / cfg.batch_size) / cfg.grad_accum)
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps > 0:
        total = min(total, cfg.max_steps)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1.0 - s / total))
    return Schedule(optimizer, scheduler, steps_per_epoch, total)


def write_run_config(out_dir: Path, fields: dict, *, data, eval_data: str, data_report: dict, dist) -> None:
    """config.json of a new run: the trainer's own `fields` (its config, model, starting point),
    then what every pairs trainer records: the data and its hash, the held-out data's hash, argv,
    the data report and the number of processes (claim compares a resumed run's against it)."""
    write_json(out_dir / "config.json", {
        **fields, "data": str(data), "data_sha256": snapshot_sha256(data),
        "eval_data_sha256": snapshot_sha256(eval_data) if eval_data else "", "argv": sys.argv,
        "data_report": data_report, "processes": dist.world})


def write_report(out_dir: Path, report: dict, steps: Steps, total: int, data_report: dict, max_length: int,
                 truncations: tuple, sequences: int) -> dict:
    """eval_report.json of a finished pairs trainer: its own `report`, then the common part: time,
    steps, data, truncation (`truncations`: the train and held-out EncodeReports); the run is then
    marked done. Returns the whole report."""
    full = {**report, "train/seconds": steps.seconds, "train/cpu_seconds": steps.cpu_seconds,
            "train/pairs_per_s": steps.pairs / max(steps.seconds, 1e-9), "steps": steps.step, "data": data_report,
            "truncation": {
                "max_length": max_length,
                "prompt_truncated": sum(t.prompt_truncated for t in truncations),
                "response_truncated": sum(t.response_truncated for t in truncations),
                "sequences": sequences,
                "longest_tokens": max(t.max_tokens_seen for t in truncations),
                "example_rows": [row for t in truncations for row in t.examples][:10]}}
    write_json(out_dir / "eval_report.json", full)
    write_status(out_dir, "done", steps.step, total)
    return full


def stage_main(body: Callable[[], dict], summary: Callable[[dict], None]) -> int:
    """The one `main` of every trainer (train-reward, train-dpo, sft, ppo, rloo): `body()` trains and
    returns its report. Bad input (ValueError, FileNotFoundError, FileExistsError) is printed on
    stderr, exit code 2; a cancel (a report whose state is 'cancelled', or PPO's Cancelled once it has
    saved) exit code 130; otherwise rank 0 of N processes prints `summary(report)`, exit code 0."""
    try:
        report = body()
    except Cancelled as exc:
        if is_writer():
            print(f"{exc}: checkpoint saved; --resume continues")
        return 130
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not is_writer():
        return 130 if report.get("state") == "cancelled" else 0
    if report.get("state") == "cancelled":
        print(f"cancelled at step {report['step']}/{report['total']}: checkpoint saved; --resume continues")
        return 130
    summary(report)
    return 0


def resume_from(out_dir: Path, schedule: Schedule, load_optimizer: Callable[[dict], None]) -> int:
    """Restore optimiser (by the caller's loader: sharded or not) and scheduler from trainer_state.pt;
    the metrics logged after that save are dropped (those steps are trained again). Returns the step."""
    state = load_state(out_dir)
    load_optimizer(state["optimizer"])
    schedule.scheduler.load_state_dict(state["scheduler"])
    truncate_metrics(out_dir, state["step"])
    return state["step"]


__all__ = ["STATE_FILE", "claim", "guarded", "recover", "load_state", "save_state", "Steps", "Schedule", "Training",
           "start_training", "StepLoop", "run_steps", "cancelled", "AfterTraining", "resume_from", "adamw_schedule",
           "write_report", "write_run_config", "stage_main"]
