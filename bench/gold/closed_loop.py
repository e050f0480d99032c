"""The round a user starts, measured as a loop: does each round of the product's defaults make the
policy better by the gold judge, on prompts nobody tuned on?

    python bench/gold/closed_loop.py --out DIR                  # SmolLM2-135M, 3 seeds x 3 rounds (hours of CPU)
    python bench/gold/closed_loop.py --out DIR --resume         # continue a stopped run where it stopped
    python bench/gold/closed_loop.py --out DIR --quick          # tiny random models, end to end (a minute)
    python bench/gold/closed_loop.py --report DIR               # report.md again from results.json and raw.json

Every round is `python -m pipeline loop --oracle embedding`'s round with `default_round` settings:
`LoopSettings()` itself but for the sizes and seeds named in SIZES (a test holds it to that). Per
seed, with its own store, annotators' noise, prompt order, round prompts, reward models and sampling:
  0. the pool (bench/gold/prompt_sets.py: the bundled prompts minus the development and the locked
     test prompts) shuffled by the seed; its last `leaderboard_prompts` held back for the blind
     evaluation (blind_prompts.jsonl: never in the store until the seed's end, so no round ranks or
     trains on them), the rest imported, so the round prompts and PPO's prompts (the first
     `ppo_prompts` of the store) differ between seeds; the base policy evaluated and its answers to
     the held-back prompts sampled (blind/base.jsonl)
  1. rounds 1..R as the loop runs them: K responses per prompt from the active policy (a job), the
     simulated annotators rank every item through the store's queue (the gold
     judge, Bradley-Terry noise), a reward model learns every pair so far (warm-started from the
     last), the reward-model gate, PPO against it; a round whose reward model the gate refuses is
     closed without a new policy, as a user who does not click "Run PPO anyway" would leave it
  2. each round's policy evaluated on the locked test prompts (bench/gold/eval.py: `samples`
     responses per prompt at the generation's length and temperature; gold, KL to the base), and
     its answers to the held-back prompts sampled as soon as it is made (blind/roundN.jsonl), as a
     sample-versions job samples each version (the same seed, pipeline/sample_versions.py)
  3. after the last round, a blind evaluation as the Models tab runs one (store/evaluations.py):
     the held-back prompts imported, one item per prompt with the answers of the base and every
     round's policy, the simulated annotators rank them in the ordinary queue, unmarked, and the
     store's Bradley-Terry leaderboard (with bootstrap intervals over prompts) ranks them; no
     earlier round's weights are needed for it
  4. results.json (settings, per seed and round: the reward model's held-out accuracy and gate,
     PPO's last KL and beta, the evaluation, CPU time per job kind and of this process) and raw.json (per evaluation and prompt: mean
     gold and KL) rewritten after every step; report.md (bench/gold/closed_report.py) from them.
Seeds run one after another (seed-major: seed 0's rounds and blind evaluation, then seed 1's ...),
so at most one seed is in flight; --resume continues a seed's round from the state its store
records, and --stop-after-rounds N ends this invocation after N rounds (at a round's end).

A run outlives the machine it started on through a packed state, small enough to commit:

    python bench/gold/closed_loop.py --out DIR --pack bench/gold/closed_loop_state    # after it stopped
    python bench/gold/closed_loop.py --out DIR2 --unpack bench/gold/closed_loop_state  # elsewhere, then --resume

After every step (the base's evaluation, each round, the blind evaluation) the run keeps a
boundary (OUT/boundary: results.json, raw.json and a backup of the seed's store as of that step's
end), and the pack is the last boundary: a run stopped in the middle of a round resumes where it
was in its own folder, and from the start of that round once packed. The pack holds results.json,
raw.json, and per seed the evaluations' sample tables, the blind answers, the prompt files and a
gzipped backup of its store (paths relative to the run folder, store/backup.py `relocate`); the
seed in flight also its active policy and newest reward model (the next round warm-starts from
it) as fp16 safetensors, which --unpack casts back to the dtype they were saved in (FP16_INDEX). A
finished seed keeps no weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import random
import shlex
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.gold.eval import EvalConfig  # noqa: E402
from bench.gold.prompt_sets import LOCKED, PROMPTS, locked_prompts, split_prompts  # noqa: E402
from bench.run_all import machine_info  # noqa: E402
from bench.gold.steps import Context, JobCPU, RecordingOracle, cpu_seconds, own_cpu_seconds, write_rows  # noqa: E402
from pipeline.orchestrate.steps import POLICY_STEPS, LoopSettings  # noqa: E402

OUT_ROOT = ROOT / "bench" / "out" / "closed_loop"
RUN = "{run}"
"""What a packed state writes in place of the run folder's path (in its stores and results)."""
BOUNDARY = "boundary"
"""The run folder's copy of its state as of the last finished step (pack reads it)."""
FP16_INDEX = "fp16.json"
"""A packed state's list of the tensors it holds in fp16, each with the dtype it was saved in."""
PUBLISH = ROOT / "docs" / "results" / "closed_loop"

