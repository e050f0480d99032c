"""Store fixtures: a fresh DuckDB file per test, seeded helpers."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest

import store.values as store_values

# the real prompt pool is the app's bundled one (license: store/data/LICENSE.md): not copied twice
from annotate.bootstrap import BUNDLED_PROMPTS
from store import Store

__all__ = ["TEST_DATA", "BUNDLED_PROMPTS", "SeededItem", "seed_items", "open_copy", "store", "store_path", "test_data",
           "store_policy", "store_annotators", "StoreClock", "clock"]

# Real HH-RLHF preference pairs carried by the repository (provenance, license, content warning:
# tests/data/README.md).
TEST_DATA = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class SeededItem:
    prompt_id: int
    item_id: int
    response_ids: list[int]


def seed_items(store: Store, n_items: int = 5, k: int = 4, *, model_version_id: int | None = None,
               round_id: int | None = None, prefix: str = "prompt") -> list[SeededItem]:
    """n_items prompts, each with one item of k responses from a policy version."""
    if model_version_id is None:
        found = store.find_model_version("seed-policy")
        model_version_id = (found or store.register_model_version("policy", "seed-policy", base_model="tiny")).id
    prompt_ids = store.add_prompts([f"{prefix} {i}: say something" for i in range(n_items)], source="test")
    item_ids = store.add_responses_bulk(
        model_version_id,
        [(pid, [(f"answer {j} to {pid}", 3 + j, "eos", {"temperature": 0.7}) for j in range(k)])
         for pid in prompt_ids],
        round_id=round_id)
    out = []
    for pid, iid in zip(prompt_ids, item_ids):
        out.append(SeededItem(pid, iid, [r.id for r in store.item_responses(iid)]))
    return out


@pytest.fixture
def store_path(tmp_path) -> Path:
    return tmp_path / "db" / "rlhf.duckdb"


@pytest.fixture
def store(store_path):
    s = Store(store_path)
    yield s
    s.close()


@pytest.fixture
def store_policy(store):
    return store.register_model_version("policy", "seed-policy", base_model="tiny")


@pytest.fixture
def store_annotators(store):
    """Two annotator accounts, ann0 and ann1 (password 'password-<i>'); scrypt makes each ~0.1 s."""
    return [store.add_annotator(f"ann{i}", f"password-{i}") for i in range(2)]


class StoreClock:
    """The store's clock (store.values.utcnow, as every store module imported it), moved by hand: the
    real UTC time plus an offset that only `advance` changes. Lease expiry is then tested without
    sleeping against a deadline that a slow or busy machine could miss."""

    def __init__(self):
        self.offset = timedelta(0)
        self._real = store_values.utcnow

    def __call__(self) -> datetime:
        return self._real() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += timedelta(seconds=seconds)


@pytest.fixture
def clock(monkeypatch) -> StoreClock:
    fake = StoreClock()
    for name, module in list(sys.modules.items()):
        if (name == "store" or name.startswith("store.")) and getattr(module, "utcnow", None) is fake._real:
            monkeypatch.setattr(module, "utcnow", fake)
    return fake


@pytest.fixture
def test_data() -> Path:
    """tests/data, with hh_dev_pairs.jsonl (2,000 HH-RLHF pairs). It is part of the repository: a
    missing file is a broken checkout, so this fails rather than skips."""
    for path in (TEST_DATA / "hh_dev_pairs.jsonl", BUNDLED_PROMPTS):
        assert path.is_file(), f"{path} is missing from the checkout"
    return TEST_DATA


def open_copy(db: Path, folder: Path) -> Store:
    """An open store on a fresh copy of the closed store file `db` (fixtures that hash passwords
    once per module hand each test its own copy)."""
    import shutil

    path = Path(folder) / "rlhf.duckdb"
    path.parent.mkdir(parents=True)
    shutil.copy(db, path)
    return Store(path)
