"""Backups while the store is in use: one instant, every table; restore checks the file first and
refuses a database in use; the admin's Backup action and the command line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import duckdb
import pytest

from annotate import admin
from annotate.context import AppContext
from store import RankingIn, Store, StoreLockedError
from store.backup import BackupError, backup, check_backup, restore, store_checksums, table_checksums
from tests.fixtures_store import open_copy, seed_items
from tests.helpers import req

ROOT = Path(__file__).resolve().parents[1]
N_ANNOTATORS = 4


@pytest.fixture(scope="module")
def filled_db(tmp_path_factory) -> Path:
    """A closed store file with 4 annotators, 300 items of 3 responses and 40 rankings (made once:
    each account costs a scrypt hash)."""
    path = tmp_path_factory.mktemp("filled") / "rlhf.duckdb"
    with Store(path) as s:
        annotators = [s.add_annotator(f"ann{i}", f"password-{i}") for i in range(N_ANNOTATORS)]
        items = seed_items(s, 300, 3)
        for it in items[:40]:
            r0, r1, r2 = it.response_ids
            s.save_ranking(RankingIn(annotators[0].id, it.prompt_id, [[r1], [r0, r2]]))  # as the burst ranks: 2 pairs
    return path


@pytest.fixture
def filled(filled_db, tmp_path):
    """A copy of filled_db, open: (store, its annotators)."""
    s = open_copy(filled_db, tmp_path / "live")
    yield s, s.list_annotators()
    s.close()


def _rank_until(store, annotator, stop: threading.Event, done: list, errors: list) -> None:
    try:
        while not stop.is_set():
            item = store.next_item(annotator.id)
            if item is None:
                return
            ids = [r.id for r in item.responses]
            store.save_ranking(RankingIn(annotator.id, item.prompt.id, [[ids[1]], [ids[0], ids[2]]]))
            done.append(1)
    except Exception as exc:  # the test fails on any
        errors.append(exc)


def test_a_backup_during_a_burst_of_submissions_is_the_store_at_one_instant(filled, tmp_path):
    store, annotators = filled
    stop, done, errors = threading.Event(), [], []
    threads = [threading.Thread(target=_rank_until, args=(store, a, stop, done, errors)) for a in annotators]
    for t in threads:
        t.start()
    try:
        while len(done) < 20:  # the burst is under way
            threading.Event().wait(0.01)
        info = backup(store, tmp_path / "backups" / "b.duckdb")
        at_backup = len(done)
        while len(done) < at_backup + 20:  # and goes on after the backup
            threading.Event().wait(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    path = Path(info["path"])
    assert path.is_file() and not list(path.parent.glob(".*tmp*"))  # no temporary file left

    con = duckdb.connect(str(path), read_only=True)
    live = store._cur()
    try:
        n_rankings = info["tables"]["rankings"][0]
        total = live.execute("SELECT count(*) FROM rankings").fetchone()[0]
        assert 40 + 20 <= n_rankings < total  # taken during the burst, not before or after it
        # One instant: the backup's rankings are exactly the live ones committed before it (ids are
        # given out in commit order, under the write lock), each with all of its pairs.
        last = con.execute("SELECT max(id) FROM rankings").fetchone()[0]
        for table, where in (("rankings", "id <= ?"),
                             ("pairs", "ranking_id IN (SELECT id FROM rankings WHERE id <= ?)")):
            expect = live.execute(f"SELECT count(*), sum(hash(x)) FROM {table} x WHERE {where}", [last]).fetchone()
            assert con.execute(f"SELECT count(*), sum(hash(x)) FROM {table} x").fetchone() == expect, table
        assert con.execute("SELECT count(*) FROM rankings r WHERE (SELECT count(*) FROM pairs p "
                           "WHERE p.ranking_id = r.id) <> 2").fetchone()[0] == 0  # 3 responses, 2 groups
        # The tables the burst does not write are equal in full.
        backed = table_checksums(con)
        now = store_checksums(store)
        for table in set(now) - {"rankings", "pairs", "leases", "skips"}:
            assert backed[table] == now[table], table
    finally:
        con.close()

    # Restore into a new place: every table equal to the backup.
    target = tmp_path / "restored" / "rlhf.duckdb"
    result = restore(path, target)
    assert result["replaced"] is None
    with Store(target) as restored:
        assert store_checksums(restored) == info["tables"]
        assert restored.counts()["rankings"] == n_rankings
        # ids go on after the ones in use at the backup
        assert restored.add_prompts(["after the restore"])[0] > max(p.id for p in restored.list_prompts()[:-1])


def test_restore_checks_the_backup_and_refuses_a_database_in_use(filled, tmp_path):
    store, _ = filled
    good = Path(backup(store, tmp_path / "b.duckdb")["path"])
    with pytest.raises(StoreLockedError, match="open in this process"):
        restore(good, store.path)  # the live store is open here

    target = tmp_path / "target" / "rlhf.duckdb"
    restore(good, target)
    before = check_backup(target)
    damaged = tmp_path / "damaged.duckdb"
    data = good.read_bytes()
    damaged.write_bytes(data[: len(data) // 2])
    not_db = tmp_path / "notes.duckdb"
    not_db.write_text("hello")
    other = tmp_path / "other.duckdb"
    duckdb.connect(str(other)).execute("CREATE TABLE t (a INT)").close()
    for bad, message in ((damaged, "damaged|not a DuckDB database"), (not_db, "not a DuckDB database"),
                         (other, "not an rlhf-loop backup"), (tmp_path / "missing.duckdb", "no such file")):
        with pytest.raises(BackupError, match=message):
            restore(bad, target)
        assert check_backup(target) == before  # the target was not touched
    assert not [p.name for p in target.parent.iterdir() if p.name.startswith(".")]

    # replacing an unused database keeps the old one beside it
    result = restore(good, target)
    assert Path(result["replaced"]).is_file() and check_backup(result["replaced"]) == before


HOLDER = """
import sys
from store import Store
s = Store(sys.argv[1])
print("holding", flush=True)
sys.stdin.read()
"""


def test_cli_backup_and_restore(filled, tmp_path):
    store, _ = filled
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    expected = store_checksums(store)
    db = store.path
    store.close()  # the command line needs the file to itself

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "store", "--db", str(db), *args], capture_output=True,
                              text=True, env=env, timeout=120, cwd=ROOT)

    out = cli("backup", str(tmp_path / "cli.duckdb"))
    assert out.returncode == 0 and f"backed up {len(expected)} tables" in out.stdout, out.stderr
    assert check_backup(tmp_path / "cli.duckdb") == expected
    assert cli("backup", str(tmp_path / "cli.duckdb")).returncode == 1  # exists: refused

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "holding"
        out = cli("restore", str(tmp_path / "cli.duckdb"))
        assert out.returncode == 2 and "in use" in out.stderr and "nothing was restored" in out.stderr
    finally:
        holder.stdin.close()
        holder.wait(60)
    bad = tmp_path / "bad.duckdb"
    bad.write_text("not a database")
    out = cli("restore", str(bad))
    assert out.returncode == 1 and "not a DuckDB database" in out.stderr
    out = cli("restore", str(tmp_path / "cli.duckdb"))
    assert out.returncode == 0 and "the database it replaced is kept as" in out.stdout, out.stderr
    assert check_backup(db) == expected


def test_admin_backup_action_gives_a_downloadable_copy(filled, tmp_path):
    store, _ = filled
    store.add_annotator("boss", "boss-password", role="admin")
    ctx = AppContext(store=store, auth=True, data_dir=tmp_path / "data")
    download, summary = admin.backup(ctx, req("boss"))
    assert "40 rankings" in summary and Path(download).is_file()
    assert check_backup(download) == store_checksums(store)
    assert len(list((tmp_path / "data" / "backups").glob("rlhf-*.duckdb"))) == 1


def test_relocate_moves_every_recorded_path_under_a_folder_and_nothing_else(tmp_path):
    """A store whose runs folder moved: model versions, run directories, snapshots and the files a
    run's arguments name point to the new folder; a path outside the old folder is kept."""
    from store.backup import relocate

    old, new = tmp_path / "old", tmp_path / "moved"
    with Store(tmp_path / "s.duckdb") as store:
        version = store.register_model_version("policy", path=str(old / "runs" / "7" / "policy"))
        elsewhere = store.register_model_version("reward", path="/models/rm")
        run = store.create_run("ppo", {"args": ["--prompts", str(old / "inputs" / "p.jsonl"), "--lr", "0.1"]},
                               run_dir=str(old / "runs" / "7"))
        snap = store.record_snapshot(str(old / "inputs" / "pairs.parquet"), "parquet", {"pairs": 1}, {}, "ab")
        changed = relocate(store, old, new)
        assert changed["model_versions.path"] == 1 and changed["runs.run_dir"] == 1 and changed["runs.config"] == 1
        assert store.get_model_version(version.id).path == str(new / "runs" / "7" / "policy")
        assert store.get_model_version(elsewhere.id).path == "/models/rm"
        moved = store.get_run(run.id)
        assert moved.run_dir == str(new / "runs" / "7")
        assert moved.config["args"] == ["--prompts", str(new / "inputs" / "p.jsonl"), "--lr", "0.1"]
        assert store.get_snapshot(snap.id).path == str(new / "inputs" / "pairs.parquet")
        assert relocate(store, new, new) == {}
