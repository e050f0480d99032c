"""Export: TRL conversational and text rows, rank_gap and the opt-in margin, the rankings beside the
pairs, the dataset card, every format and layout, filters, split by prompt, snapshots."""

import json
from datetime import datetime, timedelta, timezone

import pytest

from store import InvalidRequest, RankingIn
from store.export import COLUMNS, RANKING_COLUMNS, load_pairs_snapshot, snapshot_sha256
from store.export_select import held_out_hash
from store.io import ExportOptions, export_dataset, import_pairs
from tests.fixtures_store import seed_items


@pytest.fixture
def ranked(store, store_annotators, tmp_path):
    """Round 1: 4 items of K=3. ann0 ranks all four (the last 'all bad'); ann1 ranks item 0 the
    same way and item 1 the other way. Plus one imported TRL pair."""
    rnd = store.create_round()
    items = seed_items(store, 4, 3, round_id=rnd.id)
    a, b = store_annotators
    for i, it in enumerate(items):
        store.save_ranking(RankingIn(a.id, it.prompt_id, it.response_ids, all_bad=(i == 3)))
    store.save_ranking(RankingIn(b.id, items[0].prompt_id, items[0].response_ids))
    store.save_ranking(RankingIn(b.id, items[1].prompt_id, list(reversed(items[1].response_ids))))
    trl = tmp_path / "trl.jsonl"
    trl.write_text(json.dumps({"prompt": "Q?", "chosen": "good", "rejected": "bad"}) + "\n", encoding="utf-8")
    import_pairs(store, trl)
    return rnd, items


def _jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_conversational_rows_with_ids(store, ranked, tmp_path):
    rnd, items = ranked
    snap = export_dataset(store, tmp_path / "out.jsonl", ExportOptions(format="jsonl"))
    rows = _jsonl(tmp_path / "out.jsonl")
    assert list(rows[0]) == COLUMNS and "margin" not in rows[0]
    # 6 rankings x 3 pairs, minus the all-bad ranking's 3, plus 1 imported
    assert len(rows) == snap.counts["pairs"] == 6 * 3 - 3 + 1
    first = rows[0]
    r0 = store.get_response(first["chosen_id"])
    assert first["prompt"] == [{"role": "user", "content": store.get_prompt(first["prompt_id"]).text}]
    assert first["chosen"] == [{"role": "assistant", "content": r0.text}]
    assert first["chosen_model_version"] == r0.model_version_id and first["annotator"] == "ann0"
    assert first["rank_gap"] == 1.0 and first["round"] == rnd.id and first["split"] == "train"
    assert sorted({r["rank_gap"] for r in rows}) == [1.0, 2.0]  # K=3 without ties: gaps 1 and 2
    imported = [r for r in rows if r["ranking_id"] is None]
    assert [(r["prompt"], r["chosen"], r["rejected"], r["annotator"]) for r in imported] == [
        ([{"role": "user", "content": "Q?"}], [{"role": "assistant", "content": "good"}],
         [{"role": "assistant", "content": "bad"}], None)]
    assert snap.counts["imported"] == 1 and snap.counts["annotators"] == 2 and snap.counts["rankings"] == 5


