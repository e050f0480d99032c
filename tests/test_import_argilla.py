"""Import of an Argilla 2.x ranking dataset (store/argilla.py), on files Argilla 2.8.0's own code
wrote (tests/data/argilla/README.md): the UI's Hub export read by rank with who ranked, drafts,
discards and suggestions left out, agreement and quality over the imported annotators; the SDK's
exports, which drop the ranks, refused naming the record with nothing stored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from store import DataError
from store.export import load_pairs_snapshot
from store.import_items import import_items
from store.io import ExportOptions, export_dataset
from store.quality import annotator_quality_table

DATA = Path(__file__).parent / "data" / "argilla"
USERS = {u["id"]: u["username"] for u in json.loads((DATA / "users.json").read_text())}
# what alice and bob submitted in Argilla's UI (tests/data/argilla/README.md), best first, "=" a tie
SUBMITTED = {
    ("r1-both-submitted", "alice"): "2>1>3", ("r1-both-submitted", "bob"): "1>2>3",
    ("r2-both-submitted-tie", "alice"): "3>1>2", ("r2-both-submitted-tie", "bob"): "1=3>2",
    ("r3-one-discarded", "alice"): "1>3>2",  # bob's ranking was discarded
    ("r8-sdk-logged-response", "alice"): "3>1>2",
}
UNRANKED = {"r4-draft", "r5-suggestion-only", "r6-no-responses", "r7-discarded-without-values"}


def _rows() -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (DATA / "hub_ui.rows.jsonl").read_text().splitlines())}


def _expected_pairs() -> set[tuple[str, str, str, float]]:
    """(annotator, chosen text, rejected text, margin) of every submitted ranking."""
    rows, out = _rows(), set()
    for (record, user), ranking in SUBMITTED.items():
        groups = [[f"response-{x}" for x in g.split("=")] for g in ranking.split(">")]
        for i, better in enumerate(groups):
            for j in range(i + 1, len(groups)):
                out |= {(f"argilla:{_user_id(user)}", rows[record][c], rows[record][r], float(j - i))
                        for c in better for r in groups[j]}
    return out


def _user_id(name: str) -> str:
    return next(i for i, n in USERS.items() if n == name)


def _stored_pairs(store) -> set[tuple[str, str, str, float]]:
    return {(store.get_annotator(p.annotator_id).name, store.get_response(p.chosen_id).text,
             store.get_response(p.rejected_id).text, p.margin) for p in store.list_pairs()}


@pytest.mark.parametrize("form", ["hub_ui", "hub_ui/data/train-00000-of-00001.parquet", "hub_ui.rows.jsonl"])
def test_the_ui_export_comes_in_whole_with_who_ranked(store, tmp_path, form):
    """The UI's "Export to Hub": its folder, its parquet alone, or its rows as JSON Lines."""
    out = import_items(store, DATA / form, fmt="argilla")
    assert (out["items"], out["queued"], out["rankings"], out["pairs"]) == (8, 4, 6, 17)
    assert out["annotators_created"] == sorted(f"argilla:{_user_id(n)}" for n in ("alice", "bob"))
    assert _stored_pairs(store) == _expected_pairs()
    # the imported people are inactive accounts with no password: nobody signs in as them
    for name in out["annotators_created"]:
        account = store.find_annotator(name)
        assert not account.active and store.authenticate(name, "") is None
    # the records nobody submitted a ranking of are in the queue (a draft, a discard, a suggestion)
    ann = store.add_annotator("ann", "ann-password-1")
    served = set()
    while (item := store.next_item(ann.id, exclude=[i for i in served])) is not None:
        served.add(item.item_id)
    rows = _rows()
    prompts = {store.get_item(i).prompt.text for i in served}
    assert prompts == {rows[r]["prompt"] for r in UNRANKED}


def test_agreement_and_quality_count_the_imported_annotators(store):
    import_items(store, DATA / "hub_ui", fmt="argilla")
    # r1: alice 2>1>3, bob 1>2>3 agree on 2 of 3 pairs; r2: alice 3>1>2, bob 1=3>2 agree on both
    # pairs bob did not tie
    agreement = store.agreement()
    assert (agreement.items, agreement.comparisons, agreement.pairwise_agreement) == (2, 5, pytest.approx(0.8))
    table = {USERS[r["annotator"].split(":", 1)[1]]: r for r in annotator_quality_table(store)}
    assert set(table) == {"alice", "bob"}
    # the export says who ranked: an exported pair names its annotator
    rows = load_pairs_snapshot(export_dataset(store, store.path.parent / "export", ExportOptions(format="jsonl")).path)
    assert len(rows) == 17 and {r["annotator"] for r in rows} == {f"argilla:{_user_id(n)}" for n in ("alice", "bob")}


def test_a_second_import_of_the_same_people_reuses_their_accounts(store, tmp_path):
    import_items(store, DATA / "hub_ui.rows.jsonl", fmt="argilla")
    rows = [r | {"prompt": "Again: " + r["prompt"]} for r in _rows().values()]
    again = tmp_path / "second-export.jsonl"
    again.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = import_items(store, again, fmt="argilla")
    assert out["annotators_created"] == [] and out["rankings"] == 6
    assert len([a for a in store.list_annotators() if a.name.startswith("argilla:")]) == 2


@pytest.mark.parametrize("form", ["to_datasets.jsonl", "to_list_flatten.json", "hub_sdk", "to_disk"])
def test_the_sdk_exports_which_drop_the_ranks_are_refused_and_nothing_is_stored(store, form):
    with pytest.raises(DataError) as refused:
        import_items(store, DATA / form, fmt="argilla")
    message = str(refused.value)
    assert "argilla-io/argilla#5712" in message and "Export to Hub" in message
    if form != "to_disk":  # the row and the field of the first ranking without ranks
        assert "row 1: record r1-both-submitted: ranking.responses[0]: a ranking without ranks" in message
    assert store.counts()["items"] == 0 and store.list_annotators() == []


def test_a_record_whose_options_name_no_field_is_refused_naming_it(store, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(DATA / "hub_ui", folder)
    settings = json.loads((folder / ".argilla" / "settings.json").read_text())
    settings["questions"][0]["settings"]["options"][2]["value"] = "response-9"
    (folder / ".argilla" / "settings.json").write_text(json.dumps(settings))
    with pytest.raises(DataError) as refused:
        import_items(store, folder, fmt="argilla")
    row, problem = refused.value.errors[0]
    assert row == 1 and "record r1-both-submitted: the ranking's options ['response-9'] name no field" in problem
    assert store.counts()["items"] == 0