SIZES = ("loop.rounds", "loop.prompts_per_round", "loop.seed", "generate.seed", "reward.seed", "ppo.seed",
         "dpo.seed", "policy_step")
"""The only settings of `default_round` that differ from LoopSettings(): the simulated team's size
(prompts ranked a round), how many rounds, the policy step, and the seeds (one per run)."""


@dataclass
class Sizes:
    seeds: list[int]
    rounds: int = 3
    prompts_per_round: int = 256
    """Prompts the simulated team ranks each round (K responses each)."""
    eval_samples: int = 4
    """Responses per locked test prompt in each evaluation."""
    leaderboard_prompts: int = 64
    """Held-out prompts of the blind evaluation after the last round (0 = none)."""
    noise: float = 0.05
    """Bradley-Terry temperature of the simulated annotators (gold-score units)."""
    threads: int = 2
    policy_step: str = "ppo"


def default_round(seed: int, sizes: Sizes) -> LoopSettings:
    """What "Run a full round" and `python -m pipeline loop` run by default, with the sizes and seeds
    of SIZES set: nothing else."""
    s = LoopSettings(policy_step=sizes.policy_step)
    s.loop.rounds, s.loop.prompts_per_round, s.loop.seed = sizes.rounds, sizes.prompts_per_round, seed
    for part in (s.generate, s.reward, s.ppo, s.dpo):
        part.seed = seed
    return s


def quick_round(seed: int, sizes: Sizes, model_dir: str) -> LoopSettings:
    """`default_round` shrunk for tiny random models (the smoke test): a tiny model, a few steps,
    and no reward-model gate (a tiny model's reward model is at chance)."""
    s = default_round(seed, sizes)
    s.loop.reward_gate = False
    s.model = dataclasses.replace(s.model, model=model_dir, lora_r=4, lora_alpha=8)
    s.generate = dataclasses.replace(s.generate, k=3, max_new_tokens=8, batch_size=18)
    s.reward = dataclasses.replace(s.reward, batch_size=4, max_length=64, norm_samples=0, lr=1e-3)
    s.ppo = dataclasses.replace(s.ppo, steps=2, batch_size=4, mini_batch_size=4, micro_batch_size=4, ppo_epochs=1,
                                lr=1e-3, max_new_tokens=8)
    s.ppo_prompts = 8
    return s


def eval_config(settings: LoopSettings, sizes: Sizes, seed: int) -> EvalConfig:
    """Each evaluation samples as the round's generation does (what annotators are shown), one seed
    per run seed: the base and every round of a seed are sampled alike, so a gain is the policy's."""
    g = settings.generate
    return EvalConfig(samples=sizes.eval_samples, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                      top_p=g.top_p, top_k=g.top_k, seed=1234 + seed)


# --------------------------------------------------------------------------- one seed


