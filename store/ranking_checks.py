"""What makes a ranking valid for its item, and the checked ranking the Store writes (pure).

A ranking's order must name every response of one item of the ranking's prompt exactly once; a
display order, when given, must be an order of the same responses (else the annotator's default
one, store/queue_rules.py); a strength needs the best and second response alone in their tie
groups. Every problem is an InvalidRequest naming it. store/rankings.py writes what passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from store.values import from_db_time
from store.errors import InvalidRequest
from store.pairs import normalize_order, ranking_to_pairs
from store.queue_rules import display_order_for
from store.records import STRENGTHS, Ranking, RankingIn


def _check_against_item(r: RankingIn, groups, item_id, item_prompt, item_ids: Sequence[int]) -> list[int]:
    """Raise InvalidRequest unless `groups` is an order of exactly the item's responses; return the
    display order (given, or the annotator's default one)."""
    flat = [x for g in groups for x in g]
    if item_prompt != r.prompt_id:
        raise InvalidRequest(f"response {flat[0]} answers prompt {item_prompt}, not prompt {r.prompt_id}")
    if set(flat) != set(item_ids):
        missing = sorted(set(item_ids) - set(flat))
        extra = sorted(set(flat) - set(item_ids))
        raise InvalidRequest(
            f"the order must rank exactly the responses of item {item_id} {sorted(item_ids)}"
            + (f"; missing {missing}" if missing else "") + (f"; not in the item {extra}" if extra else ""))
    _check_strength(r.strength, groups)
    if r.display_order is None:
        return display_order_for(r.annotator_id, item_id, list(item_ids))
    display = [int(x) for x in r.display_order]
    if sorted(display) != sorted(item_ids):
        raise InvalidRequest(f"display_order {display} is not an order of the item's responses {sorted(item_ids)}")
    return display


def _check_strength(strength: str | None, groups: list[list[int]]) -> None:
    """A strength compares the best response with the second: both must stand alone in their
    tie groups (for K = 2, the pair; for K > 2, the top pair)."""
    if strength is None:
        return
    if strength not in STRENGTHS:
        raise InvalidRequest(f"strength must be one of {list(STRENGTHS)}, not {strength!r}")
    if len(groups) < 2 or len(groups[0]) != 1 or len(groups[1]) != 1:
        raise InvalidRequest(f"a strength ({strength!r}) says how much better the best response is than the "
                             "second: rank one response first and one second, without ties, or give no strength")


def order_groups(order) -> list[list[int]]:
    """An order as tie groups of response ids (store/pairs.py), a malformed one an InvalidRequest."""
    try:
        return normalize_order(order)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


@dataclass
class Checked:
    """A ranking checked against its item, ready to write."""

    r: RankingIn
    groups: list[list[int]]
    display: list[int]
    pairs: list[tuple[int, int, int]]
    item_id: int

    def record(self, ranking_id: int, now) -> Ranking:
        r = self.r
        return Ranking(id=ranking_id, item_id=self.item_id, prompt_id=r.prompt_id, annotator_id=r.annotator_id,
                       order=self.groups, display_order=self.display, all_bad=bool(r.all_bad),
                       duration_s=r.duration_s, client_token=r.client_token, comment=r.comment or "",
                       created_at=from_db_time(now), strength=r.strength)


def checked(r: RankingIn, groups, item_id: int, item_prompt: int, item_resp) -> Checked:
    """`r` with its order `groups` checked against its item (id, prompt, response ids), and its pairs."""
    display = _check_against_item(r, groups, item_id, item_prompt, item_resp)
    return Checked(r, groups, display, ranking_to_pairs(groups), item_id)
