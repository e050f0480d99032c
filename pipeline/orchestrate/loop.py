"""The closed loop: the round state machine, used by the app's Train tab and the CLI alike.

    generating ──► annotating ──► training ──────────────► done
    (a generate     (people, or a   (a train-reward job,      (the new policy is active; with
     job with the    simulated       then a ppo job against    `next_round`, round n+1 starts
     active policy)  annotator)      the new reward model;     generating at once)
                         ▲           or one train-dpo job)
                         └──── back from training when the reward gate finds the new reward model
                               no better than chance: PPO does not run (see below)

The policy step (LoopSettings.policy_step) is PPO (or RLOO / GRPO, PPO's loop without a critic)
or DPO. Both train on the same data: a snapshot of every pair so far (steps.pairs_snapshot). With
PPO a reward model learns the snapshot and PPO optimises against it; with DPO the policy learns the snapshot directly and the round trains no
reward model: that is DPO's point (Rafailov et al. 2023), and it saves the reward job's minutes.
The round then records the snapshot and no reward model. What still needs a reward model
(Compare in the Models tab, 'uncertain' prompt selection) uses the newest one trained (by an
earlier PPO round or "Train reward model"); with none, 'uncertain' selection is random.

A round is finished (trained on) once it has enough rankings: `rankings_per_round`, or every item
ranked as often as the round's overlap asks if that is fewer (`coverage`). Only the round's own
rankable items count (Store.round_rankable): gold items (everyone ranks them, outside the overlap)
and items of flagged prompts (out of the queue) count neither as items nor as rankings, so the
threshold is one that people ranking the queue can reach. `finish_round` refuses an under-ranked
round with `UnderRanked`, which says how many items are ranked, unless told to go on anyway; the
Train tab asks the admin first, and the CLI waits for people to reach it, or stops and says so
when the active accounts cannot reach it (each ranks an item once, skips are final).

Every step is a job (steps.py builds it, jobs.py runs it). A job carries its round and step in
its inputs; when it ends, `on_job_end` moves the round on and submits the next step, so a round
advances whether or not anyone waits for it, and the queue (the `runs` table) carries it across a
restart of the owner. The blocking functions (`start_round`, `finish_round`, ...) submit a step
and wait for the round to settle: the CLI and the benchmarks use those.

One failure rule: a step that fails, is cancelled or is interrupted puts its round back to
'annotating', with `meta.last_error` saying which step, which run and why. The round keeps its
items and rankings, and the same action (train again, or start the next round) retries it; a
generation that stopped part-way is finished by `resume_generation` (the headless loop does it
when it starts again).

The reward gate (LoopConfig.reward_gate, pipeline/orchestrate/gate.py): after the reward step, PPO
runs only if the reward model's held-out accuracy is above chance (95% Wilson interval). If not,
the round goes back to 'annotating' as a failed step does, its `meta.reward_gate` holding the
verdict (figures, reward version, advice) and `meta.last_error` its message, and `wait_round`
raises UntrustedReward. Rank more and train again, or `train_round_policy` against the gated
reward model (the Train tab's "Run PPO anyway"). `gated(rnd)` is the verdict while the round
stands stopped by the gate; the round's next step clears it.

    python -m pipeline loop --rounds 2 --oracle embedding     # headless, simulated annotators
    python -m pipeline loop --policy-step dpo --dpo-beta 0.1 --oracle embedding
    python -m pipeline loop --oracle embedding --reward-gate false  # PPO whatever the reward model
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import (DPOConfig, GenerateConfig, LoopConfig, ModelConfig, PPOConfig, RewardConfig,
                             add_arguments, from_args)
from pipeline.orchestrate import gate
from pipeline.orchestrate.jobs import JobRunner
from pipeline.orchestrate.steps import (POLICY_STEPS, LoopSettings, RoundStep, check_policy_step, ensure_base_policy,
                                        run_prompt_ids, select_prompts, submit_dpo, submit_generate, submit_ppo,
                                        submit_reward)

IN_FLIGHT = ("generating", "training")


class RoundFailed(RuntimeError):
    pass


class UntrustedReward(RoundFailed):
    """The reward gate stopped the round before PPO; `verdict` is the round's meta["reward_gate"]
    (gate.Verdict.to_dict()), `round_id` the round, which is 'annotating' again."""

    def __init__(self, rnd):
        super().__init__(f"round {rnd.id}: {rnd.meta['reward_gate']['message']}")
        self.round_id = rnd.id
        self.verdict = rnd.meta["reward_gate"]


@dataclass(frozen=True)
class Coverage:
    """How far a round's annotation has come, against the rankings it needs before training."""

    round_id: int
    items: int
    rankings: int
    ranked_items: int
    """Items with at least one ranking."""
    overlap: int
    """Rankings each item is to get (the round's own overlap, else the store's)."""
    threshold: int
    """Rankings needed: rankings_per_round, at most items x overlap (all a round can get)."""
    reachable: int
    """The most rankings the round can get from the active accounts (each ranks an item once;
    a skip is final): below the threshold, waiting for people cannot finish the round."""

    @property
    def enough(self) -> bool:
        return self.rankings >= self.threshold

    @property
    def stuck(self) -> bool:
        """Not enough, and the active accounts cannot make it enough."""
        return not self.enough and self.reachable < self.threshold

    def counts(self) -> str:
        """'R of M items ranked (threshold T)', with the rankings at overlap > 1."""
        if self.overlap == 1:
            return f"{self.rankings} of {self.items} items ranked (threshold {self.threshold})"
        return (f"{self.ranked_items} of {self.items} items ranked, {self.rankings} rankings at overlap "
                f"{self.overlap} (threshold {self.threshold} rankings)")

    def describe(self) -> str:
        return f"Round {self.round_id} has {self.counts()}"


