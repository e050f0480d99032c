"""The PPO run's state: built in phase 0 (`set_up`), saved in RUN_DIR/checkpoint, restored by --resume.

`check_config` refuses inconsistent options before anything loads; `set_up` loads the four roles (policy, reference, reward, critic), wraps the trained ones for N
processes, builds optimisers, schedules and the KL controller, and restores a checkpoint when
resuming. With LoRA the roles hold one copy of the base model: the reference is the policy with its
adapter disabled, and a reward model or critic trained with LoRA on the same base has its frozen
weights pointed at the policy's (`models.share_frozen_weights`). A checkpoint is written as a new
folder that replaces the old one in two renames, so a kill mid-save leaves the previous one (the
rest of the run directory: pipeline/rundir.py); a stop inside an update first puts back what the
update changed (`remember_update`, `undo_update`).

Under FSDP (configs/accelerate/fsdp.yaml, full fine-tuning; docs/scaling.md) the roles are placed so:
- policy and critic: trained, so sharded (FSDP2, one unit per decoder layer): their weights,
  gradients and AdamW states (16P bytes each) are what does not fit one device;
- reference: the frozen fp32 copy of the starting policy (4P) is as large as the policy's weights,
  so it is sharded too (1/N per process; its forwards then run on every rank alike, as the policy's);
- reward model: kept whole on every process. It is frozen and held in the run's dtype (2P in bf16,
  an eighth of a trained role), and scoring stays local to each process: its chunked passes and
  the shared-prefix cache of pipeline/scoring.py need no agreement between ranks.
Each model is sharded right after it is loaded, so at most the policy and its reference copy are
whole on a device at once (8P bytes at load time). Checkpoints hold whole weights and the whole
optimiser state keyed by parameter name, gathered on rank 0: they resume on any number of processes,
sharded or not.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from formats.hashing import snapshot_sha256
from pipeline.config import (CRITIC_FREE, ModelConfig, PPOConfig, group_size, policy_method, to_dict,
                             with_ppo_lrs)
from pipeline.distributed import Dist, full_state_dict, load_optimizer_state
from pipeline.kl import KLController, make_kl_controller
from pipeline.models import (
    META_FILE, autocast, load_scalar_model, pick_device, pick_dtype, read_meta, share_frozen_weights,
)
from pipeline.policy import load_policy_weights, load_starting_policy, master_cfg, starting_reference, trainable
from pipeline.ppo_data import read_ptx_texts
from pipeline.lifecycle import STATE_FILE
from pipeline.rundir import truncate_metrics, write_json
from pipeline.saving import GatheredPolicy, atomic_folder, save_policy, save_scalar_model
from pipeline.scoring import make_reward
from pipeline.text import read_prompts

CHECKPOINT = "checkpoint"


# --------------------------------------------------------------------------- phase 0: set-up




@dataclass
class PPORun:
    """What phase 0 builds and every later phase reads: the run's options, processes and folder, the
    four roles (three without a critic: 'rloo', 'grpo'; critic, critic_w, critic_opt and
    critic_sched are None then), optimisers, schedules, KL controller, inputs, and the steps done."""
    cfg: PPOConfig  # the options, each model's default learning rate filled in
    dist: Dist
    out: Path  # RUN_DIR
    device: torch.device
    autocast: Callable[[], contextlib.AbstractContextManager]
    policy: torch.nn.Module
    tokenizer: object
    parent: str
    reference: torch.nn.Module
    score_fn: Callable
    critic: torch.nn.Module | None
    policy_w: torch.nn.Module  # the policy and critic for training forwards (Dist.wrap)
    critic_w: torch.nn.Module | None
    policy_opt: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer | None
    policy_sched: torch.optim.lr_scheduler.LRScheduler  # stepped once per step that trains the policy
    critic_sched: torch.optim.lr_scheduler.LRScheduler | None
    kl: KLController
    step: int  # steps done: 0 or the checkpoint's at set-up, then one more after each step
    rows: list  # prompts file rows
    ptx_texts: list
    sample_logprobs: bool  # pi_old from the sampling pass (else one forward pass)
    before_update: list | None = None  # inside an update: what it changes, as it was (remember_update)

    @property
    def local(self) -> slice:
        """This process's episodes of a step's batch (all of them on one process)."""
        B, dist = self.cfg.batch_size, self.dist
        return slice(dist.rank * B // dist.world, (dist.rank + 1) * B // dist.world)

    @property
    def share_prefix(self) -> bool:
        """Whether forwards may run a shared-prefix pass: not under FSDP, where it would run on some
        ranks only (pipeline/train_ppo.py)."""
        return not self.dist.sharded


def check_config(cfg: PPOConfig, world: int = 1) -> None:
    """Derived sizes and choices, checked once before anything loads. world: processes, each taking
    batch_size / world prompts and mini_batch_size / world episodes of each minibatch."""
    problems = []
    if world > 1 and (cfg.batch_size % world or cfg.mini_batch_size % world):
        problems.append(f"--batch-size {cfg.batch_size} and --mini-batch-size {cfg.mini_batch_size} are split "
                        f"across {world} processes: both must be multiples of {world}")
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.ppo_epochs < 1:
        problems.append("--steps, --batch-size and --ppo-epochs must be >= 1")
    if not 0 <= cfg.critic_warmup_steps < cfg.steps:
        problems.append(f"--critic-warmup-steps {cfg.critic_warmup_steps} must be >= 0 and below --steps "
                        f"{cfg.steps} (the policy must train for at least one step)")
    if cfg.mini_batch_size < 1 or cfg.batch_size % cfg.mini_batch_size:
        problems.append(f"--batch-size {cfg.batch_size} must be a multiple of --mini-batch-size {cfg.mini_batch_size}")
    if cfg.micro_batch_size < 1 or cfg.mini_batch_size % cfg.micro_batch_size:
        problems.append(f"--mini-batch-size {cfg.mini_batch_size} must be a multiple of "
                        f"--micro-batch-size {cfg.micro_batch_size}")
    if not 0 <= cfg.lr_warmup_steps <= cfg.steps - cfg.critic_warmup_steps:
        problems.append(f"--lr-warmup-steps {cfg.lr_warmup_steps} must be >= 0 and at most the policy's "
                        f"{cfg.steps - cfg.critic_warmup_steps} training steps (--steps minus --critic-warmup-steps)")
    if cfg.critic_head not in ("reward", "zero"):
        problems.append(f"--critic-head {cfg.critic_head!r}: choose 'reward' or 'zero'")
    if cfg.lr < 0 or cfg.critic_lr < 0:
        problems.append("--lr and --critic-lr must be >= 0 (0 = the default for LoRA or full fine-tuning)")
    if cfg.temperature <= 0:
        problems.append("--temperature must be > 0 (PPO needs sampled responses and their log-probs)")
    if cfg.max_new_tokens < 1 or cfg.forward_batch_size < 1:
        problems.append("--max-new-tokens and --forward-batch-size must be >= 1")
    if cfg.kl_estimator not in ("k1", "k3"):
        problems.append(f"--kl-estimator {cfg.kl_estimator!r}: use 'k1' or 'k3'")
    if cfg.kl_control not in ("fixed", "adaptive", "x1.5"):
        problems.append(f"--kl-control {cfg.kl_control!r}: use 'fixed', 'adaptive' or 'x1.5'")
    if cfg.old_logprobs not in ("auto", "sample", "forward"):
        problems.append(f"--old-logprobs {cfg.old_logprobs!r}: use 'auto', 'sample' or 'forward'")
    if cfg.ptx_coef > 0 and not cfg.ptx_data:
        problems.append("--ptx-coef > 0 needs --ptx-data (JSONL with a 'text' field)")
    k = group_size(cfg)
    if cfg.advantage_estimator not in ("gae", *CRITIC_FREE):
        problems.append(f"--advantage-estimator {cfg.advantage_estimator!r}: use 'gae', 'rloo' or 'grpo'")
    elif cfg.advantage_estimator in CRITIC_FREE:
        if k < 2:
            problems.append(f"--advantage-estimator {cfg.advantage_estimator} compares a prompt's responses: "
                            f"--samples-per-prompt must be >= 2 (got {k})")
        if cfg.critic_warmup_steps:
            problems.append(f"--advantage-estimator {cfg.advantage_estimator} has no critic to warm up: "
                            "--critic-warmup-steps must be 0")
    if k < 1 or cfg.batch_size % k:
        problems.append(f"--batch-size {cfg.batch_size} must be a multiple of --samples-per-prompt {k} "
                        "(a step samples each of its prompts that many times)")
    if problems:
        raise ValueError("; ".join(problems))


RESUMABLE = ("steps", "save_every", "sample_every")
"""The PPO options a --resume may change: how long the run goes on (a finished run continues to a
larger --steps) and what it writes on the way. Any other option changed would make the resumed run
another run than the one its checkpoint started."""


def reward_name(reward: str) -> str:
    """The reward as a run records it: a scripted or oracle reward by its spec, a reward model by
    its folder's absolute path."""
    return reward if reward.startswith(("script:", "oracle:")) else str(Path(reward).resolve())


