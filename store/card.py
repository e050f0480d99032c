"""The dataset card of an export: a README.md in the Hugging Face dataset-card form (YAML metadata,
then markdown) that says what the snapshot holds and how to load it.

`gather(store, cur)` reads what the card reports from the export's temporary tables (store/export.py
builds them): annotators with their pairs, rankings and median seconds, inter-annotator agreement
on the exported rankings (store/agreement.py), the model versions that wrote the responses, and
where the prompts came from. `render(manifest, facts, fmt)` writes the card: counts,
annotators, agreement, annotator quality (when the export excluded or weighted annotators by
it), license, snapshot id and SHA-256, model versions, filters, columns, and a snippet that loads
the files with `datasets` (paths relative to the card's folder).
"""

from __future__ import annotations

import json



def gather(store, cur) -> dict:
    """What the card reports about the rows in _export / _export_rankings."""
    annotators = cur.execute("""
        WITH p AS (SELECT annotator_id, count(*) AS n FROM _export GROUP BY annotator_id),
        k AS (SELECT annotator_id, count(*) AS n, median(duration_s) AS med FROM _export_rankings
              GROUP BY annotator_id)
        SELECT coalesce(a.name, '(imported pairs)'), coalesce(k.n, 0), coalesce(p.n, 0), k.med
        FROM p FULL JOIN k ON k.annotator_id = p.annotator_id
        LEFT JOIN annotators a ON a.id = coalesce(p.annotator_id, k.annotator_id)
        ORDER BY a.name NULLS LAST""").fetchall()
    mean_agreement = cur.execute(
        "SELECT avg(agreement) FROM _export WHERE ranking_id IS NOT NULL").fetchall()[0][0]
    versions = cur.execute("""
        WITH used AS (SELECT chosen_id AS id FROM _export UNION SELECT rejected_id FROM _export
                      UNION SELECT r.id FROM responses r JOIN _export_rankings k ON k.item_id = r.item_id)
        SELECT mv.id, mv.name, mv.kind, mv.base_model, mv.parent_id, count(*)
        FROM used JOIN responses r ON r.id = used.id JOIN model_versions mv ON mv.id = r.model_version_id
        GROUP BY ALL ORDER BY mv.id""").fetchall()
    sources = cur.execute("""
        SELECT p.source, count(*) FROM prompts p
        WHERE p.id IN (SELECT prompt_id FROM _export UNION SELECT prompt_id FROM _export_rankings)
        GROUP BY p.source ORDER BY count(*) DESC, p.source LIMIT 20""").fetchall()
    return {
        "annotators": [{"name": n, "rankings": k, "pairs": p, "median_s": med} for n, k, p, med in annotators],
        "agreement": store.export_agreement(cur),
        "mean_pair_agreement": mean_agreement,
        "model_versions": [{"id": i, "name": n, "kind": k, "base_model": b, "parent_id": parent, "responses": c}
                           for i, n, k, b, parent, c in versions],
        "prompt_sources": [{"source": s, "prompts": n} for s, n in sources],
    }


