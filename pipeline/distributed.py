"""One job on N processes (one per device), through Hugging Face `accelerate`; one code path for 1 and N.

Launch any training stage under a launcher, with the same options as alone:

    python -m torch.distributed.run --nproc_per_node N -m pipeline <stage> ... --out RUN_DIR
    accelerate launch --config_file configs/accelerate/ddp.yaml -m pipeline <stage> ... --out RUN_DIR

The launcher sets RANK / WORLD_SIZE / LOCAL_RANK; `setup(device)` turns them into an `Accelerator`
(a gloo process group on CPU, NCCL on CUDA; none when the world is one process) and a `Dist` that
the stages use for everything that crosses ranks:

- device: cuda:LOCAL_RANK (pipeline.models.pick_device), or cpu;
- `wrap(model)`: the model prepared by accelerate (DistributedDataParallel for N > 1, the model itself
  for 1) inside `CallThrough`, so a training forward that is not `model(...)` (packed forwards, a
  shared-prompt pass through the backbone) still runs inside the wrapper's forward and its
  gradients are averaged across ranks. No-grad passes (sampling, the reference, the reward model)
  use the plain module;
- `sync(wrapped, last)`: gradient accumulation: only the last backward of an optimiser step
  all-reduces (DDP's no_sync), so ranks may run different numbers of micro-batches;
- `shard`, `gather_objects`, `reduce_sum`: data split by rank, and results or metric sums put back
  together, so every cross-rank decision is taken on the same reduced numbers on every rank;
- `stop_requested(flag)`: SIGTERM seen by any rank stops every rank at the same step;
- only rank 0 writes the run directory: `setup` turns pipeline.rundir's writers off on the other
  ranks, and the stages save checkpoints `if dist.is_main`.

Sizes stay global: --batch-size (and PPO's --mini-batch-size) count pairs or episodes across all
ranks, each rank taking its share, and each rank's loss is weighted so that DDP's average equals the
one-process gradient. N processes therefore run the same experiment as one, faster (tested in
tests/test_distributed.py); per-device memory knobs (--max-tokens, --micro-batch-size,
--forward-batch-size) stay per process.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from pipeline import rundir


def world_size() -> int:
    """Processes in this job, from the launcher's environment (1 when run alone)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


class CallThrough(nn.Module):
    """`wrapped(fn, *args)` runs `fn(model, *args)` inside the wrapper's forward.

    DistributedDataParallel all-reduces gradients only for a forward that went through it; the
    training forwards here call the backbone, the decoder or the LM head directly (packing,
    prefix sharing), so they are passed in as `fn` and run as the DDP module's forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


@dataclass
class Dist:
    """This process's place in the job; see the module docstring."""
    device: torch.device
    rank: int = 0
    world: int = 1
    accelerator: Any = None
    wrapped: list = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---------------------------------------------------------------- models and gradients

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model for training forwards: `wrapped(fn, *args)` = fn(model, *args), gradients
        averaged across ranks on the last backward of each step."""
        wrapped = CallThrough(model)
        if self.accelerator is not None and self.world > 1:
            kind = str(self.accelerator.distributed_type)
            if "FSDP" in kind or "DEEPSPEED" in kind:
                raise ValueError(f"{kind}: these stages train with DistributedDataParallel (LoRA keeps each "
                                 "device's copy small); use configs/accelerate/ddp.yaml and, for a larger "
                                 "model, --gradient-checkpointing true (docs/scaling.md)")
            wrapped = self.accelerator.prepare_model(wrapped, device_placement=False)
        self.wrapped.append(wrapped)
        return wrapped

    def sync(self, wrapped: nn.Module, last: bool):
        """Context for one forward + backward: all-reduce the gradients only when `last`."""
        if last or self.world == 1 or self.accelerator is None:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(wrapped)

    @property
    def loss_scale(self) -> float:
        """DDP averages gradients over ranks; a rank's loss summed over its share of a batch and
        divided by the whole batch's size is multiplied by this so the average is the batch's."""
        return float(self.world)

    # ---------------------------------------------------------------- data

    def shard(self, items: list) -> list:
        """This rank's share of a list: items rank, rank + N, ... (all of it for one process)."""
        return list(items)[self.rank::self.world]

    def gather_objects(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank (pickled; for small results)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def unshard(self, part: list, n: int) -> list:
        """Inverse of `shard`: every rank's part put back in the original order of n items."""
        parts = self.gather_objects(list(part))
        out = [None] * n
        for r, items in enumerate(parts):
            out[r::self.world] = items
        return out

    def reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each key summed over ranks (float64), the same dict on every rank."""
        if self.world == 1 or not values:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self._comm_device)
        torch.distributed.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def reduce_mean(self, values: dict[str, float]) -> dict[str, float]:
        """Each key averaged over ranks."""
        return {k: v / self.world for k, v in self.reduce_sum(values).items()}

    def stop_requested(self, signal_name: str | None) -> bool:
        """True on every rank when any rank has seen a stop signal (all ranks must call it at the
        same point of the loop: it is one all-reduce)."""
        if self.world == 1:
            return signal_name is not None
        return self.reduce_sum({"stop": 1.0 if signal_name else 0.0})["stop"] > 0

    def check_stop(self, stop: rundir.StopFlag) -> None:
        """rundir.StopFlag.check across ranks: raises Cancelled on every rank when any saw a signal."""
        if self.stop_requested(stop.signal):
            raise rundir.Cancelled(f"cancelled by {stop.signal or 'a signal to another rank'}")

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # ---------------------------------------------------------------- the end

    def close(self) -> None:
        """Leave the process group (after a last barrier): rank 0 may still be saving."""
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def describe_failure(self, exc: BaseException) -> str:
        """status.json's error: with N processes a failure on another rank reaches rank 0 as a broken
        collective, so say where to look."""
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, torch.OutOfMemoryError):
            text = (f"{type(exc).__name__}: out of memory on {self.device}. Lower the per-process sizes "
                    "(--max-tokens, --micro-batch-size, --forward-batch-size, --batch-size) or pass "
                    f"--gradient-checkpointing true (docs/scaling.md). {str(exc).splitlines()[0] if str(exc) else ''}")
        if self.world > 1:
            text += (f" (rank {self.rank} of {self.world} processes; when another rank failed first, "
                     "its traceback is in the job's log)")
        return text


def setup(device: str = "auto") -> Dist:
    """This process's `Dist`: the process group when a launcher started N > 1 processes (accelerate
    reads the launcher's environment and any `accelerate launch` config), the device, and the
    run-directory writers on rank 0 only."""
    from pipeline.models import pick_device

    dev = pick_device(device)
    world = world_size()
    accelerator = None
    if world > 1:
        if dev.type == "cuda" and dev.index != local_rank():
            raise ValueError(f"--device {device}: with {world} processes each uses its own GPU, cuda:$LOCAL_RANK; "
                             "pass --device auto or cuda (CUDA_VISIBLE_DEVICES picks the GPUs)")
        from accelerate import Accelerator

        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        # The stages place their models themselves (device from LOCAL_RANK) and run their own
        # autocast (--dtype).
        accelerator = Accelerator(cpu=dev.type == "cpu", device_placement=False)
        dist = Dist(device=dev, rank=accelerator.process_index, world=accelerator.num_processes,
                    accelerator=accelerator)
    else:
        dist = Dist(device=dev)
    rundir.set_writer(dist.is_main)
    return dist


__all__ = ["Dist", "CallThrough", "setup", "world_size", "rank", "local_rank"]