class UnderRanked(RoundFailed):
    """`finish_round` on a round with fewer rankings than its threshold, without `anyway`."""

    def __init__(self, coverage: Coverage):
        super().__init__(f"{coverage.describe()}: finish anyway?")
        self.coverage = coverage


def coverage(store, rnd, settings: LoopSettings) -> Coverage:
    """The round's rankings of its rankable items against its threshold (rankings_per_round;
    0 = none needed)."""
    overlap = store.round_queue().get(rnd.id, (None, None))[0] or store.queue_overlap()
    counts = store.round_rankable(rnd.id, overlap)
    threshold = min(max(settings.loop.rankings_per_round, 0), counts["items"] * overlap)
    return Coverage(rnd.id, counts["items"], counts["rankings"], counts["ranked_items"], overlap, threshold,
                    counts["reachable"])


def make_runner(store, runs_root, **kwargs) -> JobRunner:
    """The owner's job runner, wired to the round state machine; rounds a previous owner left
    mid-step are settled (see `recover_rounds`)."""
    runner = JobRunner(store, runs_root, on_end=on_job_end, **kwargs)
    recover_rounds(store, runner)
    return runner


def current_round(store):
    """The newest round waiting for annotations, if any."""
    rounds = [r for r in store.list_rounds() if r.status == "annotating"]
    return rounds[-1] if rounds else None


# ---------------------------------------------------------------------- starting steps


def start_round(store, runner, settings: LoopSettings, round_no: int | None = None, *, wait: bool = True):
    """A new round: pick its prompts, generate K responses each with the active policy.
    `round_no` seeds the prompt choice (default: the number of rounds so far)."""
    policy = ensure_base_policy(store, settings.model)
    round_no = len(store.list_rounds()) if round_no is None else round_no
    try:
        prompts = select_prompts(store, runner, settings.loop.prompts_per_round, settings.loop.strategy,
                                 settings.loop.seed + round_no)
    except ValueError as exc:
        raise RoundFailed(str(exc)) from None
    rnd = store.create_round(policy_version_id=policy.id, config={"loop": settings.to_dict()["loop"]})
    rnd = _begin(store, rnd, "generating", settings, {})
    uncertain = settings.loop.prompts_per_round if settings.loop.strategy == "uncertain" else 0
    _submit(store, rnd, "generate", lambda: submit_generate(
        store, runner, prompts, settings, policy, in_round=RoundStep(rnd.id, "generate"), select_uncertain=uncertain,
        label=f"round-{rnd.id}"))
    return wait_round(store, rnd) if wait else rnd


def resume_generation(store, runner, rnd, settings: LoopSettings, *, wait: bool = True):
    """A round whose generation stopped part-way (its generate job failed, or the owner stopped
    while it ran) generates, with the round's policy, the prompts its jobs were given that still
    have no responses; the items already made stay. With nothing left to generate, the round's
    error is cleared and it stays as it is."""
    given = set().union(*(run_prompt_ids(run) for run in store.list_runs(kind="generate")
                          if run.inputs.get("round_id") == rnd.id))
    missing = [p for p in store.prompts_without_responses() if p.id in given]
    keep = len(missing)
    if settings.loop.strategy == "uncertain":  # the job was given 2N candidates to keep N of
        keep = max(0, settings.loop.prompts_per_round - store.round_counts(rnd.id)["prompts"])
    if not missing or not keep:
        return store.update_round(rnd.id, meta={"last_error": None, "failed_step": None})
    policy = store.get_model_version(rnd.policy_version_id)
    rnd = _begin(store, rnd, "generating", settings, {})
    _submit(store, rnd, "generate", lambda: submit_generate(
        store, runner, missing, settings, policy, in_round=RoundStep(rnd.id, "generate"),
        select_uncertain=keep if settings.loop.strategy == "uncertain" else 0, label=f"round-{rnd.id}"))
    return wait_round(store, rnd) if wait else rnd