class Seed:
    """One seed's store, job queue, settings and results entry."""

    def __init__(self, run: "ClosedLoop", seed: int):
        from pipeline.orchestrate.loop import make_runner
        from store import Store

        self.run, self.seed, self.folder = run, seed, run.out / f"seed{seed}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.settings = run.settings_for(seed)
        self.eval = eval_config(self.settings, run.sizes, seed)
        self.exp = _Exp(self.settings, self.eval, run.sizes.threads)
        self.ctx = Context(self.exp, self.folder, run.test_prompts, run.judge, run.results, run.lock, run.log)
        self.entry = run.results["seeds"].setdefault(str(seed), {"rounds": {}})
        self.store = Store(self.folder / "rlhf.duckdb")
        self.runner = make_runner(self.store, self.folder / "runs", poll_s=0.5, env=self.ctx.env())
        self.jobs = JobCPU(self.runner, self.folder / JOB_CPU)

    def close(self) -> None:
        self.runner.shutdown()
        self.store.close()

    def evaluate(self, path, tag: str) -> dict:
        metrics, rows = self.ctx.evaluate(path, {}, f"s{self.seed}_{tag}", self.eval)
        self.run.add_raw(self.seed, tag, rows)
        return metrics

    def done(self) -> bool:
        """Every round played and, when the run has one, the blind evaluation of all of them."""
        rounds = self.run.sizes.rounds
        return str(rounds) in self.entry["rounds"] and (
            not self.run.sizes.leaderboard_prompts or self.entry.get("leaderboard", {}).get("rounds") == rounds)

    def step_done(self) -> None:
        """results.json and raw.json written, and the boundary (module docstring) moved to now."""
        self.run.save()
        boundary, fresh = self.run.out / BOUNDARY, self.run.out / f"{BOUNDARY}.tmp"
        shutil.rmtree(fresh, ignore_errors=True)
        fresh.mkdir()
        for name in ("results.json", "raw.json"):
            shutil.copy2(self.run.out / name, fresh / name)
        from store.backup import backup

        backup(self.store, fresh / f"seed{self.seed}.duckdb")
        shutil.rmtree(boundary, ignore_errors=True)
        fresh.rename(boundary)


@dataclass
class _Exp:
    """What bench/gold/steps.py's Context reads of an experiment."""

    loop: LoopSettings
    eval: EvalConfig
    threads: int


BLIND_PROMPTS = "blind_prompts.jsonl"
BLIND = "blind"
JOB_CPU = "job_cpu.json"
"""Each job's CPU seconds (steps.JobCPU), in the seed's folder."""
OWN = "this process"
"""A round's CPU besides its jobs: the evaluation, the blind answers, the simulated annotators."""


def start(sd: Seed, pool: Path) -> None:
    """Step 0: the pool in the seed's order, its last `leaderboard_prompts` held back and the rest
    imported, once; the base policy evaluated and its blind answers sampled."""
    from pipeline.orchestrate.steps import ensure_base_policy
    from store.io import import_prompts

    if not sd.store.list_prompts(limit=1):
        rows = [json.loads(line) for line in pool.read_text(encoding="utf-8").splitlines() if line.strip()]
        random.Random(sd.seed).shuffle(rows)
        keep = len(rows) - sd.run.sizes.leaderboard_prompts
        write_rows(sd.folder / BLIND_PROMPTS, rows[keep:])
        import_prompts(sd.store, write_rows(sd.folder / "pool.jsonl", rows[:keep]))
    ensure_base_policy(sd.store, sd.settings.model)
    sd.entry["base"] = sd.evaluate(None, "base")
    sd.entry["base_machine"] = sd.run.results["machine"]
    answer_blind(sd, sd.store.find_model_version("base"), "base")


def answer_blind(sd: Seed, version, tag: str) -> None:
    """`version`'s answers to the held-back prompts, one each, sampled as the Models tab's
    sample-versions job samples every version of an evaluation (its length, temperature and one
    seed for all: steps.submit_evaluation), kept in blind/TAG.jsonl for the seed's end."""
    from pipeline.compare import CompareConfig
    from pipeline.sample_versions import sample_versions

    path = sd.folder / BLIND / f"{tag}.jsonl"
    if not sd.run.sizes.leaderboard_prompts or path.is_file():
        return
    held = [json.loads(line) for line in (sd.folder / BLIND_PROMPTS).read_text(encoding="utf-8").splitlines()
            if line.strip()]
    g = sd.settings.generate
    spec = {"version_id": version.id, "name": version.name, "base_model": version.base_model or sd.settings.model.model,
            "adapter": version.path}
    rows = sample_versions([spec], [{"id": i, "prompt": r["prompt"]} for i, r in enumerate(held)], sd.settings.model,
                           CompareConfig(max_new_tokens=g.max_new_tokens, temperature=g.temperature, seed=sd.seed))
    for row in rows:  # the prompt by its text: it has no store id until the seed's end
        row["prompt"] = held[row.pop("prompt_id")]["prompt"]
    write_rows(path.with_suffix(".tmp"), rows).rename(path)  # whole or absent: a stop re-samples it


