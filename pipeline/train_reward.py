"""Train a reward model on preference pairs: pairs file in, run directory out.

    python -m pipeline train-reward --data pairs.parquet --out runs/rm-1 [--epochs 1 --lr 5e-5
        --batch-size 2 --grad-accum 1 --max-length 512 --lora true --model default ...]

The model is `load_scalar_model(kind="reward")` on the policy's base model (SmolLM2-135M-Instruct
by default), LoRA or full fine-tuning. Loss: Bradley-Terry -log sigmoid(r_c - r_r [- margin])
(Ouyang et al. 2022, eq. 1), optional reward centering (TRL) and LM loss on the chosen response
(Askell et al. 2021). With a `weight` column (an export's quality_weights, from its annotators'
quality) each pair's Bradley-Terry term counts by its weight over the training pairs' mean
weight (--use-weights false ignores the column; data without one trains on the plain loss).

A batch element is a ranking's pairs (--grouped, the default; InstructGPT sec. 3.5: "all (K choose
2) comparisons from each prompt as a single batch element"; pairs_data.group_pairs: by ranking id,
else by prompt): its prompt runs once and each distinct response once, continuing from the
prompt's KV cache in one forward pass (reward_eval.forward_groups), and every pair's gap is read
from those scores; a ranking's loss is the mean over its pairs, a batch's the mean over rankings
(losses.grouped_pairwise_loss), and --batch-size counts rankings. --grouped false trains pair by
pair: each pair's prompt once and its chosen and rejected responses from its KV cache
(forward_pairs), --batch-size counting pairs. --share-prompt false: whole sequences, one row per
response. Batches group items of similar length and are padded only to their own longest row;
long batches are split into chunks of at most --max-tokens, never splitting a pair or a ranking.
Train metrics and the held-out figures are per pair either way.

Run directory (written only here; the app tails it and registers the model):
    config.json        configs, input file and its sha256, command line
    status.json        {"state", "progress", "step", "total", ...}, rewritten as it goes
    metrics.jsonl      one line per optimiser step: {"step", "train/loss", "train/accuracy", ...},
                       then the eval/ line
    tensorboard/       the same lines as TensorBoard events (--report-to tensorboard, the default)
    checkpoint/        save_scalar_model (adapter or weights, head, reward_mean/std)
    trainer_state.pt   optimiser, scheduler and step, for --resume
    eval_report.json   held-out accuracy, margin, calibration, length baseline, truncation counts

Ctrl-C or SIGTERM (the job runner's cancel) finishes the current step, saves a usable checkpoint,
and marks the run 'cancelled' (exit code 130); `--resume` continues it with the run's own
settings, optimiser and step. A second Ctrl-C stops at once. `--init-from` warm-starts from a
previous reward checkpoint (the loop does this every round).

Held-out pairs: --eval-data, else a snapshot's own 'test' split, else eval_fraction of the prompts.
Bad input (pipeline/pairs_data.py): an empty or unreadable file is refused naming file, row and
field; pairs with chosen == rejected are dropped and counted (they carry no preference and give a
zero gradient), and a file of nothing else is refused; texts over max_length lose prompt tokens
from the left, counted in eval_report.json ("truncation"), never dropped.

Reference run, SmolLM2-135M-Instruct on the HH dev pairs, 1,601 pairs for training and 399 held
out (split by prompt; one pair per prompt, so each group is a pair and a batch 8 pairs):

    python -m pipeline train-reward --data tests/data/hh_dev_pairs.jsonl --out runs/rm-hh \\
        --eval-fraction 0.2 --epochs 1 --batch-size 8 --lr 1e-4 --max-length 512 --norm-samples 16

On 2 idle CPU cores (fp32, LoRA r16) about 0.8 pairs/s, so ~35 min for the epoch of 201 steps
(58 prompts truncated from the left, none dropped). Held-out accuracy 0.504 against 0.508 for "the longer response
wins": one epoch of 1,600 HH pairs does not teach a 135M model this task (the training loss stays
near log 2). HH-RLHF is hard for small models; expect a GPU run with more data, more epochs or
full fine-tuning to be needed before the accuracy means anything.

It prints the held-out accuracy beside the longer-response baseline and the calibration table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.config import ModelConfig, RewardConfig, add_arguments, from_args, to_dict
from pipeline.distributed import Dist, full_state_dict
from pipeline.lifecycle import STATE_FILE, AfterTraining, Steps, Training, recover, save_state, stage_main
from pipeline.losses import center_loss, group_mean, grouped_pairwise_loss, plackett_luce_loss, weighted_pairwise_loss
from pipeline.models import load_scalar_model, resolve_model_path
from pipeline.pairs_data import (encode_groups, encode_pairs, encode_rankings, group_pairs, group_weights, pair_weights,
                                  prompt_key, read_rankings, train_eval_data)
from pipeline.reward_eval import evaluate, forward_groups, forward_pairs, forward_rankings, normalisation_stats
from pipeline.rundir import open_tracker
from pipeline.saving import save_scalar_model
from pipeline.tracking import add_report_to
from pipeline.trainer import DatasetTrainer, Finished, Loaded, train

# --------------------------------------------------------------------------- helpers


def token_chunks(idx: list[int], lengths: list[int], max_tokens: int, rows: list[int] | None = None) -> list[list[int]]:
    """Split one batch of item indices into chunks whose padded size (rows per item: 2 for a pair
    (rows None), a group's or ranking's response count; x longest row) stays within max_tokens; an
    item is never split, and one that alone exceeds it runs alone. 0 = one chunk."""
    if max_tokens <= 0:
        return [idx]
    chunks, current, n_rows = [], [], 0
    for i in sorted(idx, key=lambda j: -lengths[j]):  # longest first: each chunk's width is its first
        n_rows += rows[i] if rows else 2
        if current and n_rows * lengths[current[0]] > max_tokens:
            chunks.append(current)
            current, n_rows = [], rows[i] if rows else 2
        current.append(i)
    return chunks + [current]


def lm_head_weight(model, cache_dir: str) -> torch.Tensor:
    """(V, H) output embedding for the LM term: the input embeddings when tied (SmolLM2), else the
    base model's lm_head.weight read from its safetensors (frozen; the reward backbone has no head)."""
    backbone = model.backbone
    if getattr(backbone.config, "tie_word_embeddings", False):
        return backbone.get_input_embeddings().weight
    from safetensors import safe_open

    folder = Path(resolve_model_path(model.base_model, cache_dir))
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            if "lm_head.weight" in fh.keys():
                device = next(backbone.parameters()).device
                return fh.get_tensor("lm_head.weight").to(device)
    raise ValueError(f"--lm-coef needs the base model's lm_head.weight; none in {folder}")


