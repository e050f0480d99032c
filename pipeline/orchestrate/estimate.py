"""How long a full round is expected to take on this machine, from this store's finished runs.

A round that finishes the round being annotated runs up to three jobs: train-reward on every pair
so far, then PPO against it (or train-dpo on the same pairs instead of both), then generate for
the next round. Each job's cost is its work in one unit times the seconds one unit took:

    generate       responses x max_new_tokens                       (response-tokens)
    train-reward   pairs x epochs (capped by max_steps)              (pair-epochs)
    ppo            steps x batch x max_new_tokens x (1 + ppo_epochs) (one rollout pass and one
                                                                      pass per PPO epoch over each
                                                                      episode's response tokens)
    train-dpo      pairs x epochs (capped by max_steps)              (pair-epochs)

Seconds per unit come from this store's finished runs of the same kind on the same base model
(the same LoRA setting where there are such runs): total wall time over total units of the last
RECENT runs, so everything a job does besides its main loop (loading, evaluation, saving) is in
the figure. With no such run, the figure is the reference measurement of bench/round_cost.py on a
2-core CPU (REFERENCE; docs/results/round_cost), and the estimate says so.

Pure Python over store records (no torch): the Train tab calls it in the app process.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import GenerateConfig, with_rollout_length

RECENT = 5
"""Finished runs per kind that the per-unit figure averages over (the newest: machines change)."""

REFERENCE_MODEL = "default"
REFERENCE = {
    # bench/round_cost.py's round on SmolLM2-135M-Instruct, LoRA, the app's defaults, 2 threads of
    # an idle 2-core AMD EPYC: each part's wall seconds (loading and saving in) over its units;
    # docs/results/round_cost/results.json ("after_parts") has the figures these come from
    "generate": 72.878 / (32 * 4 * 128),   # 32 prompts x K = 4 responses of up to 128 tokens
    "train-reward": 80.824 / (32 * 6),     # their 192 pairs
    "ppo": 71.517 / (16 * 128 * 3),        # one default step: 16 episodes of 128 tokens, 1 + 2 epochs
}
"""Seconds per unit measured once (module docstring); used before this store has runs of its own.
train-dpo has none: a DPO round is estimated from this store's runs only."""

MEASURED_ROUND = {"lr": 3e-4, "kl_final": 7.19, "kl_target": 6.0, "beta_final": 0.04976, "steps": 20, "batch": 16,
                  "minutes": 1201 / 60}
"""The default round's PPO step as measured (docs/results/round_defaults.md, RESULT defaults): what
the Train tab states next to the PPO settings."""

@dataclass(frozen=True)
class Part:
    """One job of the round: its work, and the time it is expected to take (None: no figure)."""

    kind: str
    what: str
    units: float
    seconds_per_unit: float | None
    source: str
    """'store' (this store's finished runs), 'reference' (the 2-core measurement) or 'none'."""
    runs: int = 0
    """Finished runs behind a 'store' figure."""

    @property
    def seconds(self) -> float | None:
        return None if self.seconds_per_unit is None else self.units * self.seconds_per_unit


@dataclass(frozen=True)
class RoundEstimate:
    parts: tuple[Part, ...]

    @property
    def seconds(self) -> float | None:
        """The whole round; None when a part has no figure."""
        parts = [p.seconds for p in self.parts]
        return None if any(s is None for s in parts) else sum(parts)

    def markdown(self) -> str:
        """One line for the Train tab: the total, each part, and where the figures come from."""
        each = ", ".join(f"{p.what} {duration(p.seconds)}" for p in self.parts)
        sources = {p.source for p in self.parts}
        if sources == {"store"}:
            runs = sum(p.runs for p in self.parts)
            whence = f"from this store's {runs} finished run{'s' * (runs != 1)} on this machine"
        elif "store" in sources:
            whence = ("partly from this store's finished runs, partly from a reference measurement on a "
                      "2-core CPU (no run of that kind here yet)")
        else:
            whence = "from a reference measurement on a 2-core CPU (no finished runs in this store yet)"
        if "none" in sources:
            missing = ", ".join(p.kind for p in self.parts if p.source == "none")
            return (f"**Expected round duration:** unknown until a {missing} job has finished here ({each}; "
                    f"{whence}).")
        return f"**Expected round duration: about {duration(self.seconds)}** ({each}; {whence})."


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# ---------------------------------------------------------------------- units of work