def generation_stopped(rnd) -> bool:
    """The round's generation failed or was interrupted (`resume_generation` finishes it)."""
    return bool(rnd.meta.get("last_error")) and rnd.meta.get("failed_step") == "generate"


def finish_round(store, runner, rnd, settings: LoopSettings, *, next_round: bool = False, wait: bool = True,
                 anyway: bool = False):
    """Train on the round: a snapshot of every pair so far -> reward model -> PPO from the round's
    policy, or DPO on the snapshot from the round's policy -> the new active policy; with
    `next_round`, then start the next round. A round with fewer rankings than its threshold
    (`coverage`) raises UnderRanked, untouched, unless `anyway`. PPO waits on the reward gate
    (settings.loop.reward_gate): with `wait`, a stop raises UntrustedReward."""
    step = check_policy_step(settings.policy_step)
    have = coverage(store, rnd, settings)
    if rnd.status == "annotating" and not have.enough and not anyway:
        raise UnderRanked(have)
    rnd = _begin(store, rnd, "training", settings, {"policy": True, "next_round": next_round})
    if step == "dpo":
        policy = store.get_model_version(rnd.policy_version_id)
        _submit(store, rnd, "policy", lambda: submit_dpo(store, runner, settings, policy,
                                                         in_round=RoundStep(rnd.id, "policy")))
    else:
        _submit(store, rnd, "reward", lambda: submit_reward(store, runner, settings,
                                                            in_round=RoundStep(rnd.id, "reward")))
    return wait_round(store, rnd) if wait else rnd


def train_round_reward(store, runner, rnd, settings: LoopSettings):
    """Only the reward step (blocking): the round goes back to 'annotating'; returns the new
    reward version."""
    rnd = _begin(store, rnd, "training", settings, {"policy": False})
    run, _ = _submit(store, rnd, "reward", lambda: submit_reward(store, runner, settings,
                                                                 in_round=RoundStep(rnd.id, "reward")))
    wait_round(store, rnd)
    return store.get_model_version(store.get_run(run.id).outputs["model_version_id"])


def train_round_policy(store, runner, rnd, reward, settings: LoopSettings, *, next_round: bool = False,
                       wait: bool = True):
    """Only the policy step: PPO from the round's policy against `reward`; the round ends done.
    Not gated: the caller chose the reward model (after the gate stopped a round, its
    meta["reward_gate"]["reward_version_id"] is the one it stopped at)."""
    rnd = _begin(store, rnd, "training", settings, {"next_round": next_round})
    policy = store.get_model_version(rnd.policy_version_id)
    _submit(store, rnd, "policy", lambda: submit_ppo(store, runner, settings, reward, policy,
                                                     in_round=RoundStep(rnd.id, "policy")))
    return wait_round(store, rnd) if wait else rnd


def close_round(store, rnd):
    """Mark an annotating round done without training in it. If the active policy was trained
    from the round's policy (by a separate PPO run), it is recorded as the round's outcome."""
    active = store.active_policy()
    if active is not None and active.parent_id == rnd.policy_version_id:
        reward = store.get_model_version(active.reward_version_id) if active.reward_version_id else None
        return store.update_round(rnd.id, status="done", new_policy_version_id=active.id,
                                  reward_version_id=reward.id if reward else None,
                                  snapshot_id=active.snapshot_id or (reward.snapshot_id if reward else None),
                                  meta={"closed": "without training in the round; trained by separate runs"})
    return store.update_round(rnd.id, status="done", meta={"closed": "without training, no new policy"})


def _begin(store, rnd, status: str, settings: LoopSettings, plan: dict):
    """Enter `status` with the settings and plan the later steps read (kept on the round, so a
    restart of the owner does not lose them)."""
    if status == "training" and rnd.status != "annotating":
        raise RoundFailed(f"round {rnd.id} is {rnd.status}: only a round being annotated can be trained")
    return store.update_round(rnd.id, status=status, meta={"settings": settings.to_dict(), "plan": plan,
                                                           "last_error": None, "reward_gate": None})


