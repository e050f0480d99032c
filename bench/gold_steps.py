"""The steps of the gold-loop experiment (bench/gold_loop.py) that touch the store and the jobs.

- split_prompts: the fixed held-out set, and the pool file that is imported through the store
- RecordingJudge, gold_agreement: the gold judge, and how often the simulated annotators agree with it
- train_reward_step, ppo_step: the two halves of pipeline/loop.py's finish_round (the settings share
  round 1's reward model, then each runs its own PPO), with the same jobs and the same records
- copy_store: a consistent copy of a store (one per setting after round 1)
- ppo_step_trace: per PPO step, proxy score and KL (metrics.jsonl) and the gold score of the step's
  sample table
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from pipeline.loop import LoopSettings

# --------------------------------------------------------------------------- phase 0: prompts


def split_prompts(path: Path, n_eval: int, seed: int, out_dir: Path) -> tuple[list[str], Path]:
    """(held-out prompts, pool file): a seeded sample of n_eval prompts is held out; the pool file
    holds the rest (for store.io.import_prompts)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(rows) <= n_eval:
        raise ValueError(f"{path}: {len(rows)} prompts, need more than the {n_eval} held out")
    held = set(random.Random(seed).sample(range(len(rows)), n_eval))
    out_dir.mkdir(parents=True, exist_ok=True)
    pool = out_dir / "pool.jsonl"
    with open(pool, "w", encoding="utf-8") as fh:
        for i, row in enumerate(rows):
            if i not in held:
                fh.write(json.dumps(row) + "\n")
    heldout = [rows[i]["prompt"] for i in sorted(held)]
    (out_dir / "heldout.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in heldout))
    return heldout, pool


class RecordingJudge:
    """The gold judge, remembering every score it gave (to measure the annotators' agreement).
    One call at a time: a fast tokenizer shared by threads fails with 'Already borrowed'."""

    def __init__(self, judge):
        import threading

        self.judge, self.name, self.scores = judge, judge.name, {}
        self._lock = threading.Lock()

    def score(self, prompts, responses):
        with self._lock:
            out = self.judge.score(prompts, responses)
            self.scores.update({(p, r): s for p, r, s in zip(prompts, responses, out)})
        return out


def gold_agreement(store, judge: RecordingJudge) -> dict:
    """Share of stored pairs whose chosen response has the higher gold score (1.0 = no noise).
    Responses the judge has not scored in this process (a reused round 1) are scored now."""
    rows = []
    for pair in store.list_pairs():
        prompt = store.get_prompt(pair.prompt_id).text
        rows.append((prompt, store.get_response(pair.chosen_id).text, store.get_response(pair.rejected_id).text))
    missing = list({(p, t) for p, a, b in rows for t in (a, b)} - judge.scores.keys())
    if missing:
        judge.score([p for p, _ in missing], [t for _, t in missing])
    scored = [(judge.scores[(p, a)], judge.scores[(p, b)]) for p, a, b in rows]
    scored = [(a, b) for a, b in scored if a != b]
    agree = sum(a > b for a, b in scored)
    return {"pairs": len(scored), "agreement": agree / len(scored) if scored else float("nan")}


# --------------------------------------------------------------------------- round-1 steps
# pipeline/loop.py's finish_round runs steps 4 (reward) and 5-6 (PPO) together; the settings share
# step 4 of round 1, so here the two halves are called separately, with the same jobs and records.


def train_reward_step(store, runner, rnd, settings: LoopSettings):
    """Round step 4: snapshot of all pairs -> reward model job -> registered reward version."""
    from pipeline.loop import _model_args, _wait_done, latest_reward
    from store.export import export_pairs

    store.update_round(rnd.id, status="training")
    policy = store.get_model_version(rnd.policy_version_id)
    snapshot = export_pairs(store, runner.runs_root / "snapshots" / f"round-{rnd.id}.parquet", "parquet")
    previous = latest_reward(store)
    args = ["--data", snapshot.path, *_cli(settings.reward), *_model_args(settings.model),
            "--model", policy.base_model or settings.model.model]
    if previous is not None and previous.path:
        args += ["--init-from", previous.path]
    run = runner.submit("train-reward", args, inputs={
        "snapshot_id": snapshot.id, "round_id": rnd.id, "parent_version_id": previous.id if previous else None})
    reward = store.get_model_version(_wait_done(runner, run, "reward training").outputs["model_version_id"])
    store.update_round(rnd.id, reward_version_id=reward.id, snapshot_id=snapshot.id)
    return reward


def ppo_step(store, runner, rnd, reward, settings: LoopSettings):
    """Round steps 5-6: PPO from the round's policy against `reward`; the new policy becomes active."""
    from pipeline.loop import _model_args, _wait_done, write_prompts

    policy = store.get_model_version(rnd.policy_version_id)
    prompts = write_prompts(store.list_prompts(limit=settings.ppo_prompts),
                            runner.runs_root / "inputs" / f"round-{rnd.id}-ppo-prompts.jsonl")
    args = ["--prompts", str(prompts), "--reward", reward.path, *_cli(settings.ppo),
            *_model_args(settings.model), "--model", policy.base_model or settings.model.model]
    if policy.path:
        args += ["--policy", policy.path]
    run = runner.submit("ppo", args, inputs={"policy_version_id": policy.id, "reward_version_id": reward.id,
                                             "round_id": rnd.id})
    new_id = _wait_done(runner, run, "PPO").outputs["model_version_id"]
    store.set_active_policy(new_id)
    return store.update_round(rnd.id, status="done", new_policy_version_id=new_id)


def _cli(cfg) -> list[str]:
    from pipeline.config import to_cli_args

    return to_cli_args(cfg)


def copy_store(store, src: Path, dst: Path) -> None:
    """A consistent copy of the DuckDB file: close it first (DuckDB folds its WAL in on close)."""
    store.close()
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def ppo_step_trace(run_dir: Path, judge, round_no: int) -> list[dict]:
    """Per PPO step: proxy score and KL of the rollout (metrics.jsonl), and the gold score of the
    step's sample table (samples/step_N.jsonl: the first responses of the rollout)."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        m = json.loads(line)
        row = {"round": round_no, "step": m["step"], "proxy": m["objective/score"], "kl": m["objective/kl"],
               "beta": m["kl/beta"], "length": m["gen/length_mean"], "eos_rate": m["gen/eos_rate"]}
        samples = run_dir / "samples" / f"step_{m['step']}.jsonl"
        if samples.is_file():
            table = [json.loads(s) for s in samples.read_text(encoding="utf-8").splitlines() if s.strip()]
            prompts = [t["prompt"] if isinstance(t["prompt"], str) else t["prompt"][-1]["content"] for t in table]
            gold = judge.score(prompts, [t["response"] for t in table])
            row.update(gold=sum(gold) / len(gold), gold_n=len(gold))
        rows.append(row)
    return rows
