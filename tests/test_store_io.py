"""Import (the real bundled prompts and tests/data pairs, every accepted layout (TRL standard and
conversational, HH-RLHF transcripts), refused files store nothing)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store import DataError
from store.io import import_pairs, import_prompts, read_rows
from tests.fixtures_store import BUNDLED_PROMPTS


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_import_bundled_prompts(store):
    out = import_prompts(store, BUNDLED_PROMPTS)
    assert out["rows"] == out["added"] == 2205 and out["duplicates"] == 0
    first = store.list_prompts(limit=1)[0]
    assert first.text == json.loads((BUNDLED_PROMPTS).read_text().splitlines()[0])["prompt"]
    assert first.source.startswith("anthropics/hh-rlhf")
    assert len(store.prompts_without_responses()) == 2205
    again = import_prompts(store, BUNDLED_PROMPTS)
    assert again["added"] == 0 and again["duplicates"] == 2205


def test_import_real_hh_pairs(store, test_data):
    out = import_pairs(store, test_data / "hh_dev_pairs.jsonl")
    assert out["pairs"] == 2000 and out["prompts_added"] == 1998
    mv = store.get_model_version(out["model_version_id"])
    assert mv.kind == "policy" and mv.name.startswith("import:hh_dev_pairs.jsonl:")
    pair = store.list_pairs(limit=1)[0]
    row = json.loads((test_data / "hh_dev_pairs.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert store.get_prompt(pair.prompt_id).text == row["prompt"]
    assert store.get_response(pair.chosen_id).text == row["chosen"]  # leading space kept
    assert store.get_response(pair.rejected_id).text == row["rejected"]
    assert store.get_response(pair.chosen_id).model_version_id == mv.id
    assert pair.annotator_id is None and pair.source == "import:hh_dev_pairs.jsonl"
    assert store.counts()["items"] == 0  # imported pairs are not queued for annotation
    with pytest.raises(DataError, match="already imported"):
        import_pairs(store, test_data / "hh_dev_pairs.jsonl")
    assert store.counts()["pairs"] == 2000


def test_prompts_from_csv_parquet_and_messages(store, tmp_path):
    csv_path = tmp_path / "p.csv"
    csv_path.write_text('prompt,source\n"Hello, there",mine\n"multi\nline",\n', encoding="utf-8")
    assert import_prompts(store, csv_path)["added"] == 2
    pq.write_table(pa.table({"prompt": ["from parquet"]}), tmp_path / "p.parquet")
    assert import_prompts(store, tmp_path / "p.parquet")["added"] == 1
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert import_prompts(store, _write_jsonl(tmp_path / "m.jsonl", [{"messages": msgs}]))["added"] == 1
    by_text = {p.text: p for p in store.list_prompts()}
    assert by_text["Hello, there"].source == "mine"
    assert by_text["multi\nline"].source == "import:p.csv"
    chat = by_text["\n\nSystem: Be brief.\n\nHuman: Hi?\n\nAssistant:"]
    assert chat.messages == msgs


def test_pairs_in_trl_and_hh_transcript_layouts(store, tmp_path):
    trl = _write_jsonl(tmp_path / "trl.jsonl", [
        {"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon.", "margin": 2},
    ])
    assert import_pairs(store, trl)["pairs"] == 1
    hh = _write_jsonl(tmp_path / "hh.jsonl", [
        {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant: 4",
         "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant: 5"},
    ])
    assert import_pairs(store, hh)["pairs"] == 1
    pairs = store.list_pairs()
    assert pairs[0].margin == 2.0 and pairs[1].margin == 1.0
    hh_prompt = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant:"
    assert store.get_prompt(pairs[1].prompt_id).text == hh_prompt
    assert store.get_response(pairs[1].chosen_id).text == " 4"


def test_pairs_in_trl_conversational_layouts(store, tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Italy?"}]
    path = _write_jsonl(tmp_path / "conv.jsonl", [
        {"prompt": chat, "chosen": [{"role": "assistant", "content": "Rome."}],
         "rejected": [{"role": "assistant", "content": "Milan."}], "rank_gap": 2},
        {"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
         "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away."}]},
    ])
    assert import_pairs(store, path)["pairs"] == 2
    explicit, implicit = store.list_pairs()
    assert store.get_prompt(explicit.prompt_id).text == "\n\nSystem: Be brief.\n\nHuman: Capital of Italy?\n\nAssistant:"
    assert store.get_response(explicit.chosen_id).text == "Rome." and explicit.margin == 2.0
    assert store.get_prompt(implicit.prompt_id).text == "\n\nHuman: Hi\n\nAssistant:"
    assert store.get_response(implicit.rejected_id).text == "Go away." and implicit.margin == 1.0


BAD_PAIRS = [
    ('{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "chosen": "a"\n', 2, "not valid JSON"),
    ('{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "chosen": "a"}\n', 2, "missing 'rejected'"),
    ('{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "chosen": "  ", "rejected": "b"}\n', 2,
     "'chosen' is empty"),
    ('{"prompt": "p", "chosen": "a", "rejected": "a"}\n', 1, "identical"),
    ('{"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}\n', 1, "margin"),
    ('{"chosen": "\\n\\nHuman: x\\n\\nAssistant: a", "rejected": "\\n\\nHuman: y\\n\\nAssistant: b"}\n', 1, "differ"),
    ('{"prompt": [{"role": "user", "content": "x"}], "chosen": "a", "rejected": "b"}\n', 1, "mix text and message lists"),
    ('{"prompt": "p", "chosen": "a", "rejected": "b", "rank_gap": "big"}\n', 1, "'rank_gap' must be a number"),
    ('{"prompt": [{"role": "user", "content": "x"}], "chosen": [{"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "user", "content": "b"}]}\n', 1, "must be the assistant's"),
    ('{"prompt": [{"role": "user", "content": "x"}], "chosen": [{"role": "assistant", "content": "a"}, '
     '{"role": "assistant", "content": "c"}], "rejected": [{"role": "assistant", "content": "b"}]}\n', 1,
     "one assistant message"),
    ('{"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "b"}]}\n', 1,
     "differ before their last message"),
    ('{"prompt": [{"role": "bot", "content": "x"}], "chosen": [{"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "assistant", "content": "b"}]}\n', 1, "'prompt': messages[0].role"),
    ('[1, 2]\n', 1, "expected a JSON object"),
]


@pytest.mark.parametrize("content, row, problem", BAD_PAIRS)
def test_bad_pair_files_are_refused_whole(store, tmp_path, content, row, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as info:
        import_pairs(store, path)
    err = info.value
    assert err.path == str(path) and str(path) in str(err)
    assert any(r == row and problem in p for r, p in err.errors), err.errors
    assert f"row {row}" in str(err) and "nothing from this file was stored" in str(err)
    assert store.counts()["pairs"] == 0 and store.counts()["prompts"] == 0
    assert store.list_model_versions() == []


def test_bad_prompt_files_are_refused_whole(store, tmp_path):
    bad_utf8 = tmp_path / "u.jsonl"
    bad_utf8.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"row 2: invalid UTF-8"):
        import_prompts(store, bad_utf8)
    no_column = tmp_path / "c.csv"
    no_column.write_text("text\nhello\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"row 1: missing 'prompt'"):
        import_prompts(store, no_column)
    too_long = _write_jsonl(tmp_path / "long.jsonl", [{"prompt": "ok"}, {"prompt": "x" * 50}])
    with pytest.raises(DataError, match=r"row 2: 'prompt' has 50 characters"):
        import_prompts(store, too_long, max_chars=40)
    with pytest.raises(DataError, match="over the limit of 10 bytes"):
        import_prompts(store, too_long, max_bytes=10)
    bad_msgs = _write_jsonl(tmp_path / "msg.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}])
    with pytest.raises(DataError, match=r"row 1: messages\[0\]\.role"):
        import_prompts(store, bad_msgs)
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        import_prompts(store, not_parquet)
    (tmp_path / "x.txt").write_text("prompt\nhello\n", encoding="utf-8")
    with pytest.raises(DataError, match="unknown file type"):
        import_prompts(store, tmp_path / "x.txt")
    with pytest.raises(DataError, match="no such file"):
        import_prompts(store, tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match="no rows"):
        import_prompts(store, empty)
    assert store.counts()["prompts"] == 0


def test_many_errors_are_listed_with_rows(tmp_path):
    path = _write_jsonl(tmp_path / "many.jsonl", [{"prompt": ""} for _ in range(60)])
    with pytest.raises(DataError) as info:
        import_prompts(None, path)  # refused before the store is touched
    assert [r for r, _ in info.value.errors[:3]] == [1, 2, 3]
    assert len(info.value.errors) == 50 and info.value.more == 10
    assert "and 55 more" in str(info.value)


def test_read_rows_numbers_csv_data_rows(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("prompt\na\nb\n", encoding="utf-8")
    assert read_rows(path) == [(1, {"prompt": "a"}), (2, {"prompt": "b"})]
