"""Blind evaluation rounds: people rank two or more model versions' answers to held-out prompts.

An admin picks versions (policies of this store, or external models whose answers were imported)
and a number of held-out prompts (pipeline/orchestrate/steps.py `held_out_prompts`: never ranked,
never in a PPO prompt file); `create_evaluation` records them, a sample-versions job
(pipeline/sample_versions.py) writes one response per version per prompt with the same seed, and
`add_evaluation_items` (store/repo.py, which writes every item) stores one item per prompt holding
those responses. The items enter the ordinary queue: each annotator sees their own shuffle of the
responses (store/queue_rules.py) and never a model's name (the annotation view shows none), and
ranks them like any other item.

Answers written elsewhere (an API, a production model) can be an evaluation too: a file of items
whose rows each hold one response from the same named models, imported with
`import_items(..., evaluation=NAME)` (`python -m store import-items FILE --evaluation NAME`).

Their rankings are the results (`evaluation_results`): each pair of versions' win rate and a
Bradley-Terry leaderboard of every version compared, with bootstrap intervals over prompts
(store/leaderboard.py), for one evaluation or all of them. They are not training data: exports,
and so every training snapshot, leave the pairs of evaluation items out unless asked
(store/export.py `include_evaluations`).
"""

from __future__ import annotations

from itertools import combinations

from store.values import from_db_time, utcnow
from store.errors import InvalidRequest, NotFoundError
from store.leaderboard import Comparison, leaderboard, win_rates
from store.pairs import group_index
from store.records import Evaluation

EVALUATED_KINDS = ("policy", "external")
"""Versions that write responses, and so can be evaluated."""
_COLS = "e.id, e.name, e.version_ids, e.prompt_ids, e.run_id, e.created_at"
_COUNTS = ("(SELECT count(*) FROM items i WHERE i.evaluation_id = e.id), "
           "(SELECT count(*) FROM rankings k JOIN items i ON i.id = k.item_id WHERE i.evaluation_id = e.id)")


def _evaluation(row) -> Evaluation:
    return Evaluation(id=row[0], name=row[1], version_ids=list(row[2]), prompt_ids=list(row[3]), run_id=row[4],
                      created_at=from_db_time(row[5]), items=row[6], rankings=row[7])


def new_evaluation(cur, name: str, versions: list[int], prompts: list[int]) -> int:
    """Inside a transaction: check and insert an evaluation (create_evaluation; an import of
    items as one, store/repo.py import_item_rows); returns its id."""
    name = (name or "").strip()
    if not name:
        raise InvalidRequest("an evaluation needs a name")
    if cur.execute("SELECT 1 FROM evaluations WHERE name = ?", [name]).fetchone():
        raise InvalidRequest(f"there is already an evaluation named {name!r}")
    kinds = dict(cur.execute("SELECT id, kind FROM model_versions WHERE id IN (SELECT unnest(?))",
                             [versions]).fetchall())
    missing = [v for v in versions if v not in kinds]
    if missing:
        raise NotFoundError(f"no model version with id {missing}")
    wrong = [v for v in versions if kinds[v] not in EVALUATED_KINDS]
    if wrong:
        raise InvalidRequest(f"versions {wrong} are {sorted({kinds[v] for v in wrong})} models, which write "
                             "no responses: evaluate policies or imported models")
    found = cur.execute("SELECT count(*) FROM prompts WHERE id IN (SELECT unnest(?))", [prompts]).fetchone()[0]
    if found != len(prompts):
        raise NotFoundError(f"{len(prompts) - found} of the evaluation's prompts are not in the store")
    eid = cur.execute("SELECT nextval('evaluations_id_seq')").fetchone()[0]
    cur.execute("INSERT INTO evaluations VALUES (?, ?, ?, ?, NULL, ?)", [eid, name, versions, prompts, utcnow()])
    return eid


