"""Blind evaluation rounds in the store (store/evaluations.py) and the statistics of their results
(store/leaderboard.py): a Bradley-Terry fit that recovers known strengths, win rates with bootstrap
intervals over prompts, items that carry no names and stay out of training exports."""

from __future__ import annotations

import math
import random

import pytest

from store import RankingIn
from store.errors import InvalidRequest, NotFoundError
from store.export import export_dataset
from store.export_options import ExportOptions
from store.leaderboard import SCALE, Comparison, bradley_terry, leaderboard, win_rates


def simulated(strengths: dict[str, float], prompts: int, seed: int) -> list[Comparison]:
    """Every pair of versions once per prompt, the first winning with sigmoid(theta_a - theta_b)."""
    rng = random.Random(seed)
    names = sorted(strengths)
    out = []
    for p in range(prompts):
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                won = rng.random() < 1 / (1 + math.exp(-(strengths[a] - strengths[b])))
                out.append(Comparison(p, a, b, 1.0 if won else 0.0))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bradley_terry_recovers_known_strengths(seed):
    # 400 comparisons per pair: the s.e. of a strength difference is about 0.12, the tolerance 0.4
    truth = {"base": 0.0, "v1": 0.7, "v2": 1.5}
    theta = bradley_terry(simulated(truth, 400, seed), sorted(truth))
    for a in truth:
        for b in truth:
            assert theta[a] - theta[b] == pytest.approx(truth[a] - truth[b], abs=0.4)


def test_the_leaderboard_orders_versions_with_intervals_that_separate_them():
    truth = {"base": 0.0, "v1": 0.7, "v2": 1.5}
    rows = leaderboard(simulated(truth, 200, seed=3), seed=0, resamples=300)
    assert [r["version"] for r in rows] == ["v2", "v1", "base"]
    for r in rows:
        assert r["low"] < r["rating"] < r["high"] and r["comparisons"] == 400 and r["prompts"] == 200
    # 0.7 apart (280 rating points) on 200 prompts: the intervals do not overlap
    assert rows[0]["low"] > rows[1]["high"] and rows[1]["low"] > rows[2]["high"]
    assert rows[0]["rating"] - rows[2]["rating"] == pytest.approx(1.5 * SCALE, abs=0.4 * SCALE)
    # the same comparisons and seed give the same table
    assert rows == leaderboard(simulated(truth, 200, seed=3), seed=0, resamples=300)


def test_a_version_that_wins_every_comparison_stays_finite():
    rows = leaderboard([Comparison(p, "a", "b", 1.0) for p in range(10)], resamples=50)
    assert rows[0]["version"] == "a" and all(math.isfinite(r["rating"]) for r in rows)


def test_win_rate_is_the_share_of_wins_with_ties_half_and_a_bootstrap_interval():
    comparisons = [Comparison(p, "new", "old", 1.0) for p in range(60)]
    comparisons += [Comparison(p, "old", "new", 1.0) for p in range(60, 90)]
    comparisons += [Comparison(p, "new", "old", 0.5) for p in range(90, 100)]
    (row,) = win_rates(comparisons, resamples=500)
    assert (row["a"], row["b"], row["comparisons"], row["prompts"]) == ("new", "old", 100, 100)
    assert row["win_rate"] == pytest.approx(0.65)
    # binomial s.e. about 0.046: the 95% interval is about +-0.09
    assert 0.53 < row["low"] < 0.6 < 0.7 < row["high"] < 0.77


# ------------------------------------------------------------------ the store


@pytest.fixture
def two_policies(store):
    base = store.register_model_version("policy", "base", base_model="tiny")
    new = store.register_model_version("policy", "new", base_model="tiny", parent_id=base.id)
    return base, new


def _answers(prompt_ids, versions):
    return [(pid, [(v.id, f"{v.name} answers {pid}", 4, "eos", {}) for v in versions]) for pid in prompt_ids]