def test_chat_prompts_become_messages(store, store_annotators, store_policy, tmp_path):
    """An HH transcript becomes alternating user/assistant messages; a prompt imported as chat
    messages keeps them (system message included); replies are kept exactly (HH's leading space)."""
    hh = tmp_path / "hh.jsonl"
    hh.write_text(json.dumps({"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant: 4",
                              "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant: 5"}) + "\n")
    import_pairs(store, hh)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    (pid,) = store.add_prompts([{"messages": chat}])
    responses = store.add_responses(pid, store_policy.id, ["Red.", "Blue, I think."])
    store.save_ranking(RankingIn(store_annotators[0].id, pid, [r.id for r in responses]))
    snap = export_dataset(store, tmp_path / "c.jsonl", ExportOptions(format="jsonl"))
    rows = {r["prompt_id"]: r for r in load_pairs_snapshot(snap.path)}
    hh_row = next(r for r in rows.values() if r["ranking_id"] is None)
    assert hh_row["prompt"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                {"role": "user", "content": "2+2?"}]
    assert hh_row["chosen"] == [{"role": "assistant", "content": " 4"}]
    assert rows[pid]["prompt"] == chat and rows[pid]["rejected"] == [{"role": "assistant", "content": "Blue, I think."}]
    text_rows = {r["prompt_id"]: r for r in load_pairs_snapshot(
        export_dataset(store, tmp_path / "t.jsonl", ExportOptions(format="jsonl", trl_format="text")).path)}
    assert text_rows[pid]["prompt"] == store.get_prompt(pid).text and text_rows[pid]["chosen"] == "Red."
    assert text_rows[hh_row["prompt_id"]]["prompt"] == "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant:"


def test_the_trainer_reads_a_transcript_back_as_its_messages(test_data):
    """A chat prompt exports as its transcript in the text format (formats/chat.messages_to_text)
    and as its messages in the conversational one; train-reward reads the transcript back as
    exactly those messages (pipeline/text.to_messages), on every HH prompt of the test data and
    every bundled prompt, and with a System turn (which the trainer once read as part of the user's
    text): one reward model, the same tokens, whichever format it was exported in."""
    from formats.chat import messages_to_text
    from pipeline.text import to_messages
    from tests.fixtures_store import BUNDLED_PROMPTS

    prompts = [json.loads(line)["prompt"] for path in (test_data / "hh_dev_pairs.jsonl", BUNDLED_PROMPTS)
               for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(prompts) == 2000 + 2205 and sum(p.startswith("\n\nHuman:") for p in prompts) == 2000
    for p in prompts:
        messages = to_messages(p)
        assert to_messages(messages_to_text(messages)) == messages
    system = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}]
    assert to_messages(messages_to_text(system)) == system


def test_margin_only_when_asked(store, ranked, tmp_path):
    snap = export_dataset(store, tmp_path / "m.parquet", ExportOptions(format="parquet", margin_column=True))
    rows = load_pairs_snapshot(snap.path)
    assert list(rows[0])[:5] == ["prompt", "chosen", "rejected", "rank_gap", "margin"]
    assert all(r["margin"] == r["rank_gap"] for r in rows) and {r["margin"] for r in rows} == {1.0, 2.0}
    manifest = json.loads((tmp_path / "m.parquet.snapshot.json").read_text())
    assert manifest["columns"] == COLUMNS[:4] + ["margin"] + COLUMNS[4:]
    assert store.get_snapshot(manifest["snapshot_id"]).filters["margin_column"] is True
    with pytest.raises(InvalidRequest, match="trl_format"):
        export_dataset(store, tmp_path / "x.jsonl", ExportOptions(format="jsonl", trl_format="chatml"))


