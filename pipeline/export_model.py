"""Shareable checkpoints: `python -m pipeline export-model SOURCE --out DIR [--db PATH]`.

Writes a standalone Hugging Face folder that plain `transformers` loads, no project code needed:

- a policy: the LoRA adapter merged into the base weights (peft's `merge_and_unload`; a fully
  fine-tuned policy as it is), saved as an AutoModelForCausalLM folder (config.json, safetensors,
  generation_config.json) with its tokenizer and chat template;
- a reward model: an AutoModelForSequenceClassification folder (num_labels=1): the merged backbone
  under the architecture's `...ForSequenceClassification` class, our scalar head as its `score`
  layer, with the reward normalisation folded into it (weight / std), so its logit is our
  normalised score minus a constant. Those classes' `score` layer has no bias, so the constant
  (head bias - mean) / std is written to config.json as `score_offset`: logit + score_offset is
  our score exactly (float rounding aside). A Bradley-Terry reward has no fixed zero, so
  differences and rankings need no offset. It reads the last non-pad token (by pad_token_id): when
  the tokenizer pads with its EOS token, which ends every scored response here, the folder's
  tokenizer pads with another special token instead; it pads on the right, where positions count
  as ours do;
- README.md: a model card (pipeline/model_card.py) with the lineage (base model, parent, reward model, the data snapshot
  and its SHA-256, the run's PPO/DPO/reward configuration, evaluation figures) and how to load it;
  rlhf_export.json: the same facts as data (without this machine's paths).

SOURCE is a checkpoint folder (a run's policy/ or checkpoint/) or a model version's name or id in
the store (--db, default: the app's database; the CLI opens it only then, and only when no app
owns it: store/lineage.py `find_version`, the one import of `store/` from a training module). The
lineage comes from the run directory beside the folder, and from the store when a version is named
(or from --lineage, a JSON file of store/lineage.py `version_lineage`: the app's Download action
writes it, as a job never opens the database). With --run-dir, OUT is a job's run directory: the
folder goes to OUT/model, a zip of it to OUT/<name>.zip, and progress to OUT/status.json.

torch, transformers and peft are imported inside the export functions only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path

from pipeline.model_card import model_card
from pipeline.rundir import read_jsonl, write_status

META_FILE = "model_meta.json"  # pipeline.models.META_FILE (that module imports torch)
DTYPES = ("fp32", "bf16", "fp16")


# --------------------------------------------------------------------------- lineage


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _portable(value):
    """Configs without this machine's paths: an absolute path is shown by its last part."""
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        return Path(value).name
    return value


def folder_lineage(folder: Path, meta: dict) -> dict:
    """What the checkpoint's own run directory says: its configuration, evaluation figures, the
    reward model's data hash (a policy's reward model folder sits in its own run directory)."""
    run_dir = Path(meta["run"]) if meta.get("run") else (folder.parent if folder.name == "checkpoint" else None)
    config = _read_json(run_dir / "config.json") if run_dir else {}
    metrics = run_dir / "metrics.jsonl" if run_dir else None
    last = read_jsonl(metrics)[-1] if metrics is not None and metrics.is_file() and metrics.stat().st_size else {}
    report = _read_json(run_dir / "eval_report.json") if run_dir else {}
    reward_dir = Path(meta.get("reward_model") or "")
    reward_config = _read_json(reward_dir.parent / "config.json") if reward_dir.is_absolute() else {}
    return {
        "stage": config.get("stage") or ("train-reward" if "reward" in config else None),
        "config": _portable({k: v for k, v in config.items() if isinstance(v, dict) and k != "data_report"}),
        "data_sha256": config.get("data_sha256") or reward_config.get("data_sha256"),
        "steps": meta.get("steps") or report.get("steps"),
        "eval": {k: v for k, v in report.items() if k.startswith("eval/") and isinstance(v, (int, float))},
        "final": {k: v for k, v in last.items() if isinstance(v, (int, float)) and k != "step"},
        "reward_model": reward_dir.parent.name if reward_dir.is_absolute() else meta.get("reward_model"),
        # the reward model's training loss: its own run's, or that of the reward model a policy trained against
        "reward_loss": next((c["reward"].get("loss", "bt") for c in (config, reward_config)
                             if isinstance(c.get("reward"), dict)), None),
    }