def test_an_evaluation_is_refused_clearly_and_nothing_is_stored(store, two_policies):
    base, new = two_policies
    reward = store.register_model_version("reward", "rm")
    pid = store.add_prompts(["held out?"])[0]
    for args, problem in (((" ", [base.id, new.id], [pid]), "needs a name"),
                          (("e", [base.id, base.id], [pid]), "at least two versions"),
                          (("e", [base.id, reward.id], [pid]), "write no responses"),
                          (("e", [base.id, new.id], []), "at least one prompt")):
        with pytest.raises(InvalidRequest, match=problem):
            store.create_evaluation(*args)
    with pytest.raises(NotFoundError):
        store.create_evaluation("e", [base.id, 999], [pid])
    with pytest.raises(NotFoundError):
        store.create_evaluation("e", [base.id, new.id], [pid, 999])
    assert store.list_evaluations() == []
    store.create_evaluation("e", [base.id, new.id], [pid])
    with pytest.raises(InvalidRequest, match="already an evaluation named"):
        store.create_evaluation("e", [base.id, new.id], [pid])


def test_evaluation_items_are_ranked_blind_scored_and_kept_out_of_training(store, two_policies, tmp_path):
    base, new = two_policies
    ann = store.add_annotator("ann", "password-ann")
    prompt_ids = store.add_prompts([f"held-out question {i}" for i in range(6)])
    ev = store.create_evaluation("round 1 vs base", [base.id, new.id], prompt_ids)
    # a prompt outside the evaluation, or a version missing, is refused with nothing stored
    other = store.add_prompts(["not in it"])[0]
    with pytest.raises(InvalidRequest, match="not one of"):
        store.add_evaluation_items(ev.id, _answers([other], [base, new]))
    with pytest.raises(InvalidRequest, match="one response from each"):
        store.add_evaluation_items(ev.id, _answers(prompt_ids[:1], [base]))
    assert store.get_evaluation(ev.id).items == 0
    item_ids = store.add_evaluation_items(ev.id, _answers(prompt_ids, [base, new]))
    with pytest.raises(InvalidRequest, match="already has items"):
        store.add_evaluation_items(ev.id, _answers(prompt_ids[:1], [base, new]))
    assert store.evaluation_prompt_ids() == set(prompt_ids)

    # the queue serves them; the annotator prefers the new version's answer on 5 of 6 prompts
    ranked = 0
    while (item := store.next_item(ann.id)) is not None:
        assert item.item_id in item_ids and {r.model_version_id for r in item.responses} == {base.id, new.id}
        by_version = {r.model_version_id: r.id for r in item.responses}
        first = new.id if ranked < 5 else base.id
        second = base.id if first == new.id else new.id
        store.save_ranking(RankingIn(ann.id, item.prompt.id, [[by_version[first]], [by_version[second]]],
                                     display_order=item.display_order))
        ranked += 1
    assert ranked == 6 and store.get_evaluation(ev.id).rankings == 6

    results = store.evaluation_results(ev.id, seed=0)
    assert results["comparisons"] == 6 and results["prompts"] == 6
    (rate,) = results["win_rates"]
    assert (rate["a"], rate["b"]) == ("base", "new") and rate["win_rate"] == pytest.approx(1 / 6)
    assert [r["version"] for r in results["leaderboard"]] == ["new", "base"]
    assert store.evaluation_results(seed=0) == results  # all evaluations: this one only

    # exports (and so training snapshots) leave its pairs out unless asked for
    store.add_responses_bulk(base.id, [(other, [("a", 1, "eos", {}), ("b", 1, "eos", {})])])
    train_item = store.next_item(ann.id)
    store.save_ranking(RankingIn(ann.id, other, [[train_item.responses[0].id], [train_item.responses[1].id]]))
    snap = export_dataset(store, tmp_path / "pairs.jsonl")
    assert snap.counts["pairs"] == 1 and snap.counts["rankings"] == 1
    both = export_dataset(store, tmp_path / "all.jsonl", ExportOptions(include_evaluations=True))
    assert both.counts["pairs"] == 7 and both.filters["include_evaluations"] is True


# ------------------------------------------------------------------ the command lines