def unchanged_on_resume(cfg: PPOConfig, *, prompts: str, reward: str) -> dict:
    """What a PPO --resume must not change, as config.json records it (lifecycle.claim compares a
    resume's against the run's): the prompts file's SHA-256, the reward, and the options as given
    (before each model's default learning rate is filled in) but RESUMABLE."""
    return {"prompts_sha256": snapshot_sha256(prompts), "reward_model": reward_name(reward),
            "ppo_options": {key: value for key, value in to_dict(cfg).items() if key not in RESUMABLE}}


def check_resume(ckpt: Path, cfg: PPOConfig) -> None:
    """A checkpoint with a critic resumes only with one ('gae'), one without only critic-free."""
    if (ckpt / "critic").is_dir() == (cfg.advantage_estimator in CRITIC_FREE):
        raise ValueError(f"{ckpt} was saved by a run {'with' if (ckpt / 'critic').is_dir() else 'without'} a critic: "
                         "resume with the run's own --advantage-estimator")


def set_up(cfg: PPOConfig, model_cfg: ModelConfig, *, prompts: str, reward: str, out: Path, policy: str,
           critic_init: str, resuming: bool, dist: Dist) -> PPORun:
    """Phase 0: load the four roles, wrap (or shard) the trained ones, build optimisers and schedules,
    restore a checkpoint when resuming (metrics after its step are dropped), and write config.json."""
    ckpt = out / CHECKPOINT
    given = cfg  # as the command line gave it: what a resume must repeat (unchanged_on_resume)
    device = pick_device(model_cfg.device)
    dtype = pick_dtype(model_cfg.dtype, device)
    if dtype == torch.float16:
        raise ValueError("--dtype fp16: PPO here has no loss scaling; use bf16 (or fp32)")
    amp = functools.partial(autocast, device, dtype)
    torch.manual_seed(cfg.seed)
    rows = read_prompts(prompts)
    policy_model, tokenizer, parent = load_starting_policy(policy, model_cfg, device, dtype)
    reference = starting_reference(policy_model, policy, model_cfg, device, dtype)  # before any resume
    if resuming:  # whole weights, loaded before sharding
        saved_base = read_meta(ckpt / "policy").get("base_model")
        if saved_base != policy_model.rlhf_meta["base_model"]:
            raise ValueError(f"{ckpt}: the checkpoint trains {saved_base}, but --policy starts from "
                             f"{policy_model.rlhf_meta['base_model']}; resume with the run's --policy")
        load_policy_weights(policy_model, ckpt / "policy")
    if reference.frozen is not None:  # full fine-tuning: a copy as large as the policy (module docstring)
        dist.shard_frozen(reference.frozen)
    # training forwards go through the wrapped models (gradients averaged across ranks); made before
    # the optimisers, as FSDP replaces the parameters by their shards
    policy_w = dist.wrap(policy_model)
    score_fn, rm = make_reward(reward, tokenizer, model_cfg, cfg.forward_batch_size, amp)
    # a reward model and a LoRA critic on the policy's frozen base hold no copy of it (bytes freed)
    shared = {"reward": share_frozen_weights(policy_model, rm) if rm is not None else 0, "critic": 0}
    critic_src, critic, critic_w, critic_opt, critic_sched = "", None, None, None, None
    if cfg.advantage_estimator not in CRITIC_FREE:
        critic_src = str(ckpt / "critic") if resuming else (
            critic_init or (reward if rm is not None else policy_model.rlhf_meta["base_model"]))
        critic = _load_critic(critic_src, cfg, model_cfg, device, dtype, dist, fresh=not resuming)
        shared["critic"] = share_frozen_weights(policy_model, critic)  # before wrapping
        critic_w = dist.wrap(critic)
    cfg = with_ppo_lrs(cfg, model_cfg.lora, critic is not None and bool(critic.lora))  # 0 = each model's default
    policy_opt = _adamw(trainable(policy_model), cfg.lr)
    # stepped once per PPO iteration that trains the model (the policy's after the critic's warm-up)
    policy_sched = torch.optim.lr_scheduler.LambdaLR(
        policy_opt, lr_factor(cfg.steps - cfg.critic_warmup_steps, cfg.lr_decay, cfg.lr_warmup_steps))
    if critic is not None:
        critic_opt = _adamw(trainable(critic), cfg.critic_lr)
        critic_sched = torch.optim.lr_scheduler.LambdaLR(critic_opt, lr_factor(cfg.steps, cfg.lr_decay))
    ppo = PPORun(
        cfg=cfg, dist=dist, out=out, device=device, autocast=amp, policy=policy_model, tokenizer=tokenizer,
        parent=parent, reference=reference, score_fn=score_fn, critic=critic, policy_w=policy_w, critic_w=critic_w,
        policy_opt=policy_opt, critic_opt=critic_opt, policy_sched=policy_sched, critic_sched=critic_sched,
        kl=make_kl_controller(cfg.kl_control, cfg.init_kl_coef, cfg.kl_target, cfg.kl_horizon), step=0, rows=rows,
        ptx_texts=read_ptx_texts(cfg.ptx_data) if cfg.ptx_coef > 0 else [],
        sample_logprobs=cfg.old_logprobs == "sample" or (cfg.old_logprobs == "auto" and dtype == torch.float32))
    if resuming:
        ppo.step = load_checkpoint(ppo)
    truncate_metrics(out, ppo.step)
    write_json(out / "config.json", {
        "stage": policy_method(cfg), "policy": policy or model_cfg.model, "parent": parent, "reward": reward,
        "critic_init": critic_src, "prompts": str(prompts), "resumed_from_step": ppo.step,
        "ppo": to_dict(cfg), "model": to_dict(model_cfg), "processes": dist.world, "fsdp": dist.sharded,
        "shared_base_bytes": shared, **unchanged_on_resume(given, prompts=prompts, reward=reward)})
    return ppo