def _submit(store, rnd, step: str, submit):
    """Run `submit()`; if it cannot queue the step, the round fails by the one rule."""
    try:
        return submit()
    except Exception as exc:
        fail(store, rnd.id, step, f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc))
        raise RoundFailed(f"round {rnd.id}, {step}: {exc}") from exc


def fail(store, round_id: int, step: str, why: str, run_id: int | None = None):
    """The one failure rule (module docstring)."""
    where = f"{step} (run #{run_id})" if run_id is not None else step
    return store.update_round(round_id, status="annotating",
                              meta={"last_error": f"{where} failed: {why.strip()[:2000]}", "failed_step": step})


def stop_at_gate(store, round_id: int, verdict: gate.Verdict):
    """The gate's stop (module docstring): back to 'annotating', with the verdict and its message."""
    return store.update_round(round_id, status="annotating",
                              meta={"reward_gate": verdict.to_dict(), "last_error": verdict.message})


def gated(rnd) -> dict | None:
    """The gate's verdict (gate.Verdict.to_dict()) when the round stands stopped by it, else None."""
    return rnd.meta.get("reward_gate") if rnd.status == "annotating" else None


# ---------------------------------------------------------------------- advancing


def on_job_end(runner, run) -> None:
    """JobRunner's on_end: move the run's round to its next step (or fail it)."""
    step, round_id = run.inputs.get("round_step"), run.inputs.get("round_id")
    if not step or round_id is None:
        return
    store = runner.store
    rnd = store.get_round(round_id)
    if run.status != "done":
        fail(store, round_id, step, run.error or run.status, run.id)
        return
    plan = rnd.meta.get("plan") or {}
    settings = LoopSettings.from_dict(rnd.meta.get("settings") or {})
    if step == "generate":
        store.update_round(round_id, status="annotating")
    elif step == "reward" and plan.get("policy"):
        reward = store.get_model_version(run.outputs["model_version_id"])
        if settings.loop.reward_gate:
            try:
                verdict = gate.judge(reward)
            except ValueError as exc:
                fail(store, round_id, "policy", str(exc))
                return
            if not verdict.trusted:
                stop_at_gate(store, round_id, verdict)
                return
        policy = store.get_model_version(rnd.policy_version_id)
        try:
            submit_ppo(store, runner, settings, reward, policy, in_round=RoundStep(round_id, "policy"))
        except Exception as exc:
            fail(store, round_id, "policy", str(exc))
    elif step == "reward":
        store.update_round(round_id, status="annotating")
    elif step == "policy":  # PPO names its reward model (and through it the snapshot); DPO its snapshot
        reward_id = run.inputs.get("reward_version_id")
        snapshot_id = run.inputs.get("snapshot_id") or store.get_model_version(reward_id).snapshot_id
        store.update_round(round_id, status="done", reward_version_id=reward_id, snapshot_id=snapshot_id,
                           new_policy_version_id=run.outputs["model_version_id"])
        if plan.get("next_round"):
            try:
                start_round(store, runner, settings, wait=False)
            except RoundFailed:
                pass  # the new round (if it was created) says why; none is created for an empty pool


def recover_rounds(store, runner) -> int:
    """Rounds left mid-step with no job of theirs queued or running (the owner stopped between
    two steps) fail by the one rule. Returns how many."""
    waiting = {r.inputs.get("round_id") for r in runner.in_flight()}
    stale = [r for r in store.list_rounds() if r.status in IN_FLIGHT and r.id not in waiting]
    for rnd in stale:
        fail(store, rnd.id, "generate" if rnd.status == "generating" else "training",
             "interrupted: the app stopped between two steps")
    return len(stale)


