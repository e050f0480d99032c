"""KL controllers: how the KL penalty coefficient beta moves during PPO.

The shaped reward is r_t = -beta * kl_t (+ score on the last token); beta trades reward against
staying close to the reference policy. Three controllers, each with the same small interface:

    ctl.value                     current beta
    ctl.update(current_kl, n)     after a rollout of n episodes whose mean KL (nats per sequence) was current_kl
    ctl.state_dict() / ctl.load_state_dict(d)    saved with PPO checkpoints so --resume continues

- FixedKLController: beta never moves.
- AdaptiveKLController: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
  sec. 2.2: e = clip(KL / target - 1, -0.2, 0.2); beta <- beta * (1 + e * n / horizon).
  (The same rule as TRL's AdaptiveKLController and lm-human-preferences.)
- X15KLController: a step rule in the style of the adaptive-KL-penalty variant of PPO (Schulman et
  al. 2017, sec. 4). As this project specifies it: beta * 1.5 when KL > 2 * target, beta / 1.5 when
  KL < target / 2. The paper's own constants are a band of 1.5 and a factor of 2 (beta * 2 when
  KL > 1.5 * target, / 2 when KL < target / 1.5); pass band=1.5, factor=2.0 to get them.
"""

from __future__ import annotations


class FixedKLController:
    """beta stays at its initial value."""

    kind = "fixed"

    def __init__(self, init_kl_coef: float):
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(self.kind, state)
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019: beta grows when KL is above target, shrinks
    when below, by at most 20% of n_steps / horizon per update."""

    kind = "adaptive"

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)  # clipped proportional error
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(self.kind, state)
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


class X15KLController:
    """Step rule: beta * factor when KL > band * target, beta / factor when KL < target / band,
    unchanged in between. Defaults (band 2, factor 1.5) are this project's 'x1.5' rule."""

    kind = "x1.5"

    def __init__(self, init_kl_coef: float, target: float, band: float = 2.0, factor: float = 1.5):
        if target <= 0 or band <= 1 or factor <= 1:
            raise ValueError(
                f"x1.5 KL needs target > 0, band > 1, factor > 1, got {target}, {band}, {factor}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.band = float(band)
        self.factor = float(factor)

    def update(self, current_kl: float, n_steps: int) -> None:
        if current_kl > self.band * self.target:
            self.value *= self.factor
        elif current_kl < self.target / self.band:
            self.value /= self.factor

    def state_dict(self) -> dict:
        return {
            "kind": self.kind,
            "value": self.value,
            "target": self.target,
            "band": self.band,
            "factor": self.factor,
        }

    def load_state_dict(self, state: dict) -> None:
        _check_kind(self.kind, state)
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.band = float(state.get("band", self.band))
        self.factor = float(state.get("factor", self.factor))


KLController = FixedKLController | AdaptiveKLController | X15KLController


def make_kl_controller(kind: str, init_kl_coef: float, target: float, horizon: int) -> KLController:
    """Build the controller PPOConfig.kl_control names: 'fixed', 'adaptive' or 'x1.5'."""
    if kind == "fixed":
        return FixedKLController(init_kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(init_kl_coef, target, horizon)
    if kind == "x1.5":
        return X15KLController(init_kl_coef, target)
    raise ValueError(f"unknown KL controller {kind!r}: use 'fixed', 'adaptive' or 'x1.5'")


def _check_kind(expected: str, state: dict) -> None:
    if state.get("kind", expected) != expected:
        raise ValueError(f"KL controller state is for {state['kind']!r}, not {expected!r}")


__all__ = [
    "FixedKLController",
    "AdaptiveKLController",
    "X15KLController",
    "KLController",
    "make_kl_controller",
]