def _load_critic(src: str, cfg: PPOConfig, model_cfg: ModelConfig, device, dtype, dist: Dist, fresh: bool):
    """The critic from `src` (a reward or critic folder, or a base model), its head zeroed on a fresh
    start with critic_head 'zero' (before any wrapping: under FSDP the head is sharded then)."""
    if dist.sharded and (Path(src) / META_FILE).is_file() and read_meta(src).get("lora"):
        raise ValueError(f"under FSDP the critic is fully trained and sharded, but it would start from {src}, "
                         "a LoRA model: pass --critic-init with the base model or a fully trained reward model")
    critic, _ = load_scalar_model(src, kind="critic", cfg=master_cfg(model_cfg, src, device, dtype))
    if cfg.critic_head == "zero" and fresh:
        with torch.no_grad():
            critic.head.weight.zero_()
            critic.head.bias.zero_()
    return critic


def lr_factor(steps: int, decay: bool, warmup: int = 0):
    """The learning rate's factor at scheduler step s (0 = the first training step): a linear ramp
    over the first `warmup` steps ((s + 1) / warmup), times the linear decay to 0 over `steps`
    (TRL's default schedule) when `decay`."""
    def factor(s: int) -> float:
        ramp = min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0
        return ramp * (max(0.0, 1.0 - s / steps) if decay else 1.0)

    return factor


