"""The gold-judge experiment as evidence: several seeds per arm, a converged proxy, measured curves.

bench/gold/loop.py runs each method once; a single training run says nothing about the next one.
Here every arm runs on several seeds, and each seed changes the annotators' noise, the sampling
and the training order:

    python bench/gold/seeds.py --quick                  # tiny random models, end to end (about a minute)
    python bench/gold/seeds.py --seeds 0,1,2            # SmolLM2-135M (sizes: --prompts-per-round, --ppo-steps ...)
    python bench/gold/seeds.py --report RESULTS_DIR     # rebuild report.md from results.json and raw.json

Per seed (bench/gold/loop.py's judge, annotators, held-out prompts and evaluation):
  1. round 1 with the base policy: K responses for each of --prompts-per-round prompts, ranked by
     the simulated annotators (seeded noise); the pairs are split by prompt into training pairs
     and held-out pairs (--heldout-fraction)
  2. the proxy reward model, trained as a user would train it: one epoch at a time (warm-started
     from the previous epoch, its own data order each epoch), scored on the held-out pairs after
     each; it stops when the held-out loss has not improved for --patience epochs (or at
     --max-epochs) and the epoch with the lowest held-out loss is the proxy
  3. the start policy samples max(n) responses per held-out prompt: its evaluation, and best-of-n
     with the proxy (bench/gold/bon.py)
  4. the arms, each from the start policy: PPO against the proxy (adaptive KL, beta = 0, ...),
     DPO on the proxy's very training pairs (held-out pairs as its eval data) and, as a control,
     PPO against the gold judge itself (JUDGE_ARMS). Each job saves a
     checkpoint every so many steps; every checkpoint is copied as it appears and evaluated on the
     held-out prompts (gold, proxy, KL): measured gold-vs-sqrt(KL) curves, start (KL 0) included
  5. results.json (settings, per seed and arm the points and PPO's training metrics) and raw.json
     (per evaluation and prompt: mean gold, proxy and KL) are rewritten after every step;
     report.md is built from them alone (bench/gold/seed_report.py)

--share-round1 trains one round 1 and proxy (the first seed's) and varies by seed only the start
policy's and the arms' sampling, the arms' training order and the evaluation's sampling: cheaper
(the proxy is the costly part), and the report says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.gold.loop import PROMPTS, Experiment, _sizes, full_experiment, quick_experiment  # noqa: E402
from bench.gold.rounds import ADAPTIVE  # noqa: E402
from bench.gold.prompt_sets import split_prompts  # noqa: E402
from bench.gold.steps import Context, RecordingOracle, cpu_seconds, run_job, write_rows  # noqa: E402

OUT_ROOT = ROOT / "bench" / "out" / "gold_seeds"
PUBLISH = ROOT / "docs" / "results" / "gold_seeds"
SLOW_KL = {"kl_horizon": 80}
"""A horizon of ten steps of 8 episodes: beta moves by at most 2% a step (ADAPTIVE's horizon of one
step lets it fall 20% a step while KL is under target, and KL overshoots late in a run)."""
ZERO_CRITIC = {"critic_head": "zero"}
"""The critic's head started at 0 (pipeline/config.py PPOConfig.critic_head)."""
LR_WARMUP = {"lr_warmup_steps": 4}
"""The policy's learning rate ramped over its first 4 training steps (PPOConfig.lr_warmup_steps)."""
BIG_BATCH = {"batch_size": 32, "mini_batch_size": 16, "steps": 6, "critic_warmup_steps": 1}
"""32 episodes per PPO step in minibatches of 16 (bench/gold/loop.py's full run: 8 in minibatches of 4, 24 steps)."""
ARMS = {
    "adaptive": ADAPTIVE,
    "beta0": {"kl_control": "fixed", "init_kl_coef": 0.0},
    "fixed": {"kl_control": "fixed", "init_kl_coef": 0.1},
    "dpo": {},
    # the second PPO settings: beta slowed and the critic's head at 0; beta = 0 beside them
    "adaptive2": {**ADAPTIVE, **SLOW_KL, **ZERO_CRITIC},
    "adaptive2_h": {**ADAPTIVE, **SLOW_KL},  # the slow beta alone (the reward model's head kept)
    "beta0_2": {"kl_control": "fixed", "init_kl_coef": 0.0, **ZERO_CRITIC},
    # adaptive2 with the policy's learning rate ramped over its first 4 steps (its first step at
    # the full rate cost adaptive2 ~2 nats for no proxy gain)
    "adaptive3": {**ADAPTIVE, **SLOW_KL, **ZERO_CRITIC, **LR_WARMUP},
    # adaptive2's episodes in 4x fewer, 4x larger steps: each gradient the mean of 16 episodes, not 4
    # (noise moves the policy, adding KL, without moving the reward); the critic's warm-up the same
    # episodes (one step of 32 = adaptive2's 4 of 8)
    "adaptive2_b32": {**ADAPTIVE, **SLOW_KL, **ZERO_CRITIC, **BIG_BATCH},
    # adaptive2 against the gold judge itself (JUDGE_ARMS)
    "judge_adaptive2": {**ADAPTIVE, **SLOW_KL, **ZERO_CRITIC},
}
JUDGE_ARMS = ("judge_adaptive2",)
"""Arms whose PPO reward is the gold judge itself, not the proxy (pipeline/scoring.py
`oracle_reward`), normalised by the mean and s.d. of its scores of the start policy's best-of-n
samples (as the proxy is normalised on the start policy's samples); the critic still starts from
the proxy. A control for KL efficiency: how fast PPO raises a reward it can learn, per nat, against
best-of-n picking by the same judge. (docs/results/gold_seeds_centred: 0.38-0.44 of best-of-n's
rate on the judge, 0.16-0.28 on a proxy that ranks 60% of pairs right, whose per-sample error
best-of-n selects and a policy does not learn.)"""
ARM_ONLY = ("arms", "ppo", "dpo", "checkpoints", "ppo_prompts")
"""Settings only the arms read: a resumed run whose arms have not started may change them."""


