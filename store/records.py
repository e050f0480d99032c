"""Frozen dataclasses the Store returns. Callers never see cursors or rows.

Timestamps are timezone-aware datetimes in UTC. Ids are plain ints. JSON columns come back as
dicts/lists. An *item* is what an annotator ranks: one prompt with the K >= 2 responses that one
model version produced for it in one generation call (`Store.add_responses`), or that an imported
row brought, each from the model it names (store/import_items.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

ROLES = ("annotator", "admin")
MODEL_KINDS = ("policy", "reward", "critic", "external")
RUN_STATUSES = ("queued", "running", "done", "failed", "cancelled")
RUN_FINAL = ("done", "failed", "cancelled")
ROUND_STATUSES = ("generating", "annotating", "training", "done")
"""A round never fails or is cancelled: a step that does puts it back to annotating with its
meta["last_error"] (pipeline/orchestrate/loop.py), and the step is tried again."""
EXPORT_FORMATS = ("jsonl", "parquet", "datasets")
STRENGTHS = {"much better": 1.0, "better": 2 / 3, "slightly better": 1 / 3, "about the same": 0.0}
"""How much better the best response is than the second, as an annotator may say (Llama 2's
four-point scale, Touvron et al. 2023, section 3.2.1), with the margin each gives TRL's
RewardTrainer (Llama 2's "small" margins, table 28: 1, 2/3, 1/3, 0)."""
ITEM_FORMATS = ("items", "labelstudio", "argilla")
"""What an items file holds (store/import_items.py): rows of items, a Label Studio JSON export, or an
Argilla ranking dataset (its Hub export)."""


@dataclass(frozen=True)
class Prompt:
    id: int
    text: str
    """The prompt as one string; for chat prompts, the HH-style transcript of `messages`."""
    messages: list[dict] | None
    """Chat messages [{role, content}, ...] when imported as such, else None."""
    source: str
    round: int | None
    """Id of the round that first generated responses for it (None: still in the pool)."""
    created_at: datetime


@dataclass(frozen=True)
class ModelVersion:
    id: int
    kind: str
    """policy | reward | critic | external (a model outside this store that wrote imported responses)"""
    name: str
    parent_id: int | None
    """The version it was trained from (a policy's starting policy, a critic's reward model)."""
    path: str | None
    """Checkpoint folder (None for the base model used as is, or for imported data)."""
    base_model: str | None
    run_id: int | None
    """The run that produced it."""
    snapshot_id: int | None
    """The export snapshot it was trained on (reward models)."""
    reward_version_id: int | None
    """The reward model that trained it (PPO policies)."""
    meta: dict
    created_at: datetime


@dataclass(frozen=True)
class Response:
    id: int
    prompt_id: int
    item_id: int
    model_version_id: int
    text: str
    token_count: int | None
    finish_reason: str | None
    """'eos', 'length', or 'import' for imported pairs."""
    sampling: dict
    created_at: datetime


@dataclass(frozen=True)
class Annotator:
    id: int
    name: str
    role: str
    """annotator | admin"""
    created_at: datetime
    active: bool = True
    """False once an admin deactivated the account: it cannot sign in and every request of a
    session it still holds is refused; its rankings stay."""
    last_login_at: datetime | None = None
    """Its last successful sign-in (None: never signed in through the app)."""

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


@dataclass(frozen=True)
class Ranking:
    id: int
    item_id: int
    prompt_id: int
    annotator_id: int
    order: list[list[int]]
    """Tie groups of response ids, best first: [[3], [1, 2], [4]]."""
    display_order: list[int]
    """Response ids in the order they were shown (left to right)."""
    all_bad: bool
    duration_s: float | None
    client_token: str | None
    comment: str
    created_at: datetime
    strength: str | None = None
    """How much better the best response is than the second (a key of STRENGTHS), or None."""


@dataclass(frozen=True)
class Pair:
    id: int
    prompt_id: int
    item_id: int
    chosen_id: int
    rejected_id: int
    margin: float
    """Rank-group distance for ranked pairs (1 = adjacent groups); from the file for imports."""
    ranking_id: int | None
    """None for imported pairs."""
    annotator_id: int | None
    all_bad: bool
    source: str
    """'ranking' or 'import:<file name>'."""
    created_at: datetime


@dataclass(frozen=True)
class Evaluation:
    """A blind evaluation round (store/evaluations.py)."""

    id: int
    name: str
    version_ids: list[int]
    """The versions compared, as chosen."""
    prompt_ids: list[int]
    """The held-out prompts each version answers once."""
    run_id: int | None
    """The job writing the responses (None before it is queued, and for responses given directly)."""
    created_at: datetime
    items: int = 0
    """Items stored so far (one per prompt once the job is done)."""
    rankings: int = 0
    """Rankings of its items so far."""


@dataclass(frozen=True)
class Item:
    """One prompt and its responses, in the display order of one annotator."""

    item_id: int
    prompt: Prompt
    responses: list[Response]
    """In display order."""
    display_order: list[int]
    """Response ids in display order (deterministic per annotator and item)."""
    model_version_id: int
    lease_expires_at: datetime | None = None


@dataclass(frozen=True)
class Progress:
    """An annotator's progress line: rankings today (local day), in total, and items left to them."""

    today: int
    total: int
    remaining: int


@dataclass(frozen=True)
class Run:
    id: int
    kind: str
    status: str
    """queued | running | done | failed | cancelled"""
    config: dict
    run_dir: str | None
    inputs: dict
    outputs: dict
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True)
class Metric:
    run_id: int
    step: int
    key: str
    value: float