def test_rankings_beside_the_pairs(store, ranked, store_annotators, tmp_path):
    rnd, items = ranked
    a, b = store_annotators
    tied = seed_items(store, 1, 3, round_id=rnd.id, prefix="tied")[0]  # all three tied: no pair
    store.save_ranking(RankingIn(b.id, tied.prompt_id, [tied.response_ids], duration_s=4.5, comment="all the same"))
    snap = export_dataset(store, tmp_path / "out",
                          ExportOptions(format="jsonl", include_all_bad=True, test_fraction=0.4, seed=1))
    rankings = _jsonl(tmp_path / "out" / "rankings" / "rankings.jsonl")
    assert list(rankings[0]) == RANKING_COLUMNS
    stored = {k.id: k for k in store.list_rankings()}
    assert sorted(r["ranking_id"] for r in rankings) == sorted(stored) and snap.counts["rankings"] == 7
    for row in rankings:
        k = stored[row["ranking_id"]]
        assert row["order"] == k.order and row["display_order"] == k.display_order
        assert row["all_bad"] == k.all_bad and row["annotator"] == store.get_annotator(k.annotator_id).name
        assert [r["response_id"] for r in row["responses"]] == sorted(x for g in k.order for x in g)
        assert all(r["text"] == store.get_response(r["response_id"]).text
                   and r["model_version"] == store.get_response(r["response_id"]).model_version_id
                   for r in row["responses"])
    last = rankings[-1]
    assert last["order"] == [tied.response_ids] and last["duration_s"] == 4.5 and last["comment"] == "all the same"
    assert [r["all_bad"] for r in rankings].count(True) == 1
    pairs = load_pairs_snapshot(snap.path)  # the folder: train-reward reads the pairs file inside
    split_of = {r["prompt_id"]: r["split"] for r in pairs}
    assert all(split_of.get(r["prompt_id"], "train") == r["split"] for r in rankings)
    assert {r["split"] for r in rankings} == {"train", "test"}
    # the filters that concern rankings apply to them; agreement and imports concern pairs only
    only_ann1 = export_dataset(store, tmp_path / "ann1",
                               ExportOptions(format="parquet", annotators=["ann1"], min_agreement=1.0))
    assert only_ann1.counts["rankings"] == 3 and only_ann1.counts["pairs"] == 3


def test_jsonl_and_parquet_load_identical_rows_with_datasets(store, ranked, tmp_path):
    """The same snapshot as JSONL, Parquet and a datasets folder: `datasets` loads identical rows."""
    import datasets

    cache = str(tmp_path / "hf-cache")
    for trl_format in ("conversational", "text"):
        jsonl = export_dataset(store, tmp_path / f"{trl_format}.jsonl",
                               ExportOptions(format="jsonl", trl_format=trl_format, test_fraction=0.5))
        parquet = export_dataset(store, tmp_path / f"{trl_format}.parquet",
                                 ExportOptions(format="parquet", trl_format=trl_format, test_fraction=0.5))
        from_json = datasets.load_dataset("json", data_files=jsonl.path, split="train", cache_dir=cache)
        from_parquet = datasets.load_dataset("parquet", data_files=parquet.path, split="train", cache_dir=cache)
        assert from_json.to_list() == from_parquet.to_list() == load_pairs_snapshot(jsonl.path)
        assert from_json.column_names == from_parquet.column_names == COLUMNS
        for name in ("rankings",):
            j = datasets.load_dataset("json", data_files=str(tmp_path / f"{trl_format}.{name}.jsonl"),
                                      split="train", cache_dir=cache)
            p = datasets.load_dataset("parquet", data_files=str(tmp_path / f"{trl_format}.{name}.parquet"),
                                      split="train", cache_dir=cache)
            assert j.to_list() == p.to_list() and len(j) == jsonl.counts["rankings"]
        print(f"{trl_format}: {len(from_json)} pairs and {jsonl.counts['rankings']} rankings, "
              "identical rows from JSONL and Parquet")
    snap = export_dataset(store, tmp_path / "ds", ExportOptions(format="datasets", test_fraction=0.5))  # conversational
    loaded = datasets.load_from_disk(str(tmp_path / "ds"))
    assert list(loaded) == ["train", "test"] and loaded["train"].column_names == COLUMNS
    by_id = lambda rows: sorted(rows, key=lambda r: r["pair_id"])  # noqa: E731 (the splits come one after the other)
    assert by_id(load_pairs_snapshot(snap.path)) == by_id(load_pairs_snapshot(tmp_path / "conversational.jsonl"))
    assert datasets.load_from_disk(str(tmp_path / "ds" / "rankings")).to_list() == _jsonl(
        tmp_path / "conversational.rankings.jsonl")
    assert snapshot_sha256(snap.path) == snap.sha256
    manifest = json.loads((tmp_path / "ds" / "snapshot.json").read_text())
    assert manifest["snapshot_id"] == snap.id and manifest["sha256"] == snap.sha256


