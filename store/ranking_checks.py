"""What makes a ranking valid for its item, and the checked ranking the Store writes (pure).

A ranking's order must name every response of one item of the ranking's prompt exactly once; a
display order, when given, must be an order of the same responses (else the annotator's default
one, store/queue_rules.py); a strength needs the best and second response alone in their tie
groups; the annotator's own answer (an edit) is text, made from a response of the item and ranked
above it. Every problem is an InvalidRequest naming it. store/rankings.py writes what passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from store.values import from_db_time
from store.errors import InvalidRequest
from store.pairs import normalize_order, ranking_to_pairs
from store.queue_rules import display_order_for
from store.records import STRENGTHS, EditIn, Ranking, RankingIn

MAX_EDIT_CHARS = 100_000
"""An annotator's own answer over this many characters is refused (as an imported reply is)."""


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
    edit_place: int | None = None
    """The tie group the annotator's own answer is ranked just above (r.edit), when there is one."""

    def edit_pairs(self, edit_id: int) -> list[tuple[int, int, int]]:
        """(chosen, rejected, rank gap) of the edit (stored as response `edit_id`) against each
        response of the order: those ranked above its place beat it, the rest lose to it."""
        place = self.edit_place
        return ([(x, edit_id, place - g) for g, group in enumerate(self.groups[:place]) for x in group]
                + [(edit_id, x, g - place + 1) for g, group in enumerate(self.groups) if g >= place for x in group])

    def record(self, ranking_id: int, now) -> Ranking:
        r = self.r
        return Ranking(id=ranking_id, item_id=self.item_id, prompt_id=r.prompt_id, annotator_id=r.annotator_id,
                       order=self.groups, display_order=self.display, all_bad=bool(r.all_bad),
                       duration_s=r.duration_s, client_token=r.client_token, comment=r.comment or "",
                       created_at=from_db_time(now), strength=r.strength)


def checked(r: RankingIn, groups, item_id: int, item_prompt: int, item_resp) -> Checked:
    """`r` with its order `groups` checked against its item (id, prompt, response ids), and its pairs."""
    display = _check_against_item(r, groups, item_id, item_prompt, item_resp)
    place = None if r.edit is None else _edit_place(r.edit, groups)
    return Checked(r, groups, display, ranking_to_pairs(groups), item_id, place)


def _edit_place(edit: EditIn, groups: list[list[int]]) -> int:
    """The tie group an annotator's own answer is ranked just above: its place, or the group of the
    response it was made from; refused unless it is text made from one of the order's responses and
    ranked above it."""
    if not isinstance(edit.text, str) or not edit.text.strip():
        raise InvalidRequest("your answer is empty: write it, or leave it out")
    if len(edit.text) > MAX_EDIT_CHARS or "\x00" in edit.text:
        raise InvalidRequest(f"your answer must be text of at most {MAX_EDIT_CHARS:,} characters")
    source = next((g for g, group in enumerate(groups) if edit.made_from in group), None)
    if source is None:
        raise InvalidRequest(f"your answer is made from response {edit.made_from}, which is not one of this item's")
    place = source if edit.place is None else int(edit.place)
    if not 0 <= place <= source:
        raise InvalidRequest("your answer is your better version of a response: rank it above the response it was "
                             "made from")
    return place
