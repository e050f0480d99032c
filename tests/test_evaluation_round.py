"""A blind evaluation round end to end, through the Models tab's handlers and the real job runner.

Two policies of the learned-reward task (tests/test_ppo_learned_reward.py: a simulated annotator
prefers responses with more letters 'e'): the tiny starting policy, and DPO trained on that
annotator's pairs. The admin starts an evaluation on held-out prompts; a sample-versions job
writes one answer per policy per prompt; the items reach an annotator's queue showing no model
names; a simulated annotator with the same preference ranks them all; the Models tab's
leaderboard and win rate, the download and the model card's section then say the trained policy
is preferred, with a 95% interval above one half.

Sized over seeds 0-3 (`python -m tests.test_evaluation_round 0 1 2 3`): the DPO policy is preferred
on 0.98, 1.00, 1.00 and 0.75 of the 32 prompts (ties half), the interval's lower end 0.95, 1.00,
1.00 and 0.63; the test asserts the lower end is above 0.5 (seed 0). The start against itself (the same answers,
every comparison a tie) has win rate and lower end 0.5, and fails.
"""

from __future__ import annotations

import json

import pytest

from annotate import bootstrap
from annotate import evaluation_admin as ev
from annotate import handlers
from annotate.context import AppContext
from pipeline.config import GenerateConfig, ModelConfig
from pipeline.model_card import human_evaluation_section
from pipeline.oracle import make_oracle
from pipeline.orchestrate.loop import make_runner
from pipeline.orchestrate.simulate import simulate_annotations
from pipeline.orchestrate.steps import LoopSettings
from store import Store
from store.lineage import human_evaluation
from tests.helpers import req
from tests.test_ppo_learned_reward import MAX_NEW, TEMPERATURE, build_learned, run_dpo

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

START, TRAINED = "start-policy-q7", "dpo-policy-z9"  # names no tiny-model text would contain


def evaluate(tmp_path, seed: int) -> dict:
    """Build both policies, run the evaluation round; returns what the checks below read."""
    learned = build_learned(tmp_path / "learned", seed=seed)
    run_dpo(learned, tmp_path / "dpo", seed=seed)
    model = learned["policy_cfg"].model
    store = Store(tmp_path / "db" / "rlhf.duckdb")
    runner = make_runner(store, tmp_path / "db" / "runs")
    try:
        start = store.register_model_version("policy", START, base_model=model)
        store.register_model_version("policy", TRAINED, base_model=model, parent_id=start.id,
                                     path=str(tmp_path / "dpo" / "policy"))
        bootstrap.ensure_admin(store, auth=False)
        store.add_prompts(learned["held_out"])  # 32 prompts nobody trained on
        settings = LoopSettings(model=ModelConfig(device="cpu", dtype="fp32"),
                                generate=GenerateConfig(max_new_tokens=MAX_NEW, temperature=TEMPERATURE))
        ctx = AppContext(store=store, auth=False, data_dir=tmp_path / "db", jobs=runner, train_settings=settings)
        admin = req(None)
        picked, _, _ = ev.choices(ctx, admin)
        assert picked["value"] == [START, TRAINED]  # preset: the two newest policies
        msg, picker, table = ev.start(ctx, [START, TRAINED], 32, "", admin)
        name = picker["value"]
        assert name == f"{START} vs {TRAINED}" and "32 held-out prompts" in msg
        run = runner.wait(store.find_evaluation(name).run_id, timeout=300)
        assert run.status == "done", run.error
        evaluation = store.get_evaluation(run.inputs["evaluation_id"])

        # an annotator's view of an evaluation item shows its two answers and no model name
        store.ensure_annotator("ann")
        shown = handlers.load(ctx, None, req("ann"))
        state, html = shown[0], " ".join(str(x) for x in shown[1:])
        assert state.current.item.item_id in _items(store, evaluation.id) and len(state.current.item.responses) == 2
        assert START not in html and TRAINED not in html
        handlers.leave(ctx, req("ann"))  # the tab closes: its leased items go back to the queue

        ranked = simulate_annotations(store, make_oracle("rule:contains:e"), name="sim-e", seed=seed)
        text, board, rates, _ = ev.results(ctx, name, admin)
        path = ev.download(ctx, name, admin)
        return {"evaluation": store.get_evaluation(evaluation.id), "ranked": ranked, "text": text, "board": board,
                "rates": rates, "download": json.loads(open(path).read()), "results": store.evaluation_results(),
                "human": human_evaluation(store, TRAINED)}
    finally:
        runner.shutdown()
        store.close()


def _items(store, evaluation_id: int) -> list[int]:
    return [r[0] for r in store.cursor().execute("SELECT id FROM items WHERE evaluation_id = ?",
                                                 [evaluation_id]).fetchall()]


def test_people_prefer_the_trained_policy_in_a_blind_evaluation(tmp_path):
    out = evaluate(tmp_path, seed=0)
    evaluation = out["evaluation"]
    assert evaluation.items == 32 and out["ranked"] == 32 and evaluation.rankings == 32
    (rate,) = out["results"]["win_rates"]
    assert (rate["a"], rate["b"]) == (TRAINED, START)  # names in sorted order: A is the trained policy
    assert rate["win_rate"] > 0.5 and rate["low"] > 0.5, rate
    board = out["board"]
    assert list(board["version"]) == [TRAINED, START] and board["rating"].iloc[0] > board["rating"].iloc[1]
    assert "32 comparisons on 32 prompts" in out["text"]
    assert out["rates"]["A"].iloc[0] == TRAINED
    assert out["download"]["leaderboard"] == out["results"]["leaderboard"]
    card = "\n".join(human_evaluation_section(TRAINED, out["human"]))
    assert f"**{TRAINED}**" in card and f"{TRAINED} is preferred to {START} in {rate['win_rate']:.0%}" in card


if __name__ == "__main__":  # the sizing in the docstring: python -m tests.test_evaluation_round SEED...
    import sys
    import tempfile
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    for s in map(int, sys.argv[1:]):
        with tempfile.TemporaryDirectory() as d:
            r = evaluate(Path(d), s)["results"]["win_rates"][0]
            print(f"seed {s}: {r['a']} over {r['b']} {r['win_rate']:.3f} [{r['low']:.3f}, {r['high']:.3f}]", flush=True)
