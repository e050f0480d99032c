"""bench/listwise_bench.py's smoke test: --quick end to end on the tiny model (about 20 s), so a
change that breaks the bench is seen; the listwise annotators' draw against its definition."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from bench import listwise_bench

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_listwise_annotator_draws_plackett_luce_orders():
    """Utilities 2, 1, 0 at temperature 1: the first pick is response 0 with probability
    e^2 / (e^2 + e + 1) = 0.665, and the whole order 0, 1, 2 with 0.665 * e / (e + 1) = 0.489."""
    rng = random.Random(0)
    draws = Counter(tuple(listwise_bench.listwise_order([2.0, 1.0, 0.0], 1.0, rng)) for _ in range(20_000))
    assert sum(n for order, n in draws.items() if order[0] == 0) / 20_000 == pytest.approx(0.665, abs=0.015)
    assert draws[(0, 1, 2)] / 20_000 == pytest.approx(0.489, abs=0.015)


@pytest.mark.slow
def test_the_quick_bench_runs_end_to_end(tmp_path, capsys):
    assert listwise_bench.main(["--quick", "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    result = next(line for line in out.splitlines() if line.startswith("RESULT listwise "))
    fields = dict(kv.split("=") for kv in result.split()[2:])
    assert fields["seeds"] == "1" and all(0 <= float(fields[f"n40_acc_{arm}"]) <= 1 for arm in ("bt", "grouped", "pl"))
    assert float(fields["n40_grouped_diff"]) == pytest.approx(float(fields["n40_acc_grouped"]) - float(fields["n40_acc_bt"]),
                                                              abs=2e-4)
    assert (tmp_path / "out.json").is_file()
    # resumed, the seed the file holds is not run again, and the same result is reported
    assert listwise_bench.main(["--quick", "--json", str(tmp_path / "out.json"), "--resume"]) == 0
    again = capsys.readouterr().out
    assert result in again.splitlines() and "seed 0 n=40" not in again
    with pytest.raises(SystemExit, match="other settings .*epochs"):
        listwise_bench.main(["--quick", "--epochs", "3", "--json", str(tmp_path / "out.json"), "--resume"])