def play_round(sd: Seed, n: int) -> None:
    """Step 1-2 for round n (from 1): as far as the store says it has come, then to its end."""
    from pipeline.orchestrate.loop import (IN_FLIGHT, RoundFailed, close_round, finish_round, generation_stopped,
                                           resume_generation, start_round, wait_round)
    from pipeline.orchestrate.simulate import simulate_annotations

    t, own = time.perf_counter(), own_cpu_seconds()
    rounds = sd.store.list_rounds()
    rnd = rounds[n - 1] if len(rounds) >= n else start_round(sd.store, sd.runner, sd.settings, n - 1)
    if generation_stopped(rnd):  # the run stopped while the round was generating: the rest first
        rnd = resume_generation(sd.store, sd.runner, rnd, sd.settings)
    ranked = simulate_annotations(sd.store, sd.ctx.judge, noise=sd.run.sizes.noise, seed=sd.seed * 1000 + n)
    gate = None
    rnd = sd.store.get_round(rnd.id)
    if rnd.status != "done":
        try:  # a step the job queue took up again (a trainer continuing its saved state) runs to its end
            rnd = (wait_round(sd.store, rnd) if rnd.status in IN_FLIGHT
                   else finish_round(sd.store, sd.runner, rnd, sd.settings, anyway=True))
        except RoundFailed:
            rnd = sd.store.get_round(rnd.id)
            gate = rnd.meta.get("reward_gate")
            if not gate or gate.get("trusted"):
                raise
            rnd = close_round(sd.store, rnd)  # the gate refused PPO: no new policy this round
    rnd = sd.store.get_round(rnd.id)
    entry = {"round_id": rnd.id, "ranked": ranked, **round_record(sd, rnd), "gate": gate}
    policy = sd.store.get_model_version(rnd.new_policy_version_id) if rnd.new_policy_version_id else None
    if policy is not None and policy.path:
        entry["eval"] = sd.evaluate(policy.path, f"round{n}")
        answer_blind(sd, policy, f"round{n}")
    else:  # the round made no policy: the policy of the round before stands (its evaluation)
        entry["eval"] = sd.entry["rounds"][str(n - 1)]["eval"] if n > 1 else sd.entry["base"]
        sd.run.add_raw(sd.seed, f"round{n}", None, same_as=f"round{n - 1}" if n > 1 else "base")
    parts = {**sd.jobs.of_round(rnd.id), OWN: own_cpu_seconds() - own}
    entry.update(wall_s=time.perf_counter() - t, cpu_s=sum(parts.values()), cpu_parts=parts,
                 machine=sd.run.results["machine"])
    with sd.run.lock:
        sd.entry["rounds"][str(n)] = entry


def blind_evaluation(sd: Seed) -> None:
    """Step 3: the base and each round's policy ranked blind by the simulated annotators, on the
    held-back prompts, from the answers each gave when it was made."""
    from pipeline.orchestrate.simulate import simulate_annotations
    from store.io import import_prompts

    rounds = sd.store.list_rounds()
    versions = [sd.store.find_model_version("base")]
    versions += [sd.store.get_model_version(r.new_policy_version_id) for r in rounds if r.new_policy_version_id]
    tags = list(policy_tags(sd.store).values())
    if len(versions) < 2:
        sd.entry["leaderboard"] = {"skipped": "no round made a policy", "rounds": len(rounds)}
        return
    name = f"rounds 1-{len(rounds)}"
    ev = sd.store.find_evaluation(name)
    if ev is None:
        import_prompts(sd.store, sd.folder / BLIND_PROMPTS, source="blind evaluation")
        ids = {p.text: p.id for p in sd.store.prompts_without_responses()}
        answers = [row for tag in tags for row in
                   map(json.loads, (sd.folder / BLIND / f"{tag}.jsonl").read_text(encoding="utf-8").splitlines())]
        by_prompt: dict[int, list[tuple]] = {}
        for row in answers:
            by_prompt.setdefault(ids[row["prompt"]], []).append(
                (row["version_id"], row["text"], row["token_count"], row["finish_reason"], row["sampling"]))
        ev = sd.store.create_evaluation(name, [v.id for v in versions], list(by_prompt))
        sd.store.add_evaluation_items(ev.id, list(by_prompt.items()))
    simulate_annotations(sd.store, sd.ctx.judge, noise=sd.run.sizes.noise, seed=sd.seed * 1000 + 999)
    results = sd.store.evaluation_results(ev.id, seed=sd.seed)
    sd.entry["leaderboard"] = {"rounds": len(rounds), "prompts": results["prompts"], "comparisons": results["comparisons"],
                               "machine": sd.run.results["machine"], "rows": results["leaderboard"]}
    label_leaderboard(sd)


