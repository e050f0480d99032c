"""The `python -m pipeline generate` CLI: K responses per prompt of a prompts file into a run
directory, in chunk files as they come (the sampling itself: pipeline/responses.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

import torch

from pipeline.config import GenerateConfig, ModelConfig, add_arguments, from_args, to_dict
from pipeline.distributed import setup
from pipeline.policy import sampling_policy
from pipeline.responses import Generation, generate_responses
from pipeline.rundir import write_json, write_jsonl, write_status
from pipeline.sampling import decode_batch_size
from pipeline.text import read_prompts


def reward_spread(reward_path: str, prompts: list, results: list[list[Generation]], model_cfg: ModelConfig,
                  batch_size: int = 16) -> list[float]:
    """Per prompt, max - min of the reward model's (normalised) scores of its K responses: how
    clearly the reward model separates them."""
    from pipeline.scoring import load_reward_model, score_texts

    rm, tokenizer = load_reward_model(reward_path, model_cfg)
    pairs = [(prompt, g.text) for prompt, gens in zip(prompts, results) for g in gens]
    scores = score_texts(rm, tokenizer, [p for p, _ in pairs], [r for _, r in pairs], batch_size)
    k = len(results[0]) if results else 0
    return [max(scores[i:i + k]) - min(scores[i:i + k]) for i in range(0, len(scores), k)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline generate",
                                     description="Sample K responses per prompt into a run directory.")
    parser.add_argument("--prompts", required=True, help="JSONL with a 'prompt' field per line")
    parser.add_argument("--out", required=True, help="run directory (created) for responses.jsonl etc.")
    parser.add_argument("--adapter", default=None, help="a policy folder saved by save_policy")
    parser.add_argument("--limit", type=int, default=0, help="only the first N prompts (0 = all)")
    parser.add_argument("--select-uncertain", type=int, default=0, metavar="N",
                        help="keep only the N prompts whose K responses --reward separates least "
                             "(active learning: annotations where the reward model is least sure)")
    parser.add_argument("--reward", default="", help="reward model folder for --select-uncertain")
    parser.add_argument("--chunk-prompts", type=int, default=0, metavar="N",
                        help="write RUN_DIR/chunks/NNNNN.jsonl as each N prompts have their K responses "
                             "(0 = the prompts that fill one decoding batch: --batch-size, or the device's, / K)")
    add_arguments(parser, GenerateConfig)
    add_arguments(parser, ModelConfig)
    return parser


CHUNKS = "chunks"
CHUNK_SEED_STRIDE = 1_000_003
"""Chunk c samples with seed + c * CHUNK_SEED_STRIDE: distinct streams, the same for a seed."""


def response_rows(rows: list[dict], results: list[list[Generation]], first_index: int, sampling: dict,
                  model_name: str) -> list[dict]:
    """responses.jsonl rows, K per prompt; prompt_index counts from first_index."""
    return [{"prompt": row["prompt"], "prompt_index": first_index + i, "prompt_id": row.get("id"),
             "text": g.text, "token_count": len(g.token_ids), "finish_reason": g.finish_reason,
             "sampling": sampling, "model": model_name}
            for i, (row, gens) in enumerate(zip(rows, results)) for g in gens]


def least_separated(reward: str, rows: list[dict], results: list, keep_n: int, model_cfg: ModelConfig):
    """The keep_n prompts (rows and their generations, in file order) whose responses the reward
    model's scores spread least: where a ranking teaches it most (--select-uncertain)."""
    spread = reward_spread(reward, [r["prompt"] for r in rows], results, model_cfg)
    keep = sorted(sorted(range(len(rows)), key=lambda i: spread[i])[:keep_n])
    print(f"kept the {len(keep)} of {len(rows)} prompts the reward model separates least "
          f"(score spread {min(spread):.3f}..{max(spread[i] for i in keep):.3f})")
    return [rows[i] for i in keep], [results[i] for i in keep]


def chunks_in_order(policy, tokenizer, rows: list[dict], gen_cfg: GenerateConfig, n: int, dist, progress):
    """(chunk index, its first row, its Generations) for every chunk of n prompts, in order, on every
    rank: rank r samples chunks r, r + N, ..., each with its own seed (so the responses are those of
    one process); progress is reported on one process only."""
    starts = list(range(0, len(rows), n))
    for first in range(0, len(starts), dist.world):  # chunks first .. first + N - 1, one per rank
        c = first + dist.rank
        mine = None
        if c < len(starts):
            mine = generate_responses(policy, tokenizer, [r["prompt"] for r in rows[starts[c]:starts[c] + n]], gen_cfg.k,
                                      dataclasses.replace(gen_cfg, seed=gen_cfg.seed + c * CHUNK_SEED_STRIDE),
                                      on_progress=progress if dist.world == 1 else None)
        for c, part in enumerate(dist.gather_objects(mine), start=first):
            if part is not None:
                yield c, starts[c], part