def _num(x, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _table(header: list[str], rows: list[list]) -> str:
    def cell(v):
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def _size_category(n: int) -> str:
    for limit, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M")):
        if n < limit:
            return name
    return "1M<n<10M"


def load_snippet(manifest: dict, fmt: str) -> str:
    """Python that loads this export's pairs (train and test) and rankings with `datasets`, run
    from the folder that holds the card."""
    files = manifest["files"]
    if fmt == "datasets":
        return ("from datasets import load_from_disk\n\n"
                "pairs = load_from_disk(\".\")  # a DatasetDict: 'train' (and 'test' when there is a test split)\n"
                "train = pairs[\"train\"]\n"
                f"rankings = load_from_disk({json.dumps(files['rankings'])})\n")
    builder = json.dumps("json" if fmt == "jsonl" else "parquet")
    return ("from datasets import load_dataset\n\n"
            f"pairs = load_dataset({builder}, data_files={json.dumps(files['pairs'])}, split=\"train\")\n"
            "train = pairs.filter(lambda row: row[\"split\"] == \"train\")  # the column `split` holds the split\n"
            "test = pairs.filter(lambda row: row[\"split\"] == \"test\")\n"
            f"rankings = load_dataset({builder}, data_files={json.dumps(files['rankings'])}, split=\"train\")\n"
            + ("# or, by this card's configs: load_dataset(\".\", \"pairs\"), load_dataset(\".\", \"rankings\")\n"
               if files["card"] == "README.md" else ""))


def _front_matter(manifest: dict, fmt: str) -> str:
    lines = ["---", f"license: {json.dumps(manifest['license'])}",
             f"pretty_name: {json.dumps('rlhf-loop preference snapshot ' + str(manifest['snapshot_id']))}",
             "tags:", "- trl", "- rlhf", "- preference", "- human-feedback",
             "size_categories:", f"- {_size_category(manifest['counts']['pairs'])}"]
    if fmt != "datasets":  # `load_dataset(folder, "rankings")` reads these
        lines += ["configs:", "- config_name: pairs", "  default: true",
                  f"  data_files: {json.dumps(manifest['files']['pairs'])}",
                  "- config_name: rankings", f"  data_files: {json.dumps(manifest['files']['rankings'])}"]
    return "\n".join(lines + ["---", ""])


def _quality_section(manifest: dict) -> list[str]:
    """Each annotator's quality, what measured it, weight and whether it was left out (exports with
    min_quality or quality_weights only)."""
    rows = manifest.get("annotator_quality")
    if rows is None:
        return []
    f = manifest["filters"]
    how = []
    if "min_quality" in f:
        how.append(f"annotators measured below quality {f['min_quality']:g} are left out")
    if f.get("quality_weights"):
        how.append(f"each pair's `weight` is its annotator's weight, 2q - 1 clipped to "
                   f"[{manifest['min_weight']:g}, 1] (1 for annotators not measured yet and for imported pairs)")
    least = manifest.get("min_comparisons", 0)
    return ["## Annotator quality\n",
            "Quality q: accuracy on gold items, else agreement with the majority of the other annotators, "
            f"each from {least} response pairs up (fewer: not enough data, kept with weight 1); "
            + "; ".join(how) + ".\n",
            _table(["annotator", "quality", "measured by", "gold items", "comparisons",
                    "weight" if f.get("quality_weights") else "weight (not applied)", "left out"],
                   [[q["annotator"], _num(q["quality"]), _measured_by(q), q["n_gold"], q.get("comparisons", ""),
                     _num(q["weight"]), "yes" if q["excluded"] else "no"] for q in rows]) + "\n"]


def _measured_by(q: dict) -> str:
    """'gold', 'majority', 'not enough data' (a few comparisons) or 'not measured' (none)."""
    return q["measured_by"] or ("not enough data" if q.get("comparisons") else "not measured")


def render(manifest: dict, facts: dict, fmt: str) -> str:
    """The card's text."""
    c, ag = manifest["counts"], facts["agreement"]
    conversational = manifest["trl_format"] == "conversational"
    margin = "margin" in manifest["columns"]
    people = [a for a in facts["annotators"] if a["name"] != "(imported pairs)"]
    parts = [
        _front_matter(manifest, fmt),
        f"# Preference snapshot {manifest['snapshot_id']}\n",
        f"Preference pairs from {len(people)} annotator{'s' * (len(people) != 1)} ranking responses in "
        f"rlhf-loop, exported {manifest['created_at']} in TRL's "
        f"{'conversational' if conversational else 'standard (text)'} preference format.\n",
        f"- snapshot: {manifest['snapshot_id']}, SHA-256 of the data `{manifest['sha256']}` "
        "(a reward model trained on it records the same hash)",
        f"- license: **{manifest['license']}**; the prompts and responses keep the terms of their "
        "sources (below)",
        f"- files: {fmt}, TRL format {manifest['trl_format']}\n",
        "## Counts\n",
        _table(["what", "count"], [[k, c[k]] for k in ("pairs", "train", "test", "prompts", "rankings",
                                                       "demonstrations", "annotators", "imported", "all_bad",
                                                       "left_out_empty")
                                        if k in c]),
        "\n## Annotators\n",
        _table(["annotator", "rankings", "pairs", "median seconds per ranking"],
               [[a["name"], a["rankings"], a["pairs"], _num(a["median_s"], 1)] for a in facts["annotators"]]),
        "\n## Agreement\n",
        f"On the {ag['items']} exported items ranked by two or more annotators ({ag['comparisons']} "
        f"compared response pairs): pairwise agreement {_num(ag['pairwise_agreement'])}, Krippendorff's "
        f"alpha (ordinal) {_num(ag['krippendorff_alpha'])}, mean Kendall tau-b {_num(ag['kendall_tau'])}. "
        f"Mean of the pairs' `agreement` column (ranked pairs): {_num(facts['mean_pair_agreement'])}.\n",
        *_quality_section(manifest),
        "## Model versions that wrote the responses\n",
        _table(["id", "name", "kind", "base model", "parent id", "responses"],
               [[v["id"], v["name"], v["kind"], v["base_model"] or "–", v["parent_id"] or "–", v["responses"]]
                for v in facts["model_versions"]]),
        "\n## Prompt sources\n",
        _table(["source", "prompts"], [[s["source"], s["prompts"]] for s in facts["prompt_sources"]]),
        "\n## Filters\n",
        "```json\n" + json.dumps(manifest["filters"], indent=2) + "\n```\n",
        "## Files and columns\n",
        f"- `{manifest['files']['pairs']}`: one row per pair: " + ", ".join(f"`{x}`" for x in manifest["columns"]),
        f"- `{manifest['files']['rankings']}`: one row per ranking: "
        + ", ".join(f"`{x}`" for x in manifest["ranking_columns"]),
        *([f"- `{manifest['files']['demonstrations']}`: {c['demonstrations']} demonstrations, the answers "
           "annotators wrote themselves, each from a response it ranks above (its pairs are above, source "
           "`edit`, model `human edit`), in TRL's SFT format (`messages`, or `prompt` and `completion`): "
           "`python -m pipeline sft` or `trl.SFTTrainer` trains on them"]
          if "demonstrations" in manifest["files"] else []),
        f"- `{manifest['files']['manifest']}`: the manifest (counts, filters, hash)\n",
        ("`prompt` is a list of chat messages and `chosen` / `rejected` one assistant message each: "
         "the tokenizer needs a chat template. " if conversational else
         "`prompt`, `chosen` and `rejected` are plain text (chat prompts as \"\\n\\nHuman: ... "
         "\\n\\nAssistant:\" transcripts). ")
        + "`rank_gap` is the distance between the two responses' tie groups in the ranking "
          "(1 = adjacent). "
        + "`strength` is how much better the annotator said the best response is than the second "
          "(much better, better, slightly better, about the same: Llama 2's scale), on that top pair "
          "only; `rationale` is the comment written with the ranking. "
        + ("`margin` is the pair's strength as Llama 2's margin (1, 2/3, 1/3, 0) where it has one, "
           "else the rank gap, under the name TRL's RewardTrainer reads: its loss becomes "
           "-log sigmoid(r_chosen - r_rejected - margin). " if margin else
           "There is no `margin` column, so RewardTrainer uses the plain Bradley-Terry loss "
           "(export with a margin column to use the strength, else the rank gap, as TRL's margin). ")
        + "`chosen_model` / `rejected_model` name the model versions that wrote the responses "
          "(kind external: a model outside rlhf-loop, named by the file the items were imported from). "
        + ("`weight` is the pair's annotator's quality weight: `python -m pipeline train-reward` weighs "
           "each pair's loss by it; TRL's trainers ignore it. " if "weight" in manifest["columns"] else "")
        + "`split` is `train` or `test`, by prompt (no prompt is in both). In the rankings, `order` "
          "lists tie groups of response ids best first and `display_order` the order they were shown.\n",
        "## Load it\n",
        "```python\n" + load_snippet(manifest, fmt) + "```\n",
        "Then, for example, `trl.RewardTrainer(model=..., train_dataset=train, args=trl.RewardConfig(...))` "
        "or `trl.DPOTrainer(...)`: both accept this format (extra columns are dropped).\n",
    ]
    return "\n".join(parts)
