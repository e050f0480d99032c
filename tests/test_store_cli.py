"""The file lock (a real second process) and the `python -m store` command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from store import Store, StoreLockedError
from store.__main__ import main
from tests.fixtures_store import BUNDLED_PROMPTS

ROOT = Path(__file__).resolve().parents[1]

HOLDER = """
import sys, duckdb
con = duckdb.connect(sys.argv[1])
print("holding", flush=True)
sys.stdin.read()  # hold the file until the test closes our stdin
"""


@pytest.fixture
def held_db(tmp_path):
    """A database file held open read-write by another process."""
    path = tmp_path / "held.duckdb"
    Store(path).close()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        yield path
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_locked_file_gives_a_clear_error(held_db):
    with pytest.raises(StoreLockedError) as info:
        Store(held_db)
    msg = str(info.value)
    assert str(held_db) in msg
    assert "the database is in use by another process (the app?): use the UI, or stop it" in msg


def test_cli_reports_the_lock(held_db):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "store", "--db", str(held_db), "stats"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2
    assert "the database is in use by another process" in out.stderr and str(held_db) in out.stderr


def test_users_import_export_stats(tmp_path, capsys, monkeypatch, test_data):
    db = tmp_path / "cli.duckdb"
    monkeypatch.setenv("RLHF_LOOP_DB", str(db))  # the default path, overridden
    assert main(["users", "add", "boss", "--admin"]) == 0
    out = capsys.readouterr().out
    assert "created admin 'boss'" in out
    password = out.split("password: ")[1].strip()
    assert main(["users", "add", "ann", "--password", "longenough"]) == 0
    assert main(["users", "add", "ann", "--password", "longenough"]) == 1  # duplicate name
    assert "already exists" in capsys.readouterr().err
    assert main(["users", "list"]) == 0
    listing = capsys.readouterr().out
    assert "boss" in listing and "admin" in listing and "ann" in listing

    assert main(["import-prompts", str(BUNDLED_PROMPTS)]) == 0
    assert json.loads(capsys.readouterr().out)["added"] == 2205
    assert main(["import-pairs", str(test_data / "hh_dev_pairs.jsonl")]) == 0
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": ""}\n', encoding="utf-8")
    assert main(["import-prompts", str(bad)]) == 1
    assert "row 1: 'prompt' is empty" in capsys.readouterr().err

    out_file = tmp_path / "pairs.parquet"
    assert main(["export", "--format", "parquet", "--out", str(out_file), "--test-fraction", "0.1"]) == 0
    assert "2000 pairs" in capsys.readouterr().out and out_file.is_file()
    assert main(["stats"]) == 0
    stats = capsys.readouterr().out
    assert "prompts" in stats and "4203" in stats and "agreement" in stats

    s = Store(db)
    try:
        assert s.authenticate("boss", password).role == "admin"
        assert s.authenticate("ann", "longenough").role == "annotator"
        assert s.counts()["pairs"] == 2000 and len(s.list_snapshots()) == 1
    finally:
        s.close()