def arm_label(settings: dict, name: str) -> str:
    if name == "dpo":
        return "DPO"
    if settings["kl_control"] == "adaptive":
        label = f"PPO, adaptive KL (target {settings['kl_target']:g} nats, horizon {settings['kl_horizon']} episodes)"
    else:
        label = "PPO, beta = 0" if settings["init_kl_coef"] == 0 else f"PPO, fixed beta {settings['init_kl_coef']:g}"
    label += ", critic head at 0" if settings.get("critic_head") == "zero" else ""
    label += f", {settings['batch_size']} episodes a step" if settings.get("batch_size") else ""
    label += ", rewarded by the gold judge itself" if name in JUDGE_ARMS else ""
    return label + (f", lr ramped over {settings['lr_warmup_steps']} steps" if settings.get("lr_warmup_steps") else "")


@dataclass
class SeedsConfig:
    exp: Experiment
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    arms: list[str] = field(default_factory=lambda: ["adaptive", "dpo", "beta0"])
    checkpoints: int = 3
    """Evaluations along each arm's training, its end included (the start, KL 0, is one more)."""
    max_epochs: int = 5
    patience: int = 1
    heldout_fraction: float = 0.25
    """Share of round 1's prompts whose pairs are held out for the proxy's early stopping."""
    share_round1: bool = False
    kl_target: float = 0.0
    """The adaptive arm's KL target in nats (0: ADAPTIVE's)."""

    def arm(self, name: str) -> dict:
        """The PPO settings of arm `name` ({} for DPO)."""
        if ARMS[name].get("kl_control") == "adaptive" and self.kl_target:
            return {**ARMS[name], "kl_target": self.kl_target}
        return ARMS[name]


def seeded(exp: Experiment, seed: int) -> Experiment:
    """The experiment with every seed of a run set from `seed` (annotators, prompt choice,
    sampling, the trainers' data order); the held-out prompts stay the same for every seed."""
    s = exp.loop
    loop = dataclasses.replace(s, loop=dataclasses.replace(s.loop, seed=seed),
                               generate=dataclasses.replace(s.generate, seed=seed),
                               reward=dataclasses.replace(s.reward, seed=seed, max_steps=0),
                               ppo=dataclasses.replace(s.ppo, seed=seed))
    return dataclasses.replace(exp, loop=loop, seed=seed,
                               eval=dataclasses.replace(exp.eval, seed=exp.eval.seed + seed),
                               dpo={**exp.dpo, "seed": seed})


# --------------------------------------------------------------------------- checkpoints as they appear