def chunk_size(gen_cfg: GenerateConfig, device) -> int:
    """Prompts per chunk when --chunk-prompts is 0: as many as fill one decoding batch with their K
    responses (GenerateConfig.batch_size, else the device's decode_batch_size), at least one.

    A chunk is one call of the sampler, so a chunk smaller than the batch caps the batch: at the
    former 4 prompts x K = 4 every decode step ran 16 rows, and a round's generation gained nothing
    from the batch of 64 (docs/results/round_cost)."""
    batch = gen_cfg.batch_size or decode_batch_size(device)
    return max(1, batch // max(gen_cfg.k, 1))


def main(argv: list[str] | None = None) -> int:
    """Sample in chunks of --chunk-prompts prompts (0, the default: one decoding batch, `chunk_size`);
    each finished chunk's rows go to RUN_DIR/chunks/NNNNN.jsonl at once (the owner ingests them while
    the job runs), then all rows to responses.jsonl. With --select-uncertain every prompt is sampled
    and scored first, and only the kept prompts are written, as chunk files after the selection.

    On N processes (pipeline/distributed.py) rank r samples chunks r, r + N, ...; each chunk has its
    own seed, so the responses are those of one process, and rank 0 writes every chunk in order."""
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    gen_cfg, model_cfg = from_args(GenerateConfig, args), from_args(ModelConfig, args)
    dist = setup(model_cfg.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.select_uncertain and not args.reward:
        print("error: --select-uncertain needs --reward (a reward model folder)")
        return 2
    if args.chunk_prompts < 0:
        print("error: --chunk-prompts must be 0 (one decoding batch) or more")
        return 2
    write_status(out, "running", 0, 0)
    try:
        rows = read_prompts(args.prompts)[: args.limit or None]
        policy, tokenizer, model_name = sampling_policy(args.adapter, model_cfg)
        n = args.chunk_prompts or chunk_size(gen_cfg, next(policy.parameters()).device)
        write_json(out / "config.json", {
            "stage": "generate", "prompts": str(args.prompts), "adapter": args.adapter,
            "model": model_name, "num_prompts": len(rows), "chunk_prompts": n,
            "generate": to_dict(gen_cfg), "model_config": to_dict(model_cfg)})
        torch.manual_seed(gen_cfg.seed)
        sampling = {key: getattr(gen_cfg, key) for key in ("temperature", "top_p", "top_k", "max_new_tokens", "seed")}
        chunks = out / CHUNKS
        if dist.is_main:
            shutil.rmtree(chunks, ignore_errors=True)  # a rerun in the same folder starts its chunks afresh
            chunks.mkdir()
        k, total = gen_cfg.k, len(rows) * gen_cfg.k
        bar = tqdm(total=total, desc="generate", unit="resp", disable=not dist.is_main)
        results: list[list[Generation]] = []
        written: list[dict] = []
        n_chunks = 0

        def progress(chunk_done: int, chunk_total: int) -> None:
            bar.update(len(results) * k + chunk_done - bar.n)
            write_status(out, "running", len(results) * k + chunk_done, total, chunks=n_chunks)

        def emit(c: int, start: int, part: list) -> None:  # chunk c's rows: its file (rank 0), and kept
            nonlocal n_chunks
            lines = response_rows(rows[start:start + n], part, start, sampling, model_name)
            if dist.is_main:
                write_jsonl(chunks / f"{c:05d}.jsonl", lines)
            written.extend(lines)
            n_chunks += 1

        for c, start, part in chunks_in_order(policy, tokenizer, rows, gen_cfg, n, dist, progress):
            results += part
            if not args.select_uncertain:
                emit(c, start, part)
            write_status(out, "running", len(results) * k, total, chunks=n_chunks)
            bar.update(len(results) * k - bar.n)
        bar.close()
        if args.select_uncertain:  # every rank holds every response; each scores and selects the same
            rows, results = least_separated(args.reward, rows, results, args.select_uncertain, model_cfg)
            for c, start in enumerate(range(0, len(rows), n)):
                emit(c, start, results[start:start + n])
        total = len(rows) * k
        if dist.is_main:
            write_jsonl(out / "responses.jsonl", written)
            print(f"wrote {total} responses to {out / 'responses.jsonl'}")
        write_status(out, "done", total, total, chunks=n_chunks)
        dist.close()
        return 0
    except (Exception, KeyboardInterrupt) as exc:
        error = "interrupted" if isinstance(exc, KeyboardInterrupt) else dist.describe_failure(exc)
        write_status(out, "failed", 0, 0, error=error)
        if isinstance(exc, (ValueError, RuntimeError, FileNotFoundError)):
            print(f"error: {error}")
            return 1
        raise