# --------------------------------------------------------------------------- exporting


def export_policy(folder: Path | None, base_model: str, out: Path, dtype: str) -> dict:
    """The policy in `folder` (or the base model as is) as an AutoModelForCausalLM folder."""
    from pipeline.config import ModelConfig
    from pipeline.models import is_peft, pick_dtype
    from pipeline.policy import load_policy
    from pipeline.text import template_with_system_prompt

    cfg = ModelConfig(model=base_model or "default", device="cpu", dtype="fp32", lora=False)
    model, tokenizer = load_policy(cfg, adapter_path=folder) if folder is not None else load_policy(cfg)
    merged = is_peft(model)
    if merged:
        model = model.merge_and_unload()  # W + (alpha / r) B A, one plain weight per layer
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # where our sampling stops
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(pick_dtype(dtype, model.device)).save_pretrained(out)
    tokenizer.chat_template = template_with_system_prompt(tokenizer.chat_template)  # as our stages encoded prompts
    tokenizer.save_pretrained(out)  # with its chat template
    return {"merged_lora": merged, "architecture": type(model).__name__}


def _distinct_pad(tokenizer) -> str | None:
    """Make the tokenizer pad with a special token other than EOS (sequence classifiers pool at the
    last non-pad token, and our scored texts end with EOS). Returns the token added, if any."""
    if tokenizer.pad_token_id != tokenizer.eos_token_id:
        return None
    template = tokenizer.chat_template or ""
    for token_id, token in sorted(tokenizer.added_tokens_decoder.items()):
        if token.special and token_id not in (tokenizer.eos_token_id, tokenizer.bos_token_id) \
                and token.content not in template:
            tokenizer.pad_token = token.content
            return None
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    return "<|pad|>"