@dataclass(frozen=True)
class Snapshot:
    """The manifest of one export: what was written, where, with which filters, and its hash."""

    id: int
    path: str
    format: str
    counts: dict
    filters: dict
    sha256: str
    """SHA-256 of the exported data file(s), see store.io.snapshot_sha256."""
    created_at: datetime


@dataclass(frozen=True)
class Round:
    """One iteration of the loop: generate with a policy, annotate, train a reward model, PPO."""

    id: int
    status: str
    policy_version_id: int | None
    """The policy that generated this round's responses."""
    reward_version_id: int | None
    """The reward model trained in this round."""
    new_policy_version_id: int | None
    """The policy PPO produced in this round."""
    snapshot_id: int | None
    config: dict
    meta: dict
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class EditIn:
    """An annotator's own better answer, written from one of the item's responses and ranked with
    them (RankingIn.edit, store/ranking_checks.py)."""

    text: str
    made_from: int
    """The id of the response it was written from; the edit ranks above it."""
    place: int | None = None
    """Where the annotator ranked it: alone, just above the order's tie group of this index (0 =
    best of all); None: just above the response it was made from."""


HUMAN_EDIT = "human edit"
"""The model version (kind 'external') of every annotator's own answer: exports name it in
`chosen_model`, and the responses' `sampling` say who wrote each and from which response."""


@dataclass(frozen=True)
class RankingIn:
    """One ranking to save (`Store.save_ranking`, `save_ranking_and_lease_next`,
    `save_rankings_bulk`; the rules are store/rankings.py's)."""

    annotator_id: int
    prompt_id: int
    order: list[list[int]]
    """Tie groups of response ids, best first ([[3], [1, 2], [4]]), or a flat list."""
    all_bad: bool = False
    display_order: list[int] | None = None
    """Response ids as shown (None: the annotator's shuffle of the item, store/queue_rules.py)."""
    duration_s: float | None = None
    client_token: str | None = None
    """Saving the same token again for the same annotator stores nothing and returns the first
    ranking (a double click, a retry)."""
    comment: str = ""
    strength: str | None = None
    """How much better the best response is than the second (a key of STRENGTHS); both must
    then stand alone in the first and second tie groups."""
    edit: EditIn | None = None
    """The annotator's own better answer."""


@dataclass(frozen=True)
class OrderIn:
    """A ranking made in another tool, of an imported item (ItemIn.orders)."""

    groups: list[list[int]]
    """Tie groups of indices into the item's responses, best first; a response the annotator left
    unsorted is in none."""
    annotator: str | None = None
    """Who ranked, as '<tool>:<the tool's user id or email>' (an imported annotator account), or
    None when the file does not say."""
    duration_s: float | None = None


@dataclass(frozen=True)
class ItemIn:
    """One checked row of an items file to store (`Store.import_item_rows`, store/import_items.py)."""

    n: int
    """The row's number in its file (for errors)."""
    prompt: str
    messages: str | None
    """The chat messages as JSON text, or None for a text prompt."""
    source: str
    responses: list[tuple[str, str | None]]
    """(text, model name or None) in the file's order."""
    queued: bool = True
    orders: list[OrderIn] = field(default_factory=list)
    """Rankings made in another tool."""


