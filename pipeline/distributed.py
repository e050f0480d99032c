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
  ranks, and the stages save checkpoints `if dist.is_main`;
- `sharded`: launched with configs/accelerate/fsdp.yaml (accelerate exports FSDP_* settings), a
  fully trained model is sharded with PyTorch's FSDP2 instead of wrapped in DDP (`shard_model`);
  every rank then runs the same forward passes and checkpoints gather whole weights
  (`full_state_dict`, `full_optimizer_state`): train-reward, ppo and train-dpo with full fine-tuning
  (docs/scaling.md).

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
class FSDPSettings:
    """What an `accelerate launch --config_file configs/accelerate/fsdp.yaml` asks for, as accelerate
    exports it to each process (accelerate/utils/launch.py: ACCELERATE_USE_FSDP and FSDP_*)."""
    reshard_after_forward: bool = True  # FULL_SHARD; False = SHARD_GRAD_OP
    wrap_classes: tuple = ()  # decoder layer class names; () = the model's own _no_split_modules


def fsdp_settings(env=None) -> FSDPSettings | None:
    """FSDPSettings when the launcher asked for FSDP, else None; settings these stages do not
    implement are refused here, before any model is loaded."""
    env = os.environ if env is None else env
    if str(env.get("ACCELERATE_USE_FSDP", "false")).lower() != "true":
        return None
    version = str(env.get("FSDP_VERSION", "1"))
    if version != "2":
        raise ValueError(f"FSDP_VERSION {version}: these stages shard with FSDP2 (torch's fully_shard, what "
                         "accelerate runs for fsdp_version: 2); set fsdp_version: 2 (configs/accelerate/fsdp.yaml)")
    strategy = str(env.get("FSDP_RESHARD_AFTER_FORWARD", env.get("FSDP_SHARDING_STRATEGY", "true"))).lower()
    reshard = {"true": True, "full_shard": True, "1": True, "false": False, "shard_grad_op": False, "2": False}
    if strategy not in reshard:
        raise ValueError(f"FSDP sharding {strategy!r}: use FULL_SHARD (fsdp_reshard_after_forward: true) or "
                         "SHARD_GRAD_OP (false)")
    policy = str(env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")).upper()
    if policy not in ("TRANSFORMER_BASED_WRAP", "NO_WRAP", ""):
        raise ValueError(f"FSDP auto-wrap policy {policy}: use TRANSFORMER_BASED_WRAP (one shard unit per decoder layer)")
    state_dict = str(env.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")).upper()
    if state_dict != "FULL_STATE_DICT":
        raise ValueError(f"FSDP state dict {state_dict}: checkpoints here hold whole weights gathered on rank 0; "
                         "use FULL_STATE_DICT")
    if str(env.get("FSDP_OFFLOAD_PARAMS", "false")).lower() == "true":
        raise ValueError("fsdp_offload_params: CPU offload is not supported by these stages")
    classes = tuple(c.strip() for c in str(env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")).split(",") if c.strip())
    return FSDPSettings(reshard_after_forward=reshard[strategy], wrap_classes=classes)


def shard_model(model: nn.Module, settings: FSDPSettings, trained: bool = True) -> list[nn.Module]:
    """Shard a model in place with FSDP2 (torch.distributed.fsdp.fully_shard): one unit per decoder
    layer (settings.wrap_classes, else the backbone's `_no_split_modules`, as accelerate's
    TRANSFORMER_BASED_WRAP picks them), then every other module that holds parameters of its own
    (embeddings, final norm, LM or scalar head) as a unit of its own. Each unit gathers its weights in
    its own forward, so the stages' direct calls of the backbone, the decoder or the head (packed
    forwards, evaluation) work without going through one root. Modules that share a parameter (an
    LM head tied to the input embeddings) form one unit, which gathers the shared weight once.

    trained: the model is fully fine-tuned (LoRA is refused: use DDP); False for a frozen model
    (PPO's and DPO's reference), sharded only to hold 1/N of its weights per process. Returns the units."""
    from torch.distributed.fsdp import fully_shard

    from pipeline.models import is_peft

    backbone = getattr(model, "backbone", model)
    if trained and (is_peft(backbone) or any(not p.requires_grad for p in model.parameters())):
        raise ValueError("FSDP shards full fine-tuning here (--lora false): with LoRA the trained and "
                         "communicated part is small; use configs/accelerate/ddp.yaml")
    names = set(settings.wrap_classes or getattr(backbone, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"FSDP: no module of class {sorted(names)} in {type(backbone).__name__}; set "
                         "fsdp_transformer_layer_cls_to_wrap to its decoder layer class")
    inside = {id(p) for layer in layers for p in layer.parameters()}
    groups: dict[int, list[nn.Module]] = {}  # first parameter's id -> the modules holding it
    for m in model.modules():
        own = [id(p) for p in m.parameters(recurse=False) if id(p) not in inside]
        if own:
            key = next((k for k in own if k in groups), own[0])
            groups.setdefault(key, []).append(m)
            for k in own:
                groups.setdefault(k, groups[key])
    rest = list({id(g): g for g in groups.values()}.values())
    for layer in layers:
        fully_shard(layer, reshard_after_forward=settings.reshard_after_forward)
    for group in rest:
        fully_shard(group if len(group) > 1 else group[0], reshard_after_forward=settings.reshard_after_forward)
    if any(len(group) > 1 for group in rest):
        # a unit of several modules cannot be FSDP's root (the first unit to run forward becomes one):
        # the whole model becomes the root, set up now, so every unit also runs when called directly
        fully_shard(model, reshard_after_forward=settings.reshard_after_forward)
        model._get_fsdp_state()._lazy_init()
    return layers + [m for group in rest for m in group]


def full_state_dict(model: nn.Module) -> dict:
    """The whole (unsharded) state dict of a sharded model, on CPU, on rank 0 ({} elsewhere); every
    rank must call it (it gathers)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model: nn.Module, optimizer) -> dict:
    """The optimiser's state for whole parameters (keyed by parameter name), on rank 0; collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(model: nn.Module, optimizer, state: dict) -> None:
    """Inverse of full_optimizer_state on every rank (each keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def load_optimizer_state(model: nn.Module, optimizer, state: dict) -> None:
    """An optimiser state saved by either kind of run, into this run's optimiser: the whole state
    keyed by parameter name (a sharded run's `full_optimizer_state`) or by position (`optimizer.
    state_dict()` of a one-process or DDP run). A name-keyed state loads into a sharded optimiser
    (each rank takes its shard) and into a plain one alike, so a run sharded on N processes resumes
    on one; a position-keyed one is renamed for a sharded optimiser (the positions are those of the
    trained parameters in `model.named_parameters()` order, as the stages build their optimisers)."""
    by_name = any(isinstance(k, str) for k in state.get("state", {})) or any(
        isinstance(i, str) for group in state.get("param_groups", []) for i in group["params"])
    sharded = any(hasattr(p, "full_tensor") for p in model.parameters())
    if not by_name and not sharded:
        optimizer.load_state_dict(state)
        return
    if not by_name:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        state = {"state": {names[i]: v for i, v in state["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    load_full_optimizer_state(model, optimizer, state)


def clip_grad_norm(params: list, max_norm: float) -> float:
    """torch's clip_grad_norm_ as a float: over sharded parameters the norm is a DTensor whose whole
    value needs one all-reduce (every rank must call it)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


@dataclass
class Dist:
    """This process's place in the job; see the module docstring."""
    device: torch.device
    rank: int = 0
    world: int = 1
    accelerator: Any = None
    wrapped: list = field(default_factory=list)
    fsdp: FSDPSettings | None = None  # weights sharded across ranks (full fine-tuning only)

    @property
    def sharded(self) -> bool:
        """Models trained here are FSDP-sharded: every rank must run the same forward passes (each
        layer gathers its weights), and saving gathers the whole weights first."""
        return self.fsdp is not None and self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---------------------------------------------------------------- models and gradients

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model for training forwards: `wrapped(fn, *args)` = fn(model, *args), gradients
        averaged across ranks on the last backward of each step."""
        wrapped = CallThrough(model)
        if self.sharded:
            # FSDP2 directly (the engine accelerate itself calls for fsdp_version 2): accelerate's
            # own FSDP path exists for GPU process groups only, this one also runs on gloo (tests)
            shard_model(model, self.fsdp)
        elif self.accelerator is not None and self.world > 1:
            kind = str(self.accelerator.distributed_type)
            if "DEEPSPEED" in kind:
                raise ValueError(f"{kind}: DeepSpeed is not supported; use configs/accelerate/ddp.yaml, or "
                                 "configs/accelerate/fsdp.yaml for full fine-tuning of a model that does not fit "
                                 "(docs/scaling.md)")
            wrapped = self.accelerator.prepare_model(wrapped, device_placement=False)
        self.wrapped.append(wrapped)
        return wrapped

    def shard_frozen(self, model: nn.Module) -> nn.Module:
        """A frozen model as large as a trained one (the reference copy of a fully trained policy):
        sharded like the trained models when they are, so each process holds 1/N of it; its forwards
        are then collectives, which every rank must run alike. Unchanged otherwise."""
        if self.sharded:
            shard_model(model, self.fsdp, trained=False)
        return model

    def optimizer_state(self, model: nn.Module, optimizer) -> dict:
        """The optimiser state to save: whole and keyed by parameter name when sharded (a collective:
        every rank calls it, rank 0 gets it), the optimiser's own state_dict otherwise."""
        return full_optimizer_state(model, optimizer) if self.sharded else optimizer.state_dict()

    def sync(self, wrapped: nn.Module | None, last: bool):
        """Context for one forward + backward: all-reduce the gradients only when `last` (None: a
        role the run does not have, such as the critic of a critic-free estimator)."""
        if wrapped is None or last or self.world == 1 or self.accelerator is None or self.sharded:
            # sharded: every backward reduce-scatters into the sharded gradients, which accumulate
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

    def passes(self, n: int) -> int:
        """How many forward passes of a loop this rank runs when it has n to do: n, or under FSDP the
        busiest rank's count (every pass of a sharded model is a collective; a rank with fewer runs
        passes whose results it drops)."""
        return max(self.gather_objects(n)) if self.sharded else n

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
        """Leave the process group after a last barrier: rank 0 may still be saving, and a rank
        that tears down its gloo connections while a peer still uses them can abort at exit
        ("terminate called without an active exception")."""
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()
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
                    accelerator=accelerator, fsdp=fsdp_settings())
    else:
        dist = Dist(device=dev)
    rundir.set_writer(dist.is_main)
    return dist


__all__ = ["Dist", "CallThrough", "FSDPSettings", "fsdp_settings", "shard_model", "full_state_dict",
           "full_optimizer_state", "load_full_optimizer_state", "load_optimizer_state", "clip_grad_norm", "setup",
           "world_size", "rank", "local_rank"]
