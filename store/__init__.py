"""All persistence of rlhf-loop: a DuckDB file behind one `Store` class (the only place with SQL).

    from store import RankingIn, Store
    store = Store("data/rlhf.duckdb")          # creates and migrates the file
    item = store.next_item(annotator_id)        # a prompt and its K responses, leased to you
    store.save_ranking(RankingIn(annotator_id, item.prompt.id, [[r3], [r1, r2], [r4]]))

Import and export of files: store.io (import_prompts, import_pairs, export_dataset with
its ExportOptions, load_pairs_snapshot), store.import_items (items to rank; Label Studio exports). Command line: `python -m store --help`.
"""

from store.db import default_db_path
from store.errors import DataError, InvalidRequest, NotFoundError, StoreError, StoreLockedError
from store.records import (
    Agreement,
    Annotator,
    AnnotatorStats,
    Item,
    Metric,
    ModelVersion,
    Pair,
    PositionBias,
    Progress,
    Prompt,
    Ranking,
    RankingIn,
    Response,
    Round,
    Run,
    Snapshot,
)
from store.repo import Store

__all__ = [
    "Agreement", "Annotator", "AnnotatorStats", "DataError", "InvalidRequest", "Item", "Metric",
    "ModelVersion", "NotFoundError", "Pair", "PositionBias", "Progress", "Prompt", "Ranking",
    "RankingIn", "Response", "Round", "Run", "Snapshot", "Store", "StoreError", "StoreLockedError",
    "default_db_path",
]