@pytest.mark.parametrize("fmt, out", [("jsonl", "card"), ("parquet", "pairs.parquet"), ("datasets", "card-ds")])
def test_dataset_card_and_its_load_snippet(store, ranked, tmp_path, monkeypatch, fmt, out):
    snap = export_dataset(store, tmp_path / out, ExportOptions(format=fmt, test_fraction=0.3, license="cc-by-4.0"))
    card_path = tmp_path / ("pairs.parquet.README.md" if out.endswith(".parquet") else f"{out}/README.md")
    text = card_path.read_text(encoding="utf-8")
    assert text.startswith("---\nlicense: \"cc-by-4.0\"\n") and snap.sha256 in text
    ag = store.agreement()  # every ranking with 2+ annotators is in this export
    assert f"pairwise agreement {ag.pairwise_agreement:.3f}" in text
    assert f"Krippendorff's alpha (ordinal) {ag.krippendorff_alpha:.3f}" in text
    assert "| ann0 | 3 | 9 |" in text and "| ann1 | 2 | 6 |" in text  # rankings, pairs (all-bad left out)
    assert "| 1 | seed-policy | policy | tiny |" in text and "import:trl.jsonl:" in text
    assert f"| pairs | {snap.counts['pairs']} |" in text and f"| rankings | {snap.counts['rankings']} |" in text
    # the card's snippet loads the export, run from the card's folder
    snippet = text.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(card_path.parent)
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    scope = {}
    exec(snippet, scope)
    assert len(scope["train"]) == snap.counts["train"] and len(scope["rankings"]) == snap.counts["rankings"]


def test_split_by_prompt_is_disjoint_and_recorded(store, ranked, tmp_path):
    import datasets

    snap = export_dataset(store, tmp_path / "ds", ExportOptions(format="datasets", test_fraction=0.4, seed=3))
    dd = datasets.load_from_disk(str(tmp_path / "ds"))
    train, test = dd["train"], dd["test"]
    assert set(train["prompt_id"]).isdisjoint(test["prompt_id"])
    # the prompts whose hash of (seed, prompt id) is below 0.4 (the all-bad item is left out)
    assert set(test["prompt_id"]) == {p for p in set(train["prompt_id"]) | set(test["prompt_id"])
                                      if held_out_hash(p, 3) < 0.4} and len(set(test["prompt_id"])) == 2
    assert snap.counts["train"] == len(train) and snap.counts["test"] == len(test)
    assert store.get_snapshot(snap.id).filters["test_fraction"] == 0.4
    again = export_dataset(store, tmp_path / "again.jsonl", ExportOptions(format="jsonl", test_fraction=0.4, seed=3))
    rows = load_pairs_snapshot(again.path, split="test")
    assert {r["prompt_id"] for r in rows} == set(test["prompt_id"])  # same seed, same split


def test_filters(store, ranked, tmp_path):
    rnd, items = ranked

    def n(**kw):
        out = tmp_path / f"f{len(store.list_snapshots())}.jsonl"
        return export_dataset(store, out, ExportOptions(format="jsonl", **kw)).counts["pairs"]

    assert n(include_all_bad=True) == 6 * 3 + 1
    assert n(include_imported=False) == 15
    assert n(annotators=["ann1"]) == 6
    assert n(rounds=[rnd.id]) == 15
    with pytest.raises(InvalidRequest, match="no pairs match"):
        n(rounds=rnd.id + 1)
    # item 0: both agree on every pair (1.0); item 1: they disagree on every pair (0.5 each)
    assert n(min_agreement=1.0) == 3 + 3 + 3 + 1  # item 0 by both, item 2 by ann0, imported
    now = datetime.now(timezone.utc)
    with pytest.raises(InvalidRequest, match="no pairs match"):
        n(since=now + timedelta(hours=1))
    assert n(until=now + timedelta(hours=1)) == 16
    assert n(since=(now - timedelta(days=1)).date().isoformat()) == 16
    with pytest.raises(InvalidRequest, match="no annotator"):
        n(annotators=["nobody"])
    with pytest.raises(InvalidRequest, match="min_agreement"):
        n(min_agreement=2)