# --------------------------------------------------------------------------- training


def train_reward(data: str, out: str, cfg: RewardConfig, model_cfg: ModelConfig, resume: bool = False,
                 init_from: str = "", on_step=None) -> dict:
    """Train, evaluate, normalise and save (RewardTrainer through pipeline/trainer.py). Returns the
    eval report (also in eval_report.json), or {"state": "cancelled", ...} when a signal stopped it.

    on_step(step, metrics) is called after each optimiser step (tests use it to send signals).
    Under a launcher of N processes (pipeline/distributed.py) every rank calls this; each takes its
    share of every batch and rank 0 writes the run directory.
    """
    return train(RewardTrainer, data, out, cfg, model_cfg, start=init_from, resume=resume, on_step=on_step)


def pair_loss(cfg: RewardConfig, wrapped, items: list, weights: list[float] | None, *, pad_id: int, device,
              share_prompt: bool, lm_weight):
    """The Bradley-Terry loss of a chunk of pairs (with margin, centering and LM terms when set):
    (loss, each pair scored in order (b,), its score gap (b,), real tokens)."""
    r_c, r_r, lm, margin, tokens = wrapped(  # (b,), (b,), scalar, (b,)
        forward_pairs, items, pad_id, device, share_prompt, lm_weight)
    w = None if weights is None else torch.tensor(weights, device=device)  # (b,)
    loss = weighted_pairwise_loss(r_c, r_r, w, margin if cfg.margin else None)
    if cfg.center_coef > 0:
        loss = loss + cfg.center_coef * center_loss(r_c, r_r)
    if lm is not None:
        loss = loss + cfg.lm_coef * lm
    gap = (r_c - r_r).detach()
    return loss, (gap > 0).float(), gap, tokens