def wait_round(store, rnd, timeout: float | None = None, poll_s: float = 0.2):
    """Block until the round has settled (not generating or training); UntrustedReward if the
    reward gate stopped it, RoundFailed if a step failed. Returns the round."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        rnd = store.get_round(rnd.id)
        if rnd.status not in IN_FLIGHT:
            break
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"round {rnd.id} still {rnd.status} after {timeout} s")
        time.sleep(poll_s)
    if gated(rnd):
        raise UntrustedReward(rnd)
    if rnd.meta.get("last_error"):
        raise RoundFailed(f"round {rnd.id}: {rnd.meta['last_error']}")
    return rnd


# ---------------------------------------------------------------------- headless


def run_loop(store, runner, settings: LoopSettings, oracle=None, noise: float = 0.0, log=print) -> list:
    """R rounds headless. Rankings come from `oracle` (simulated annotator) or, without one, from
    people: the loop waits until the round has the rankings it needs (`coverage`). A round the
    reward gate stops ends the loop with UntrustedReward (unless settings.loop.reward_gate is off)."""
    from pipeline.orchestrate.simulate import simulate_annotations

    done = []
    rnd = current_round(store) or start_round(store, runner, settings, 0)
    if generation_stopped(rnd):  # the loop stopped while the round was generating: finish that first
        rnd = resume_generation(store, runner, rnd, settings)
    for n in range(settings.loop.rounds):
        log(f"round {rnd.id}: annotating")
        if oracle is not None:
            simulate_annotations(store, oracle, noise=noise, seed=settings.loop.seed + n)
        else:
            wait_for_rankings(store, rnd, settings, log)
        log(f"round {rnd.id}: training")
        # a simulated annotator has ranked all the queue gave it (one ranking per item, whatever the overlap)
        done.append(finish_round(store, runner, rnd, settings, anyway=oracle is not None))
        log(f"round {rnd.id}: done, new policy {done[-1].new_policy_version_id}")
        rnd = start_round(store, runner, settings, n + 1)
    return done


def wait_for_rankings(store, rnd, settings: LoopSettings, log=print, poll_s: float = 5.0) -> Coverage:
    """Block until people have ranked enough of the round (`coverage`); RoundFailed, saying why and
    what to do, as soon as the active accounts cannot get there (waiting would never end). The
    round stays open: add annotators, or lower --rankings-per-round, and run the loop again."""
    said = None
    while True:
        have = coverage(store, rnd, settings)
        if have.enough:
            return have
        if have.stuck:
            raise RoundFailed(
                f"{have.describe()}, and its items can get at most {have.reachable} rankings from the active "
                f"accounts (each ranks an item once, skips are final): add annotators, lower "
                f"--rankings-per-round, or finish the round anyway in the app's Train tab")
        if have.rankings != said:
            log(f"{have.describe()}: waiting for people to rank in the app")
            said = have.rankings
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    from pipeline.oracle import make_oracle
    from store import Store, default_db_path

    parser = argparse.ArgumentParser(prog="python -m pipeline loop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", default=str(default_db_path()), help="the DuckDB file (default: %(default)s)")
    parser.add_argument("--runs", default="", help="where run directories go (default: runs/ beside --db)")
    parser.add_argument("--oracle", "--judge", dest="oracle", default="",
                        help="simulated annotators' oracle (see simulate-annotators; --judge: its earlier name); "
                             "'' = wait for people to rank in the app")
    parser.add_argument("--noise", type=float, default=0.0, help="simulated annotator's Bradley-Terry noise")
    parser.add_argument("--policy-step", choices=POLICY_STEPS, default="ppo",
                        help="how a round trains its policy: ppo (a reward model on the round's snapshot, then PPO "
                             "against it), rloo or grpo (the same without a critic; options --ppo-*) or dpo (DPO on "
                             "the snapshot, no reward model; options --dpo-*)")
    parser.add_argument("--ppo-prompts", type=int, default=256, help="pool prompts PPO trains on per round")
    parser.add_argument("--processes", type=int, default=1,
                        help="data-parallel processes per job, e.g. one per GPU (torchrun; default: %(default)s)")
    parser.add_argument("--accelerate-config", default="",
                        help="launch jobs with `accelerate launch --config_file` this file (FSDP, DeepSpeed)")
    for cls, prefix in ((LoopConfig, ""), (ModelConfig, ""), (GenerateConfig, "gen_"), (RewardConfig, "rm_"),
                        (PPOConfig, "ppo_"), (DPOConfig, "dpo_")):
        add_arguments(parser, cls, prefix)
    args = parser.parse_args(argv)
    settings = LoopSettings(loop=from_args(LoopConfig, args), model=from_args(ModelConfig, args),
                            generate=from_args(GenerateConfig, args, "gen_"), reward=from_args(RewardConfig, args, "rm_"),
                            ppo=from_args(PPOConfig, args, "ppo_"),
                            dpo=from_args(DPOConfig, args, "dpo_"), policy_step=args.policy_step,
                            ppo_prompts=args.ppo_prompts, processes=args.processes,
                            accelerate_config=args.accelerate_config)
    store = Store(args.db)
    runner = make_runner(store, args.runs or Path(args.db).resolve().parent / "runs")
    try:
        run_loop(store, runner, settings, oracle=make_oracle(args.oracle) if args.oracle else None, noise=args.noise)
    except RoundFailed as exc:
        print(f"error: {exc}")
        return 1
    finally:
        runner.shutdown()
        store.close()
    return 0
