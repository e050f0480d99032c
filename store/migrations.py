"""Schema migrations: ordered, named, append-only.

`MIGRATIONS` is a list of (name, sql). `migrate(con)` applies, in order, every migration whose
name is not yet in the `schema_migrations` table, each in its own transaction together with the
row that records it, so a failed migration leaves the database as it was. Never edit or reorder
a migration that has shipped: add a new one at the end.

Design notes on the schema (DuckDB):
- No FOREIGN KEY constraints: DuckDB refuses to delete a referenced row and re-use it in one
  transaction and to update tables that are referenced (see DuckDB's "foreign key limitations").
  The Store checks references inside its write transactions instead.
- Ids come from one sequence per table, so bulk inserts can reserve ids up front.
- Besides primary keys, one ART index: responses(item_id), for the item shown to an annotator
  (DuckDB scans the rest fast enough; each index slows bulk inserts).
- JSON columns hold dicts/lists as JSON text. Timestamps are TIMESTAMP in UTC.
- A response belongs to an *item* (one generation call: one prompt, one model version, K
  responses; or one imported row, whose responses may each name their own version). Items are
  what annotators rank; imported pairs are items that are not queued.
"""

from __future__ import annotations

from datetime import datetime, timezone

MIGRATIONS: list[tuple[str, str]] = [
    (
        "0001_initial",
        """
        CREATE SEQUENCE rounds_id_seq START 1;
        CREATE SEQUENCE prompts_id_seq START 1;
        CREATE SEQUENCE model_versions_id_seq START 1;
        CREATE SEQUENCE items_id_seq START 1;
        CREATE SEQUENCE responses_id_seq START 1;
        CREATE SEQUENCE annotators_id_seq START 1;
        CREATE SEQUENCE rankings_id_seq START 1;
        CREATE SEQUENCE pairs_id_seq START 1;
        CREATE SEQUENCE runs_id_seq START 1;
        CREATE SEQUENCE snapshots_id_seq START 1;

        CREATE TABLE settings (
            key VARCHAR PRIMARY KEY,
            value JSON NOT NULL,
            updated_at TIMESTAMP NOT NULL
        );
        CREATE TABLE rounds (
            id BIGINT PRIMARY KEY,
            status VARCHAR NOT NULL,
            policy_version_id BIGINT,
            reward_version_id BIGINT,
            new_policy_version_id BIGINT,
            snapshot_id BIGINT,
            config JSON NOT NULL,
            meta JSON NOT NULL,
            created_at TIMESTAMP NOT NULL,
            finished_at TIMESTAMP
        );
        CREATE TABLE prompts (
            id BIGINT PRIMARY KEY,
            text VARCHAR NOT NULL,
            messages JSON,
            source VARCHAR NOT NULL,
            round_id BIGINT,
            created_at TIMESTAMP NOT NULL
        );
        CREATE TABLE model_versions (
            id BIGINT PRIMARY KEY,
            kind VARCHAR NOT NULL CHECK (kind IN ('policy', 'reward', 'critic')),
            name VARCHAR NOT NULL UNIQUE,
            parent_id BIGINT,
            path VARCHAR,
            base_model VARCHAR,
            run_id BIGINT,
            snapshot_id BIGINT,
            reward_version_id BIGINT,
            meta JSON NOT NULL,
            created_at TIMESTAMP NOT NULL
        );
        CREATE TABLE items (
            id BIGINT PRIMARY KEY,
            prompt_id BIGINT NOT NULL,
            model_version_id BIGINT NOT NULL,
            round_id BIGINT,
            n_responses INTEGER NOT NULL,
            queued BOOLEAN NOT NULL,
            created_at TIMESTAMP NOT NULL
        );
        CREATE TABLE responses (
            id BIGINT PRIMARY KEY,
            item_id BIGINT NOT NULL,
            prompt_id BIGINT NOT NULL,
            model_version_id BIGINT NOT NULL,
            text VARCHAR NOT NULL,
            token_count INTEGER,
            finish_reason VARCHAR,
            sampling JSON NOT NULL,
            created_at TIMESTAMP NOT NULL
        );
        CREATE INDEX responses_item_idx ON responses (item_id);
        CREATE TABLE annotators (
            id BIGINT PRIMARY KEY,
            name VARCHAR NOT NULL UNIQUE,
            role VARCHAR NOT NULL CHECK (role IN ('annotator', 'admin')),
            password_hash VARCHAR NOT NULL,
            created_at TIMESTAMP NOT NULL
        );
        CREATE TABLE rankings (
            id BIGINT PRIMARY KEY,
            item_id BIGINT NOT NULL,
            prompt_id BIGINT NOT NULL,
            annotator_id BIGINT NOT NULL,
            order_groups BIGINT[][] NOT NULL,
            display_order BIGINT[] NOT NULL,
            all_bad BOOLEAN NOT NULL,
            duration_s DOUBLE,
            client_token VARCHAR,
            comment VARCHAR NOT NULL,
            created_at TIMESTAMP NOT NULL
        );
        CREATE TABLE pairs (
            id BIGINT PRIMARY KEY,
            prompt_id BIGINT NOT NULL,
            item_id BIGINT NOT NULL,
            chosen_id BIGINT NOT NULL,
            rejected_id BIGINT NOT NULL,
            margin DOUBLE NOT NULL,
            ranking_id BIGINT,
            annotator_id BIGINT,
            all_bad BOOLEAN NOT NULL,
            source VARCHAR NOT NULL,
            created_at TIMESTAMP NOT NULL
        );
        CREATE TABLE leases (
            item_id BIGINT NOT NULL,
            annotator_id BIGINT NOT NULL,
            expires_at TIMESTAMP NOT NULL,
            PRIMARY KEY (item_id, annotator_id)
        );
        CREATE TABLE skips (
            annotator_id BIGINT NOT NULL,
            item_id BIGINT NOT NULL,
            created_at TIMESTAMP NOT NULL,
            PRIMARY KEY (annotator_id, item_id)
        );
        CREATE TABLE flags (
            prompt_id BIGINT NOT NULL,
            annotator_id BIGINT,
            reason VARCHAR NOT NULL,
            created_at TIMESTAMP NOT NULL
        );
        CREATE TABLE runs (
            id BIGINT PRIMARY KEY,
            kind VARCHAR NOT NULL,
            status VARCHAR NOT NULL
                CHECK (status IN ('queued', 'running', 'done', 'failed', 'cancelled')),
            config JSON NOT NULL,
            run_dir VARCHAR,
            inputs JSON NOT NULL,
            outputs JSON NOT NULL,
            error VARCHAR,
            created_at TIMESTAMP NOT NULL,
            started_at TIMESTAMP,
            finished_at TIMESTAMP
        );
        CREATE TABLE metrics (
            run_id BIGINT NOT NULL,
            step BIGINT NOT NULL,
            key VARCHAR NOT NULL,
            value DOUBLE,
            PRIMARY KEY (run_id, step, key)
        );
        CREATE TABLE snapshots (
            id BIGINT PRIMARY KEY,
            path VARCHAR NOT NULL,
            format VARCHAR NOT NULL,
            counts JSON NOT NULL,
            filters JSON NOT NULL,
            sha256 VARCHAR NOT NULL,
            created_at TIMESTAMP NOT NULL
        );
        """,
    ),
    (
        # Accounts an admin can switch off without deleting their rankings, and the time of each
        # account's last sign-in (shown in the Users table).
        "0002_account_state",
        """
        ALTER TABLE annotators ADD COLUMN active BOOLEAN NOT NULL DEFAULT TRUE;
        ALTER TABLE annotators ADD COLUMN last_login_at TIMESTAMP;
        """,
    ),
    (
        # Running a team: a round's own overlap and queue priority (NULL = the store's default
        # overlap; the newest round first), and gold items: a reference ranking per item, from an
        # annotator's ranking an admin chose (ranking_id, annotator_id) or from an imported file.
        "0003_round_queue_and_gold",
        """
        CREATE TABLE round_queue (
            round_id BIGINT PRIMARY KEY,
            overlap INTEGER,
            priority INTEGER,
            updated_at TIMESTAMP NOT NULL
        );
        CREATE TABLE gold (
            item_id BIGINT PRIMARY KEY,
            order_groups BIGINT[][] NOT NULL,
            ranking_id BIGINT,
            annotator_id BIGINT,
            source VARCHAR NOT NULL,
            created_at TIMESTAMP NOT NULL
        );
        """,
    ),
    (
        # Imported items to rank: a response's model may be one this store never ran (an API, a
        # production model, another team's), recorded as a model version of kind 'external'.
        # DuckDB cannot change a CHECK constraint in place, so the table is rebuilt with its rows.
        "0004_external_model_versions",
        """
        CREATE TABLE model_versions_new (
            id BIGINT PRIMARY KEY,
            kind VARCHAR NOT NULL CHECK (kind IN ('policy', 'reward', 'critic', 'external')),
            name VARCHAR NOT NULL UNIQUE,
            parent_id BIGINT,
            path VARCHAR,
            base_model VARCHAR,
            run_id BIGINT,
            snapshot_id BIGINT,
            reward_version_id BIGINT,
            meta JSON NOT NULL,
            created_at TIMESTAMP NOT NULL
        );
        INSERT INTO model_versions_new SELECT * FROM model_versions;
        DROP TABLE model_versions;
        ALTER TABLE model_versions_new RENAME TO model_versions;
        """,
    ),
    (
        # How much better the best response is than the second (records.STRENGTHS), when the
        # annotator said so; NULL for every ranking made before.
        "0005_ranking_strength",
        """
        ALTER TABLE rankings ADD COLUMN strength VARCHAR;
        """,
    ),
    (
        # Blind evaluation rounds (store/evaluations.py): versions compared on held-out prompts by
        # people; an item of one is marked with its id, which keeps its pairs out of training.
        "0006_evaluations",
        """
        CREATE SEQUENCE evaluations_id_seq START 1;
        CREATE TABLE evaluations (
            id BIGINT PRIMARY KEY,
            name VARCHAR NOT NULL UNIQUE,
            version_ids BIGINT[] NOT NULL,
            prompt_ids BIGINT[] NOT NULL,
            run_id BIGINT,
            created_at TIMESTAMP NOT NULL
        );
        ALTER TABLE items ADD COLUMN evaluation_id BIGINT;
        """,
    ),
    (
        # Sign-in sessions (SHA-256 of the token) and failed sign-ins, so that a restart of the app
        # signs no one out and forgets no lock (store/sessions.py, annotate/accounts.py).
        "0007_sessions",
        """
        CREATE TABLE sessions (
            token_sha256 VARCHAR PRIMARY KEY,
            name VARCHAR NOT NULL,
            issued_at DOUBLE NOT NULL
        );
        CREATE TABLE login_failures (
            key VARCHAR PRIMARY KEY,
            failures INTEGER NOT NULL,
            last_at DOUBLE NOT NULL
        );
        """,
    ),
    (
        # Each item's share of the agreement figures, kept up to date from the rankings when read
        # (store/agreement_table.py), so that the Team tab does not recompute every ranking.
        "0008_agreement_items",
        """
        CREATE TABLE agreement_items (
            item_id BIGINT NOT NULL,
            n_rankings BIGINT NOT NULL,
            last_ranking_id BIGINT NOT NULL,
            annotators INTEGER NOT NULL,
            agree BIGINT NOT NULL,
            comparisons BIGINT NOT NULL,
            tau_sum DOUBLE NOT NULL,
            tau_n BIGINT NOT NULL,
            per_annotator STRUCT(annotator_id BIGINT, ranking_id BIGINT, pairwise_agree BIGINT,
                                 pairwise_n BIGINT, majority_agree BIGINT, majority_n BIGINT)[] NOT NULL,
            coincidence STRUCT(c DOUBLE, k DOUBLE, w DOUBLE)[] NOT NULL
        );
        """,
    ),
    (
        # Conversations (store/conversations.py): an annotator chats with the policy and ranks its
        # replies turn by turn; each turn is an ordinary item (its prompt the conversation so far)
        # marked with its conversation and turn number. Items from before: NULL.
        "0009_conversations",
        """
        CREATE SEQUENCE conversations_id_seq START 1;
        CREATE TABLE conversations (
            id BIGINT PRIMARY KEY,
            annotator_id BIGINT NOT NULL,
            status VARCHAR NOT NULL CHECK (status IN ('open', 'ended', 'flagged')),
            reason VARCHAR NOT NULL,
            created_at TIMESTAMP NOT NULL,
            ended_at TIMESTAMP
        );
        ALTER TABLE items ADD COLUMN conversation_id BIGINT;
        ALTER TABLE items ADD COLUMN turn INTEGER;
        """,
    ),
]