def export_reward(folder: Path, out: Path, dtype: str) -> dict:
    """The reward model in `folder` as an AutoModelForSequenceClassification folder (module docstring)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from pipeline.config import ModelConfig
    from pipeline.models import load_scalar_model, pick_dtype
    from pipeline.text import template_with_system_prompt

    rm, tokenizer = load_scalar_model(str(folder), "reward", ModelConfig(device="cpu", dtype="fp32"))
    backbone = rm.backbone.merge_and_unload() if rm.lora else rm.backbone
    added = _distinct_pad(tokenizer)
    tokenizer.padding_side = "right"  # positions then count from 0 as ours do; HF uses 0..T-1 per row
    offset = float((rm.head.bias.detach()[0] - rm.reward_mean) / rm.reward_std)
    config = backbone.config.__class__.from_dict(backbone.config.to_dict())
    config.architectures = None
    config.num_labels, config.id2label, config.label2id = 1, {0: "reward"}, {"reward": 0}
    config.pad_token_id, config.score_offset = tokenizer.pad_token_id, offset
    model = AutoModelForSequenceClassification.from_config(config)
    getattr(model, model.base_model_prefix).load_state_dict(backbone.state_dict())  # strict: every weight
    with torch.no_grad():
        model.score.weight.copy_(rm.head.weight / rm.reward_std)  # (1, H): normalisation folded in
    if added:
        model.resize_token_embeddings(len(tokenizer))
    model.to(pick_dtype(dtype, model.device)).save_pretrained(out)
    tokenizer.chat_template = template_with_system_prompt(tokenizer.chat_template)  # as our stages encoded prompts
    tokenizer.save_pretrained(out)
    return {"architecture": type(model).__name__, "score_offset": offset, "merged_lora": bool(rm.lora),
            "pad_token": tokenizer.pad_token, "reward_mean": rm.reward_mean, "reward_std": rm.reward_std}


def zip_folder(folder: Path, target: Path, top: str) -> Path:
    """`folder` as a zip whose entries sit under `top/`, written whole or not at all (weights are
    stored as they are: safetensors barely compress)."""
    tmp = target.with_name(f".{target.name}.tmp")
    with zipfile.ZipFile(tmp, "w") as zf:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            kind = zipfile.ZIP_STORED if path.suffix == ".safetensors" else zipfile.ZIP_DEFLATED
            zf.write(path, f"{top}/{path.relative_to(folder)}", compress_type=kind)
    os.replace(tmp, target)
    return target


# --------------------------------------------------------------------------- the stage


def resolve(source: str, db: str | None, lineage_file: str = "") -> tuple[Path | None, dict, dict]:
    """(checkpoint folder, its model_meta.json, lineage) of SOURCE; the folder is None for a
    version that is the base model used as is."""
    lineage = json.loads(Path(lineage_file).read_text(encoding="utf-8")) if lineage_file else {}
    folder = Path(source).expanduser()
    if not folder.is_dir():
        from store.lineage import find_version  # the CLI's --db only: no job opens the database

        lineage, mv = find_version(source, db)
        if mv.path is None:
            return None, {"kind": "policy", "base_model": mv.base_model}, lineage
        folder = Path(mv.path)
        if not folder.is_dir():
            raise FileNotFoundError(f"{mv.name}: its folder {folder} is gone")
    meta = _read_json(folder / META_FILE)
    kind = meta.get("kind")
    if kind not in ("policy", "reward"):
        raise ValueError(f"{source}: " + (f"a {kind} checkpoint: export its policy or reward model instead" if kind
                                          else f"no {META_FILE} (not a policy or reward model saved by rlhf-loop)"))
    return folder, meta, {"kind": kind, "name": f"{folder.parent.name}-{kind}", **lineage}


def export(source: str, out: str | os.PathLike, *, db: str | None = None, lineage_file: str = "",
           dtype: str = "fp32", run_dir: bool = False) -> Path:
    """Export SOURCE (module docstring); returns the folder written (or, with run_dir, the zip)."""
    from tqdm.auto import tqdm

    from pipeline.models import make_tmp_dir

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    out = Path(out)
    target = out / "model" if run_dir else out
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"--out {target} already exists and is not empty: choose a new folder")
    folder, meta, lineage = resolve(source, db, lineage_file)
    found = {**folder_lineage(folder, meta), "base_model": meta.get("base_model")} if folder else {}
    phases = ["load, merge and save", "model card"] + (["zip"] if run_dir else [])
    with tqdm(total=len(phases), desc="export-model", unit="phase", dynamic_ncols=True) as bar:

        def phase(i: int) -> None:  # the bar, and a job's status.json
            bar.update(i - bar.n)
            if run_dir:
                write_status(out, "running", i, len(phases), phase=phases[i])

        phase(0)
        tmp = make_tmp_dir(target)  # the folder is written whole, then renamed into place
        try:
            if meta["kind"] == "policy":
                info = export_policy(folder, meta.get("base_model") or "default", tmp, dtype)
            else:
                info = export_reward(folder, tmp, dtype)
            phase(1)
            (tmp / "README.md").write_text(model_card(lineage, found, info), encoding="utf-8")
            record = {"lineage": {k: v for k, v in lineage.items() if k != "path"}, "run": found, "export": info}
            (tmp / "rlhf_export.json").write_text(json.dumps(_portable(record), indent=2, default=str),
                                                  encoding="utf-8")
            if target.exists():
                target.rmdir()  # empty (checked above)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not run_dir:
            bar.update(len(phases) - bar.n)
            return target
        phase(2)
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", lineage["name"]).strip("-.") or "model"
        archive = zip_folder(target, out / f"{name}.zip", name)
        bar.update(len(phases) - bar.n)
    write_status(out, "done", len(phases), len(phases), archive=archive.name)
    return archive


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline export-model",
                                     description="Export a policy or reward model as a standalone Hugging Face folder.")
    parser.add_argument("source", metavar="VERSION_OR_FOLDER",
                        help="a checkpoint folder (a run's policy/ or checkpoint/), or a model version's name or id")
    parser.add_argument("--out", required=True, help="the folder to write (new or empty)")
    parser.add_argument("--db", default=None, help="the store to find VERSION in (default: the app's database)")
    parser.add_argument("--lineage", default="", help="lineage JSON of the version (the app writes it for its jobs)")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES, help="dtype of the saved weights")
    parser.add_argument("--run-dir", action="store_true",
                        help="--out is a job's run directory: write OUT/model, OUT/<name>.zip and OUT/status.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        written = export(args.source, args.out, db=args.db, lineage_file=args.lineage, dtype=args.dtype,
                         run_dir=args.run_dir)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        if args.run_dir:
            write_status(Path(args.out), "failed", 0, 0, error=str(exc))
        return 2
    print(f"exported: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
