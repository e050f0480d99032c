"""PPO with a KL-shaped reward: `python -m pipeline ppo --policy ... --reward ... --prompts ... --out RUN_DIR`.

One loop, read top to bottom in numbered phases (like CleanRL's ppo.py and TRL's PPOTrainer.train):

  1. take a batch of prompts (the step's seeded order; pipeline/ppo_data.py)
  2. sample responses from the policy; pi_old log-probs come from that pass (or one forward)
  3. reference log-probs, critic values (no grad; pipeline/rollout.py)
  4. score prompt+response (reward model, normalised; or a scripted reward)
  5. missing-EOS penalty, per-token KL to the reference, shaped reward r_t = -beta * kl_t (+ score on
     the last real token)
  6. advantages by GAE over response tokens, whitened; returns = advantages + values
  7. PPO epochs over shuffled minibatches, micro-batch gradient accumulation: clipped policy loss on
     pi_theta / pi_old (never pi_theta / pi_ref), entropy bonus, PPO-ptx, clipped value loss (during
     the critic's warm-up, `critic_warmup_steps`, the value loss only; pipeline/ppo_update.py)
  8. KL controller and learning-rate schedules (the policy's wait for the warm-up's end)
  9. metrics.jsonl, status.json, sample table, checkpoint

Speed without changing the arithmetic (beyond float rounding): sampling runs with the LoRA deltas
merged into a copy of the base weights (`merged_lora`, pipeline/policy.py), and every forward pass
over episodes, in the rollout and in the update, packs the sequences without padding
(pipeline/packing.py).

On N processes (a launcher; pipeline/distributed.py) each rank samples, scores and runs the no-grad
forwards for its B/N prompts; the rollouts are gathered so every rank computes the same advantages,
KL and controller update on the whole batch; each rank then trains on its share of every
minibatch, DDP averaging the gradients, and rank 0 writes the run directory.

With FSDP (configs/accelerate/fsdp.yaml, --lora false) the policy, its reference copy and the critic
are sharded (pipeline/ppo_state.py says which role is where, and why), and every forward pass of a
sharded model is a collective: each rank must run the same passes, in the same order. So sampling
steps until every rank's responses are done (`Decoding(synced=True)`, as transformers' synced_gpus),
each rank's B/N episodes run in the same number of chunks and micro-batches, no pass depends on a
rank's own data (no shared-prefix pass: whether a batch has one differs between ranks), and
checkpoints gather the whole weights on rank 0. The reward model stays whole on every rank.

The four roles (docs/DESIGN.md): the policy (LoRA by default), the reference (the policy with
its adapter disabled, or a frozen copy with full fine-tuning), the frozen reward model, and the
critic (initialised from the reward model). A run writes only into RUN_DIR: config.json,
metrics.jsonl (one JSON object per step; the same as TensorBoard events in tensorboard/),
status.json, samples/step_N.jsonl, checkpoint/ (policy, critic, optimisers, KL controller) and,
when done, policy/ (model_meta.json names the parent policy and the reward model; the owner
process registers it). SIGTERM or Ctrl-C saves a checkpoint and marks the run cancelled;
`--resume` continues from it (a larger --steps extends even a finished run; other prompts, another
reward or any other option is refused, naming it: lifecycle.claim, ppo_state.unchanged_on_resume).
A stop seen inside an update, after some of its optimiser steps, puts back the weights and optimiser states the step started from before saving (with full
fine-tuning, too large to keep a copy of, the update finishes first): a resumed run is the run
never stopped.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from pipeline.config import (ModelConfig, PPOConfig, add_arguments, from_args, group_size, policy_method,
                             with_rollout_length)
from pipeline.distributed import setup
from pipeline.losses import masked_mean, masked_var
from pipeline.policy import merged_lora
from pipeline.ppo_data import episode_uniforms, prompt_order
from pipeline.ppo_state import (CHECKPOINT, PPORun, check_config, check_resume, remember_update, reward_name,
                                save_checkpoint, set_up, undo_update, unchanged_on_resume)
from pipeline.ppo_update import ppo_update
from pipeline.rollout import Rollout, StepRollout, gather_rollout, kl_shaped_advantages, rollout_forwards
from pipeline.lifecycle import STATE_FILE, claim, guarded, recover, stage_main
from pipeline.rundir import Cancelled, StopFlag, append_metrics, open_tracker, write_jsonl, write_status
from pipeline.sampling import Decoding, sample
from pipeline.saving import save_whole_policy
from pipeline.text import decode_responses, encode_prompts
from pipeline.tracking import add_report_to


def train(cfg: PPOConfig, model_cfg: ModelConfig, *, prompts: str, reward: str, out_dir: str | os.PathLike,
          policy: str = "", critic_init: str = "", resume: bool = False) -> dict:
    """Run PPO; returns the last step's metrics. See the module docstring for the phases."""
    cfg = with_rollout_length(cfg)  # standalone, a length of 0 is the generation's default
    dist = setup(model_cfg.device)
    check_config(cfg, dist.world)
    if dist.sharded and model_cfg.lora:
        raise ValueError("ppo with FSDP shards full fine-tuning (--lora false); with LoRA the trained and "
                         "communicated part is small: use configs/accelerate/ddp.yaml (docs/scaling.md)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / CHECKPOINT
    recover(ckpt, dist)  # a kill in the middle of a checkpoint write leaves the last good one to put back
    if ckpt.is_dir() and not resume:
        raise ValueError(f"{out} already holds a checkpoint: pass --resume, or use a new run directory")
    resuming = resume and ckpt.is_dir()  # --resume before any checkpoint starts the run
    if resuming:
        check_resume(ckpt, cfg)
    # the run folder's rules (pipeline/lifecycle.py): a resume with other prompts, reward or options is refused
    claim(out, resume=resuming, results=(CHECKPOINT,), dist=dist, state=f"{CHECKPOINT}/{STATE_FILE}",
          finished_continues=True,
          unchanged=unchanged_on_resume(cfg, prompts=prompts, reward=reward) if resuming else {})
    ppo = None  # what phase 0 builds (pipeline/ppo_state.py)
    with guarded(out, dist) as progress:  # 'failed' with the error if anything below raises
        progress["total"] = cfg.steps
        try:
            with StopFlag() as stop:
                # 0. set-up: device, models (four roles), optimisers, KL controller, resume (pipeline/ppo_state.py);
                # training forwards go through policy_w and critic_w (gradients averaged across ranks), sampling
                # and the no-grad forwards use the plain modules (the reference: the policy, adapter disabled)
                ppo = set_up(cfg, model_cfg, prompts=prompts, reward=reward, out=out, policy=policy,
                             critic_init=critic_init, resuming=resuming, dist=dist)
                progress["step"] = ppo.step
                write_status(out, "running", ppo.step, cfg.steps)

                from tqdm import tqdm

                bar = tqdm(total=cfg.steps, initial=ppo.step, desc=policy_method(cfg), unit="step", dynamic_ncols=True,
                           disable=not dist.is_main)
                metrics: dict = {}
                while ppo.step < cfg.steps:
                    metrics = ppo_step(ppo, stop)
                    progress["step"] = ppo.step
                    write_status(out, "running", ppo.step, cfg.steps)
                    bar.update(1)
                    bar.set_postfix(score=f"{metrics['objective/score']:.3f}", kl=f"{metrics['objective/kl']:.3f}",
                                    beta=f"{metrics['kl/beta']:.3g}")
                bar.close()
                finish(ppo, reward)
                return metrics
        except Cancelled as exc:
            # every rank agreed to stop at this step (dist.check_stop): rank 0 saves one checkpoint of
            # the weights as the last step left them. A stop inside an update, seen between its
            # minibatches only where what they changed was kept (LoRA: ppo_state.remember_update),
            # first puts that back: a resume repeats the step from its start, as a run never
            # stopped took it. Without such a copy (full fine-tuning) the update runs to its end and
            # the next step's start sees the stop.
            if ppo is not None and undo_update(ppo):
                print(f"stopped inside step {ppo.step + 1}'s update: its optimiser steps undone", flush=True)
            done = ppo.step if ppo is not None else 0
            if ppo is not None:
                save_checkpoint(ppo)
            dist.barrier()
            write_status(out, "cancelled", done, cfg.steps, error=str(exc))
            print(f"cancelled at step {done} (rank {dist.rank} of {dist.world})", flush=True)
            dist.close()
            raise


def ppo_step(ppo: PPORun, stop) -> dict:
    """Phases 1-9 of step ppo.step (0-based); returns its metrics (also appended to metrics.jsonl)."""
    cfg, dist, step = ppo.cfg, ppo.dist, ppo.step
    dist.check_stop(stop)  # a stop since the last step's update: its end is saved (train)
    t_start = time.perf_counter()
    # 1-6. prompts, sampling, forwards, scores, KL-shaped rewards and GAE
    sr = rollout_step(ppo, stop)
    # 7. PPO epochs over shuffled minibatches, gradients accumulated over micro-batches (the critic
    # alone while it warms up)
    train_policy = step >= cfg.critic_warmup_steps
    remember_update(ppo)  # a stop inside the update puts back what it changed (train)
    stats, n_minibatches = ppo_update(ppo, sr, stop, train_policy)
    t_update = time.perf_counter() - t_start - sr.times["rollout"]
    # the update's sums over every rank's micro-batches (grad norms: the same on every rank)
    norms = {k: stats.pop(k) for k in ("policy/grad_norm", "val/grad_norm") if k in stats}
    stats = {**dist.reduce_sum(dict(stats)), **norms}
    # 8. KL controller (on the measured KL per sequence) and learning rates
    lrs = advance_schedules(ppo, sr.adv, cfg.batch_size, train_policy)
    ppo.step, ppo.before_update = step + 1, None
    # 9. metrics, sample table, checkpoint
    sr.times.update(update=t_update, step=time.perf_counter() - t_start)
    metrics = step_metrics(stats, n_minibatches, sr, ppo.kl.value, lrs, critic=ppo.critic is not None)
    append_metrics(ppo.out, ppo.step, metrics)
    keep_step(ppo, sr)
    return metrics


def finish(ppo: PPORun, reward: str) -> None:
    """The end: a resumable checkpoint, and the policy (its meta naming the parent and the reward
    model) for the owner process to register."""
    cfg, dist, out = ppo.cfg, ppo.dist, ppo.out
    ppo.policy.rlhf_meta = {**ppo.policy.rlhf_meta, "parent": ppo.parent, "reward_model": reward_name(reward),
                            "run": str(out.resolve()), "steps": cfg.steps}
    save_checkpoint(ppo)  # rank 0 writes; every rank holds the weights or a shard
    save_whole_policy(ppo.policy, ppo.tokenizer, out / "policy", dist)
    dist.barrier()  # the other ranks exit only once rank 0 has saved
    write_status(out, "done", cfg.steps, cfg.steps)
    dist.close()


def rollout_step(ppo: PPORun, stop) -> StepRollout:
    """Phases 1-6 of step ppo.step."""
    t_start = time.perf_counter()
    cfg, dist, step, local = ppo.cfg, ppo.dist, ppo.step, ppo.local
    policy_model, tokenizer, device, autocast = ppo.policy, ppo.tokenizer, ppo.device, ppo.autocast
    B, k = cfg.batch_size, group_size(cfg)
    # 1. a batch of prompts (the order depends only on seed and step, so --resume continues it), each
    # k times in a row: a critic-free estimator's groups
    order = [i for i in prompt_order(len(ppo.rows), step, B // k, cfg.seed) for _ in range(k)]
    batch_prompts = [ppo.rows[i]["prompt"] for i in order][local]
    input_ids, prompt_mask = encode_prompts(tokenizer, batch_prompts, cfg.max_prompt_tokens, device)

    # 2. sample from the current policy = pi_old, the whole distribution of logits / T; each
    # episode draws its own seeded numbers, so N processes sample what one would. Post-EOS
    # tokens come back masked. LoRA is merged into (a copy of) the base weights meanwhile:
    # one matmul per layer and step
    uniforms = episode_uniforms(cfg.seed, step, range(B)[local], cfg.max_new_tokens, device)
    with torch.no_grad(), autocast(), merged_lora(policy_model):
        sb = sample(policy_model, input_ids, prompt_mask, cfg, tokenizer, draws=uniforms,
                    decoding=Decoding(synced=dist.sharded))
    mask = sb.response_mask.float()  # (B, R)
    t_sample = time.perf_counter() - t_start
    dist.check_stop(stop)

    # 3. reference log-probs, critic values (and pi_old by one forward, when configured)
    policy_model.eval()
    if ppo.critic is not None:
        ppo.critic.eval()
    ref_logp, old_logp, values = rollout_forwards(policy_model, ppo.reference, ppo.critic, sb, cfg,
                                                  not ppo.sample_logprobs, autocast, ppo.share_prefix)
    ro = Rollout(prompts=batch_prompts, sequences=sb.sequences, attention_mask=sb.attention_mask,
                 response_ids=sb.response_ids, mask=mask, prompt_length=sb.prompt_length,
                 logprobs=(sb.logprobs if ppo.sample_logprobs else old_logp) * mask,
                 ref_logprobs=ref_logp * mask, values=values * mask,
                 eos=torch.tensor([f == "eos" for f in sb.finish_reason], device=device))
    t_forwards = time.perf_counter() - t_start - t_sample

    # 4. score prompt+response: reward model (normalised) or scripted
    raw_score = ppo.score_fn(ro.sequences, ro.attention_mask, ro.response_ids, ro.mask, prompts=batch_prompts)  # (B,)
    # N processes: every rank gets the whole batch (rank 0's episodes first), so phases 5-6
    # and the KL controller see the same numbers everywhere
    ro, raw_score = gather_rollout(ro, raw_score, dist, tokenizer.pad_token_id)
    t_score = time.perf_counter() - t_start - t_sample - t_forwards

    # 5-6. missing-EOS penalty, per-token KL, shaped rewards, GAE (pipeline/rollout.py)
    beta = ppo.kl.value
    adv = kl_shaped_advantages(ro, raw_score, cfg, beta)
    times = {"sample": t_sample, "forwards": t_forwards, "score": t_score, "rollout": time.perf_counter() - t_start}
    return StepRollout(ro, raw_score, adv, beta, times)


def advance_schedules(ppo: PPORun, adv, episodes: int, train_policy: bool) -> tuple[float, float]:
    """Phase 8: the KL controller sees the step's KL per sequence, and each learning-rate schedule
    steps; a policy frozen for the critic's warm-up leaves its own two as they are. Returns the
    (policy, critic) learning rates the step trained with."""
    policy_sched, critic_sched = ppo.policy_sched, ppo.critic_sched
    lrs = (policy_sched.get_last_lr()[0] if train_policy else 0.0,
           critic_sched.get_last_lr()[0] if critic_sched else 0.0)
    if train_policy:
        ppo.kl.update(float(adv.kl_seq.mean()), episodes)
        policy_sched.step()
    if critic_sched:
        critic_sched.step()
    return lrs


def keep_step(ppo: PPORun, sr: StepRollout) -> None:
    """Phase 9's files after ppo.step steps: the sample table every cfg.sample_every steps (and at
    the end; rank 0), a checkpoint every cfg.save_every (the end saves its own).

    The sample table, samples/step_N.jsonl: the step's first 4 episodes, each its prompt, the
    policy's response, its raw score, its KL to the reference, its length and why it ended."""
    cfg, done = ppo.cfg, ppo.step
    if ppo.dist.is_main and cfg.sample_every > 0 and (done % cfg.sample_every == 0 or done == cfg.steps):
        ro, n = sr.ro, 4
        texts = decode_responses(ppo.tokenizer, ro.response_ids[:n], ro.mask[:n])
        rows = [{"prompt": ro.prompts[i], "response": text, "score": round(float(sr.raw_score[i]), 4),
                 "kl": round(float(sr.adv.kl_seq[i]), 4), "tokens": int(ro.lengths[i]),
                 "finish_reason": "eos" if bool(ro.eos[i]) else "length"} for i, text in enumerate(texts)]
        (ppo.out / "samples").mkdir(exist_ok=True)
        write_jsonl(ppo.out / "samples" / f"step_{done}.jsonl", rows)
    if cfg.save_every > 0 and done % cfg.save_every == 0 and done < cfg.steps:
        save_checkpoint(ppo)  # every rank (a sharded model is gathered), rank 0 writes


def step_metrics(stats: dict, n_minibatches: int, sr: StepRollout, beta_next: float, lrs: tuple[float, float],
                 critic: bool = True) -> dict:
    """Phase 9's metrics.jsonl line: the update's averages over minibatches, then the rollout's
    objective, value (with a critic), KL-controller, generation and timing figures (sr.times with
    the update's and the whole step's seconds)."""
    metrics = {key: val / n_minibatches for key, val in stats.items() if key != "policy/ratio_first"}
    if "policy/ratio_first" in stats:  # (none while the critic warms up)
        metrics["policy/ratio_first"] = stats["policy/ratio_first"]
    ro, adv, beta, times = sr.ro, sr.adv, sr.beta, sr.times
    mask, returns, kl_seq = ro.mask, adv.returns, adv.kl_seq
    with torch.no_grad():
        var_returns = masked_var(returns, mask)
        metrics.update({
            "objective/score": float(sr.raw_score.mean()),
            "objective/kl": float(kl_seq.mean()),
            "objective/non_score_reward": float((-beta * kl_seq).mean()),
            "objective/rlhf_reward": float((adv.score - beta * kl_seq).mean()),
            # TRL's estimate: mean over sequences of the summed -log pi_old of the sampled tokens
            "objective/entropy": float((-ro.logprobs).sum(1).mean()),
            "kl/beta": beta, "kl/beta_next": beta_next,
            "gen/length_mean": float(ro.lengths.float().mean()),
            "gen/eos_rate": float(ro.eos.float().mean()),
            "policy/lr": lrs[0],
            "time/rollout": times["rollout"], "time/update": times["update"], "time/sample": times["sample"],
            "time/forwards": times["forwards"], "time/score": times["score"],
            "time/episodes_per_s": len(ro.prompts) / times["step"],
        })
        if critic:
            metrics.update({
                "val/explained_var": float(1 - masked_var(returns - ro.values, mask) / var_returns)
                if var_returns > 0 else 0.0,
                "val/value_mean": float(masked_mean(ro.values, mask)), "val/lr": lrs[1]})
    return metrics


# --------------------------------------------------------------------------- CLI


def build_parser(stage: str = "ppo") -> argparse.ArgumentParser:
    description = {"ppo": "PPO on a policy with a reward model (or a scripted reward).",
                   "rloo": "RLOO (PPO's loop without a critic: --advantage-estimator rloo, or grpo) on a policy "
                           "with a reward model (or a scripted reward)."}[stage]
    parser = argparse.ArgumentParser(prog=f"python -m pipeline {stage}", description=description)
    parser.add_argument("--policy", default="",
                        help="starting policy: a folder saved by a previous run (its adapter keeps training) "
                             "or a base model; '' = --model")
    parser.add_argument("--reward", required=True,
                        help="reward model folder; 'oracle:[norm=MEAN,STD:]ORACLE' (a simulated annotator's "
                             "scorer, e.g. oracle:embedding); 'script:count:<text>' / 'script:length' for tests")
    parser.add_argument("--critic-init", default="",
                        help="critic start: a reward/critic folder or a base model "
                             "(default: the reward model when it is a folder, else the policy's base)")
    parser.add_argument("--prompts", required=True, help="JSONL with a 'prompt' field per line")
    parser.add_argument("--out", required=True, help="run directory (created)")
    parser.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoint")
    add_report_to(parser)
    add_arguments(parser, PPOConfig)
    add_arguments(parser, ModelConfig)
    if stage == "rloo":
        parser.set_defaults(advantage_estimator="rloo")
    return parser


def main_rloo(argv: list[str] | None = None) -> int:
    """`python -m pipeline rloo`: this stage with --advantage-estimator rloo by default."""
    return main(argv, stage="rloo")


def print_summary(report: dict) -> None:
    """A finished run's policy folder and its last step's score and KL."""
    print(f"done: policy saved in {report['policy']}; last score "
          f"{report.get('objective/score', float('nan')):.3f}, KL {report.get('objective/kl', float('nan')):.3f}")


def main(argv: list[str] | None = None, stage: str = "ppo") -> int:
    args = build_parser(stage).parse_args(argv)
    cfg, model_cfg = from_args(PPOConfig, args), from_args(ModelConfig, args)
    open_tracker(args.out, args.report_to)  # metrics.jsonl's lines also as TensorBoard events

    def body() -> dict:
        metrics = train(cfg, model_cfg, prompts=args.prompts, reward=args.reward, out_dir=args.out,
                        policy=args.policy, critic_init=args.critic_init, resume=args.resume)
        return {**metrics, "policy": str(Path(args.out) / "policy")}

    return stage_main(body, print_summary)


__all__ = ["train", "main", "main_rloo", "build_parser", "step_metrics"]