def test_the_command_lines_start_an_evaluation_and_print_its_results(tmp_path, tiny_model_dir, capsys):
    """`python -m pipeline evaluate` samples the versions (a real job on the tiny model) and queues
    the items; `python -m store evaluations` prints the leaderboard and writes it as JSON."""
    import json

    from pipeline.__main__ import main as pipeline_cli
    from store import Store
    from store.__main__ import main as store_cli

    db = tmp_path / "rlhf.duckdb"
    store = Store(db)
    for name in ("old", "new"):
        store.register_model_version("policy", name, base_model=str(tiny_model_dir))
    store.add_prompts([f"held-out {i}" for i in range(3)])
    store.close()
    base = ["evaluate", "--db", str(db), "--device", "cpu", "--dtype", "fp32", "--gen-max-new-tokens", "4"]
    assert pipeline_cli(base + ["--versions", "old,nope"]) == 1
    assert "no model version named nope" in capsys.readouterr().out
    assert pipeline_cli(base + ["--versions", "old,new", "--prompts", "3"]) == 0
    assert "3 items queued for ranking" in capsys.readouterr().out

    store = Store(db)
    ann = store.add_annotator("ann", "password-ann")
    while (item := store.next_item(ann.id)) is not None:  # "new" preferred every time
        new = [r.id for r in item.responses if store.get_model_version(r.model_version_id).name == "new"]
        old = [r.id for r in item.responses if r.id not in new]
        store.save_ranking(RankingIn(ann.id, item.prompt.id, [new, old]))
    store.close()
    out = tmp_path / "results.json"
    assert store_cli(["--db", str(db), "evaluations", "old vs new", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 comparisons on 3 prompts" in printed and "new over old: 100.0%" in printed
    assert [r["version"] for r in json.loads(out.read_text())["leaderboard"]] == ["new", "old"]
    assert store_cli(["--db", str(db), "evaluations", "missing"]) == 1


def test_items_imported_as_an_evaluation_compare_their_named_models(store, tmp_path):
    """`import_items(..., evaluation=NAME)`: answers of two outside models (an API, production) to
    the same prompts become a blind evaluation between them; a file that cannot be one is refused
    naming each row, and nothing of it is stored."""
    import json

    from store.errors import DataError
    from store.import_items import import_items

    def write(rows):
        path = tmp_path / f"items{len(list(tmp_path.iterdir()))}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    good = [{"prompt": f"q{i}", "responses": [{"text": f"api {i}", "model": "api"},
                                              {"text": f"prod {i}", "model": "prod"}]} for i in range(4)]
    bad = good[:1] + [{"prompt": "q9", "responses": [{"text": "x", "model": "api"}, {"text": "y"}]},
                      {"prompt": "q8", "responses": [{"text": "x", "model": "api"}, {"text": "y", "model": "other"}]},
                      {"prompt": "q7", "responses": [{"text": "x", "model": "api"}, {"text": "y", "model": "api"}]}]
    with pytest.raises(DataError) as refused:
        import_items(store, write(bad), evaluation="api vs prod")
    problems = dict(refused.value.errors)
    assert set(problems) == {2, 3, 4} and "names its model" in problems[2] and "differ from row 1" in problems[3]
    assert "one each" in problems[4]
    assert store.list_evaluations() == [] and store.counts()["items"] == 0

    result = import_items(store, write(good), evaluation="api vs prod")
    ev = store.get_evaluation(result["evaluation_id"])
    assert ev.name == "api vs prod" and ev.items == 4
    assert sorted(store.get_model_version(v).name for v in ev.version_ids) == ["api", "prod"]
    ann = store.add_annotator("ann", "password-ann")
    while (item := store.next_item(ann.id)) is not None:
        api = [r.id for r in item.responses if r.text.startswith("api")]
        store.save_ranking(RankingIn(ann.id, item.prompt.id, [api, [r.id for r in item.responses if r.id not in api]]))
    (rate,) = store.evaluation_results(ev.id)["win_rates"]
    assert (rate["a"], rate["b"], rate["win_rate"], rate["comparisons"]) == ("api", "prod", 1.0, 4)