def policy_tags(store) -> dict[str, str]:
    """{model version name: 'base' or 'roundN'} of the base and each round's new policy, by the
    round that made it (a round the gate stopped made none)."""
    tags = {store.find_model_version("base").name: "base"}
    for n, r in enumerate(store.list_rounds(), 1):
        if r.new_policy_version_id:
            tags[store.get_model_version(r.new_policy_version_id).name] = f"round{n}"
    return tags


def label_leaderboard(sd: Seed) -> None:
    """Each leaderboard row's `policy`: the round that made its version (`policy_tags`). Run again
    on every resume: an earlier version of this file labelled rows by their place among the
    policies, calling a round after a gated one by the round before."""
    rows = sd.entry.get("leaderboard", {}).get("rows", [])
    tags = policy_tags(sd.store) if rows else {}
    for row in rows:
        row["policy"] = tags.get(row["version"], row["version"])


def round_record(sd: Seed, rnd) -> dict:
    """What the store recorded of a round: its items, pairs so far, the reward model's held-out
    figures and PPO's last step."""
    out: dict = {"items": sd.store.round_rankable(rnd.id, 1)["items"], "pairs_so_far": len(sd.store.list_pairs())}
    reward_id = rnd.reward_version_id or (rnd.meta.get("reward_gate") or {}).get("reward_version_id")
    if reward_id:
        ev = sd.store.get_model_version(reward_id).meta.get("eval", {})
        out["reward"] = {k: ev.get(k) for k in ("eval/accuracy", "eval/pairs", "eval/length_baseline_accuracy",
                                                "eval/loss", "train/pairs")}
    ppo = [r for r in sd.store.list_runs(kind="ppo") if r.inputs.get("round_id") == rnd.id and r.status == "done"]
    if ppo:
        rows = [json.loads(line) for line in (Path(ppo[-1].run_dir) / "metrics.jsonl").read_text().splitlines()
                if line.strip()]
        last = rows[-1] if rows else {}
        out["ppo"] = {k: last.get(k) for k in ("step", "objective/kl", "kl/beta", "objective/score", "gen/eos_rate",
                                               "gen/length_mean")}
    return out


def machine() -> str:
    """The machine this process runs on, in a few words: each round records the one it ran on (a run
    stopped and resumed may have run its rounds on several)."""
    info = machine_info()
    return f"{info['cpu']}, {info['cores']} cores, torch {info.get('torch', '?')}, GPU {info.get('gpu', 'none')}"


# --------------------------------------------------------------------------- the whole run