def _capped(pairs: float, cfg: dict, pairs_per_group: float = 1.0) -> float:
    """Pair-epochs of a train-reward or train-dpo run: all its pairs each epoch, or max_steps
    optimiser steps of batch_size x grad_accum batch elements when that is fewer: pairs, or with
    `grouped` rankings of about pairs_per_group pairs each."""
    units = pairs * int(cfg.get("epochs", 1))
    steps = int(cfg.get("max_steps", 0) or 0)
    if steps > 0:
        per_element = pairs_per_group if cfg.get("grouped") else 1.0
        units = min(units, steps * int(cfg.get("batch_size", 8)) * int(cfg.get("grad_accum", 1)) * per_element)
    return float(units)


def generate_units(responses: float, max_new_tokens: int) -> float:
    return float(responses * max_new_tokens)


def ppo_units(ppo: dict) -> float:
    # a length of 0 is the generation's (a standalone run's: GenerateConfig's default; a round
    # records its own length resolved)
    tokens = ppo["max_new_tokens"] or GenerateConfig.max_new_tokens
    return float(ppo["steps"] * ppo["batch_size"] * tokens * (1 + ppo["ppo_epochs"]))


def run_units(store, run) -> float | None:
    """A finished run's work in its kind's unit (None when its record lacks what is needed)."""
    cfg = run.config or {}
    try:
        if run.kind == "generate":
            return generate_units(run.outputs["responses"], cfg["generate"]["max_new_tokens"])
        if run.kind == "ppo":
            return ppo_units(cfg["ppo"])
        if run.kind in ("train-reward", "train-dpo"):
            counts = store.get_snapshot(run.inputs["snapshot_id"]).counts
            pairs = counts.get("pairs", 0)
            return _capped(pairs, cfg["reward" if run.kind == "train-reward" else "dpo"],
                           pairs / max(counts.get("rankings") or pairs, 1))
    except (KeyError, TypeError, LookupError):
        return None
    return None


def _run_model(run) -> tuple[str, bool | None]:
    """(base model, LoRA) a run trained or sampled with: its config's model part, else its --model."""
    model = (run.config or {}).get("model")
    if isinstance(model, dict):
        return str(model.get("model", REFERENCE_MODEL)), model.get("lora")
    args = (run.config or {}).get("args", [])
    return (args[args.index("--model") + 1] if "--model" in args[:-1] else REFERENCE_MODEL), None


# ---------------------------------------------------------------------- per-unit figures


def seconds_per_unit(store, kind: str, model: str, lora: bool) -> tuple[float | None, str, int]:
    """(seconds per unit, source, runs): from the newest RECENT finished runs of `kind` on `model`
    (those with the same LoRA setting when there are any), else the reference figure for the
    default model, else none."""
    same, other = [], []  # (seconds, units) of runs with this LoRA setting, and with the other
    for run in store.list_runs(kind=kind, status="done"):  # newest first
        if len(same) == RECENT:
            break  # the Train tab asks on every change of the form: stop reading once there are enough
        run_model, run_lora = _run_model(run)
        timed = same if run_lora in (lora, None) else other
        if run.started_at is None or run.finished_at is None or run_model != model or len(timed) == RECENT:
            continue
        units = run_units(store, run)
        if units:
            timed.append(((run.finished_at - run.started_at).total_seconds(), units))
    chosen = same or other
    if chosen:
        return sum(t[0] for t in chosen) / sum(t[1] for t in chosen), "store", len(chosen)
    if model == REFERENCE_MODEL and REFERENCE.get(kind):
        return REFERENCE[kind], "reference", 0
    return None, "none", 0


def round_estimate(store, settings) -> RoundEstimate:
    """The expected duration of a full round with `settings` (a LoopSettings): train on the pairs so
    far (none yet: a fully ranked round's, prompts_per_round x C(K, 2)), the policy step, and the
    next round's generation."""
    k, model, lora = settings.generate.k, settings.model.model, settings.model.lora
    pairs = store.counts().get("pairs") or settings.loop.prompts_per_round * k * (k - 1) // 2
    parts = []

    def part(kind: str, what: str, units: float) -> None:
        per_unit, source, runs = seconds_per_unit(store, kind, model, lora)
        parts.append(Part(kind, what, units, per_unit, source, runs))

    per_ranking = k * (k - 1) / 2  # a ranking without ties
    if settings.policy_step == "dpo":
        part("train-dpo", f"DPO on {pairs} pairs", _capped(pairs, vars(settings.dpo), per_ranking))
    else:
        part("train-reward", f"reward model on {pairs} pairs", _capped(pairs, vars(settings.reward), per_ranking))
        part("ppo", f"{settings.policy_step.upper()} {settings.ppo.steps} steps", ppo_units(vars(with_rollout_length(settings.ppo, settings.generate))))
    responses = settings.loop.prompts_per_round * k
    part("generate", f"generating {responses} responses",
         generate_units(responses, settings.generate.max_new_tokens))
    return RoundEstimate(tuple(parts))