def group_loss(cfg: RewardConfig, wrapped, items: list, weights: list[list[float]] | None, *, pad_id: int, device,
               share_prompt: bool, lm_weight):
    """The Bradley-Terry loss of a chunk of groups, each group's responses scored once
    (`forward_groups`): per group the mean over its pairs of the weighted pair loss (margin when
    set) plus center_coef (r_c + r_r)^2, the chunk's the mean over groups (`grouped_pairwise_loss`),
    plus lm_coef times the LM term on the chosen responses. weights: per group, each pair's (or
    None). Returns (loss, each pair scored in order (n,), its score gap (n,), real tokens)."""
    scores, batch, lm, tokens = wrapped(forward_groups, items, pad_id, device, share_prompt, lm_weight)  # (N,)
    c, r, g = batch["chosen"], batch["rejected"], batch["group"]  # (n,)
    w = None if weights is None else torch.tensor([x for ws in weights for x in ws], device=device)  # (n,)
    loss = grouped_pairwise_loss(scores, c, r, g, w, batch["margin"] if cfg.margin else None)
    if cfg.center_coef > 0:
        loss = loss + cfg.center_coef * group_mean((scores[c] + scores[r]) ** 2, g)
    if lm is not None:
        loss = loss + cfg.lm_coef * lm
    gap = (scores[c] - scores[r]).detach()
    return loss, (gap > 0).float(), gap, tokens


def ranking_loss(wrapped, items: list, *, pad_id: int, device):
    """The Plackett-Luce loss of a chunk of rankings, mean over rankings: (loss, per ranking the
    share of its ordered pairs scored in order (b,) and their mean score gap (b,), real tokens)."""
    scores, tokens = wrapped(forward_rankings, items, pad_id, device)
    losses, right, gaps = [], [], []
    for s, it in zip(scores, items):
        tiers = torch.tensor(it.tiers, device=s.device)
        losses.append(plackett_luce_loss(s, tiers))
        above = tiers[:, None] < tiers[None, :]  # (K, K): i ranked above j
        gap = (s[:, None] - s[None, :]).detach()[above]
        right.append((gap > 0).float().mean())
        gaps.append(gap.mean())
    return torch.stack(losses).mean(), torch.stack(right), torch.stack(gaps), tokens


def reward_step(cfg: RewardConfig, training: Training, items: list, weights: list | None, *, pad_id: int,
                share_prompt: bool, lm_weight) -> Callable:
    """The optimiser step run_steps calls: the loss (`pair_loss` on pairs, `group_loss` on groups,
    `ranking_loss` on rankings for 'plackett-luce') over a step's micro-batches of indices into
    `items`; returns (metrics, pairs, tokens). train/loss is the mean over items (pairs, groups or
    rankings, as the loss counts them), train/accuracy and train/margin over pairs (rankings: the
    share of each ranking's ordered pairs, per ranking)."""
    dist, wrapped = training.dist, training.wrapped
    ranked = cfg.loss == "plackett-luce"
    grouped = not ranked and cfg.grouped
    lengths = [it.length for it in items]
    rows = [len(it.responses) for it in items] if ranked or grouped else None  # sequences per item (a pair: 2)

    def chunk_loss(chunk: list[int]):
        batch = [items[i] for i in chunk]
        if ranked:
            return ranking_loss(wrapped, batch, pad_id=pad_id, device=dist.device)
        loss_of = group_loss if grouped else pair_loss
        return loss_of(cfg, wrapped, batch, None if weights is None else [weights[i] for i in chunk],
                       pad_id=pad_id, device=dist.device, share_prompt=share_prompt, lm_weight=lm_weight)

    def train_step(micro: list[list[int]]) -> tuple[dict, int, int]:
        sums = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0, "items": 0, "pairs": 0, "tokens": 0}
        # A long batch runs as several forward passes of at most max_tokens tokens, never splitting an
        # item; each chunk's loss is weighted by its share of the batch's items, so the gradient is the
        # batch's own (the loss is a mean over items). With N processes each takes every N-th item of
        # each batch, and DDP's mean over ranks undoes loss_scale.
        chunks = [(chunk, len(chunk) / len(idx) / len(micro) * dist.loss_scale)
                  for idx in micro for chunk in token_chunks(dist.shard(idx), lengths, cfg.max_tokens, rows) if chunk]
        if not chunks:  # fewer items than processes: this rank joins the all-reduce with zeros
            chunks = [(micro[0][:1], 0.0)]
        if dist.sharded:  # every layer's forward gathers across ranks: run as many as the busiest
            chunks += [(micro[0][:1], 0.0)] * (max(dist.gather_objects(len(chunks))) - len(chunks))
        for j, (chunk, weight) in enumerate(chunks):
            with dist.sync(wrapped, last=j == len(chunks) - 1):  # one all-reduce per step
                with training.amp():
                    loss, right, gap, tokens = chunk_loss(chunk)
                (loss * weight).backward()
            if weight == 0.0:
                continue
            sums["loss"] += loss.item() * len(chunk)
            sums["items"] += len(chunk)
            sums["accuracy"] += right.sum().item()
            sums["margin"] += gap.sum().item()
            sums["pairs"] += len(right)
            sums["tokens"] += tokens
        sums, grad_norm, n = training.optimizer_step(sums)
        return {"train/loss": sums["loss"] / sums["items"], "train/accuracy": sums["accuracy"] / n,
                "train/margin": sums["margin"] / n, "train/grad_norm": grad_norm}, n, sums["tokens"]

    return train_step