CONVERSATION_STATUSES = ("open", "ended", "flagged")


@dataclass(frozen=True)
class Conversation:
    """An annotator's chat with the policy (store/conversations.py): its turns are items."""

    id: int
    annotator_id: int
    status: str
    """open | ended | flagged"""
    reason: str
    """Why it was flagged ('' otherwise)."""
    created_at: datetime
    ended_at: datetime | None
    turns: int
    """Turns stored so far."""


@dataclass(frozen=True)
class ChatTurn:
    """One turn of a conversation: the item holding its replies, and the annotator's ranking."""

    conversation_id: int
    turn: int
    """1 for the conversation's first message."""
    item_id: int
    prompt_id: int
    messages: list[dict]
    """The conversation up to this turn, ending with the annotator's message: the item's prompt."""
    ranking_id: int | None
    """The annotator's ranking of the replies (None until they rank them)."""
    reply: str | None
    """What the assistant said at this turn once ranked (the reply the next turn continues from):
    the annotator's own answer when they wrote one, else the first of the best-ranked replies in
    the order they were shown."""


@dataclass(frozen=True)
class AnnotatorStats:
    annotator_id: int
    name: str
    role: str
    rankings: int
    rankings_today: int
    pairs: int
    skips: int
    all_bad: int
    median_duration_s: float | None


@dataclass(frozen=True)
class Agreement:
    """Inter-annotator agreement on items ranked by two or more annotators (latest rankings)."""

    items: int
    """Items with >= 2 annotators."""
    comparisons: int
    """(annotator pair, item, response pair) triples where both annotators gave a strict order."""
    pairwise_agreement: float | None
    """Share of those comparisons where both preferred the same response."""
    krippendorff_alpha: float | None
    """Ordinal alpha; units = (item, response), values = mid-ranks within the item."""
    kendall_tau: float | None
    """Mean Kendall tau-b over (annotator pair, item)."""


@dataclass(frozen=True)
class GoldItem:
    """An item with a reference ranking (store/gold.py)."""

    item_id: int
    order: list[list[int]]
    """The reference: tie groups of response ids, best first."""
    ranking_id: int | None
    """The ranking an admin chose as the reference (None: given or imported)."""
    annotator_id: int | None
    """Who made that ranking (not scored on this item)."""
    source: str
    """'ranking:<id>', 'manual' or 'import:<file name>'."""
    created_at: datetime


@dataclass(frozen=True)
class ItemAgreement:
    """How the annotators of one item agree (latest ranking of each)."""

    item_id: int
    prompt_id: int
    round_id: int | None
    annotators: int
    comparisons: int
    pairwise_agreement: float | None
    kendall_tau: float | None
    rankings: list[tuple[int, int]]
    """(ranking id, annotator id) of the rankings compared."""
    gold: bool


@dataclass(frozen=True)
class AnnotatorAgreement:
    """One annotator against the others, the majority and the gold items."""

    annotator_id: int
    name: str
    rankings: int
    shared_items: int
    """Items they ranked that others ranked too."""
    pairwise_agreement: float | None
    """Share of their strict preferences other annotators of the item share."""
    majority_agreement: float | None
    """Share of their strict preferences the majority of the item's other annotators shares."""
    gold_items: int
    """Gold items they ranked (not counting those whose reference is their own ranking)."""
    gold_accuracy: float | None
    """Share of the gold's strict preferences their rankings keep (ties count half)."""
    first_shown_best_rate: float | None
    """Position bias: how often the response shown first was in their top group ..."""
    expected_first_rate: float | None
    """... against the same rate if position did not matter."""
    gold_comparisons: int = 0
    """The gold's strict response pairs gold_accuracy is over ..."""
    majority_comparisons: int = 0
    """... and the pairs the others' majority decided that majority_agreement is over."""


@dataclass(frozen=True)
class PositionBias:
    """How often the response shown first was ranked best (in the top tie group)."""

    rankings: int
    first_shown_best_rate: float | None
    expected_rate: float | None
    """The same rate if position did not matter: mean over rankings of |top group| / K."""
    best_rate_by_position: list[float] = field(default_factory=list)
    """For display positions 0..K-1: share of rankings whose top group holds that position."""
