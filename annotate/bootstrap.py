"""First start of the app: an admin account, the bundled prompt pool, a first batch to rank.

Each step only acts when its part of the store is empty, so restarting the app changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import store as store_pkg
from store import io as store_io
from store.users import generate_password

BUNDLED_PROMPTS = Path(store_pkg.__file__).resolve().parent / "data" / "prompts.jsonl"
"""2,205 single-turn prompts from HH-RLHF (license and provenance: store/data/LICENSE.md)."""


def ensure_admin(store, *, auth: bool, local_user: str = "local", name: str = "admin") -> str | None:
    """With login: when there is no account at all, create admin `name` with a random password and
    return that password (to print once). Without login (--no-auth): make sure the local admin
    account exists. Returns None when nothing needs printing."""
    if not auth:
        store.ensure_annotator(local_user, role="admin")
        return None
    if store.list_annotators():
        return None
    password = generate_password()
    store.add_annotator(name, password, role="admin")
    return password


def ensure_prompts(store, path: Path = BUNDLED_PROMPTS) -> int:
    """Import the bundled prompt pool into an empty store; returns the number added (0 if the store
    already had prompts)."""
    if store.counts()["prompts"] > 0:
        return 0
    return store_io.import_prompts(store, path)["added"]


def first_batch(store, jobs, settings, n: int) -> int:
    """Queue a generate job for K responses to the first `n` prompts when nothing is queued yet,
    so there is something to rank within minutes of a first start (items appear chunk by chunk).
    `settings`: a LoopSettings (its model and generate parts). Returns the number of prompts."""
    from pipeline.orchestrate.steps import prompt_pool, submit_generate

    if jobs is None or n <= 0 or store.counts()["items"] > 0 or jobs.in_flight(("generate",)):
        return 0
    prompts = prompt_pool(store, jobs, limit=n)
    if not prompts:
        return 0
    submit_generate(store, jobs, prompts, settings, label="first-batch")
    return len(prompts)