def training_rankings(data: str, cfg: RewardConfig, eval_pairs: list, data_report: dict) -> list:
    """The rankings Plackett-Luce trains on: the snapshot's (pairs_data.read_rankings) minus those
    of its test split and of every held-out pair's prompt; counted in data_report['rankings']."""
    if cfg.margin or cfg.center_coef > 0 or cfg.lm_coef > 0:
        raise ValueError("--loss plackett-luce trains on whole rankings: --margin, --center-coef and --lm-coef "
                         "are Bradley-Terry's pair terms (use --loss bt)")
    rankings, report = read_rankings(data)
    held = {prompt_key(p.prompt) for p in eval_pairs}
    train = [r for r in rankings if r.split != "test" and prompt_key(r.prompt) not in held]
    data_report["rankings"] = {**report, "train": len(train)}
    if not train:
        raise ValueError(f"{report['file']}: no rankings left to train on after holding out the evaluation prompts")
    return train


def encode_items(pairs: list, tokenizer, cfg: RewardConfig, data_report: dict, side: str):
    """(items, truncation report) of the training or held-out pairs (`side`): groups
    (pairs_data.group_pairs, a ranking's pairs as one item) with cfg.grouped, counted in
    data_report['groups'][side], else the pairs themselves."""
    if not cfg.grouped:
        return encode_pairs(pairs, tokenizer, cfg.max_length)
    groups = group_pairs(pairs)
    data_report.setdefault("groups", {})[side] = {
        "groups": len(groups), "responses": sum(len(g.responses) for g in groups),
        "pairs_max": max((len(g.chosen) for g in groups), default=0)}
    return encode_groups(groups, tokenizer, cfg.max_length)


def sequences(items: list) -> int:
    """Sequences (prompt + response) the items hold: a pair's two, a group's or a ranking's responses."""
    return sum(len(it.responses) if hasattr(it, "responses") else 2 for it in items)


def shares_prompt(cfg: RewardConfig, model_cfg: ModelConfig, dist: Dist) -> bool:
    """Whether a pair's prompt runs once for both responses in training (cfg.share_prompt): not with
    gradient checkpointing, which turns the KV cache off, nor sharded, where a prompt's keys and
    values reused by its responses fail FSDP2's backward (storage of a resharded weight;
    tests/test_distributed.py; the numbers are the same either way)."""
    return cfg.share_prompt and not model_cfg.gradient_checkpointing and not dist.sharded