def _adamw(params: list, lr: float) -> torch.optim.AdamW:
    """AdamW without weight decay (TRL's PPO default); the fused kernel when the parameters allow
    it (about 6x faster than the per-tensor loop for a fully trained 135M critic on CPU)."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


# --------------------------------------------------------------------------- checkpoints


def _trained_roles(ppo: PPORun) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    return [(model, opt) for model, opt in ((ppo.policy, ppo.policy_opt), (ppo.critic, ppo.critic_opt))
            if model is not None]


def remember_update(ppo: PPORun) -> None:
    """Before a step's update: keep a copy of what it changes (the trained weights and the
    optimisers' states), so that a stop inside it can put them back (`undo_update`) and the
    checkpoint then saved is the state the step started from. Copied only where the trained
    weights are a small part of each model (LoRA: a few MB); with full fine-tuning or FSDP the copy
    would be as large as the model, and the update runs to its end before a stop is seen."""
    roles = _trained_roles(ppo)
    small = all(4 * sum(p.numel() for p in trainable(m)) < sum(p.numel() for p in m.parameters()) for m, _ in roles)
    ppo.before_update = None if ppo.dist.sharded or not small else [
        ([p.detach().clone() for p in trainable(m)], copy.deepcopy(opt.state_dict())) for m, opt in roles]


def undo_update(ppo: PPORun) -> bool:
    """Put back what remember_update kept: the step is then as if its update never ran. False
    when nothing was kept."""
    if ppo.before_update is None:
        return False
    with torch.no_grad():
        for (model, opt), (weights, state) in zip(_trained_roles(ppo), ppo.before_update):
            for p, w in zip(trainable(model), weights):
                p.copy_(w)
            opt.load_state_dict(state)
    ppo.before_update = None
    return True


def save_checkpoint(ppo: PPORun) -> None:
    """RUN_DIR/checkpoint: policy (adapter or full), critic (when the run has one), optimisers,
    schedulers, KL controller, steps done.
    Written beside the old one and swapped in (pipeline/saving.py, atomic_folder), so a kill
    mid-save leaves the previous checkpoint. Every rank calls it (sharded weights and optimiser
    states are gathered first, a collective); rank 0 writes."""
    dist, policy, critic = ppo.dist, ppo.policy, ppo.critic
    policy_weights = full_state_dict(policy) if dist.sharded else None
    critic_weights = full_state_dict(critic) if dist.sharded and critic is not None else None
    policy_optim = dist.optimizer_state(policy, ppo.policy_opt)
    critic_optim = dist.optimizer_state(critic, ppo.critic_opt) if critic is not None else None
    if not dist.is_main:  # every rank holds the same weights (or its shard of them)
        return

    def write(folder: Path) -> None:
        save_policy(GatheredPolicy(policy, policy_weights) if dist.sharded else policy, ppo.tokenizer,
                    folder / "policy")
        saved = {"step": ppo.step, "policy_optim": policy_optim, "policy_sched": ppo.policy_sched.state_dict(),
                 "kl": ppo.kl.state_dict()}
        if critic is not None:
            save_scalar_model(critic, ppo.tokenizer, folder / "critic", state_dict=critic_weights)
            saved.update(critic_optim=critic_optim, critic_sched=ppo.critic_sched.state_dict())
        torch.save(saved, folder / STATE_FILE)

    atomic_folder(ppo.out / CHECKPOINT, write)


def load_checkpoint(ppo: PPORun) -> int:
    """Restore the optimisers of the policy and the critic (when the run has one; saved by a sharded
    run or not: each loads into a sharded or plain one), their schedules and the KL controller from
    RUN_DIR/checkpoint; returns the step. The weights are loaded before (load_policy_weights, the
    critic from checkpoint/critic). The file is memory-mapped on the CPU (the processes of one
    machine share its pages, so N of them do not each hold the whole optimiser state), and loading
    moves each state to its parameter's device (sharded: its shard)."""
    state = torch.load(ppo.out / CHECKPOINT / STATE_FILE, map_location="cpu", mmap=True, weights_only=False)
    load_optimizer_state(ppo.policy, ppo.policy_opt, state["policy_optim"])
    ppo.policy_sched.load_state_dict(state["policy_sched"])
    if ppo.critic is not None:
        load_optimizer_state(ppo.critic, ppo.critic_opt, state["critic_optim"])
        ppo.critic_sched.load_state_dict(state["critic_sched"])
    ppo.kl.load_state_dict(state["kl"])
    return int(state["step"])


__all__ = ["PPORun", "set_up", "check_resume", "unchanged_on_resume", "reward_name", "RESUMABLE", "save_checkpoint",
           "load_checkpoint", "CHECKPOINT"]