def test_snapshots_are_recorded_and_outputs_protected(store, ranked, tmp_path):
    out = tmp_path / "o.parquet"
    snap = export_dataset(store, out, ExportOptions(format="parquet", annotators=["ann0"]))
    assert store.list_snapshots() == [snap]
    assert snap.filters["annotators"] == ["ann0"] and snap.format == "parquet"
    assert sorted(p.name for p in tmp_path.glob("o.*")) == [
        "o.parquet", "o.parquet.README.md", "o.parquet.snapshot.json", "o.rankings.parquet"]
    with pytest.raises(InvalidRequest, match="already exists"):
        export_dataset(store, out, ExportOptions(format="parquet"))
    again = export_dataset(store, out, ExportOptions(format="parquet", annotators=["ann0"], overwrite=True))
    assert again.sha256 == snap.sha256 and again.id != snap.id  # same data, same hash
    export_dataset(store, tmp_path / "folder", ExportOptions(format="jsonl"))
    with pytest.raises(InvalidRequest, match="already exists"):
        export_dataset(store, tmp_path / "folder", ExportOptions(format="jsonl"))
    with pytest.raises(InvalidRequest, match="format"):
        export_dataset(store, tmp_path / "x.csv", ExportOptions(format="csv"))
    with pytest.raises(InvalidRequest, match="license"):
        export_dataset(store, tmp_path / "y.jsonl", ExportOptions(format="jsonl", license="two\nlines"))
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary leftovers
    assert not (tmp_path / "y.jsonl").exists() and not (tmp_path / "y.rankings.jsonl").exists()
    # the reward model names its data
    rm = store.register_model_version("reward", snapshot_id=snap.id)
    assert store.get_model_version(rm.id).snapshot_id == snap.id


@pytest.fixture
def measured_from_one(monkeypatch):
    """Quality measured from a single comparison: the tests of what min_quality and the weights do
    with a measure, on the small `ranked` store (test_loop_hardening.py tests the minimum)."""
    monkeypatch.setattr("store.quality.MIN_COMPARISONS", 1)


