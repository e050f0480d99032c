"""Supervised fine-tuning on demonstrations: the answers annotators wrote themselves, policy out.

    python -m pipeline sft --data demonstrations.jsonl --out runs/sft-1 [--policy POLICY_DIR
        --epochs 3 --lr 5e-5 --batch-size 8 --grad-accum 1 --max-length 512 ...]

The data is an export's demonstrations.jsonl (store/export.py) or any file in TRL's SFT formats:
conversational rows `{"messages": [..., {"role": "assistant", "content": answer}]}` (the messages
before the last are the prompt) or `{"prompt": ..., "completion": ...}`. A row whose `split` is
`test` is held out: its loss is reported, never trained on. Each demonstration is encoded as the
policy samples (pipeline/text.py: the chat template with SYSTEM_PROMPT and the generation prompt,
then the answer and EOS), and the loss is the answer's mean negative log-likelihood per token (the
prompt's tokens are not predicted: TRL's completion-only loss), with the answer's token accuracy.

The policy starts from --policy (a folder saved by ppo, train-dpo or sft: its LoRA adapter or full
weights keep training) or the base model (--model); the trained policy names its parent, so a
round can start from it (the Train tab's "Fine-tune on demonstrations" activates it).

Run directory (as train-dpo's; the app tails it and registers the policy):
    config.json      configs, the data file and its sha256, the starting policy, command line
    status.json      {"state", "progress", "step", "total", "phase", ...}
    metrics.jsonl    one line per optimiser step: train/loss, train/token_accuracy, train/lr, ...;
                     then the eval/ line (held-out demonstrations)
    checkpoint/, trainer_state.pt   the policy and optimiser as trained so far, for --resume
    policy/          the trained policy; model_meta.json names its parent, "method": "sft", the data's sha256
    eval_report.json train/ and eval/ loss and token accuracy over every demonstration, timings

Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and marks the run 'cancelled'
(exit code 130); --resume continues it. Under a launcher of N processes each rank takes its share
of every batch (DDP).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from formats.hashing import snapshot_sha256
from formats.rows import RowsError, read_rows
from pipeline.config import ModelConfig, SFTConfig, add_arguments, from_args, to_dict
from pipeline.distributed import setup
from pipeline.models import checkpointing, pick_dtype
from pipeline.policy import causal_lm_logits, load_policy_weights, load_starting_policy
from pipeline.pairs_data import EncodeReport
from pipeline.lifecycle import (STATE_FILE, AfterTraining, StepLoop, Training, cancelled, claim, guarded, recover,
                                run_steps, save_state, start_training, write_report, write_run_config)
from pipeline.rundir import append_metrics, is_writer, open_tracker, write_status
from pipeline.saving import save_whole_policy
from pipeline.text import encode_response, prompt_token_ids
from pipeline.tracking import add_report_to


@dataclass(frozen=True)
class Demonstration:
    prompt: object
    """The prompt as the policy reads it: text, or chat messages."""
    answer: str
    held_out: bool


def read_demonstrations(path: str | Path) -> list[Demonstration]:
    """The demonstrations of a file in TRL's SFT formats (module docstring); a row that is neither
    refuses the file naming the row."""
    problems = []
    out = []
    try:
        rows = read_rows(path)
    except RowsError as exc:
        raise ValueError(str(exc)) from None
    for n, row in rows:
        held_out = row.get("split") == "test"
        messages = row.get("messages")
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict) \
                and messages[-1].get("role") == "assistant" and isinstance(messages[-1].get("content"), str):
            prompt, answer = messages[:-1], messages[-1]["content"]
        elif isinstance(row.get("prompt"), (str, list)) and isinstance(row.get("completion"), str):
            prompt, answer = row["prompt"], row["completion"]
        else:
            problems.append(f"row {n}: neither 'messages' ending with the assistant's answer nor 'prompt' and "
                            "'completion'")
            continue
        if not prompt or not answer.strip():
            problems.append(f"row {n}: an empty prompt or answer")
            continue
        out.append(Demonstration(prompt, answer, held_out))
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    if not [d for d in out if not d.held_out]:
        raise ValueError(f"{path}: no demonstration to train on")
    return out


def encode(demos: list[Demonstration], tokenizer, max_length: int) -> tuple[list[tuple[list[int], int]], EncodeReport]:
    """(token ids, answer's first position) per demonstration, at most max_length tokens: a long
    prompt loses its start, then a long answer its end."""
    report = EncodeReport()
    out = []
    for d in demos:
        prompt, answer = prompt_token_ids(tokenizer, d.prompt), encode_response(tokenizer, d.answer)
        report.max_tokens_seen = max(report.max_tokens_seen, len(prompt) + len(answer))
        keep_prompt = max(1, min(len(prompt), max_length - len(answer)))
        if keep_prompt < len(prompt):
            report.prompt_truncated += 1
            prompt = prompt[-keep_prompt:]
        if len(prompt) + len(answer) > max_length:
            report.response_truncated += 1
            answer = answer[:max_length - len(prompt)]
        out.append((prompt + answer, len(prompt)))
    return out, report


def answer_loss(model, items: list[tuple[list[int], int]], pad_id: int, device) -> tuple[torch.Tensor, int, int]:
    """(summed NLL of the answers' tokens, answer tokens, correctly predicted tokens) of a batch."""
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, (ids, start) in enumerate(items):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = 1
        labels[i, start:len(ids)] = torch.tensor(ids[start:])
    input_ids, mask, labels = input_ids.to(device), mask.to(device), labels.to(device)
    logits = causal_lm_logits(model, input_ids, mask)[:, :-1].float()
    target = labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                           reduction="sum")
    scored = target != -100
    correct = int(((logits.argmax(-1) == target) & scored).sum())
    return loss, int(scored.sum()), correct


def train_sft(data: str, out: str, cfg: SFTConfig, model_cfg: ModelConfig, policy: str = "",
              resume: bool = False) -> dict:
    """Train on the demonstrations, evaluate the held-out ones and save; returns the report (also in
    eval_report.json), or {"state": "cancelled", ...} when a signal stopped the run."""
    out_dir = Path(out)
    if cfg.batch_size < 1 or cfg.grad_accum < 1 or cfg.epochs < 1 or cfg.max_steps < 0 or cfg.max_length < 2:
        raise ValueError("--batch-size, --grad-accum and --epochs must be at least 1, --max-steps >= 0, "
                         "--max-length >= 2")
    dist = setup(model_cfg.device)
    if dist.sharded:
        raise ValueError("sft runs under DDP (configs/accelerate/ddp.yaml), not FSDP")
    saved = claim(out_dir, resume=resume, data=data, results=("checkpoint", STATE_FILE, "policy", "eval_report.json"),
                  dist=dist)
    if saved:
        cfg, policy = SFTConfig(**saved["sft"]), saved["policy"]
        model_cfg = ModelConfig(**{**saved["model"], "device": model_cfg.device, "dtype": model_cfg.dtype})
    with guarded(out_dir, dist) as progress:
        report = _train(data, out_dir, cfg, model_cfg, policy, resume, progress, dist)
        dist.close()
        return report


def sft_step(training: Training, items: list[tuple[list[int], int]], pad_id: int) -> Callable:
    """The optimiser step run_steps calls: the answers' NLL per token over a step's micro-batches of
    indices into `items`; returns (metrics, demonstrations, answer tokens)."""
    dist, wrapped = training.dist, training.wrapped

    def train_step(micro: list[list[int]]) -> tuple[dict, int, int]:
        sums = {"loss": 0.0, "pairs": 0, "tokens": 0, "correct": 0}
        step_tokens = sum(len(items[i][0]) - items[i][1] for idx in micro for i in idx)
        for j, idx in enumerate(micro):
            # each rank takes every N-th demonstration; the sum over its answer tokens, scaled by the
            # step's tokens (every rank's) and loss_scale (undoing DDP's mean), is the step's mean
            mine, scale = dist.shard(idx), dist.loss_scale / step_tokens
            if not mine:  # fewer demonstrations than processes: join the all-reduce with a zero loss
                mine, scale = idx[:1], 0.0
            with dist.sync(wrapped, last=j == len(micro) - 1), training.amp():
                loss, tokens, correct = wrapped(answer_loss, [items[i] for i in mine], pad_id, dist.device)
            (loss * scale).backward()
            if scale:
                sums["loss"] += loss.item()
                sums["pairs"] += len(mine)
                sums["tokens"] += tokens
                sums["correct"] += correct
        sums, grad_norm, n = training.optimizer_step(sums)
        return {"train/loss": sums["loss"] / max(sums["tokens"], 1),
                "train/token_accuracy": sums["correct"] / max(sums["tokens"], 1),
                "train/grad_norm": grad_norm}, n, sums["tokens"]

    return train_step


def _train(data, out_dir: Path, cfg: SFTConfig, model_cfg: ModelConfig, policy: str, resume: bool, progress: dict,
           dist) -> dict:
    device = dist.device
    dtype = pick_dtype(model_cfg.dtype, device)
    if dtype == torch.float16:
        raise ValueError("--dtype fp16: sft has no loss scaling; use bf16 (or fp32)")
    torch.manual_seed(cfg.seed)
    demos = read_demonstrations(data)
    model, tokenizer, parent = load_starting_policy(policy, model_cfg, device, dtype)
    if resume:
        recover(out_dir / "checkpoint", dist)
        load_policy_weights(model, out_dir / "checkpoint")
    train_items, trunc_train = encode([d for d in demos if not d.held_out], tokenizer, cfg.max_length)
    eval_items, trunc_eval = encode([d for d in demos if d.held_out], tokenizer, cfg.max_length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.train(checkpointing(model))
    data_report = {"demonstrations": len(demos), "train": len(train_items), "held_out": len(eval_items)}
    if not resume:
        write_run_config(out_dir, {"stage": "sft", "sft": to_dict(cfg), "model": to_dict(model_cfg), "policy": policy,
                                   "parent": parent, "base_model": model.rlhf_meta["base_model"]},
                         data=data, eval_data="", data_report=data_report, dist=dist)
    training = start_training(model, len(train_items), cfg, out_dir, resume, dist, dtype)
    total = training.schedule.total

    def save(step: int) -> None:
        save_whole_policy(model, tokenizer, out_dir / "checkpoint", dist)
        save_state(out_dir, training.state(step), dist)

    lengths = [len(ids) for ids, _ in train_items]
    done = run_steps(out_dir, cfg, StepLoop(training, lengths, sft_step(training, train_items, pad_id), save,
                                            desc="sft", shown=("train/token_accuracy", "acc")), progress)
    if done.stopped:
        return cancelled(out_dir, done, total, save, dist)

    # The trained weights saved first (a stop from here on loses no training: --resume runs only what
    # follows again), then the losses on the training and held-out demonstrations, the checkpoint
    # and the policy with its lineage.
    with AfterTraining(out_dir, done, total, save, dist) as after:
        after.check()
        write_status(out_dir, "running", done.step, total, phase="evaluating")
        report = {**_evaluate(model, train_items, pad_id, device, training.amp, cfg.batch_size, "train"),
                  **_evaluate(model, eval_items, pad_id, device, training.amp, cfg.batch_size, "eval")}
        after.check()
        model.rlhf_meta = {**model.rlhf_meta, "parent": parent, "method": "sft", "data": str(data),
                           "data_sha256": snapshot_sha256(data), "run": str(out_dir.resolve()), "steps": done.step}
        save(done.step)
        save_whole_policy(model, tokenizer, out_dir / "policy", dist)
        dist.barrier()
    if after.result:
        return after.result
    append_metrics(out_dir, done.step, report)
    own = {**report, "policy": str(out_dir / "policy"), "train/demonstrations": len(train_items),
           "eval/demonstrations": len(eval_items)}
    return write_report(out_dir, own, done, total, data_report, cfg.max_length, (trunc_train, trunc_eval),
                        len(train_items) + len(eval_items))


@torch.no_grad()
def _evaluate(model, items, pad_id: int, device, amp, batch_size: int, split: str) -> dict:
    """{split/loss, split/token_accuracy} over every demonstration of `items` (nothing when none)."""
    if not items:
        return {}
    was_training = model.training
    model.eval()
    loss = tokens = correct = 0
    for i in range(0, len(items), batch_size):
        with amp():
            batch_loss, batch_tokens, batch_correct = answer_loss(model, items[i:i + batch_size], pad_id, device)
        loss, tokens, correct = loss + batch_loss.item(), tokens + batch_tokens, correct + batch_correct
    model.train(was_training)
    return {f"{split}/loss": loss / tokens, f"{split}/token_accuracy": correct / tokens}


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline sft",
                                     description="Supervised fine-tuning on demonstrations (annotators' own answers).")
    parser.add_argument("--data", required=True, help="demonstrations: an export's demonstrations.jsonl, or rows of "
                                                      "TRL's SFT formats (messages, or prompt and completion)")
    parser.add_argument("--out", required=True, help="run directory (new, or the one to --resume)")
    parser.add_argument("--policy", default="", help="starting policy: a folder saved by ppo, train-dpo or sft; "
                                                     "'' = the base model (--model)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out (optimiser and step)")
    add_report_to(parser)
    add_arguments(parser, SFTConfig)
    add_arguments(parser, ModelConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, model_cfg = from_args(SFTConfig, args), from_args(ModelConfig, args)
    open_tracker(args.out, args.report_to)
    try:
        report = train_sft(args.data, args.out, cfg, model_cfg, policy=args.policy, resume=args.resume)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not is_writer():
        return 0
    if report.get("state") == "cancelled":
        print(f"cancelled at step {report['step']}/{report['total']}: checkpoint saved; --resume continues")
        return 130
    print(f"answer loss {report['train/loss']:.3f} per token on the {report['train/demonstrations']} training "
          "demonstrations" + (f", {report['eval/loss']:.3f} on the {report['eval/demonstrations']} held out"
                              if "eval/loss" in report else ""))
    print(f"policy: {report['policy']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
