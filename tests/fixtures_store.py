"""Store fixtures: a fresh DuckDB file per test, seeded helpers."""