class Follower:
    """Copies a job's checkpoint each time it is rewritten: a thread polls `state` (a file the
    trainer replaces after the weights are written) and copies `policy` to dest/step_N."""

    def __init__(self, run_dir: Path, state: str, policy: str, dest: Path):
        self.run_dir, self.state, self.policy, self.dest = Path(run_dir), state, policy, Path(dest)
        self.copies: dict[int, str] = {}
        self._seen, self._stop = None, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def poll(self) -> None:
        import torch

        path = self.run_dir / self.state
        try:
            key = path.stat().st_mtime_ns
            if key == self._seen:
                return
            step = int(torch.load(path, map_location="cpu", weights_only=False)["step"])
            if step not in self.copies:
                target = self.dest / f"step_{step}"
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(self.run_dir / self.policy, target)
                self.copies[step] = str(target)
            self._seen = key
        except (OSError, EOFError, RuntimeError, KeyError):
            pass  # not there yet, or being replaced: the next poll takes it

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.poll()

    def stop(self) -> dict[int, str]:
        self._stop.set()
        self._thread.join()
        self.poll()
        return dict(sorted(self.copies.items()))


def follow_job(runner, run, state: str, policy: str, dest: Path):
    """Wait for a queued job, copying its checkpoints; (the ended run, {step: copied policy})."""
    while not run.run_dir:
        time.sleep(0.2)
        run = runner.store.get_run(run.id)
    follower = Follower(Path(run.run_dir), state, policy, dest)
    try:
        run = runner.wait(run.id)
    finally:
        copies = follower.stop()
    if run.status != "done":
        raise RuntimeError(f"{run.kind} job {run.id} {run.status} ({run.run_dir}): {run.error}")
    return run, copies


