"""The jobs the owner can start, each built in one place: generate, train-reward, ppo, train-dpo, sft, compare,
sample-versions (a blind evaluation's answers), export-model.

Each `submit_*` reads what it needs from the store (prompts, model versions), writes the job's
input files (a prompts file, a Parquet snapshot of the pairs), builds the command line from the
stage configs (pipeline/config.py) and queues it on the JobRunner. The `inputs` recorded with the
run tell ingest.py what to register when it ends. The Train, Data and Models tabs, the round
state machine (loop.py) and the CLI all start jobs through these functions.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import (DPOConfig, GenerateConfig, LoopConfig, ModelConfig, PPOConfig, RewardConfig, SFTConfig,
                             to_cli_args, to_dict, with_rollout_length)

POLICY_STEPS = ("ppo", "rloo", "grpo", "dpo")
"""A round's policy step: PPO, RLOO or GRPO against a reward model trained on the round's snapshot
(the ppo trainer with its advantage estimator: `round_ppo`), or DPO on the snapshot itself (no
reward model)."""

ESTIMATORS = {"ppo": "gae", "rloo": "rloo", "grpo": "grpo"}
"""The ppo trainer's advantage estimator for each policy step that uses a reward model."""


@dataclass
class LoopSettings:
    """Everything the jobs of a round need, one dataclass per stage (pipeline/config.py)."""

    loop: LoopConfig = field(default_factory=LoopConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    policy_step: str = "ppo"
    """How a round trains its policy: 'ppo', 'rloo' or 'grpo' (a reward model on the round's snapshot,
    then that online RL against it; `ppo` holds their settings) or 'dpo' (DPO on the same snapshot;
    the round trains no reward model)."""
    ppo_prompts: int = 256
    """Prompts from the pool that PPO trains on each round."""
    processes: int = 1
    """Data-parallel processes per generate / train-reward / ppo job (e.g. one per GPU)."""
    accelerate_config: str = ""
    """An `accelerate` config file (FSDP, DeepSpeed) the jobs launch with; '' = torchrun for
    several processes."""

    def __post_init__(self):
        check_policy_step(self.policy_step)
        if self.ppo.advantage_estimator != "gae":  # one way to choose it: the policy step
            raise ValueError(f"a round's advantage estimator follows its policy step: choose policy step "
                             f"{self.ppo.advantage_estimator!r} instead of ppo.advantage_estimator")

    def to_dict(self) -> dict:
        return {"loop": to_dict(self.loop), "model": to_dict(self.model), "generate": to_dict(self.generate),
                "reward": to_dict(self.reward), "ppo": to_dict(self.ppo), "dpo": to_dict(self.dpo),
                "sft": to_dict(self.sft), "policy_step": self.policy_step, "ppo_prompts": self.ppo_prompts, "processes": self.processes,
                "accelerate_config": self.accelerate_config}

    @property
    def launch(self) -> dict:
        """How the jobs start (JobRunner.submit's nproc and accelerate_config)."""
        return {"nproc": self.processes, "accelerate_config": self.accelerate_config}

    @classmethod
    def from_dict(cls, data: dict) -> "LoopSettings":
        """The inverse of to_dict; fields a newer version added keep their defaults (a round stored
        before DPO existed reads as policy step 'ppo'), except `grouped`: settings stored before the
        reward model and DPO trained on rankings counted their batch in pairs, so they read as
        grouped=False."""
        parts = {"loop": LoopConfig, "model": ModelConfig, "generate": GenerateConfig, "reward": RewardConfig,
                 "ppo": PPOConfig, "dpo": DPOConfig, "sft": SFTConfig}
        made = {}
        for name, cls_ in parts.items():
            known = {f.name for f in dataclasses.fields(cls_)}
            stored = {k: v for k, v in (data.get(name) or {}).items() if k in known}
            if name in ("reward", "dpo") and data.get(name) and "grouped" not in stored:
                stored["grouped"] = False
            made[name] = cls_(**stored)
        return cls(**made, policy_step=str(data.get("policy_step", cls.policy_step)),
                   ppo_prompts=int(data.get("ppo_prompts", cls.ppo_prompts)),
                   processes=int(data.get("processes", cls.processes)),
                   accelerate_config=str(data.get("accelerate_config", cls.accelerate_config)))


def check_policy_step(step: str) -> str:
    if step not in POLICY_STEPS:
        raise ValueError(f"policy step must be one of {', '.join(repr(s) for s in POLICY_STEPS)}, not {step!r}")
    return step


# ---------------------------------------------------------------------- model versions


def ensure_base_policy(store, model_cfg: ModelConfig):
    """The active policy; on a fresh store, register the base model as policy 'base' and activate it."""
    active = store.active_policy()
    if active is not None:
        return active
    base = store.find_model_version("base") or store.register_model_version(
        "policy", name="base", base_model=model_cfg.model, meta={"note": "the starting policy, no training"})
    return store.set_active_policy(base.id)


def latest_reward(store):
    """The newest reward model with a checkpoint, or None."""
    versions = [mv for mv in store.list_model_versions("reward") if mv.path]
    return versions[-1] if versions else None


def model_args(model_cfg: ModelConfig, base_model: str | None) -> list[str]:
    """The ModelConfig options of a job, with `base_model` (a version's) as its --model."""
    return to_cli_args(dataclasses.replace(model_cfg, model=base_model or model_cfg.model))


# ---------------------------------------------------------------------- input files


def inputs_dir(runner) -> Path:
    return runner.runs_root / "inputs"


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + f"-{time.time_ns() % 1_000_000_000:09d}"


def write_prompts(prompts, path: Path) -> Path:
    """The prompts a job reads: {"id", "prompt"} per line (chat messages when the prompt has them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps({"id": p.id, "prompt": p.messages or p.text}) + "\n")
    return path


def read_prompt_ids(path: Path) -> set[int]:
    """The prompt ids of a prompts file written by `write_prompts` (empty if it is gone)."""
    if not path.is_file():
        return set()
    return {json.loads(line).get("id") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}


def run_prompt_ids(run) -> set[int]:
    """The prompt ids a job was given (its --prompts file; empty if it had none)."""
    args = run.config.get("args", [])
    return read_prompt_ids(Path(args[args.index("--prompts") + 1])) if "--prompts" in args else set()


def prompt_pool(store, runner, limit: int | None = None) -> list:
    """Prompts with no responses that no generate job in flight is answering, oldest first (so
    two generate jobs never give one prompt two items)."""
    pending = store.evaluation_prompt_ids()  # held out for people to judge versions on
    for run in runner.in_flight(("generate",)):
        pending |= run_prompt_ids(run)
    pool = [p for p in store.prompts_without_responses() if p.id not in pending]
    return pool[:limit] if limit is not None else pool


def select_prompts(store, runner, n: int, strategy: str, seed: int = 0) -> list:
    """N prompts from the pool. 'uncertain' is handled by the generate job (it scores candidates
    with the reward model), so here it means: a random candidate pool of 2N."""
    if strategy not in ("random", "uncertain"):
        raise ValueError(f"strategy must be 'random' or 'uncertain', not {strategy!r}")
    pool = prompt_pool(store, runner)
    if not pool:
        raise ValueError("the prompt pool is empty: import more prompts (Data tab or python -m store import-prompts)")
    take = min(len(pool), n * (2 if strategy == "uncertain" else 1))
    return random.Random(seed).sample(pool, take)


def held_out_prompts(store, n: int) -> list:
    """Up to n prompts nobody has seen: no responses (annotators never ranked them), in no PPO
    run's prompt file (no policy trained on them) and in no blind evaluation. The newest first,
    so the choice is stable."""
    used = store.evaluation_prompt_ids()
    for run in store.list_runs(kind="ppo"):
        used |= run_prompt_ids(run)
    pool = [p for p in store.prompts_without_responses() if p.id not in used]
    return sorted(pool, key=lambda p: -p.id)[:n]


# ---------------------------------------------------------------------- the jobs


@dataclass(frozen=True)
class RoundStep:
    """The round a job belongs to and the step of it the job runs ('generate', 'reward', 'policy'):
    recorded in the job's inputs, where the loop finds it when the job ends (loop.on_run_finished)."""
    round_id: int
    step: str


def round_inputs(in_round: RoundStep | None) -> dict:
    """A job's inputs naming its round and step (both None for a job outside a round)."""
    return {"round_id": in_round.round_id if in_round else None, "round_step": in_round.step if in_round else None}


def submit_generate(store, runner, prompts: list, settings: LoopSettings, version=None, *,
                    in_round: RoundStep | None = None, select_uncertain: int = 0, label: str = "generate"):
    """K responses per prompt (settings.generate, settings.model) with `version` (default: the
    active policy) -> items, chunk by chunk. A round's job runs as the round's processes
    (settings.launch); one outside a round (the Data tab's, the first batch) as one process.
    With `select_uncertain` = N, the job keeps the N of `prompts` the newest reward model separates
    least; with no reward model yet (a first round, or rounds whose policy step is DPO) it keeps
    the first N (`select_prompts` drew them at random)."""
    gen_cfg, model_cfg = settings.generate, settings.model
    if gen_cfg.k < 2:
        raise ValueError(f"K={gen_cfg.k}: ranking needs at least 2 responses per prompt")
    if not prompts:
        raise ValueError("no prompts to generate for")
    version = version or ensure_base_policy(store, model_cfg)
    reward = latest_reward(store) if select_uncertain else None
    if select_uncertain and reward is None:
        prompts = prompts[:select_uncertain]
    path = write_prompts(prompts, inputs_dir(runner) / f"{label}-{_stamp()}-prompts.jsonl")
    args = ["--prompts", str(path), *model_args(model_cfg, version.base_model), *to_cli_args(gen_cfg)]
    if version.path:
        args += ["--adapter", version.path]
    if reward is not None:
        args += ["--select-uncertain", str(select_uncertain), "--reward", reward.path]
    return runner.submit("generate", args, config={"label": label, "generate": to_dict(gen_cfg)}, inputs={
        "model_version_id": version.id, "prompts": len(prompts), **round_inputs(in_round)},
        **(settings.launch if in_round else {}))


def pairs_snapshot(store, runner, settings: LoopSettings, trainer: str = "reward"):
    """A Parquet snapshot of every pair so far, recorded in the store with its hash: what a round
    trains on, the reward model (train-reward, `trainer` 'reward') or the policy itself (train-dpo,
    'dpo').

    Its held-out split is the trainer's eval_fraction of the prompts, chosen by a hash of each
    prompt (store/export.py), not by the trainer: a prompt held out once stays held out in every
    later round, so round-over-round held-out accuracy is measured on the same prompts and no
    round trains on a prompt an earlier one was scored on. With the trainer's own eval_data the
    snapshot holds nothing out. Pairs with an empty (blank) response are left out and counted
    (counts['left_out_empty']): train-reward refuses them, and the store keeps them."""
    from store.export import export_dataset
    from store.export_options import ExportOptions

    held_out = settings.dpo if trainer == "dpo" else settings.reward
    # --margin trains on the rank gap: only then does the snapshot carry TRL's `margin` column; the
    # loop's quality options leave out or weigh annotators by their quality (store/export.py)
    options = ExportOptions(format="parquet", margin_column=settings.reward.margin,
                            min_quality=settings.loop.min_quality or None,
                            quality_weights=settings.loop.quality_weights, include_empty=False,
                            test_fraction=0.0 if held_out.eval_data else held_out.eval_fraction, seed=held_out.seed)
    snapshot = export_dataset(store, inputs_dir(runner) / f"pairs-{_stamp()}.parquet", options)
    if not snapshot.counts.get("pairs"):
        raise ValueError("no preference pairs to train on yet: rank some items first")
    return snapshot


def snapshot_split(trainer_cfg, snapshot):
    """The trainer's config for a snapshot from `pairs_snapshot`: its eval_fraction 0, so that a
    snapshot with no prompt held out yet (a first small round) trains on all of it rather than
    the trainer drawing a split of its own, which would move prompts between rounds."""
    if "test_fraction" in snapshot.filters and snapshot.filters["test_fraction"] > 0:
        return dataclasses.replace(trainer_cfg, eval_fraction=0.0)
    return trainer_cfg


def round_ppo(settings: LoopSettings) -> PPOConfig:
    """The round's ppo-trainer settings: the policy step's advantage estimator (ESTIMATORS), and the
    rollout length resolved, the generation's unless given (config.with_rollout_length), so PPO
    samples at the length its reward model was trained on."""
    ppo = dataclasses.replace(settings.ppo, advantage_estimator=ESTIMATORS.get(settings.policy_step, "gae"))
    return with_rollout_length(ppo, settings.generate)


def normalised_as_ppo(reward_cfg, ppo_cfg):
    """The reward config with its normalisation sampled as PPO will sample its rollouts (length
    limit, temperature), so that the reference's rollouts score mean 0, std 1 in PPO."""
    return dataclasses.replace(reward_cfg, norm_max_new_tokens=ppo_cfg.max_new_tokens,
                               norm_temperature=ppo_cfg.temperature)


def submit_reward(store, runner, settings: LoopSettings, *, warm_start: bool = True,
                  in_round: RoundStep | None = None):
    """A snapshot of every pair so far (`pairs_snapshot`) -> a train-reward job on it,
    warm-started from the newest reward model, its normalisation sampled as the round's PPO samples
    (length, temperature). Returns (run, snapshot)."""
    snapshot = pairs_snapshot(store, runner, settings, "reward")
    reward_cfg = normalised_as_ppo(snapshot_split(settings.reward, snapshot), round_ppo(settings))
    policy = ensure_base_policy(store, settings.model)
    previous = latest_reward(store) if warm_start else None
    args = ["--data", snapshot.path, *to_cli_args(reward_cfg), *model_args(settings.model, policy.base_model)]
    if previous is not None:
        args += ["--init-from", previous.path]
    run = runner.submit("train-reward", args,
                        config={"reward": to_dict(reward_cfg), "model": to_dict(settings.model)},
                        inputs={"snapshot_id": snapshot.id, "parent_version_id": previous.id if previous else None,
                                **round_inputs(in_round)}, **settings.launch)
    return run, snapshot


def submit_ppo(store, runner, settings: LoopSettings, reward, policy=None, *, activate: bool = True,
               in_round: RoundStep | None = None, score_with: str = ""):
    """PPO from `policy` (default: the active one) against the frozen reward model `reward`, on the
    first `settings.ppo_prompts` prompts of the pool. With `activate`, the new policy becomes the
    active one as soon as it is registered. `score_with`: train-ppo's --reward in place of the
    reward model's folder (the gold experiment's 'oracle:...' control); `reward` then only starts
    the critic (--critic-init)."""
    if reward is None or reward.kind != "reward" or not reward.path:
        raise ValueError("no trained reward model: train one first")
    policy = policy or ensure_base_policy(store, settings.model)
    judged = store.evaluation_prompt_ids()  # people compare versions on these: never trained on
    prompts = [p for p in store.list_prompts(limit=settings.ppo_prompts + len(judged))
               if p.id not in judged][:settings.ppo_prompts]
    if not prompts:
        raise ValueError("no prompts to train on: import prompts first")
    path = write_prompts(prompts, inputs_dir(runner) / f"ppo-{_stamp()}-prompts.jsonl")
    ppo = round_ppo(settings)
    args = ["--prompts", str(path), "--reward", score_with or reward.path, *to_cli_args(ppo),
            *model_args(settings.model, policy.base_model)]
    if score_with:
        args += ["--critic-init", reward.path]
    if policy.path:
        args += ["--policy", policy.path]
    return runner.submit("ppo", args, config={"ppo": to_dict(ppo), "model": to_dict(settings.model)},
                         inputs={"policy_version_id": policy.id, "reward_version_id": reward.id,
                                 "prompts": len(prompts), "activate": activate, **round_inputs(in_round)},
                         **settings.launch)


def submit_dpo(store, runner, settings: LoopSettings, policy=None, *, activate: bool = True,
               in_round: RoundStep | None = None):
    """DPO (or IPO, settings.dpo.loss) from `policy` (default: the active one) on a snapshot of every
    pair so far (`pairs_snapshot`, the data a reward model would train on), with no reward model.
    The new policy records its parent and the snapshot (ingest.py); with `activate` it becomes the
    active one as soon as it is registered. Returns (run, snapshot)."""
    policy = policy or ensure_base_policy(store, settings.model)
    snapshot = pairs_snapshot(store, runner, settings, "dpo")
    dpo_cfg = snapshot_split(settings.dpo, snapshot)
    args = ["--data", snapshot.path, *to_cli_args(dpo_cfg), *model_args(settings.model, policy.base_model)]
    if policy.path:
        args += ["--policy", policy.path]
    run = runner.submit("train-dpo", args, config={"dpo": to_dict(dpo_cfg), "model": to_dict(settings.model)},
                        inputs={"policy_version_id": policy.id, "snapshot_id": snapshot.id, "activate": activate,
                                **round_inputs(in_round)}, **settings.launch)
    return run, snapshot


def submit_sft(store, runner, settings: LoopSettings, policy=None, *, activate: bool = True):
    """Supervised fine-tuning of `policy` (default: the active one) on every demonstration so far,
    the answers annotators wrote themselves (exported beside a snapshot of the pairs, whose held-out
    prompts are the reward model's: store/export.py). The new policy records its parent and the
    snapshot (ingest.py); with `activate` it becomes the active one, so the next round samples from
    it. Returns (run, snapshot)."""
    from store.errors import StoreError
    from store.export import export_layout

    policy = policy or ensure_base_policy(store, settings.model)
    try:
        snapshot = pairs_snapshot(store, runner, settings)
    except StoreError:  # no pair at all: an own answer brings pairs with it, so there is none either
        snapshot = None
    if snapshot is None or not snapshot.counts.get("demonstrations"):
        raise ValueError("no demonstrations yet: annotators write their own answers with ✎ Edit in the ranking panel")
    data = export_layout(snapshot.path, snapshot.format).demonstrations
    args = ["--data", str(data), *to_cli_args(settings.sft), *model_args(settings.model, policy.base_model)]
    if policy.path:
        args += ["--policy", policy.path]
    run = runner.submit("sft", args, config={"sft": to_dict(settings.sft), "model": to_dict(settings.model)},
                        inputs={"policy_version_id": policy.id, "snapshot_id": snapshot.id, "activate": activate},
                        **settings.launch)
    return run, snapshot


def submit_compare(store, runner, a, b, reward, prompts: list, settings: LoopSettings):
    """Policies `a` and `b` sample one response per prompt with the same seed; `reward` judges."""
    if a.id == b.id:
        raise ValueError("pick two different policies to compare")
    if not reward.path:
        raise ValueError(f"{reward.name} has no checkpoint to score with")
    if not prompts:
        raise ValueError("no held-out prompts to compare on")
    path = write_prompts(prompts, inputs_dir(runner) / f"compare-{_stamp()}-prompts.jsonl")
    args = ["--prompts", str(path), "--reward", reward.path,
            "--max-new-tokens", str(round_ppo(settings).max_new_tokens), "--temperature", str(settings.ppo.temperature)]
    for side, v in (("a", a), ("b", b)):
        args += [f"--{side}-model", v.base_model or settings.model.model, f"--{side}-name", v.name]
        if v.path:
            args += [f"--{side}-adapter", v.path]
    # each side names its own base model: the shared options leave --model out
    model = to_cli_args(dataclasses.replace(settings.model, model=ModelConfig.model))
    return runner.submit("compare", args + model, config={"label": f"{a.name} vs {b.name}"}, inputs={
        "a_version_id": a.id, "b_version_id": b.id, "a_name": a.name, "b_name": b.name,
        "reward_version_id": reward.id, "reward_name": reward.name, "prompts": len(prompts)})


def submit_evaluation(store, runner, name: str, versions: list, n_prompts: int, settings: LoopSettings, *,
                      seed: int = 1234):
    """A blind evaluation (store/evaluations.py): each of `versions` (two or more policies) answers
    `n_prompts` held-out prompts once, with the same seed, in a sample-versions job
    (pipeline/sample_versions.py); its responses become queued items that show no model names.
    Returns (run, evaluation)."""
    if len({v.id for v in versions}) < 2:
        raise ValueError("pick at least two different policies to evaluate")
    for v in versions:
        if v.kind != "policy":
            raise ValueError(f"{v.name} is a {v.kind} model version: only policies can answer prompts here "
                             "(an imported model's answers come in through Data > Import)")
    if int(n_prompts) < 1:
        raise ValueError(f"an evaluation needs at least one prompt, not {n_prompts}")
    prompts = held_out_prompts(store, int(n_prompts))
    if not prompts:
        raise ValueError("no held-out prompts left (never ranked, never trained on, in no evaluation): "
                         "import more prompts")
    ev = store.create_evaluation(name, [v.id for v in versions], [p.id for p in prompts])
    stamp = _stamp()
    path = write_prompts(prompts, inputs_dir(runner) / f"evaluation-{stamp}-prompts.jsonl")
    spec = inputs_dir(runner) / f"evaluation-{stamp}-versions.json"
    spec.write_text(json.dumps([{"version_id": v.id, "name": v.name, "base_model": v.base_model or settings.model.model,
                                 "adapter": v.path} for v in versions], indent=2), encoding="utf-8")
    args = ["--prompts", str(path), "--versions", str(spec), "--max-new-tokens", str(settings.generate.max_new_tokens),
            "--temperature", str(settings.generate.temperature), "--seed", str(seed)]
    # each version names its own base model: the shared options leave --model out
    args += to_cli_args(dataclasses.replace(settings.model, model=ModelConfig.model))
    run = runner.submit("sample-versions", args, config={"label": f"evaluation {ev.name}"},
                        inputs={"evaluation_id": ev.id, "prompts": len(prompts), "versions": [v.id for v in versions]})
    store.set_evaluation_run(ev.id, run.id)
    return run, ev


def submit_export(store, runner, version):
    """`version` as a standalone Hugging Face folder, zipped in the run directory (the Models tab's
    Download; pipeline/export_model.py). Its lineage is read from the store now and handed to the
    job in a file: a job never opens the database."""
    from store.lineage import version_lineage

    if version.kind not in ("policy", "reward"):
        raise ValueError(f"{version.name} is a {version.kind}: export a policy or a reward model")
    if not version.path:
        raise ValueError(f"{version.name} is the base model used as is: nothing trained to export")
    path = inputs_dir(runner) / f"export-{_stamp()}-lineage.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(version_lineage(store, version), indent=2), encoding="utf-8")
    return runner.submit("export-model", [version.path, "--lineage", str(path), "--run-dir"],
                         config={"label": f"export {version.name}"},
                         inputs={"version_id": version.id, "version_name": version.name})
