"""The model card (README.md) of an exported checkpoint (pipeline/export_model.py): lineage,
training configuration, evaluation figures, people's blind rankings, and how to load it with
plain `transformers`. Pure text from plain dicts: no torch, no store.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what base model "default" is (pipeline/models.py)
REWARD_LOSSES = {"bt": "Bradley-Terry", "plackett-luce": "Plackett-Luce"}  # RewardConfig.loss, by name


def model_card(lineage: dict, found: dict, info: dict) -> str:
    """README.md of the exported folder: lineage, configuration, evaluation, how to load it."""
    kind, name = lineage.get("kind"), lineage.get("name")
    base = lineage.get("base_model") or found.get("base_model") or "default"
    base_id = DEFAULT_BASE if base == "default" else Path(base).name
    stage = found.get("stage") or ("train-reward" if kind == "reward" else "ppo")
    trained = "a policy (causal LM)" if kind == "policy" else "a reward model (one score per text)"
    head = ["---", "library_name: transformers", f"pipeline_tag: {'text-generation' if kind == 'policy' else 'text-classification'}",
            f"tags: [rlhf, rlhf-loop, {'reward-model' if kind == 'reward' else stage}]"]
    if base == "default":
        head.append(f"base_model: {DEFAULT_BASE}")
    lines = head + ["---", "", f"# {name}", "",
                    f"{name} is {trained} exported by rlhf-loop from base model `{base_id}`"
                    + (" (the package's GGUF Q4_1 file, de-quantised)" if base == "default" else "") + "."]
    if info.get("merged_lora"):
        lines[-1] += " Its LoRA adapter is merged into the weights (peft `merge_and_unload`)."
    snap = lineage.get("snapshot") or {}
    rows = [("Base model", f"`{base_id}`"), ("Trained from", lineage.get("parent")),
            ("KL reference", f"the base model `{base_id}` (every round, LoRA or full fine-tuning)"
             if kind == "policy" else None),
            ("Training stage", f"{stage}" + (f", {found['steps']} steps" if found.get("steps") else "")),
            ("Reward model", lineage.get("reward_model") or found.get("reward_model")),
            ("Reward model's loss", REWARD_LOSSES.get(found.get("reward_loss"), found.get("reward_loss"))),
            ("Preference data", f"snapshot #{snap['id']} `{snap['file']}` ({snap['counts'].get('pairs', '?')} pairs)"
             if snap else None),
            ("Data SHA-256", f"`{snap.get('sha256') or found.get('data_sha256')}`"
             if snap.get("sha256") or found.get("data_sha256") else None),
            ("Run", f"#{lineage['run']['id']} {lineage['run']['kind']}" if lineage.get("run") else None),
            ("Created", lineage.get("created_at"))]
    lines += ["", "## Lineage", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows if v]
    if found.get("config"):
        lines += ["", "## Training configuration", "", "```json", json.dumps(found["config"], indent=2), "```"]
    figures = {**found.get("eval", {}), **(lineage.get("eval") or {})} if kind == "reward" else \
        {**found.get("final", {}), **(lineage.get("final") or {})}
    keep = ("eval/", "objective/", "gen/", "kl/", "dpo/", "rewards/")
    shown = [(k, v) for k, v in sorted(figures.items()) if k.startswith(keep) and isinstance(v, (int, float))]
    shown += [(f"win rate vs {other}", f"{c['win_rate']:.3f} ± {c['stderr']:.3f} on {c['prompts']} held-out "
               f"prompts, judged by {c.get('reward')}") for other, c in (lineage.get("comparisons") or {}).items()]
    if shown:
        lines += ["", "## Evaluation", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in shown]
    lines += human_evaluation_section(name, lineage.get("human_evaluation"))
    if kind == "reward":
        lines += ["", "## Scores", "", f"rlhf-loop normalises the reward model's raw score to mean 0 and std 1 on "
                  f"samples of the reference policy (raw mean {info['reward_mean']:.6g}, std {info['reward_std']:.6g}); "
                  "the normalisation is folded into the `score` layer. That layer has no bias, so "
                  f"`logits[:, 0] + config.score_offset` (score_offset = {info['score_offset']:.6g}) is rlhf-loop's "
                  "score of the text; without the offset the scores differ from it by that constant, which changes "
                  "no comparison. Score a batch padded on the right (the tokenizer does), the text laid out as below; "
                  f"the tokenizer pads with `{info['pad_token']}`."]
    lines += ["", "## Use", "", "```python", *_usage(kind, info), "```", ""]
    return "\n".join(lines)


def human_evaluation_section(name: str, human: dict | None) -> list[str]:
    """The card's section on people's blind rankings (rlhf-loop's Models tab, store/evaluations.py)."""
    if not human:
        return []
    lines = ["", "## Human evaluation (blind)", "",
             f"People ranked one answer from each version per held-out prompt, without names ({human['prompts']} "
             "prompts). Rating: Bradley-Terry strength on the Elo scale (400 points = 10:1 odds); 95% bootstrap "
             "intervals over prompts.", "", "| version | rating | 95% interval | comparisons |", "|---|---|---|---|"]
    for row in human["leaderboard"]:
        label = f"**{row['version']}**" if row["version"] == name else row["version"]
        lines.append(f"| {label} | {row['rating']:.0f} | {row['low']:.0f} to {row['high']:.0f} | {row['comparisons']} |")
    for r in human["win_rates"]:  # each pair is stored with its names in sorted order
        flip = r["b"] == name
        other = r["a"] if flip else r["b"]
        p, lo, hi = (1 - r["win_rate"], 1 - r["high"], 1 - r["low"]) if flip else (r["win_rate"], r["low"], r["high"])
        lines.append(f"\n{name} is preferred to {other} in {p:.0%} of {r['comparisons']} comparisons "
                     f"(95% interval {lo:.0%} to {hi:.0%}).")
    return lines


def _usage(kind: str, info: dict) -> list[str]:
    if kind == "policy":
        return ["from transformers import AutoModelForCausalLM, AutoTokenizer",
                'tok = AutoTokenizer.from_pretrained("PATH")', 'model = AutoModelForCausalLM.from_pretrained("PATH")',
                'ids = tok.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,',
                '                              return_tensors="pt", return_dict=True)',
                "out = model.generate(**ids, max_new_tokens=64, do_sample=True)",
                "print(tok.decode(out[0, ids['input_ids'].shape[1]:], skip_special_tokens=True))"]
    return ["from transformers import AutoModelForSequenceClassification, AutoTokenizer",
            'tok = AutoTokenizer.from_pretrained("PATH")  # pads on the right',
            'model = AutoModelForSequenceClassification.from_pretrained("PATH")',
            "# the layout the reward model was trained on: the prompt through the chat template with the",
            "# assistant turn opened, then the response (stripped) and the EOS token",
            'prompt = tok.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True, tokenize=False)',
            'batch = tok([prompt + "Hello! How can I help?" + tok.eos_token], add_special_tokens=False,',
            '            padding=True, return_tensors="pt")',
            "score = model(**batch).logits[:, 0] + model.config.score_offset  # rlhf-loop's normalised reward"]
