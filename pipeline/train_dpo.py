"""DPO (or IPO) on preference pairs: pairs file in, policy out, no reward model.

    python -m pipeline train-dpo --data pairs.parquet --out runs/dpo-1 [--policy POLICY_DIR
        --loss sigmoid|ipo --beta 0.1 --epochs 1 --lr 5e-5 --batch-size 2 --grad-accum 1 --grouped true ...]

Direct Preference Optimization (Rafailov et al. 2023) trains the policy on the same pairs a reward
model would learn from: loss -log sigmoid(beta * ((log pi(y_c) - log ref(y_c)) - (log pi(y_r) -
log ref(y_r)))), or IPO's squared form (Azar et al. 2023) with --loss ipo (pipeline/losses.py).
beta * log(pi / ref) is a response's implicit reward; its accuracy (chosen above rejected) and
margins are logged as a reward model's would be. With a `weight` column (an export's
quality_weights, from its annotators' quality) each pair's term counts by its weight over the
training pairs' mean weight, as in train-reward (--use-weights false ignores the column; data
without one, or with equal weights, trains on the plain loss).

The policy starts from --policy (a folder saved by ppo or train-dpo: its LoRA adapter or full
weights keep training) or the base model (--model). The reference is the base model in every mode,
as in PPO (pipeline/policy.py, starting_reference; docs/DESIGN.md, "The four PPO roles"): the
adapter disabled (LoRA, no second copy), or frozen full weights of the base, so KL is measured
against the same model across rounds.

A ranking's pairs train together as one batch element (--grouped, the default; InstructGPT's "all
(K choose 2) comparisons from each prompt as a single batch element"): its prompt runs once and
each distinct response once, continuing from it, and the loss of every pair of the ranking is read
from those K sums; a ranking's loss is the mean over its pairs and a batch's the mean over its
rankings, so a ranking counts once whatever its K. --batch-size counts rankings (pairs with
--grouped false, where each pair is its own group of two responses). Several groups are packed per
row with no padding between them (pipeline/dpo_data.py); reference log-probs come from one no-grad
pass over the same packed batch. Batches group rankings of similar length (pipeline/pairs_data.py).

Run directory (as train-reward's and ppo's; the app tails it and registers the policy):
    config.json        configs, the data file and its sha256, the starting policy, command line,
                       whether the pairs' weights were used ("weighted")
    status.json        {"state", "progress", "step", "total", "phase", ...}
    metrics.jsonl      one line per optimiser step (also TensorBoard events in tensorboard/, --report-to):
                       train/loss, train/reward_accuracy, train/margin,
                       train/rewards_chosen, train/rewards_rejected, train/logps_chosen, ...; then
                       the eval/ line (held-out pairs) and kl/heldout
    checkpoint/        the policy as trained so far (save_policy), with trainer_state.pt beside it
    trainer_state.pt   optimiser, scheduler and step, for --resume
    policy/            the trained policy when done; model_meta.json names its parent, the data's
                       sha256, "method": "dpo", the loss and beta
    eval_report.json   held-out implicit-reward accuracy and margins (every held-out pair counts once),
                       KL to the reference, timings, train/pairs and train/groups, train/weighted

KL to the reference on held-out prompts (kl/heldout, nats per response): kl_samples responses per
held-out prompt sampled from the trained policy at temperature 1, each scored as the sum over its
tokens of log pi - log ref (an unbiased estimate of KL(pi || ref)), with its standard error.

Ctrl-C or SIGTERM (the job runner's cancel) finishes the current step, saves a checkpoint, and
marks the run 'cancelled' (exit code 130); --resume continues it with its own settings.
Under a launcher of N processes each rank takes its share of every batch (DDP). With FSDP
(configs/accelerate/fsdp.yaml, --lora false) the policy and its reference copy are sharded (as in
PPO: pipeline/ppo_state.py), every rank runs the same forward passes (a rank with no pair in a
micro-batch, or fewer held-out batches, runs one whose result it drops; no shared-prefix pass), and
checkpoints gather the whole weights on rank 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pipeline.config import DPOConfig, ModelConfig, add_arguments, from_args, to_dict
from pipeline.dpo_data import (
    PAIR_STATS, Packing, encode_dpo, evaluate_pairs, heldout_kl, pack_pairs, pair_stats, preference_loss,
    reference_logps, sequence_logps,
)
from pipeline.lifecycle import AfterTraining, Steps, Training, stage_main
from pipeline.models import attn_ratio, checkpointing
from pipeline.pairs_data import group_weights, train_eval_data
from pipeline.policy import starting_reference
from pipeline.rundir import open_tracker
from pipeline.tracking import add_report_to
from pipeline.trainer import Finished, Loaded, PolicyTrainer, train

LOSSES = ("sigmoid", "ipo")


def check_config(cfg: DPOConfig) -> None:
    problems = []
    if cfg.loss not in LOSSES:
        problems.append(f"--loss {cfg.loss!r}: use {' or '.join(LOSSES)}")
    if not cfg.beta > 0:
        problems.append(f"--beta must be > 0, got {cfg.beta}")
    if cfg.batch_size < 1 or cfg.grad_accum < 1 or cfg.epochs < 1:
        problems.append("--batch-size, --grad-accum and --epochs must be at least 1")
    if cfg.max_steps < 0 or cfg.kl_prompts < 0 or cfg.kl_samples < 1 or cfg.kl_max_new_tokens < 1:
        problems.append("--max-steps and --kl-prompts must be >= 0, --kl-samples and --kl-max-new-tokens >= 1")
    if problems:
        raise ValueError("; ".join(problems))


# --------------------------------------------------------------------------- training


def train_dpo(data: str, out: str, cfg: DPOConfig, model_cfg: ModelConfig, policy: str = "", resume: bool = False,
              on_step=None) -> dict:
    """Train, evaluate and save (DPOTrainer through pipeline/trainer.py); returns the report (also
    in eval_report.json), or {"state": "cancelled", ...} when a signal stopped the run.
    on_step(step, metrics) runs after each step."""
    return train(DPOTrainer, data, out, cfg, model_cfg, start=policy, resume=resume, on_step=on_step)


def dpo_step(cfg: DPOConfig, training: Training, reference, items: list, weights: list[list[float]] | None,
             packing: Packing) -> Callable:
    """The optimiser step run_steps calls: DPO's (or IPO's) loss over a step's micro-batches of group
    indices into `items` (weights: each group's pairs' weights, or None), against the reference's
    log-probs; returns (metrics, pairs, tokens). train/loss is the mean over the step's groups, the
    implicit-reward figures are means over its pairs."""
    dist, wrapped = training.dist, training.wrapped

    def train_step(micro: list[list[int]]) -> tuple[dict, int, int]:
        sums = {"loss": 0.0, "groups": 0, "pairs": 0, "tokens": 0, **dict.fromkeys(PAIR_STATS, 0.0)}
        for j, idx in enumerate(micro):
            # each rank takes every N-th group; a loss weighted by its share of the step's groups makes
            # DDP's mean over ranks (undone by loss_scale) the step's mean over groups
            mine = dist.shard(idx)
            weight = len(mine) / len(idx) / len(micro) * dist.loss_scale
            if not mine:  # fewer groups than processes: join the all-reduce with a zero loss
                mine, weight = idx[:1], 0.0
            pp = pack_pairs([items[i] for i in mine], packing, dist.device,
                            weights=None if weights is None else [w for i in mine for w in weights[i]])
            with training.amp():
                ref = reference_logps(reference, pp)  # (R,) no grad
            with dist.sync(wrapped, last=j == len(micro) - 1), training.amp():
                logps = wrapped(sequence_logps, pp)  # (R,)
                loss = preference_loss(cfg, logps, ref, pp)
            (loss * weight).backward()
            if weight == 0.0:
                continue
            sums["loss"] += loss.item() * pp.groups
            sums["groups"] += pp.groups
            sums["pairs"] += pp.pairs
            sums["tokens"] += pp.real_tokens
            for key, value in pair_stats(logps.detach(), ref, pp, cfg.beta).items():
                sums[key] += value
        sums, grad_norm, n = training.optimizer_step(sums)
        return {"train/loss": sums["loss"] / sums["groups"], **{f"train/{key}": sums[key] / n for key in PAIR_STATS},
                "train/grad_norm": grad_norm}, n, sums["tokens"]

    return train_step


class DPOTrainer(PolicyTrainer):
    """train-dpo's side of the driver (pipeline/trainer.py): pairs in, the policy trained against
    its reference (the base model), evaluated on held-out pairs and by KL on held-out prompts."""

    name, section, config = "train-dpo", "dpo", DPOConfig
    desc, shown = "dpo", ("train/reward_accuracy", "acc")
    check = staticmethod(check_config)

    @classmethod
    def restored(cls, saved: dict) -> tuple[DPOConfig, str]:
        """A run whose settings have no `grouped` trained pair by pair."""
        return DPOConfig(**{"grouped": False, **saved["dpo"]}), saved["policy"]

    @staticmethod
    def check_run(cfg: DPOConfig, model_cfg: ModelConfig, dist, resume: bool) -> None:
        if dist.sharded and model_cfg.lora:  # after a resume's own settings replaced the command line's
            resumed = " (the run being resumed trains LoRA)" if resume else ""
            raise ValueError(f"train-dpo with FSDP shards full fine-tuning (--lora false){resumed}; with LoRA the "
                             "trained and communicated part is small: use configs/accelerate/ddp.yaml "
                             "(docs/scaling.md)")

    def load(self) -> Loaded:
        run, cfg, model_cfg, dist = self.run, self.run.cfg, self.run.model_cfg, self.run.dist
        # 1. Data: the pairs train-reward reads, held-out pairs as it chooses them.
        train_pairs, self.eval_pairs, data_report = train_eval_data(run.data, cfg.eval_data, cfg.eval_fraction,
                                                                    cfg.seed)
        # 2. Policy and reference: the reference is made before any checkpoint is loaded (the start).
        self.start_policy()
        self.reference = starting_reference(self.model, run.start, model_cfg, dist.device, run.dtype)  # the base
        if run.resume:
            self.restore_policy()
        # a ranking's pairs as one group (each pair a group of its own with --grouped false)
        self.train_items, trunc_train = encode_dpo(train_pairs, self.tokenizer, cfg.max_length, cfg.grouped)
        self.eval_items, trunc_eval = encode_dpo(self.eval_pairs, self.tokenizer, cfg.max_length, cfg.grouped)
        # no dropout (TRL's disable_dropout), but checkpointing acts in train mode
        self.model.train(checkpointing(self.model))
        # checkpointed layers drop the KV cache a shared prefix needs; under FSDP a prefix pass would run on
        # some ranks only, and a prefix's keys and values reused by a batch fail FSDP2's backward
        self.packing = Packing(attn_ratio(self.model), self.tokenizer.pad_token_id,
                               share_prefix=not checkpointing(self.model) and not dist.sharded)
        self.weights = group_weights(self.train_items, cfg.use_weights)  # None: the plain loss, as train-reward's
        if self.reference.frozen is not None:  # full fine-tuning: a copy as large as the policy, sharded alike
            dist.shard_frozen(self.reference.frozen)
        return Loaded(model=self.model, lengths=[it.length for it in self.train_items],
                      fields={"stage": "train-dpo", "dpo": to_dict(cfg), "model": to_dict(model_cfg),
                              "policy": run.start, "parent": self.parent,
                              "base_model": self.model.rlhf_meta["base_model"], "weighted": self.weights is not None},
                      data_report=data_report, truncations=(trunc_train, trunc_eval),
                      sequences=sum(len(g.responses) for g in self.train_items + self.eval_items),
                      eval_data=cfg.eval_data)

    def train_step(self, training: Training) -> Callable:
        """One optimiser step = grad_accum micro-batches of batch_size groups: `dpo_step`."""
        return dpo_step(self.run.cfg, training, self.reference, self.train_items, self.weights, self.packing)

    def finish(self, training: Training, done: Steps, after: AfterTraining) -> Finished:
        """The held-out pairs (implicit-reward accuracy and margins), KL to the reference on samples
        of the trained policy for held-out prompts, and the checkpoint and the policy with its lineage."""
        cfg, dist = self.run.cfg, self.run.dist
        after.phase("evaluating")
        report = evaluate_pairs(self.model, self.reference, self.eval_items, cfg, self.packing, training.amp, dist)
        if cfg.kl_prompts > 0 and self.eval_pairs:
            after.phase("measuring KL")
            report.update(heldout_kl(self.model, self.reference, self.tokenizer, [p.prompt for p in self.eval_pairs],
                                     cfg, training.amp, dist))
        after.check()
        self.save_policy(training, done, method="dpo", loss=cfg.loss, beta=cfg.beta)
        own = {**report, "policy": str(self.run.out_dir / "policy"),
               "train/pairs": sum(g.n_pairs for g in self.train_items), "train/groups": len(self.train_items),
               "train/weighted": self.weights is not None,
               "eval/prompts": len({str(p.prompt) for p in self.eval_pairs})}
        return Finished(report, own)


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline train-dpo",
                                     description="DPO (or IPO) on preference pairs: a new policy, no reward model.")
    parser.add_argument("--data", required=True, help="pairs: .jsonl/.json/.parquet, a datasets folder, or HH-RLHF style")
    parser.add_argument("--out", required=True, help="run directory (new, or the one to --resume)")
    parser.add_argument("--policy", default="",
                        help="starting policy: a folder saved by ppo or train-dpo (its adapter keeps training); "
                             "'' = the base model (--model)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out (optimiser and step)")
    add_report_to(parser)
    add_arguments(parser, DPOConfig)
    add_arguments(parser, ModelConfig)
    return parser


def print_summary(report: dict) -> None:
    """A finished run's held-out implicit-reward accuracy, KL to the reference, and policy folder."""
    if "eval/reward_accuracy" in report:
        print(f"held-out implicit-reward accuracy {report['eval/reward_accuracy']:.3f} on {report['eval/pairs']} "
              f"pairs, margin {report['eval/margin']:.3f}")
    if "kl/heldout" in report:
        print(f"KL to the reference on held-out prompts: {report['kl/heldout']:.3f} +- {report['kl/heldout_se']:.3f} "
              f"nats per response ({report['kl/samples']} samples)")
    print(f"policy: {report['policy']}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, model_cfg = from_args(DPOConfig, args), from_args(ModelConfig, args)
    open_tracker(args.out, args.report_to)  # metrics.jsonl's lines also as TensorBoard events
    return stage_main(lambda: train_dpo(args.data, args.out, cfg, model_cfg, policy=args.policy, resume=args.resume),
                      print_summary)


if __name__ == "__main__":
    sys.exit(main())