class RewardTrainer(DatasetTrainer):
    """train-reward's side of the driver (pipeline/trainer.py): pairs (or rankings) in, a reward
    model out, evaluated on held-out pairs and normalised on samples of the reference policy."""

    name, section, config, start_key = "train-reward", "reward", RewardConfig, "init_from"
    results = ("checkpoint", STATE_FILE, "eval_report.json")
    desc, shown = "reward model", ("train/accuracy", "acc")

    @staticmethod
    def check(cfg: RewardConfig) -> None:
        if cfg.batch_size < 1 or cfg.grad_accum < 1 or cfg.epochs < 1:
            raise ValueError("batch_size, grad_accum and epochs must be at least 1")
        if cfg.loss not in ("bt", "plackett-luce"):
            raise ValueError(f"--loss {cfg.loss!r}: use 'bt' (Bradley-Terry on pairs) or 'plackett-luce' "
                             "(whole rankings)")

    def load(self) -> Loaded:
        run, cfg, model_cfg = self.run, self.run.cfg, self.run.model_cfg
        # Full fine-tuning keeps fp32 master weights and runs bf16 under autocast; with LoRA the frozen
        # base may sit in bf16 (models.py keeps the LoRA weights fp32).
        load_cfg = ModelConfig(**{**vars(model_cfg), "dtype": "fp32" if not model_cfg.lora else model_cfg.dtype})
        # 1. Data: read, drop identical pairs; held-out pairs from --eval-data, the snapshot's 'test'
        #    split, or eval_fraction of the prompts.
        self.train_pairs, self.eval_pairs, data_report = train_eval_data(run.data, cfg.eval_data, cfg.eval_fraction,
                                                                         cfg.seed)
        #    Plackett-Luce trains on the rankings of the training pairs' prompts instead (the held-out
        #    pairs stay the evaluation, so both losses are measured alike)
        rankings = training_rankings(run.data, cfg, self.eval_pairs, data_report) if cfg.loss == "plackett-luce" \
            else None
        # 2. Model: a new reward head on the base model, a previous reward model (--init-from), or this
        #    run's own checkpoint (--resume).
        if run.resume:  # a kill in the middle of a checkpoint write leaves the last good one to put back
            recover(run.out_dir / "checkpoint", run.dist)
        source = str(run.out_dir / "checkpoint") if run.resume else (run.start or model_cfg.model)
        self.model, self.tokenizer = load_scalar_model(source, "reward", load_cfg)
        self.train_items, trunc_train = encode_rankings(rankings, self.tokenizer, cfg.max_length) \
            if rankings is not None else encode_items(self.train_pairs, self.tokenizer, cfg, data_report, "train")
        self.eval_items, trunc_eval = encode_items(self.eval_pairs, self.tokenizer, cfg, data_report, "eval")
        self.ranked = rankings is not None
        self.lm_weight = lm_head_weight(self.model, model_cfg.cache_dir) if cfg.lm_coef > 0 else None  # unsharded
        #    each training item's weight (groups, pairs; none for rankings); None: the plain loss
        self.weights = None if self.ranked else group_weights(self.train_items, cfg.use_weights) if cfg.grouped \
            else pair_weights(self.train_items, cfg.use_weights)
        self.model.train()
        return Loaded(model=self.model, lengths=[it.length for it in self.train_items],
                      fields={"reward": to_dict(cfg), "model": to_dict(model_cfg), "init_from": run.start,
                              "base_model": self.model.base_model},
                      data_report=data_report, truncations=(trunc_train, trunc_eval),
                      sequences=sequences(self.train_items) + sequences(self.eval_items), eval_data=cfg.eval_data)

    def train_step(self, training: Training) -> Callable:
        """One optimiser step = grad_accum micro-batches of batch_size items (groups, pairs with
        --grouped false, rankings with plackett-luce): `reward_step`."""
        return reward_step(self.run.cfg, training, self.train_items, self.weights,
                           pad_id=self.tokenizer.pad_token_id,
                           share_prompt=shares_prompt(self.run.cfg, self.run.model_cfg, self.run.dist),
                           lm_weight=self.lm_weight)

    def save(self, training: Training, step: int, norm: dict | None = None) -> None:
        """checkpoint/ (save_scalar_model: adapter or weights, head, the normalisation once `norm`
        is set) and trainer_state.pt."""
        dist = self.run.dist
        whole = full_state_dict(self.model) if dist.sharded else None  # every rank takes part in gathering
        state = training.state(step, normalised=norm is not None)
        if dist.is_main:
            save_scalar_model(self.model, self.tokenizer, self.run.out_dir / "checkpoint", state_dict=whole)
        save_state(self.run.out_dir, state, dist)

    def finish(self, training: Training, done: Steps, after: AfterTraining) -> Finished:
        """The held-out evaluation (accuracy, margin, calibration, length baseline), the reward
        normalisation on reference-policy samples (pipeline/reward_eval.py), and the final checkpoint."""
        cfg, dist = self.run.cfg, self.run.dist
        # sharded: every rank scores every pair (the same forward passes on all ranks, as the gathers need)
        shared = None if dist.sharded else dist
        report = evaluate(self.model, self.eval_items, self.tokenizer.pad_token_id, dist.device, self.run.dtype,
                          2 * cfg.batch_size, cfg.share_prompt, shared,
                          on_progress=after.on_progress("evaluating", "held-out pairs"))
        calibration = report.pop("calibration", [])
        norm = None
        if cfg.norm_samples > 0:  # the model's reward mean and std, stored in its checkpoint
            norm = normalisation_stats(self.model, self.train_pairs, cfg, self.run.model_cfg, training.amp,
                                       dist=shared, on_progress=after.on_progress("normalising", "samples"))
            self.model.reward_mean, self.model.reward_std = norm["reward_mean"], norm["reward_std"]
        after.check()
        self.save(training, done.step, norm)
        logged = {**report, **({"norm/reward_mean": norm["reward_mean"], "norm/reward_std": norm["reward_std"]}
                               if norm else {})}
        own = {**report, "calibration": calibration, "normalisation": norm,
               "checkpoint": str(self.run.out_dir / "checkpoint"), "train/pairs": len(self.train_pairs),
               "train/weighted": self.weights is not None,
               **({"train/rankings": len(self.train_items)} if self.ranked else {}),
               "train/prompts": len({str(p.prompt) for p in self.train_pairs}),
               "eval/prompts": len({str(p.prompt) for p in self.eval_pairs})}
        return Finished(logged, own)


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline train-reward",
                                     description="Train a reward model on preference pairs.")
    parser.add_argument("--data", required=True, help="pairs: .jsonl/.json/.parquet, a datasets folder, or HH-RLHF style")
    parser.add_argument("--out", required=True, help="run directory (new, or the one to --resume)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out (optimiser and step)")
    parser.add_argument("--init-from", default="", help="start from a previous reward checkpoint folder")
    add_report_to(parser)
    add_arguments(parser, RewardConfig)
    add_arguments(parser, ModelConfig)
    return parser