class ClosedLoop:
    def __init__(self, sizes: Sizes, out: Path, quick_model: str = "", log=print, resume: bool = False):
        from pipeline.oracle import make_oracle

        self.sizes, self.out, self.quick_model, self.log = sizes, Path(out), quick_model, log
        self.lock = threading.RLock()
        self.out.mkdir(parents=True, exist_ok=True)
        # the development prompts are only left out of the pool here: this run never evaluates on them
        _, self.pool = split_prompts(PROMPTS, 24, 0, self.out / "prompts")
        self.test_prompts = locked_prompts()
        if quick_model:
            self.test_prompts = self.test_prompts[:4]
        self.judge = RecordingOracle(make_oracle("embedding"))
        self.results = {"settings": self.describe(), "seeds": {}, "timings": {}, "commit": _commit(),
                        "cpu_counts_jobs": True, "machine": machine()}
        self.raw: dict = {}
        self.t0, self.cpu0, self.before = time.perf_counter(), cpu_seconds(), (0.0, 0.0)
        if resume:
            self.resume()

    def settings_for(self, seed: int) -> LoopSettings:
        if self.quick_model:
            return quick_round(seed, self.sizes, self.quick_model)
        return default_round(seed, self.sizes)

    def describe(self) -> dict:
        settings = self.settings_for(0).to_dict()
        settings["model"]["model"] = settings["model"]["model"].replace(str(self.out), RUN)  # --quick's tiny model
        return {"sizes": dataclasses.asdict(self.sizes), "settings": settings,
                "sizes_differ_from_defaults": list(SIZES), "test_prompts": str(LOCKED.relative_to(ROOT)),
                "test_prompts_n": len(self.test_prompts), "quick": bool(self.quick_model),
                "judge": "embedding (all-MiniLM-L6-v2, pipeline/oracle.py defaults)"}

    def resume(self) -> None:
        """Continue a stopped run with the same settings; rounds that finished are kept."""
        old = json.loads((self.out / "results.json").read_text(encoding="utf-8"))
        before, now = dict(old["settings"]), dict(self.results["settings"])
        for d in (before, now):  # more seeds or rounds may be asked of a resumed run (not other blind prompts)
            d["sizes"] = {k: v for k, v in d["sizes"].items() if k not in ("seeds", "rounds")}
            d["settings"]["loop"].pop("rounds", None)
        # a setting the code gained since the run started ran as its default (as LoopSettings.from_dict reads it)
        now["settings"] = _as_known(now["settings"], before["settings"])
        if before != now:
            differ = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
            raise SystemExit(f"--resume {self.out}: its settings differ from these ({', '.join(differ)})")
        self.raw = json.loads((self.out / "raw.json").read_text(encoding="utf-8"))["evals"]
        self.results.update(seeds=old["seeds"], timings=old.get("timings", {}), command=old.get("command", ""),
                            resumed=old.get("resumed", []) + [{"commit": old.get("commit"), "wall_s": old.get("wall_s"),
                                                               "cpu_s": old.get("cpu_s"),
                                                               "machine": old.get("machine")}])
        self.before = (sum(r["wall_s"] or 0 for r in self.results["resumed"]),
                       sum(r["cpu_s"] or 0 for r in self.results["resumed"]))
        for entry in self.results["seeds"].values():  # rounds run before a job's CPU was counted
            for rnd in entry["rounds"].values():
                if "cpu_parts" not in rnd and rnd.get("cpu_s") is not None:
                    rnd.update(cpu_s=None, cpu_not_counted=rnd["cpu_s"])  # this process's alone: not the round's
        if not old.get("cpu_counts_jobs"):  # the run's total CPU missed its jobs until now: not known
            self.before = (self.before[0], None)

    def add_raw(self, seed: int, tag: str, rows: list[dict] | None, same_as: str = "") -> None:
        """Per prompt of one evaluation: mean gold and KL over its responses, and how many (or the
        table of `same_as`: a round without a new policy)."""
        with self.lock:
            evals = self.raw.setdefault(str(seed), {})
            if rows is None:
                evals[tag] = evals[same_as]
                return
            groups: dict[str, list[dict]] = {}
            for r in rows:
                groups.setdefault(r["prompt"], []).append(r)
            evals[tag] = {p: {"gold": sum(r["gold"] for r in g) / len(g), "kl": sum(r["kl"] for r in g) / len(g),
                              "n": len(g)} for p, g in groups.items()}

    def save(self) -> None:
        with self.lock:
            self.results["wall_s"] = self.before[0] + time.perf_counter() - self.t0
            self.results["cpu_s"] = None if self.before[1] is None else self.before[1] + cpu_seconds() - self.cpu0
            (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
            (self.out / "raw.json").write_text(json.dumps({"prompts": self.test_prompts, "evals": self.raw}, indent=0))

    def run(self, stop_after_rounds: int = 0) -> bool:
        """Seed after seed, each to its end (module docstring); True when every seed is done, False
        when `stop_after_rounds` rounds (0: no limit) were played first."""
        import torch

        torch.set_num_threads(self.sizes.threads)
        played = 0
        for seed in self.sizes.seeds:
            sd = Seed(self, seed)
            try:
                label_leaderboard(sd)
                if "base" not in sd.entry:
                    self.log(f"seed {seed}, the base")
                    start(sd, self.pool)
                    sd.step_done()
                for n in range(1, self.sizes.rounds + 1):
                    if str(n) in sd.entry["rounds"]:
                        continue
                    if stop_after_rounds and played == stop_after_rounds:
                        self.log(f"stopped after {played} rounds: --resume goes on, --pack keeps it")
                        return False
                    self.log(f"seed {seed}, round {n}")
                    sd.entry.pop("done", None)  # a resumed run asked for more rounds
                    play_round(sd, n)
                    played += 1
                    sd.step_done()
                if not sd.done():
                    self.log(f"seed {seed}, blind evaluation")
                    blind_evaluation(sd)
                if not sd.entry.get("done"):
                    sd.entry["done"] = True  # its pack keeps no weights
                    sd.step_done()
            finally:
                sd.close()
        self.save()
        return True


def _as_known(now: dict, before: dict) -> dict:
    """`now` without the keys `before` does not have, at every level of nesting: the settings a
    run recorded before the code gained them."""
    return {k: _as_known(v, before[k]) if isinstance(v, dict) and isinstance(before[k], dict) else v
            for k, v in now.items() if k in before}


def _commit() -> str:
    """The checkout's commit (with '+changes' when its tracked files differ from it), '' outside git."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+changes" if dirty else "")


# --------------------------------------------------------------------------- a state to commit


def pack(out: Path, state: Path) -> list[Path]:
    """The run in `out` as of its last boundary, as the resume state in `state` (module
    docstring); returns the files."""
    from pipeline.orchestrate.steps import latest_reward
    from store import Store
    from store.backup import backup, relocate

    boundary = out / BOUNDARY
    if not (boundary / "results.json").is_file():
        raise SystemExit(f"--pack: {out} has no {BOUNDARY}/ (a run of this version writes one after every step)")
    results = json.loads((boundary / "results.json").read_text(encoding="utf-8"))
    if state.exists():
        shutil.rmtree(state)
    state.mkdir(parents=True)
    results["command"] = results.get("command", "").replace(str(out), RUN)
    (state / "results.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    shutil.copy2(boundary / "raw.json", state / "raw.json")
    fp16: dict[str, dict[str, str]] = {}
    for seed, entry in results["seeds"].items():
        folder, packed = out / f"seed{seed}", state / f"seed{seed}"
        db = boundary / f"seed{seed}.duckdb"
        keep = [folder / "eval", folder / BLIND, folder / BLIND_PROMPTS, folder / "pool.jsonl", folder / JOB_CPU,
                *sorted((folder / "runs" / "inputs").glob("*prompts.jsonl"))]
        with Store(db if db.is_file() else folder / "rlhf.duckdb") as store:
            in_flight = [] if entry.get("done") else [store.active_policy(), latest_reward(store)]
            weights = [Path(v.path) for v in in_flight if v is not None and v.path]
            backup(store, packed / "relocating.db")
        with Store(packed / "relocating.db") as relocating:
            relocate(relocating, out, RUN)
            # copied again into a fresh file: the relocated one keeps the old paths in freed pages
            backup(relocating, packed / "store.db")
        (packed / "relocating.db").unlink()
        _gzip(packed / "store.db")  # a DuckDB file is mostly empty pages: ~30x smaller
        for path in [p for p in keep if p.exists()] + weights:
            target = state / path.relative_to(out)
            target.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, target)
        for folder_ in weights:
            for file in sorted((state / folder_.relative_to(out)).rglob("*.safetensors")):
                fp16[str(file.relative_to(state))] = _cast_safetensors(file, {})
    (state / FP16_INDEX).write_text(json.dumps(fp16, indent=1, sort_keys=True), encoding="utf-8")
    if (out / "tiny_model").is_dir():
        shutil.copytree(out / "tiny_model", state / "tiny_model")
    _replace_in_json(state, str(out), RUN)  # model folders name their base model (--quick: a path)
    return sorted(p for p in state.rglob("*") if p.is_file())


def _cast_safetensors(path: Path, dtypes: dict[str, str]) -> dict[str, str]:
    """Rewrite a safetensors file with every float32 tensor in fp16 (`dtypes` empty), or with the
    tensors `dtypes` names back in those dtypes; returns {tensor: dtype it had} of those cast."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    cast = {}
    for name, t in tensors.items():
        want = getattr(torch, dtypes[name]) if dtypes else (torch.float16 if t.dtype == torch.float32 else None)
        if want is not None and t.dtype != want:
            cast[name] = str(t.dtype).removeprefix("torch.")
            tensors[name] = t.to(want).contiguous()
    save_file(tensors, str(path), metadata=metadata)
    return cast


def _gzip(path: Path) -> None:
    """`path` replaced by `path`.gz."""
    with open(path, "rb") as src, gzip.open(path.with_name(path.name + ".gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()


def _replace_in_json(folder: Path, old: str, new: str) -> None:
    """In the model folders' JSON files (results.json keeps RUN: a run's results name no machine's path)."""
    for path in folder.glob("seed*/**/*.json"):
        text = path.read_text(encoding="utf-8")
        if old in text:
            path.write_text(text.replace(old, new), encoding="utf-8")


def unpack(state: Path, out: Path) -> None:
    """A packed state as the run folder `out`, ready for --resume: its stores relocated, its fp16
    weights cast back to the dtypes they were saved in, and its boundary the packed state."""
    from store import Store
    from store.backup import relocate

    if (out / "results.json").exists():
        raise SystemExit(f"--unpack: {out} already holds a run; give a new --out")
    shutil.copytree(state, out, dirs_exist_ok=True)
    _replace_in_json(out, RUN, str(out))
    index = out / FP16_INDEX
    for name, dtypes in (json.loads(index.read_text(encoding="utf-8")) if index.is_file() else {}).items():
        _cast_safetensors(out / name, dtypes)
    index.unlink(missing_ok=True)
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    (out / BOUNDARY).mkdir()
    for seed in results["seeds"]:
        db = out / f"seed{seed}" / "rlhf.duckdb"
        packed = out / f"seed{seed}" / "store.db.gz"
        with gzip.open(packed, "rb") as src, open(db, "wb") as dst:
            shutil.copyfileobj(src, dst)
        packed.unlink()
        with Store(db) as store:
            relocate(store, RUN, out)
        shutil.copy2(db, out / BOUNDARY / f"seed{seed}.duckdb")
    for name in ("results.json", "raw.json"):
        shutil.copy2(out / name, out / BOUNDARY / name)


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--out", default="", help="results directory (default: bench/out/closed_loop/<time>)")
    add("--seeds", type=lambda t: [int(x) for x in t.split(",") if x.strip()], default=[0, 1, 2], help="e.g. 0,1,2")
    add("--rounds", type=int, default=3)
    add("--prompts-per-round", type=int, default=256, help="the simulated team's size: prompts ranked a round")
    add("--eval-samples", type=int, default=4, help="responses per locked test prompt")
    add("--leaderboard-prompts", type=int, default=64,
        help="held-out prompts of the blind evaluation after the last round (0: none)")
    add("--policy-step", choices=POLICY_STEPS, default="ppo",
        help="the round's policy step, as the Train tab's (one run per step: an RLOO run beside a PPO run with the same seeds)")
    add("--threads", type=int, default=2, help="torch threads here and in every job")
    add("--quick", action="store_true", help="tiny random models")
    add("--resume", action="store_true", help="continue the stopped run in --out (the same options)")
    add("--stop-after-rounds", type=int, default=0,
        help="stop after this many rounds of this invocation, at a round's end (0: run to the end)")
    add("--report", default="", help="only rebuild report.md of this results directory")
    add("--pack", default="", help="only write the stopped run in --out as a resume state to this folder")
    add("--unpack", default="", help="only unpack this resume state as the run folder --out (then --resume)")
    add("--publish", default=None, help="copy report and raw data here (default: docs/results/closed_loop for a "
                                        "full run, nowhere for --quick; 'none': nowhere)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from bench.gold.closed_report import publish, result_line, write_report

    args = build_parser().parse_args(argv)
    if args.report:
        print(write_report(Path(args.report)))
        print(result_line(Path(args.report)))
        return 0
    if args.pack or args.unpack:
        if not args.out:
            raise SystemExit("--pack and --unpack need --out (the run folder)")
        if args.pack:
            files = pack(Path(args.out), Path(args.pack))
            print(f"packed {len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB, in {args.pack}")
        else:
            unpack(Path(args.unpack), Path(args.out))
            print(f"unpacked {args.unpack} as {args.out}: continue with --resume")
        return 0
    if args.resume and not (Path(args.out) / "results.json").is_file():
        raise SystemExit("--resume: give the stopped run's folder as --out (it has no results.json)")
    out = Path(args.out or OUT_ROOT / time.strftime("%Y%m%d-%H%M%S"))
    sizes = Sizes(seeds=args.seeds, rounds=args.rounds, prompts_per_round=args.prompts_per_round,
                  eval_samples=args.eval_samples, leaderboard_prompts=args.leaderboard_prompts, threads=args.threads,
                  policy_step=args.policy_step)
    quick_model = ""
    if args.quick:
        from tests.tiny import save_tiny_model_dir

        quick_model = str(save_tiny_model_dir(out / "tiny_model"))
    run = ClosedLoop(sizes, out, quick_model, resume=args.resume)
    command = "python bench/gold/closed_loop.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    run.results["command"] = run.results.get("command", "") + (" then " if args.resume else "") + command
    if not run.run(args.stop_after_rounds):
        return 0
    print(f"report: {write_report(out)}")
    target = args.publish if args.publish is not None else ("" if args.quick else str(PUBLISH))
    if target and target != "none":
        for path in publish(out, Path(target)):
            print(f"published: {path}")
    print(result_line(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