def test_annotator_quality_excludes_and_weights(store, ranked, store_annotators, tmp_path, measured_from_one):
    """ann0 ranks gold item 1 as its reference, ann1 reverses it: gold accuracy 1 and 0."""
    _, items = ranked
    store.set_gold(items[1].item_id, [[r] for r in items[1].response_ids])
    # no quality option: no weight column, nothing recorded
    plain = export_dataset(store, tmp_path / "plain.jsonl", ExportOptions(format="jsonl"))
    assert "weight" not in _jsonl(tmp_path / "plain.jsonl")[0] and "min_quality" not in plain.filters

    kept = export_dataset(store, tmp_path / "kept.jsonl", ExportOptions(format="jsonl", min_quality=0.5))
    card = (tmp_path / "kept.jsonl.README.md").read_text()
    assert "weight (not applied)" in card and "| ann1 | 0.000 | gold | 1 | 3 | 0.050 | yes |" in card
    rows = _jsonl(tmp_path / "kept.jsonl")
    assert {r["annotator"] for r in rows} == {"ann0", None} and len(rows) == 9 + 1  # ann0's 3 items + imported
    assert {r["annotator"] for r in _jsonl(tmp_path / "kept.rankings.jsonl")} == {"ann0"}
    assert kept.filters["min_quality"] == 0.5 and kept.filters["excluded_annotators"] == ["ann1"]
    everyone = export_dataset(store, tmp_path / "everyone.jsonl", ExportOptions(format="jsonl", min_quality=0.0))
    assert everyone.counts["pairs"] == 16 and everyone.filters["excluded_annotators"] == []

    out = tmp_path / "weighted"
    snap = export_dataset(store, out, ExportOptions(format="jsonl", quality_weights=True))
    by_annotator = {(r["annotator"], r["weight"]) for r in _jsonl(out / "pairs.jsonl")}
    assert by_annotator == {("ann0", 1.0), ("ann1", 0.05), (None, 1.0)}  # 2q - 1 clipped; imported 1
    assert snap.filters["quality_weights"] is True and "min_quality" not in snap.filters
    manifest = json.loads((out / "snapshot.json").read_text())
    assert manifest["columns"][:5] == ["prompt", "chosen", "rejected", "rank_gap", "weight"]
    assert [(q["annotator"], q["quality"], q["measured_by"], q["weight"], q["excluded"])
            for q in manifest["annotator_quality"]] == [("ann0", 1.0, "gold", 1.0, False),
                                                        ("ann1", 0.0, "gold", 0.05, False)]
    card = (out / "README.md").read_text()
    assert "## Annotator quality" in card and "| ann1 | 0.000 | gold | 1 | 3 | 0.050 | no |" in card
    assert "`weight` is the pair's annotator's quality weight" in card
    both = export_dataset(store, tmp_path / "both.parquet", ExportOptions(format="parquet", margin_column=True,
                                                                          quality_weights=True, min_quality=0.5))
    assert {r["weight"] for r in load_pairs_snapshot(both.path)} == {1.0}
    assert json.loads((tmp_path / "both.parquet.snapshot.json").read_text())["columns"][3:6] == [
        "rank_gap", "margin", "weight"]
    with pytest.raises(InvalidRequest, match="min_quality"):
        export_dataset(store, tmp_path / "bad.jsonl", ExportOptions(format="jsonl", min_quality=1.5))


def test_annotator_quality_falls_back_to_majority_agreement(store, ranked, tmp_path, measured_from_one):
    from store.quality import annotator_quality_table, quality_weight

    # no gold: ann0 and ann1 agree on item 0 and disagree on item 1, so each agrees with the
    # (other's) majority on 3 of 6 pairs: chance, weight at the floor
    table = annotator_quality_table(store, min_quality=0.6)
    assert [(q["annotator"], q["quality"], q["measured_by"], q["weight"], q["excluded"]) for q in table] == [
        ("ann0", 0.5, "majority", 0.05, True), ("ann1", 0.5, "majority", 0.05, True)]
    assert (quality_weight(None), quality_weight(0.8), quality_weight(0.2)) == (1.0, pytest.approx(0.6), 0.05)
    snap = export_dataset(store, tmp_path / "x.jsonl", ExportOptions(format="jsonl", min_quality=0.6))
    assert snap.counts["pairs"] == 1 and snap.filters["excluded_annotators"] == ["ann0", "ann1"]  # imported


def test_cli_quality_options(store, store_path, ranked, tmp_path, monkeypatch, capsys, measured_from_one):
    from store.__main__ import main

    _, items = ranked
    store.set_gold(items[1].item_id, [[r] for r in items[1].response_ids])  # ann1 reversed it: quality 0
    store.close()
    monkeypatch.setenv("RLHF_LOOP_DB", str(store_path))
    out = tmp_path / "cli.jsonl"
    assert main(["export", "--out", str(out), "--min-quality", "0.5", "--quality-weights"]) == 0
    assert "left out (quality below 0.5): ann1" in capsys.readouterr().out
    assert {(r["annotator"], r["weight"]) for r in _jsonl(out)} == {("ann0", 1.0), (None, 1.0)}
    assert main(["export", "--out", str(tmp_path / "bad.jsonl"), "--min-quality", "2"]) == 1
    assert "min_quality must be between 0 and 1" in capsys.readouterr().err