def last_step(run_dir: Path) -> int:
    lines = (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return max(json.loads(line)["step"] for line in lines if line.strip())


def metric_rows(run_dir: Path) -> list[dict]:
    """A job's metrics.jsonl, numbers only."""
    rows = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            rows.append({k: v for k, v in json.loads(line).items() if isinstance(v, (int, float))})
    return rows


# --------------------------------------------------------------------------- one seed


SHARED = ("annotators", "pairs_train", "pairs_heldout", "train_pairs", "heldout_pairs", "proxy")
"""A seed's entries that --share-round1 takes from the first seed (its pairs and proxy)."""


class Seed:
    """One seed's store, job queue and results entry; `record` keeps every evaluation."""

    def __init__(self, run: "SeedsRun", seed: int, folder: Path, borrow: "Seed | None" = None):
        from pipeline.orchestrate.loop import make_runner
        from store import Store

        self.run, self.seed, self.folder, self.owner = run, seed, folder, borrow is None
        self.exp = seeded(run.cfg.exp, seed)
        self.ctx = Context(self.exp, folder, run.heldout, run.judge, run.results, run.lock, run.log)
        folder.mkdir(parents=True, exist_ok=True)
        self.entry = run.results["seeds"].setdefault(str(seed), {"arms": {}})
        if borrow is None:
            self.store = Store(folder / "rlhf.duckdb")
            self.runner = make_runner(self.store, folder / "runs", poll_s=0.5, env=self.ctx.env())
        else:  # --share-round1: the first seed's store, pairs and proxy
            self.store, self.runner = borrow.store, borrow.runner
        self.borrow = borrow

    def take_shared(self) -> None:
        """--share-round1: the first seed's pairs and proxy, once its round 1 is done."""
        if self.borrow is not None:
            self.entry.update({k: self.borrow.entry[k] for k in SHARED if k in self.borrow.entry},
                              shared_round1_from=self.borrow.seed)

    def close(self) -> None:
        if self.owner:
            self.runner.shutdown()
            self.store.close()

    def evaluate(self, path, tag: str, eval_cfg=None) -> tuple[dict, list[dict]]:
        metrics, rows = self.ctx.evaluate(path, {"proxy": self.entry["proxy"]["path"]}, f"s{self.seed}_{tag}", eval_cfg)
        self.run.add_raw(self.seed, tag, rows)
        return metrics, rows


def round1(sd: Seed, pool: Path) -> None:
    """Steps 1-2 of the module docstring: pairs, their split, the early-stopped proxy."""
    from pipeline.orchestrate.loop import start_round
    from pipeline.orchestrate.simulate import simulate_annotations
    from pipeline.orchestrate.steps import pairs_snapshot
    from bench.gold.arms import _plain
    from bench.gold.steps import gold_agreement
    from store.export import load_pairs_snapshot
    from store.io import import_prompts

    cfg, settings = sd.run.cfg, sd.exp.loop
    import_prompts(sd.store, pool)
    start_round(sd.store, sd.runner, settings, 0)
    simulate_annotations(sd.store, sd.ctx.judge, noise=sd.exp.noise, seed=sd.seed)
    split = dataclasses.replace(settings, reward=dataclasses.replace(settings.reward, eval_fraction=cfg.heldout_fraction))
    rows = [_plain(r) for r in load_pairs_snapshot(pairs_snapshot(sd.store, sd.runner, split).path)]
    train = write_rows(sd.folder / "pairs_train.jsonl", [r for r in rows if r.get("split") != "test"])
    heldout = write_rows(sd.folder / "pairs_heldout.jsonl", [r for r in rows if r.get("split") == "test"])
    sd.entry.update(annotators=gold_agreement(sd.store, sd.ctx.judge), pairs_train=str(train), pairs_heldout=str(heldout),
                    train_pairs=sum(r.get("split") != "test" for r in rows),
                    heldout_pairs=sum(r.get("split") == "test" for r in rows))
    sd.entry["proxy"] = train_proxy(sd, train, heldout)
    sd.run.save()


def train_proxy(sd: Seed, train: Path, heldout: Path) -> dict:
    """One epoch a job, each warm-started from the last, until the held-out loss stops improving."""
    from pipeline.orchestrate.gate import wilson
    from pipeline.config import to_cli_args
    from pipeline.orchestrate.steps import ensure_base_policy, model_args, normalised_as_ppo, round_ppo

    cfg, settings = sd.run.cfg, sd.exp.loop
    base = ensure_base_policy(sd.store, settings.model)
    epochs, best, previous = [], None, None
    for epoch in range(1, cfg.max_epochs + 1):
        rcfg = dataclasses.replace(normalised_as_ppo(settings.reward, round_ppo(settings)), epochs=1, max_steps=0,
                                   seed=sd.seed * 1000 + epoch, eval_data=str(heldout))
        args = ["--data", str(train), *to_cli_args(rcfg), *model_args(settings.model, base.base_model)]
        if previous:
            args += ["--init-from", previous]
        t = time.perf_counter()
        run = run_job(sd.store, sd.runner, "train-reward", args, config={"label": f"proxy, epoch {epoch}"})
        report = json.loads((Path(run.run_dir) / "eval_report.json").read_text(encoding="utf-8"))
        m = report["eval/pairs"]
        lo, hi = wilson(round(report["eval/accuracy"] * m), m)
        version = sd.store.get_model_version(run.outputs["model_version_id"])
        row = {"epoch": epoch, "path": version.path, "version_id": version.id, "eval/loss": report["eval/loss"],
               "eval/accuracy": report["eval/accuracy"], "eval/pairs": m, "acc_lo": lo, "acc_hi": hi,
               "length_baseline": report.get("eval/length_baseline_accuracy"),
               "train_loss": report.get("train/loss"), "seconds": time.perf_counter() - t}
        epochs.append(row)
        sd.ctx.log(f"seed {sd.seed} proxy epoch {epoch}: held-out loss {row['eval/loss']:.4f}, accuracy "
                   f"{row['eval/accuracy']:.3f} [{lo:.3f}, {hi:.3f}] on {m} pairs")
        previous = row["path"]
        if best is None or row["eval/loss"] < best["eval/loss"]:
            best = row
        elif epoch - best["epoch"] >= cfg.patience:
            break
    return {**best, "epochs": epochs, "stopped_at": epochs[-1]["epoch"]}


def start_policy(sd: Seed) -> None:
    """Step 3: the start policy evaluated exactly as the arms are (same samples, same seed: at KL 0
    an arm's gain is 0), and max(n) further samples per prompt for best-of-n (`score_bon`)."""
    metrics, _ = sd.evaluate(None, "base")
    sd.entry["base"] = metrics
    sd.entry["bon"] = []
    if sd.exp.bon:
        ns = sorted(set(sd.exp.bon))
        sd.evaluate(None, "bon_all", dataclasses.replace(sd.exp.eval, samples=max(ns), seed=sd.exp.eval.seed + 7919))
        score_bon(sd)
    sd.run.save()


BON_ESTIMATOR = "expected, by the proxy and by the judge"
"""bench/gold/bon.py expected_best_of_n, picking by the proxy (raw.json bon_n<n>) and by the gold
judge (bon_judge_n<n>: what best-of-n reaches on the reward the JUDGE_ARMS train on). A run whose
seeds record another estimator (or none: the first n samples, before it) is rescored from its
stored samples when resumed."""


def bon_samples(sd: Seed) -> list[dict]:
    """The start policy's stored best-of-n samples (eval/s<seed>_bon_all.jsonl), one row per response."""
    path = sd.ctx.out / "eval" / f"s{sd.seed}_bon_all.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def score_bon(sd: Seed) -> None:
    """Best-of-n with the proxy, and with the gold judge, on the start policy's stored samples;
    gains are against the mean of those samples (raw.json: bon_all)."""
    from bench.gold.bon import bon_table, expected_best_of_n

    rows = bon_samples(sd)
    ns = sorted(set(sd.exp.bon))
    sd.entry["bon"] = bon_table([{**r, "proxy:rm1": r["proxy:proxy"]} for r in rows], ns)  # bon_table's key
    for n in ns:
        sd.run.add_raw(sd.seed, f"bon_n{n}", expected_best_of_n(rows, n, key="proxy:proxy"))
        sd.run.add_raw(sd.seed, f"bon_judge_n{n}", expected_best_of_n(rows, n, key="gold"))
    sd.entry["bon_estimator"] = BON_ESTIMATOR


def judge_reward(sd: Seed) -> str:
    """train-ppo's --reward for JUDGE_ARMS: the gold judge, normalised by its scores' mean and s.d.
    over the start policy's best-of-n samples (PPO's length and temperature, every held-out prompt)."""
    gold = [r["gold"] for r in bon_samples(sd)]
    return f"oracle:norm={statistics.fmean(gold):.6g},{statistics.pstdev(gold):.6g}:embedding"


def run_arm(sd: Seed, name: str) -> None:
    """Step 4 for one arm: train with checkpoints, evaluate each one as a point of the curve."""
    from pipeline.orchestrate.steps import ensure_base_policy, submit_ppo

    cfg, settings = sd.run.cfg, sd.exp.loop
    base = ensure_base_policy(sd.store, settings.model)
    t, cpu = time.perf_counter(), cpu_seconds()
    dest = sd.folder / "checkpoints" / name
    if name == "dpo":
        run = submit_dpo_job(sd, base, dpo_save_every(sd.entry["train_pairs"], sd.exp.dpo, cfg.checkpoints))
        run, copies = follow_job(sd.runner, run, "trainer_state.pt", "checkpoint", dest)
        final = str(Path(run.run_dir) / "policy")
    else:
        arm = dataclasses.replace(settings, ppo=arm_ppo(settings.ppo, cfg.arm(name), cfg.checkpoints))
        proxy = sd.store.get_model_version(sd.entry["proxy"]["version_id"])
        score_with = judge_reward(sd) if name in JUDGE_ARMS else ""
        run = submit_ppo(sd.store, sd.runner, arm, proxy, base, activate=False, score_with=score_with)
        run, copies = follow_job(sd.runner, run, "checkpoint/trainer_state.pt", "checkpoint/policy", dest)
        final = sd.store.get_model_version(run.outputs["model_version_id"]).path
    end = last_step(run.run_dir)
    copies[end] = copies.get(end, final)
    entry = {"label": arm_label(cfg.arm(name), name), "settings": cfg.arm(name), "run_dir": run.run_dir, "points": [],
             "reward": "judge" if name in JUDGE_ARMS else ("proxy" if name != "dpo" else "pairs"),
             "train": metric_rows(run.run_dir)}
    with sd.run.lock:
        sd.entry["arms"][name] = entry
    for step, path in sorted(copies.items()):
        metrics, _ = sd.evaluate(path, f"{name}_step{step}")
        entry["points"].append({"step": step, "tag": f"{name}_step{step}", **metrics})
        sd.run.save()
    entry.update(wall_s=time.perf_counter() - t, cpu_s=cpu_seconds() - cpu)
    sd.run.save()


def arm_ppo(ppo, settings: dict, checkpoints: int):
    """The run's PPOConfig with an arm's settings, saving `checkpoints` times over the arm's own steps."""
    ppo = dataclasses.replace(ppo, **settings)
    return dataclasses.replace(ppo, save_every=max(1, ppo.steps // checkpoints))


def dpo_save_every(train_pairs: int, dpo: dict, checkpoints: int) -> int:
    """Optimiser steps between DPO's checkpoints: its steps (epochs x batches, or max_steps when
    that is fewer) spread over `checkpoints` evaluations."""
    total = math.ceil(train_pairs / dpo.get("batch_size", 8)) * dpo.get("epochs", 1)
    total = min(total, dpo.get("max_steps") or total)
    return max(1, total // checkpoints)


def submit_dpo_job(sd: Seed, base, save_every: int):
    """train-dpo from the start policy on the proxy's training pairs (its held-out pairs as eval data)."""
    from bench.gold.arms import dpo_args

    dpo = {**sd.exp.dpo, "save_every": save_every, "eval_data": sd.entry["pairs_heldout"]}
    args = dpo_args(sd.entry["pairs_train"], dpo, sd.exp.loop.model, base)
    return sd.runner.submit("train-dpo", args, config={"label": "dpo on the proxy's training pairs"},
                            inputs={"policy_version_id": base.id, "snapshot_id": None, "activate": False})


# --------------------------------------------------------------------------- the whole run


class SeedsRun:
    def __init__(self, cfg: SeedsConfig, out: Path, prompts: Path = PROMPTS, log=print, resume: bool = False):
        from pipeline.oracle import make_oracle

        self.cfg, self.out, self.log, self.lock = cfg, Path(out), log, threading.RLock()
        self.out.mkdir(parents=True, exist_ok=True)
        self.heldout, self.pool = split_prompts(prompts, cfg.exp.eval_prompts, 0, self.out / "prompts")
        self.judge = RecordingOracle(make_oracle("embedding"))
        self.results = {"settings": describe(cfg), "seeds": {}, "parts": {}, "timings": {}, "commit": _commit()}
        self.raw: dict = {}
        self.t0, self.cpu0, self.before = time.perf_counter(), cpu_seconds(), (0.0, 0.0)
        if resume:
            self.resume()

    def resume(self) -> None:
        """Continue a stopped run in the same folder with the same settings (the arms' order may
        differ, and before the first arm has started, so may every setting only the arms read,
        ARM_ONLY): round 1, start evaluations and arms that finished are kept, an arm cut short runs again."""
        old = json.loads((self.out / "results.json").read_text(encoding="utf-8"))
        new = self.results["settings"]
        free = ARM_ONLY if not any(e["arms"] for e in old["seeds"].values()) else ("arms",)
        before, now = _comparable(old["settings"]), _comparable(new)
        differ = sorted(k for k in set(before) | set(now) if k not in free and before.get(k) != now.get(k))
        if differ:
            raise SystemExit(f"--resume {self.out}: its settings differ from these ({', '.join(differ)}); "
                             "give the same options")
        self.raw = json.loads((self.out / "raw.json").read_text(encoding="utf-8"))["evals"]
        for seed, entry in old["seeds"].items():
            cut = [a for a, e in entry["arms"].items() if "wall_s" not in e]
            for arm in cut:
                del entry["arms"][arm]
            self.raw[seed] = {t: v for t, v in self.raw.get(seed, {}).items()
                              if not any(t.startswith(f"{a}_step") for a in cut)}
        self.results.update(seeds=old["seeds"], parts=old["parts"], timings=old.get("timings", {}),
                            command=old.get("command", ""),
                            resumed=old.get("resumed", []) + [{"commit": old.get("commit"), "wall_s": old.get("wall_s"),
                                                               "cpu_s": old.get("cpu_s")}])
        self.before = (sum(r["wall_s"] or 0 for r in self.results["resumed"]),
                       sum(r["cpu_s"] or 0 for r in self.results["resumed"]))

    def add_raw(self, seed: int, tag: str, rows: list[dict]) -> None:
        """Per prompt of one evaluation: mean gold, proxy and KL over its responses, and how many."""
        groups: dict[str, list[dict]] = {}
        for r in rows:
            groups.setdefault(r["prompt"], []).append(r)
        table = {p: {"gold": _mean(g, "gold"), "proxy": _mean(g, "proxy:proxy"), "kl": _mean(g, "kl"), "n": len(g)}
                 for p, g in groups.items()}
        with self.lock:
            self.raw.setdefault(str(seed), {})[tag] = table

    def save(self) -> None:
        with self.lock:
            self.results["wall_s"] = self.before[0] + time.perf_counter() - self.t0
            self.results["cpu_s"] = self.before[1] + cpu_seconds() - self.cpu0
            (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
            (self.out / "raw.json").write_text(json.dumps({"prompts": self.heldout, "evals": self.raw}, indent=0))

    def part(self, name: str, fn) -> None:
        t, cpu = time.perf_counter(), cpu_seconds()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failed part: the others go on, the report says which
            import traceback

            self.log(f"{name} failed:\n{traceback.format_exc()}")
            self.results.setdefault("failed", {})[name] = f"{type(exc).__name__}: {exc}"
        self.results["parts"][name] = {"wall_s": time.perf_counter() - t, "cpu_s": cpu_seconds() - cpu}
        self.save()

    def run(self) -> dict:
        import torch

        torch.set_num_threads(self.cfg.exp.threads)
        seeds: list[Seed] = []
        try:
            for seed in self.cfg.seeds:
                borrow = seeds[0] if self.cfg.share_round1 and seeds else None
                seeds.append(Seed(self, seed, self.out / f"seed{seed}", borrow=borrow))
            # arm by arm over the seeds: a run stopped early has every seed of its first arms
            for sd in seeds:  # (parts a resumed run finished are not run again)
                if sd.owner and "proxy" not in sd.entry:
                    self.part(f"seed{sd.seed}/round1", lambda sd=sd: round1(sd, self.pool))
                sd.take_shared()
                if "proxy" in sd.entry and "base" not in sd.entry:
                    self.part(f"seed{sd.seed}/start", lambda sd=sd: start_policy(sd))
                elif sd.exp.bon and "base" in sd.entry and sd.entry.get("bon_estimator") != BON_ESTIMATOR:
                    self.part(f"seed{sd.seed}/bon", lambda sd=sd: score_bon(sd))
            for arm in self.cfg.arms:
                for sd in seeds:
                    if "proxy" in sd.entry and "base" in sd.entry and arm not in sd.entry["arms"]:
                        self.part(f"seed{sd.seed}/{arm}", lambda sd=sd, arm=arm: run_arm(sd, arm))
        finally:
            for sd in reversed(seeds):
                sd.close()
        self.save()
        return self.results


def _comparable(settings: dict) -> dict:
    """Settings as a resume compares them: a PPO option added since the run started counts as its
    default (the run ran with that behaviour), and the oracle by its kind (its module was renamed)."""
    from pipeline.config import PPOConfig

    out = dict(settings)
    if "ppo" in out:
        out["ppo"] = {**dataclasses.asdict(PPOConfig()), **out["ppo"]}
    if "judge" in out:
        out["judge"] = out["judge"].split(" (")[0]
    return out


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


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def describe(cfg: SeedsConfig) -> dict:
    e, s = cfg.exp, cfg.exp.loop
    return {"model": s.model.model, "seeds": cfg.seeds, "arms": {a: cfg.arm(a) for a in cfg.arms},
            "checkpoints": cfg.checkpoints, "max_epochs": cfg.max_epochs, "patience": cfg.patience,
            "heldout_fraction": cfg.heldout_fraction, "share_round1": cfg.share_round1,
            "prompts_per_round": s.loop.prompts_per_round, "k": s.generate.k,
            "max_new_tokens": s.generate.max_new_tokens, "generate_temperature": s.generate.temperature,
            "reward": dataclasses.asdict(s.reward), "ppo": dataclasses.asdict(s.ppo), "ppo_prompts": s.ppo_prompts,
            "lora_r": s.model.lora_r, "eval_prompts": e.eval_prompts, "eval": dataclasses.asdict(e.eval),
            "noise": e.noise, "bon": e.bon, "dpo": e.dpo, "threads": e.threads,
            "judge": "embedding (all-MiniLM-L6-v2, pipeline/oracle.py defaults)"}


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--seeds", type=lambda t: [int(x) for x in t.split(",") if x.strip()], default=[0, 1, 2], help="e.g. 0,1,2")
    add("--arms", default="adaptive,dpo,beta0", help=f"subset of {','.join(ARMS)}")
    add("--quick", action="store_true", help="tiny random models")
    add("--out", default="", help="results directory (default: bench/out/gold_seeds/<time>)")
    add("--report", default="", help="only rebuild report.md of this results directory")
    add("--resume", action="store_true", help="continue the stopped run in --out (same options; --arms may reorder)")
    add("--share-round1", action="store_true", help="one round 1 and proxy (the first seed's) for every seed")
    add("--checkpoints", type=int, default=3)
    add("--max-epochs", type=int, default=5)
    add("--patience", type=int, default=1)
    add("--heldout-fraction", type=float, default=0.25)
    add("--bon", type=_sizes, default=None, help="best-of-n sizes, e.g. 1,2,4,8,16 (none: skip)")
    for name, kind in (("prompts-per-round", int), ("ppo-steps", int), ("eval-samples", int), ("eval-prompts", int),
                       ("dpo-epochs", int), ("dpo-max-steps", int), ("ppo-prompts", int), ("ppo-epochs", int), ("critic-warmup-steps", int),
                       ("critic-lam", float)):
        add(f"--{name}", type=kind, default=0, help=f"override the {name.replace('-', ' ')}")
    add("--kl-target", type=float, default=0.0, help="the adaptive arm's KL target in nats (default 2)")
    add("--threads", type=int, default=1)
    add("--publish", default=None, help="copy report and raw data here (default: docs/results/gold_seeds for a "
                                        "full run, nowhere for --quick; 'none': nowhere)")
    return parser


def configure(args) -> SeedsConfig:
    out = Path(args.out)
    if args.quick:
        from tests.tiny import save_tiny_model_dir

        exp = quick_experiment(str(save_tiny_model_dir(out / "tiny_model")), args.threads)
        exp.bon = [1, 2, 4]
    else:
        exp = full_experiment(args.threads)
    exp.loop.reward.max_steps = 0
    s = exp.loop
    for value, target, attr in ((args.prompts_per_round, s.loop, "prompts_per_round"), (args.ppo_steps, s.ppo, "steps"),
                                (args.eval_samples, exp.eval, "samples"), (args.ppo_prompts, s, "ppo_prompts"),
                                (args.ppo_epochs, s.ppo, "ppo_epochs"),
                                (args.critic_warmup_steps, s.ppo, "critic_warmup_steps"),
                                (args.critic_lam, s.ppo, "critic_lam")):
        if value:
            setattr(target, attr, value)
    if args.eval_prompts:
        exp.eval_prompts = args.eval_prompts
    if args.dpo_epochs:
        exp.dpo["epochs"] = args.dpo_epochs
    if args.dpo_max_steps:  # its LR schedule then spans these steps (pipeline/config.py DPOConfig.max_steps)
        exp.dpo["max_steps"] = args.dpo_max_steps
    exp.dpo.setdefault("kl_prompts", 0)  # the evaluation measures KL on the held-out prompts
    if args.bon is not None:
        exp.bon = args.bon
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    return SeedsConfig(exp=exp, seeds=args.seeds, arms=arms, checkpoints=args.checkpoints,
                       max_epochs=args.max_epochs, patience=args.patience, heldout_fraction=args.heldout_fraction,
                       share_round1=args.share_round1, kl_target=args.kl_target)


def main(argv: list[str] | None = None) -> int:
    from bench.gold.seed_report import publish, seeds_result_line, write_report

    args = build_parser().parse_args(argv)
    if args.report:
        folder = Path(args.report)
        print(write_report(folder))
        if args.publish and args.publish != "none":
            for path in publish(folder, Path(args.publish)):
                print(f"published: {path}")
        print(seeds_result_line(folder))
        return 0
    if args.resume and not (Path(args.out) / "results.json").is_file():
        raise SystemExit("--resume: give the stopped run's folder as --out (it has no results.json)")
    args.out = args.out or str(OUT_ROOT / time.strftime("%Y%m%d-%H%M%S"))
    cfg = configure(args)
    run = SeedsRun(cfg, Path(args.out), resume=args.resume)
    command = "python bench/gold/seeds.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    run.results["command"] = run.results.get("command", "") + (" then " if args.resume else "") + command
    run.results["mode"] = "quick" if args.quick else "full"
    results = run.run()
    results["done"] = True
    run.save()
    print(f"report: {write_report(run.out)}")
    target = args.publish if args.publish is not None else ("" if args.quick else str(PUBLISH))
    if target and target != "none":
        for path in publish(run.out, Path(target)):
            print(f"published: {path}")
    print(seeds_result_line(run.out))
    return 1 if results.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
