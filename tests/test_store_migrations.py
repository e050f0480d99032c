"""Migrations: a blank database gets the whole schema; reopening applies nothing; failures roll back."""

import duckdb
import pytest

from store import RankingIn, Store
from store.migrations import MIGRATIONS, MigrationError, applied_migrations, migrate
from tests.fixtures_store import seed_items

TABLES = {"settings", "rounds", "prompts", "model_versions", "items", "responses", "annotators",
          "rankings", "pairs", "leases", "skips", "flags", "runs", "metrics", "snapshots",
          "schema_migrations"}


def _tables(con) -> set[str]:
    return {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}


def test_blank_database_is_migrated(tmp_path):
    con = duckdb.connect(str(tmp_path / "blank.duckdb"))
    applied = migrate(con)
    assert applied == [name for name, _ in MIGRATIONS]
    assert TABLES <= _tables(con)
    assert applied_migrations(con) == applied
    assert migrate(con) == []  # idempotent
    con.close()


def test_store_creates_file_and_reopens_without_migrating(tmp_path):
    path = tmp_path / "sub" / "dir" / "rlhf.duckdb"
    s = Store(path)
    assert path.exists()
    assert s.migrations_applied == [name for name, _ in MIGRATIONS]
    s.add_prompts(["kept across reopen"])
    s.close()
    s = Store(path)
    assert s.migrations_applied == []
    assert [p.text for p in s.list_prompts()] == ["kept across reopen"]
    s.close()


def test_failed_migration_leaves_database_unchanged(tmp_path):
    con = duckdb.connect(str(tmp_path / "x.duckdb"))
    migrate(con)
    broken = MIGRATIONS + [("0999_broken", "CREATE TABLE half_done (a INT); SELECT * FROM no_such_table;")]
    with pytest.raises(MigrationError, match="0999_broken"):
        migrate(con, broken)
    assert "half_done" not in _tables(con)
    assert "0999_broken" not in applied_migrations(con)
    con.close()


def test_database_from_a_newer_version_is_refused(tmp_path):
    con = duckdb.connect(str(tmp_path / "x.duckdb"))
    migrate(con, MIGRATIONS + [("0999_future", "CREATE TABLE future (a INT);")])
    with pytest.raises(MigrationError, match="0999_future"):
        migrate(con)
    con.close()


def test_a_store_made_before_external_versions_and_strength_keeps_its_rows(tmp_path):
    """0004 rebuilds model_versions (DuckDB cannot change a CHECK in place): an older store's
    versions, with their ids and the responses naming them, come through, and 'external' is allowed."""
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    migrate(con, MIGRATIONS[:3])
    con.execute("INSERT INTO model_versions (id, kind, name, meta, created_at) VALUES "
                "(nextval('model_versions_id_seq'), 'policy', 'old-policy', '{\"lr\": 1}', now()), "
                "(nextval('model_versions_id_seq'), 'reward', 'old-rm', '{}', now())")
    con.execute("INSERT INTO rankings VALUES (1, 1, 1, 1, [[1], [2]], [1, 2], false, 2.0, NULL, 'ok', now())")
    with pytest.raises(duckdb.ConstraintException):
        con.execute("INSERT INTO model_versions (id, kind, name, meta, created_at) "
                    "VALUES (99, 'external', 'x', '{}', now())")
    con.close()
    s = Store(path)
    assert s.migrations_applied == [name for name, _ in MIGRATIONS[3:]]
    old = {mv.name: mv for mv in s.list_model_versions()}
    assert (old["old-policy"].id, old["old-policy"].kind, old["old-policy"].meta) == (1, "policy", {"lr": 1})
    assert old["old-rm"].kind == "reward"
    (ranking,) = s.list_rankings()
    assert (ranking.order, ranking.comment, ranking.strength) == ([[1], [2]], "ok", None)  # 0005: no strength
    ext = s.register_model_version("external", "api-model")
    assert ext.id == 3 and ext.kind == "external"  # the sequence carried on
    with pytest.raises(Exception, match="already exists"):
        s.register_model_version("external", "old-policy")  # names stay unique
    s.close()


def test_a_store_from_before_the_agreement_table_reports_its_agreement(tmp_path):
    """0008 adds agreement_items empty: the first read fills it from the rankings already stored."""
    path = tmp_path / "old.duckdb"
    s = Store(path)
    (item,) = seed_items(s, 1, 3)
    a, b = (s.add_annotator(f"old{i}", f"password-{i}").id for i in range(2))
    x1, x2, x3 = item.response_ids
    s.save_ranking(RankingIn(a, item.prompt_id, [x1, x2, x3]))
    s.save_ranking(RankingIn(b, item.prompt_id, [x2, x1, x3]))
    s.close()
    con = duckdb.connect(str(path))  # as a store of the previous version left it
    con.execute("DROP TABLE agreement_items")
    con.execute("DELETE FROM schema_migrations WHERE name = '0008_agreement_items'")
    con.close()
    s = Store(path)
    assert s.migrations_applied == ["0008_agreement_items"]
    ag = s.agreement()
    assert (ag.items, ag.comparisons, ag.pairwise_agreement) == (1, 3, pytest.approx(2 / 3))
    assert s.refresh_agreement() == 0
    s.close()


def test_duckdb_memory_is_bounded_by_default_and_set_by_the_environment(tmp_path, monkeypatch):
    """store/db.py DEFAULT_MEMORY_LIMIT (DuckDB's own default is 80% of the machine), or
    $RLHF_LOOP_DB_MEMORY, or the Store's argument."""
    def limit(**kw):
        s = Store(tmp_path / f"mem{len(list(tmp_path.iterdir()))}.duckdb", **kw)
        try:
            return s.cursor().execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
        finally:
            s.close()

    monkeypatch.delenv("RLHF_LOOP_DB_MEMORY", raising=False)
    quarter = duckdb.connect(config={"memory_limit": "25%"})
    assert limit() == quarter.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]  # of the machine
    quarter.close()
    monkeypatch.setenv("RLHF_LOOP_DB_MEMORY", "3GB")
    assert limit() == "2.7 GiB"
    assert limit(memory_limit="1GB") == "953.6 MiB"