class MigrationError(RuntimeError):
    """The database cannot be brought to this code's schema."""


def applied_migrations(con) -> list[str]:
    """Names recorded in schema_migrations, in the order they were applied."""
    con.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations "
        "(name VARCHAR PRIMARY KEY, applied_at TIMESTAMP NOT NULL)"
    )
    rows = con.execute("SELECT name FROM schema_migrations ORDER BY applied_at, name").fetchall()
    return [r[0] for r in rows]


def migrate(con, migrations: list[tuple[str, str]] | None = None) -> list[str]:
    """Apply the missing migrations in order; return the names applied now.

    Refuses a database that holds a migration this code does not know (it was written by a newer
    version), rather than guessing at its schema.
    """
    migrations = MIGRATIONS if migrations is None else migrations
    names = [name for name, _ in migrations]
    if len(set(names)) != len(names):
        raise MigrationError(f"duplicate migration names in {names}")
    done = applied_migrations(con)
    unknown = [n for n in done if n not in names]
    if unknown:
        raise MigrationError(
            f"the database has migrations this version does not know: {unknown} "
            "(it was created by a newer rlhf-loop; upgrade the code)"
        )
    applied = []
    for name, sql in migrations:
        if name in done:
            continue
        con.execute("BEGIN TRANSACTION")
        try:
            con.execute(sql)
            now = datetime.now(timezone.utc).replace(tzinfo=None)
            con.execute("INSERT INTO schema_migrations VALUES (?, ?)", [name, now])
            con.execute("COMMIT")
        except Exception as exc:
            con.execute("ROLLBACK")
            raise MigrationError(f"migration {name} failed: {exc}") from exc
        applied.append(name)
    return applied
