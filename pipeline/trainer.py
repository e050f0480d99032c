"""One driver for the trainers that learn from a dataset: train-reward, train-dpo and sft.

Each algorithm is a `DatasetTrainer`: it says what is its own (how to read and encode its data and
load its model, one optimiser step, what it saves, what it does after the last step) and `train`
does the rest, the same for all three, as TRL's trainers share one training loop and an algorithm
is its compute_loss:

    check(cfg)                 the algorithm's options, before anything starts
    claim                      the run folder: a new run, or a --resume of the run's own settings
                               on the same data (pipeline/lifecycle.py)
    check_run(...)             what the options ask of these processes (FSDP or not)
    guarded                    status.json through the run ('failed' with the error)
    fp16 refused, seeded       (no trainer here scales its loss)
    load()                     data read and encoded, the model loaded (its checkpoint on --resume),
                               config.json's own fields
    start_training             the model wrapped for N processes, AdamW and its schedule
    run_steps(train_step)      the step loop; `save` at save_every
    cancelled                  a stop: saved, marked 'cancelled' (--resume continues)
    AfterTraining(finish)      the algorithm's evaluation and final saves, a stop losing no training
    write_report               eval_report.json, the run marked 'done'

A new algorithm is a subclass and a `train(MyTrainer, ...)` call; a change to how a trainer
claims, saves, stops or reports is one change here or in pipeline/lifecycle.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch

from formats.hashing import snapshot_sha256
from pipeline.config import ModelConfig, TrainerConfig
from pipeline.distributed import Dist, setup
from pipeline.lifecycle import (STATE_FILE, AfterTraining, StepLoop, Steps, Training, cancelled, claim, guarded,
                                recover, run_steps, save_state, start_training, write_report, write_run_config)
from pipeline.models import pick_dtype
from pipeline.policy import load_policy_weights, load_starting_policy
from pipeline.rundir import append_metrics
from pipeline.saving import save_whole_policy


@dataclass(frozen=True)
class Run:
    """One run's inputs once claim() has settled them (a resume's own settings and starting point)."""
    data: str
    out_dir: Path
    cfg: TrainerConfig
    """The algorithm's config (RewardConfig, DPOConfig, SFTConfig)."""
    model_cfg: ModelConfig
    start: str
    """Where the model starts: --init-from (reward) or --policy; '' = the base model."""
    resume: bool
    dist: Dist
    dtype: torch.dtype


@dataclass
class Loaded:
    """What an algorithm's `load` hands the driver."""
    model: torch.nn.Module
    """The model to train (before any wrapping: start_training wraps it)."""
    lengths: list[int]
    """Each training item's length in tokens (run_steps groups similar lengths)."""
    fields: dict
    """config.json's own fields (write_run_config adds the data's and the run's)."""
    data_report: dict
    truncations: tuple
    """The training and held-out items' EncodeReports."""
    sequences: int
    """Sequences (prompt + response) encoded, training and held out."""
    eval_data: str = ""
    """The held-out data's file, when separate (its hash goes into config.json)."""


@dataclass
class Finished:
    """What an algorithm's `finish` hands the driver."""
    logged: dict
    """metrics.jsonl's last line (the held-out figures); nothing is logged when empty."""
    report: dict
    """eval_report.json's own part (write_report adds the common one)."""


class DatasetTrainer:
    """An algorithm's side of `train`. A subclass sets the class attributes and implements `load`,
    `train_step`, `save` and `finish`; `self.run` holds the run's inputs."""

    name: ClassVar[str]
    """The stage as messages name it ('train-dpo')."""
    section: ClassVar[str]
    """config.json's key for the algorithm's config (a resume reads its settings back from it)."""
    config: ClassVar[type]
    start_key: ClassVar[str] = "policy"
    """config.json's key for the starting point (Run.start)."""
    results: ClassVar[tuple[str, ...]] = ("checkpoint", STATE_FILE, "policy", "eval_report.json")
    """What in the run folder means a run is there (claim: only --resume continues it)."""
    desc: ClassVar[str]
    """The progress bar's name."""
    shown: ClassVar[tuple[str, str]]
    """(metric key, label) the bar shows beside the loss."""

    def __init__(self, run: Run):
        self.run = run

    @staticmethod
    def check(cfg) -> None:
        """Refuse options that cannot train (ValueError), before anything starts."""

    @staticmethod
    def check_run(cfg, model_cfg: ModelConfig, dist: Dist, resume: bool) -> None:
        """Refuse what these processes cannot run (FSDP or not), with the settings a resume restored."""

    @classmethod
    def restored(cls, saved: dict) -> tuple[object, str]:
        """The config and starting point a resumed run keeps, from its config.json."""
        return cls.config(**saved[cls.section]), saved.get(cls.start_key, "")

    def load(self) -> Loaded:
        raise NotImplementedError

    def train_step(self, training: Training) -> Callable[[list[list[int]]], tuple[dict, int, int]]:
        """The optimiser step run_steps calls (StepLoop.train_step)."""
        raise NotImplementedError

    def save(self, training: Training, step: int) -> None:
        """The checkpoint at `step` and trainer_state.pt; every rank calls it (a sharded model is
        gathered), rank 0 writes."""
        raise NotImplementedError

    def finish(self, training: Training, done: Steps, after: AfterTraining) -> Finished:
        """After the last step, inside AfterTraining (the trained weights already saved): evaluate
        and save what the run leaves; `after.on_progress` or `after.check()` between phases."""
        raise NotImplementedError