def print_summary(report: dict) -> None:
    """A finished run's held-out figures, calibration table, truncation counts and checkpoint."""
    if "eval/accuracy" in report:
        print(f"held-out accuracy {report['eval/accuracy']:.3f} on {report['eval/pairs']} pairs "
              f"(longer-response baseline {report['eval/length_baseline_accuracy']:.3f}), "
              f"mean margin {report['eval/margin']:.3f}")
        for row in report["calibration"]:
            print(f"  |r_c - r_r| {row['abs_diff_min']:.2f}-{row['abs_diff_max']:.2f}: accuracy "
                  f"{row['accuracy']:.2f} (model says {row['predicted']:.2f}), {row['count']} pairs")
    t = report["truncation"]
    print(f"truncated to {t['max_length']} tokens: {t['prompt_truncated']} prompts, "
          f"{t['response_truncated']} responses of {t['sequences']} sequences; "
          f"{report['data']['dropped_identical']} pairs dropped (chosen == rejected)")
    print(f"checkpoint: {report['checkpoint']}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, model_cfg = from_args(RewardConfig, args), from_args(ModelConfig, args)
    open_tracker(args.out, args.report_to)  # metrics.jsonl's lines also as TensorBoard events
    return stage_main(lambda: train_reward(args.data, args.out, cfg, model_cfg, resume=args.resume,
                                           init_from=args.init_from), print_summary)


if __name__ == "__main__":
    sys.exit(main())
