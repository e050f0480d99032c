"""What the store learns from a run directory: run in the owner process, never in a job.

    Partial(store, run).poll()        while a job runs: its results so far (generated responses
                                      arrive in chunk files: each chunk becomes items at once)
    finish(store, run, run_dir, p)    after it succeeded: the rest of its results, in the store
                                      (a reward model, a policy from ppo, train-dpo or sft, a comparison)

Each chunk, and each finisher, writes the store in one transaction, so a job that crashes or is
killed (even with SIGKILL) leaves the store with whole chunks only and no half-registered model.
What a finisher registers is told by the run's `inputs` (recorded when it was submitted), so a
job queued before a restart of the owner is ingested the same way.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

from pipeline.rundir import read_jsonl

CHUNKS = "chunks"
"""Folder of a generate run: NNNNN.jsonl, each complete (written under a temporary name, then renamed)."""


class Partial:
    """Ingests a running job's partial results; `done` counts what it stored."""

    def __init__(self, store, run):
        self.store, self.run = store, run
        self.next_chunk = 0
        self.items = self.responses = 0

    def poll(self) -> None:
        if self.run.kind == "generate":
            self._generated_chunks()

    def _generated_chunks(self) -> None:
        folder = Path(self.run.run_dir) / CHUNKS
        while True:
            path = folder / f"{self.next_chunk:05d}.jsonl"
            if not path.is_file():
                return
            self.store_responses(read_jsonl(path))
            self.next_chunk += 1

    def store_responses(self, rows: list[dict]) -> None:
        """responses rows -> one item per prompt, in one transaction, tagged with the version."""
        by_prompt: dict[int, list[tuple]] = collections.defaultdict(list)
        for row in rows:
            if row.get("prompt_id") is None:
                raise ValueError("a generated row has no prompt_id: generate from prompts that name their ids")
            by_prompt[int(row["prompt_id"])].append(
                (row["text"], row["token_count"], row["finish_reason"], row.get("sampling", {})))
        inputs = self.run.inputs
        self.store.add_responses_bulk(inputs["model_version_id"], list(by_prompt.items()),
                                      round_id=inputs.get("round_id"))
        self.items += len(by_prompt)
        self.responses += sum(len(v) for v in by_prompt.values())


# ---------------------------------------------------------------------- finishers


def finish(store, run, run_dir: Path, partial: Partial) -> dict:
    """The run's results into the store; returns what goes into the run's outputs."""
    finisher = FINISHERS.get(run.kind)
    return finisher(store, run, Path(run_dir), partial) if finisher is not None else {}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def finish_generate(store, run, run_dir: Path, partial: Partial) -> dict:
    partial.poll()  # chunks written after the last poll
    return {"items": partial.items, "responses": partial.responses}


def finish_train_reward(store, run, run_dir: Path, partial: Partial) -> dict:
    ckpt = run_dir / "checkpoint"
    meta = _read_json(ckpt / "model_meta.json")
    report = _read_json(run_dir / "eval_report.json")
    config = _read_json(run_dir / "config.json")
    version = store.register_model_version(
        "reward", parent_id=run.inputs.get("parent_version_id"), path=str(ckpt),
        base_model=meta.get("base_model"), run_id=run.id, snapshot_id=run.inputs.get("snapshot_id"),
        meta={"eval": {k: v for k, v in report.items() if not isinstance(v, (list, dict))},
              "reward_mean": meta.get("reward_mean"), "reward_std": meta.get("reward_std"),
              "loss": (config.get("reward") or {}).get("loss", "bt"), "data_sha256": config.get("data_sha256")})
    return {"model_version_id": version.id}


