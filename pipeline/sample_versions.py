"""One response per prompt from each of several policies: the answers of a blind evaluation.

    python -m pipeline sample-versions --prompts held_out.jsonl --versions versions.json --out RUN_DIR

`versions.json` is a list of {"version_id", "name", "base_model", "adapter"} (adapter null for a
base model used as is), what store model versions hold. Each policy samples one response per
prompt with the same seed (pipeline/compare.py `sample_policy`, as a comparison does: the
versions differ by their weights, not by the random stream), then is freed before the next loads.
Nothing judges them here: people do, ranking the items the owner makes of them
(store/evaluations.py).

RUN_DIR gets config.json, status.json (step/total over every version's sampling batches) and
samples.jsonl: one row per prompt and version, {prompt_id, version_id, text, token_count,
finish_reason, sampling}. Exit 0 when done; 1 with status 'failed' and the error; 130 with status
'cancelled' on SIGTERM or Ctrl-C (checked after every batch). It never touches the store.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pipeline.compare import CompareConfig, PolicySpec, sample_policy, sampling_batch
from pipeline.config import ModelConfig, add_arguments, from_args, to_dict
from pipeline.rundir import run_job, write_json, write_jsonl
from pipeline.text import read_prompts

SAMPLES = "samples.jsonl"


def read_versions(path) -> list[dict]:
    """The versions file: a list of at least two {version_id, name, base_model, adapter}."""
    versions = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(versions, list) or len(versions) < 2:
        raise ValueError(f"{path}: expected a list of at least two versions")
    for i, v in enumerate(versions):
        missing = [k for k in ("version_id", "name", "base_model") if not isinstance(v, dict) or v.get(k) is None]
        if missing:
            raise ValueError(f"{path}: version {i} has no {', '.join(missing)}")
    return versions


def sample_versions(versions: list[dict], prompts: list[dict], model_cfg: ModelConfig, cfg: CompareConfig,
                    on_progress=None) -> list[dict]:
    """The samples.jsonl rows (module docstring) for `prompts` ({"id", "prompt"} each)."""
    texts = [p["prompt"] for p in prompts]
    batches = math.ceil(len(texts) / sampling_batch(cfg, model_cfg))
    total, done = batches * len(versions), 0
    sampling = {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed}
    rows = []
    for v in versions:
        def step(name=v["name"]):
            nonlocal done
            done += 1
            if on_progress is not None:
                on_progress(min(done, total), total, f"sampling with {name}")

        spec = PolicySpec(v["name"], v["base_model"], v.get("adapter"))
        for p, g in zip(prompts, sample_policy(spec, texts, model_cfg, cfg, step)):
            rows.append({"prompt_id": p["id"], "version_id": v["version_id"], "text": g.text,
                         "token_count": len(g.token_ids), "finish_reason": g.finish_reason, "sampling": sampling})
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline sample-versions",
                                     description="One response per prompt from each policy, for a blind evaluation.")
    parser.add_argument("--prompts", required=True, help="JSONL with 'id' and 'prompt' per line")
    parser.add_argument("--versions", required=True, help="JSON list of {version_id, name, base_model, adapter}")
    parser.add_argument("--out", required=True, help="run directory (created)")
    add_arguments(parser, CompareConfig)
    add_arguments(parser, ModelConfig)  # device, dtype, cache; each version names its own base model
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, model_cfg = from_args(CompareConfig, args), from_args(ModelConfig, args)
    out = Path(args.out)

    def body(on_progress) -> None:
        versions = read_versions(args.versions)
        prompts = read_prompts(args.prompts)
        if any(p.get("id") is None for p in prompts):
            raise ValueError(f"{args.prompts}: every prompt needs its store 'id'")
        write_json(out / "config.json", {"stage": "sample-versions", "prompts": str(args.prompts),
                                         "versions": versions, "sampling": to_dict(cfg), "model": to_dict(model_cfg)})
        rows = sample_versions(versions, prompts, model_cfg, cfg, on_progress)
        write_jsonl(out / SAMPLES, rows)
        print(f"{len(rows)} responses: {len(prompts)} prompts x {len(versions)} versions")

    return run_job(out, body)

if __name__ == "__main__":
    sys.exit(main())
