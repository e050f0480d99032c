"""The SHA-256 of a pairs snapshot: one definition for the store and the trainers.

store/export.py records it with each exported snapshot, and train-reward writes it into its
config.json (`data_sha256`), so a reward model's data can be matched to the store's snapshot row.
This module imports neither torch nor the store: both sides import it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

DATA_SUFFIXES = (".arrow", ".parquet", ".jsonl")
"""Data files of a folder snapshot (a `datasets` folder's .arrow files, or a folder of pairs files)."""


def snapshot_sha256(path) -> str:
    """SHA-256 of a snapshot's data: a file's bytes; for a folder, its data files (DATA_SUFFIXES
    and a datasets folder's dataset_dict.json) in path order, each preceded by its relative path.
    State files (random fingerprints) and the manifest are left out, so the same rows exported
    twice hash the same."""
    path = Path(path)
    h = hashlib.sha256()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and (p.suffix in DATA_SUFFIXES or p.name == "dataset_dict.json"))
    else:
        files = [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def file_sha256(path) -> str:
    """SHA-256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
