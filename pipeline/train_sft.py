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

from formats.rows import RowsError, read_rows
from pipeline.config import ModelConfig, SFTConfig, add_arguments, from_args, to_dict
from pipeline.lifecycle import AfterTraining, Steps, Training, stage_main
from pipeline.models import checkpointing
from pipeline.pairs_data import EncodeReport
from pipeline.policy import causal_lm_logits
from pipeline.rundir import open_tracker
from pipeline.text import encode_response, prompt_token_ids
from pipeline.tracking import add_report_to
from pipeline.trainer import Finished, Loaded, PolicyTrainer, train


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
    """Train on the demonstrations, evaluate the held-out ones and save (SFTTrainer through
    pipeline/trainer.py); returns the report (also in eval_report.json), or {"state": "cancelled",
    ...} when a signal stopped the run."""
    return train(SFTTrainer, data, out, cfg, model_cfg, start=policy, resume=resume)


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


class SFTTrainer(PolicyTrainer):
    """sft's side of the driver (pipeline/trainer.py): demonstrations in, the policy trained on the
    answers' tokens, its loss measured on the training and held-out demonstrations."""

    name, section, config = "sft", "sft", SFTConfig
    desc, shown = "sft", ("train/token_accuracy", "acc")

    @staticmethod
    def check(cfg: SFTConfig) -> None:
        if cfg.batch_size < 1 or cfg.grad_accum < 1 or cfg.epochs < 1 or cfg.max_steps < 0 or cfg.max_length < 2:
            raise ValueError("--batch-size, --grad-accum and --epochs must be at least 1, --max-steps >= 0, "
                             "--max-length >= 2")

    @staticmethod
    def check_run(cfg: SFTConfig, model_cfg: ModelConfig, dist, resume: bool) -> None:
        if dist.sharded:
            raise ValueError("sft runs under DDP (configs/accelerate/ddp.yaml), not FSDP")

    def load(self) -> Loaded:
        run, cfg = self.run, self.run.cfg
        demos = read_demonstrations(run.data)
        self.start_policy()
        if run.resume:
            self.restore_policy()
        self.train_items, trunc_train = encode([d for d in demos if not d.held_out], self.tokenizer, cfg.max_length)
        self.eval_items, trunc_eval = encode([d for d in demos if d.held_out], self.tokenizer, cfg.max_length)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        self.model.train(checkpointing(self.model))
        return Loaded(model=self.model, lengths=[len(ids) for ids, _ in self.train_items],
                      fields={"stage": "sft", "sft": to_dict(cfg), "model": to_dict(run.model_cfg),
                              "policy": run.start, "parent": self.parent,
                              "base_model": self.model.rlhf_meta["base_model"]},
                      data_report={"demonstrations": len(demos), "train": len(self.train_items),
                                   "held_out": len(self.eval_items)},
                      truncations=(trunc_train, trunc_eval), sequences=len(self.train_items) + len(self.eval_items))

    def train_step(self, training: Training) -> Callable:
        return sft_step(training, self.train_items, self.pad_id)

    def finish(self, training: Training, done: Steps, after: AfterTraining) -> Finished:
        """The losses on the training and held-out demonstrations, the checkpoint and the policy
        with its lineage."""
        after.phase("evaluating")
        batch_size, device = self.run.cfg.batch_size, self.run.dist.device
        report = {**_evaluate(self.model, self.train_items, self.pad_id, device, training.amp, batch_size, "train"),
                  **_evaluate(self.model, self.eval_items, self.pad_id, device, training.amp, batch_size, "eval")}
        after.check()
        self.save_policy(training, done, method="sft")
        own = {**report, "policy": str(self.run.out_dir / "policy"), "train/demonstrations": len(self.train_items),
               "eval/demonstrations": len(self.eval_items)}
        return Finished(report, own)


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


def print_summary(report: dict) -> None:
    """A finished run's answer loss and policy folder."""
    print(f"answer loss {report['train/loss']:.3f} per token on the {report['train/demonstrations']} training "
          "demonstrations" + (f", {report['eval/loss']:.3f} on the {report['eval/demonstrations']} held out"
                              if "eval/loss" in report else ""))
    print(f"policy: {report['policy']}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, model_cfg = from_args(SFTConfig, args), from_args(ModelConfig, args)
    open_tracker(args.out, args.report_to)
    return stage_main(lambda: train_sft(args.data, args.out, cfg, model_cfg, policy=args.policy, resume=args.resume),
                      print_summary)


if __name__ == "__main__":
    sys.exit(main())