def _register_policy(store, run, run_dir: Path, meta: dict, **lineage) -> dict:
    """The run's policy/ folder as a new policy version whose parent is the policy the run started
    from; active at once when the run was submitted with `activate`."""
    policy_dir = run_dir / "policy"
    if not (policy_dir / "model_meta.json").is_file():
        raise ValueError(f"the {run.kind} run ended without a policy in {policy_dir}")
    version = store.register_model_version(
        "policy", parent_id=run.inputs.get("policy_version_id"), path=str(policy_dir),
        base_model=_read_json(policy_dir / "model_meta.json").get("base_model"), run_id=run.id, meta=meta, **lineage)
    if run.inputs.get("activate"):
        store.set_active_policy(version.id)
    return {"model_version_id": version.id}


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if isinstance(v, (int, float))}


def finish_ppo(store, run, run_dir: Path, partial: Partial) -> dict:
    """The new policy, trained against the reward model the run names; its method is the run's
    ('ppo', or 'rloo' / 'grpo' without a critic)."""
    metrics = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    method = _read_json(run_dir / "config.json").get("stage", "ppo")
    return _register_policy(store, run, run_dir, {"method": method, "final": _numbers(metrics[-1] if metrics else {})},
                            reward_version_id=run.inputs.get("reward_version_id"))


def finish_train_dpo(store, run, run_dir: Path, partial: Partial) -> dict:
    """The new policy, trained by DPO on a snapshot: its lineage is the starting policy (parent) and
    the snapshot (no reward model); its meta names the loss and beta and the held-out figures."""
    trained = _read_json(run_dir / "policy" / "model_meta.json")
    report = _read_json(run_dir / "eval_report.json")
    return _register_policy(store, run, run_dir, {
        "method": "dpo", "loss": trained.get("loss"), "beta": trained.get("beta"),
        "data_sha256": trained.get("data_sha256"), "final": _numbers(report)},
        snapshot_id=run.inputs.get("snapshot_id"))


def finish_sft(store, run, run_dir: Path, partial: Partial) -> dict:
    """The new policy, fine-tuned on the annotators' own answers: its lineage is the starting
    policy (parent) and the snapshot they were exported with."""
    trained = _read_json(run_dir / "policy" / "model_meta.json")
    report = _read_json(run_dir / "eval_report.json")
    return _register_policy(store, run, run_dir, {"method": "sft", "data_sha256": trained.get("data_sha256"),
                                                  "final": _numbers(report)},
                            snapshot_id=run.inputs.get("snapshot_id"))


def finish_compare(store, run, run_dir: Path, partial: Partial) -> dict:
    """The win rate goes on policy A's version (meta "compare/<B>"); the rows stay in result.json."""
    result = _read_json(run_dir / "result.json")
    if "win_rate" not in result:
        raise ValueError(f"{run_dir / 'result.json'} has no win_rate")
    inputs = run.inputs
    summary = {"win_rate": result["win_rate"], "stderr": result["stderr"], "mean_a": result["mean_a"],
               "mean_b": result["mean_b"], "prompts": result["prompts"]}
    store.update_model_version(inputs["a_version_id"], meta={f"compare/{inputs['b_name']}": {
        **summary, "reward": inputs["reward_name"], "run_id": run.id}})
    return summary


def finish_sample_versions(store, run, run_dir: Path, partial: Partial) -> dict:
    """A blind evaluation's answers (pipeline/sample_versions.py samples.jsonl) -> one queued item
    per prompt, its responses from every version (store/evaluations.py)."""
    by_prompt: dict[int, list[tuple]] = collections.defaultdict(list)
    rows = read_jsonl(run_dir / "samples.jsonl")
    for row in rows:
        by_prompt[int(row["prompt_id"])].append((row["version_id"], row["text"], row["token_count"],
                                                 row["finish_reason"], row.get("sampling", {})))
    items = store.add_evaluation_items(run.inputs["evaluation_id"], list(by_prompt.items()))
    return {"items": len(items), "responses": len(rows)}


FINISHERS = {"generate": finish_generate, "train-reward": finish_train_reward, "ppo": finish_ppo,
             "train-dpo": finish_train_dpo, "sft": finish_sft, "compare": finish_compare, "sample-versions": finish_sample_versions}