class EvaluationsMixin:
    """Blind-evaluation methods of Store (the core they use is store/db.py's; the items are added by
    store/repo.py `add_evaluation_items`)."""

    def create_evaluation(self, name: str, version_ids, prompt_ids) -> Evaluation:
        """Record an evaluation of these versions (at least two, each a policy or an external
        model) on these prompts; its responses come later (add_evaluation_items)."""
        versions = list(dict.fromkeys(int(v) for v in version_ids))
        if len(versions) < 2:
            raise InvalidRequest(f"an evaluation compares at least two versions, not {len(versions)}")
        prompts = list(dict.fromkeys(int(p) for p in prompt_ids))
        if not prompts:
            raise InvalidRequest("an evaluation needs at least one prompt")
        with self._tx() as cur:
            eid = new_evaluation(cur, name, versions, prompts)
        return self.get_evaluation(eid)

    def set_evaluation_run(self, evaluation_id: int, run_id: int) -> None:
        """The job that writes the evaluation's responses."""
        with self._tx() as cur:
            self._need(cur.execute("SELECT 1 FROM evaluations WHERE id = ?", [evaluation_id]).fetchone(),
                       f"evaluation with id {evaluation_id}")
            cur.execute("UPDATE evaluations SET run_id = ? WHERE id = ?", [run_id, evaluation_id])

    def get_evaluation(self, evaluation_id: int) -> Evaluation:
        row = self._one(f"SELECT {_COLS}, {_COUNTS} FROM evaluations e WHERE e.id = ?", [evaluation_id])
        if row is None:
            raise NotFoundError(f"no evaluation with id {evaluation_id}")
        return _evaluation(row)

    def find_evaluation(self, name: str) -> Evaluation | None:
        row = self._one(f"SELECT {_COLS}, {_COUNTS} FROM evaluations e WHERE e.name = ?", [name])
        return None if row is None else _evaluation(row)

    def list_evaluations(self) -> list[Evaluation]:
        """Every evaluation, newest first, with its items and rankings so far."""
        return [_evaluation(r) for r in self._rows(f"SELECT {_COLS}, {_COUNTS} FROM evaluations e ORDER BY e.id DESC")]

    def evaluation_prompt_ids(self) -> set[int]:
        """The prompts of every evaluation: no training job may use them (pipeline/orchestrate/steps.py)."""
        return {int(p) for (ids,) in self._rows("SELECT prompt_ids FROM evaluations") for p in ids}

    def evaluation_comparisons(self, evaluation_id: int | None = None) -> list[Comparison]:
        """Every comparison people made between two versions' responses in the rankings of
        evaluation items (of one evaluation, or all): one per pair of responses from two versions
        in a ranking, outcome 1 / 0.5 / 0 for the first version (above, tied, below)."""
        where, params = ("= ?", [evaluation_id]) if evaluation_id is not None else ("IS NOT NULL", [])
        rankings = self._rows(
            "SELECT k.prompt_id, k.order_groups, k.item_id FROM rankings k JOIN items i ON i.id = k.item_id "
            f"WHERE i.evaluation_id {where} ORDER BY k.id", params)
        names = dict(self._rows(
            "SELECT r.id, mv.name FROM responses r JOIN items i ON i.id = r.item_id "
            f"JOIN model_versions mv ON mv.id = r.model_version_id WHERE i.evaluation_id {where}", params))
        out = []
        for prompt_id, groups, _ in rankings:
            rank = group_index([list(g) for g in groups])
            for x, y in combinations(sorted(rank), 2):
                if names[x] == names[y]:
                    continue
                outcome = 0.5 if rank[x] == rank[y] else 1.0 if rank[x] < rank[y] else 0.0
                out.append(Comparison(prompt_id, names[x], names[y], outcome))
        return out

    def evaluation_results(self, evaluation_id: int | None = None, *, seed: int = 0) -> dict:
        """{comparisons, prompts, win_rates, leaderboard} of one evaluation (or all):
        store/leaderboard.py's tables over evaluation_comparisons."""
        comparisons = self.evaluation_comparisons(evaluation_id)
        return {"comparisons": len(comparisons), "prompts": len({c.prompt_id for c in comparisons}),
                "win_rates": win_rates(comparisons, seed=seed), "leaderboard": leaderboard(comparisons, seed=seed)}