class PolicyTrainer(DatasetTrainer):
    """A DatasetTrainer whose model is the policy (train-dpo, sft): it starts from --policy or the
    base model, is checkpoint/ while it trains, and at the end policy/, whose model_meta.json names
    its parent and how it was trained. A subclass's `load` calls `start_policy` (and, on --resume,
    `restore_policy` once what must see the start, such as DPO's reference, is made)."""

    def start_policy(self) -> None:
        """self.model, self.tokenizer and self.parent: the starting policy (pipeline/policy.py)."""
        run = self.run
        self.model, self.tokenizer, self.parent = load_starting_policy(run.start, run.model_cfg, run.dist.device,
                                                                       run.dtype)

    def restore_policy(self) -> None:
        """--resume: the run's own checkpoint into the policy (a kill in the middle of a checkpoint
        write leaves the last good one to put back first)."""
        recover(self.run.out_dir / "checkpoint", self.run.dist)
        load_policy_weights(self.model, self.run.out_dir / "checkpoint")

    def save(self, training: Training, step: int) -> None:
        save_whole_policy(self.model, self.tokenizer, self.run.out_dir / "checkpoint", self.run.dist)
        save_state(self.run.out_dir, training.state(step), self.run.dist)

    def save_policy(self, training: Training, done: Steps, **lineage) -> None:
        """The end: the checkpoint and policy/, its model_meta.json naming the parent, the data, the
        run and `lineage` (the method and its settings)."""
        run = self.run
        self.model.rlhf_meta = {**self.model.rlhf_meta, "parent": self.parent, **lineage, "data": str(run.data),
                                "data_sha256": snapshot_sha256(run.data), "run": str(run.out_dir.resolve()),
                                "steps": done.step}
        self.save(training, done.step)
        save_whole_policy(self.model, self.tokenizer, run.out_dir / "policy", run.dist)


def train(kind: type[DatasetTrainer], data: str, out: str | Path, cfg, model_cfg: ModelConfig, *, start: str = "",
          resume: bool = False, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train `kind` on `data` into run folder `out` (module docstring); returns the eval report
    (also in eval_report.json), or {"state": "cancelled", ...} when a signal stopped the run.
    on_step(step, metrics) runs after each optimiser step (tests use it to send signals). Under a
    launcher of N processes every rank calls this; each takes its share of every batch and rank 0
    writes the run folder."""
    out_dir = Path(out)
    kind.check(cfg)
    dist = setup(model_cfg.device)
    # only a resume hashes the data here: a new run reads it inside `guarded`, where a missing file
    # is a failed status naming it
    saved = claim(out_dir, resume=resume, results=kind.results, dist=dist,
                  unchanged={"data_sha256": snapshot_sha256(data)} if resume else {})
    if saved:  # the run's own settings win: same batches, same schedule; only where it runs may change
        cfg, start = kind.restored(saved)
        model_cfg = ModelConfig(**{**saved["model"], "device": model_cfg.device, "dtype": model_cfg.dtype})
    kind.check_run(cfg, model_cfg, dist, resume)
    with guarded(out_dir, dist) as progress:
        dtype = pick_dtype(model_cfg.dtype, dist.device)
        if dtype == torch.float16:
            raise ValueError(f"--dtype fp16: {kind.name} has no loss scaling; use bf16 (or fp32)")
        torch.manual_seed(cfg.seed)
        trainer = kind(Run(data=data, out_dir=out_dir, cfg=cfg, model_cfg=model_cfg, start=start, resume=resume,
                           dist=dist, dtype=dtype))
        report = _fit(trainer, progress, on_step)
        dist.close()
        return report


def _fit(trainer: DatasetTrainer, progress: dict, on_step) -> dict:
    """Load, train, finish and report, inside `guarded`."""
    run = trainer.run
    loaded = trainer.load()
    if not run.resume:
        write_run_config(run.out_dir, loaded.fields, data=run.data, eval_data=loaded.eval_data,
                         data_report=loaded.data_report, dist=run.dist)
    training = start_training(loaded.model, len(loaded.lengths), run.cfg, run.out_dir, run.resume, run.dist, run.dtype)
    total = training.schedule.total

    def save(step: int) -> None:
        trainer.save(training, step)

    loop = StepLoop(training, loaded.lengths, trainer.train_step(training), save, desc=trainer.desc,
                    shown=trainer.shown, on_step=on_step)
    done = run_steps(run.out_dir, run.cfg, loop, progress)
    if done.stopped:  # a signal: save what there is and leave (--resume continues)
        return cancelled(run.out_dir, done, total, save, run.dist)
    finished = None
    with AfterTraining(run.out_dir, done, total, save, run.dist) as after:
        finished = trainer.finish(training, done, after)
        run.dist.barrier()
    if after.result:
        return after.result
    if finished.logged:
        append_metrics(run.out_dir, done.step, finished.logged)
    return write_report(run.out_dir, finished.report, done, total, loaded.data_report, run.cfg.max_length,
                        loaded.truncations, loaded.sequences)


__all__ = ["DatasetTrainer", "PolicyTrainer", "Run", "Loaded", "Finished", "train"]
