"""pipeline/kl.py: each controller on a scripted KL sequence, betas worked out by hand."""

import pytest

from pipeline.kl import AdaptiveKLController, FixedKLController, X15KLController, make_kl_controller


def run(ctl, kls, n_steps):
    betas = []
    for kl in kls:
        ctl.update(kl, n_steps)
        betas.append(ctl.value)
    return betas


def test_fixed_never_moves():
    assert run(make_kl_controller("fixed", 0.1, 6.0, 10000), [100.0, 0.0, -3.0], 64) == [0.1] * 3


def test_adaptive_hand_values():
    # target 6, horizon 10000, 1000 episodes per update -> beta *= 1 + e * 0.1
    # KL 12: e = clip(1, .2) = .2 -> .1 * 1.02 = .102
    # KL 6:  e = 0              -> .102
    # KL 3:  e = clip(-.5) = -.2 -> .102 * .98 = .09996
    # KL 6.6: e = .1            -> .09996 * 1.01 = .1009596
    betas = run(make_kl_controller("adaptive", 0.1, 6.0, 10000), [12.0, 6.0, 3.0, 6.6], 1000)
    assert betas == pytest.approx([0.102, 0.102, 0.09996, 0.1009596])


def test_x15_hand_values():
    # target 6: up x1.5 above 12, down /1.5 below 3, unchanged in [3, 12]
    betas = run(make_kl_controller("x1.5", 0.1, 6.0, 10000), [13.0, 12.0, 2.9, 3.0, 1.0], 64)
    assert betas == pytest.approx([0.15, 0.15, 0.1, 0.1, 0.1 / 1.5])


def test_x15_with_the_paper_constants():
    ctl = X15KLController(1.0, target=6.0, band=1.5, factor=2.0)  # Schulman et al. 2017, sec. 4
    assert run(ctl, [9.5, 3.9, 5.0], 1) == pytest.approx([2.0, 1.0, 1.0])


def test_state_dict_round_trip_continues_the_sequence():
    a = AdaptiveKLController(0.2, 6.0, 100)
    run(a, [10.0, 9.0], 10)
    b = AdaptiveKLController(0.05, 1.0, 5)
    b.load_state_dict(a.state_dict())
    assert run(b, [1.0], 10) == run(a, [1.0], 10)
    f = FixedKLController(0.0)
    f.load_state_dict(FixedKLController(0.3).state_dict())
    assert f.value == 0.3
    with pytest.raises(ValueError, match="adaptive"):
        f.load_state_dict(a.state_dict())


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown KL controller"):
        make_kl_controller("pid", 0.1, 6.0, 100)
    with pytest.raises(ValueError, match="target > 0"):
        make_kl_controller("adaptive", 0.1, 0.0, 100)
