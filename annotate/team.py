"""Data-tab handlers for running a team (Data > Team): the queue's settings (overlap, a round's
overlap and priority, the gold rate), agreement per annotator and per item, refreshed live, and
the gold items (mark a ranking as the reference, remove one, import a file of them).

Every function starts with `admin(ctx, request)` (annotate/context.py) and returns plain values
(markdown, pandas DataFrames, gr.update) that annotate/ui_team.py puts into components; tests
call them directly. The store does the work (store/queue.py, store/gold.py, store/stats.py).
"""

from __future__ import annotations

import gradio as gr
import pandas as pd

from annotate import render
from annotate.admin import _path, problems_table
from annotate.context import AppContext, admin
from store.errors import DataError, StoreError
from store.quality import MIN_COMPARISONS, annotator_quality_table

LIVE_SECONDS = 5.0
"""How often the open Team tab re-reads the agreement tables (a few queries each time)."""
ITEMS_SHOWN = 100
"""Rows of the per-item table: the items with the least agreement first."""


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def _whole_or_none(value, label: str):
    """A form's whole number (64-bit), None when left blank; gr.Error naming the field otherwise."""
    if value is None or value == "":
        return None
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        x = float("nan")
    if isinstance(value, bool) or not x.is_integer() or not -(2**63) < x < 2**63:
        raise gr.Error(f"{label} must be a whole number, not {value!r}.")
    return int(x)


def _id_or_none(value, label: str):
    """A form's id (a whole number from 1), None when left blank."""
    x = _whole_or_none(value, label)
    if x is not None and x < 1:
        raise gr.Error(f"{label} must be an id from the tables (1 or more), not {value!r}.")
    return x


# ------------------------------------------------------------------------- queue settings


def queue_form(ctx: AppContext, request: gr.Request):
    """(overlap, gold rate, the round picker, the rounds table) as stored."""
    admin(ctx, request)
    rounds = ctx.store.list_rounds()
    choices = [(f"round {r.id} · {r.status}", r.id) for r in reversed(rounds)]
    picker = gr.update(choices=choices, value=choices[0][1] if choices else None)
    return ctx.store.queue_overlap(), ctx.store.gold_rate(), picker, rounds_table(ctx, request)


def rounds_table(ctx: AppContext, request: gr.Request) -> pd.DataFrame:
    """Rounds, newest first, with their items, rankings and queue settings."""
    admin(ctx, request)
    settings = ctx.store.round_queue()
    default = ctx.store.queue_overlap()
    rows = []
    for r in reversed(ctx.store.list_rounds()):
        overlap, priority = settings.get(r.id, (None, None))
        counts = ctx.store.round_counts(r.id)
        rows.append({"round": r.id, "status": r.status, "items": counts["items"], "rankings": counts["rankings"],
                     "overlap": f"{default} (store)" if overlap is None else str(overlap),
                     "priority": "default" if priority is None else str(priority)})
    return pd.DataFrame(rows, columns=["round", "status", "items", "rankings", "overlap", "priority"])


def save_queue(ctx: AppContext, overlap, gold_rate, request: gr.Request) -> str:
    """Set the store's overlap and the gold rate."""
    admin(ctx, request)
    n = _whole_or_none(overlap, "Overlap")
    rate = None
    if gold_rate is not None and gold_rate != "":
        try:
            rate = float(gold_rate)
        except (TypeError, ValueError, OverflowError):
            rate = float("nan")
        if isinstance(gold_rate, bool) or not 0.0 <= rate <= 1.0:
            raise gr.Error(f"Not saved: the gold rate must be a number from 0 to 1, not {gold_rate!r}.")
    try:
        if n is not None:
            ctx.store.set_queue_overlap(n)
        if rate is not None:
            ctx.store.set_gold_rate(rate)
    except StoreError as exc:
        raise gr.Error(f"Not saved: {exc}") from None
    rate = ctx.store.gold_rate()
    return (f"Saved: each item is ranked by **{ctx.store.queue_overlap()}** annotator(s) unless its round says "
            f"otherwise; gold items make up **{rate:.0%}** of each annotator's items"
            + (" (when there are gold items they have not ranked)." if rate else "."))


def round_form(ctx: AppContext, round_id, request: gr.Request):
    """(overlap, priority) the picked round has now (None = the default), so that saving one field
    keeps the other."""
    admin(ctx, request)
    rid = _id_or_none(round_id, "Round")
    return ctx.store.round_queue().get(rid, (None, None)) if rid is not None else (None, None)


def save_round(ctx: AppContext, round_id, overlap, priority, request: gr.Request):
    """Set a round's own overlap and priority (blank = the defaults). Returns (message, rounds table)."""
    admin(ctx, request)
    rid = _id_or_none(round_id, "Round")
    if rid is None:
        raise gr.Error("Choose a round first.")
    n, p = _whole_or_none(overlap, "Overlap"), _whole_or_none(priority, "Priority")
    try:
        ctx.store.set_round_queue(rid, overlap=n, priority=p)
    except StoreError as exc:
        raise gr.Error(f"Not saved: {exc}") from None
    said = [f"overlap {n}" if n is not None else "the store's overlap",
            f"priority {p}" if p is not None else "the default priority (the newest round first)"]
    return f"Round {rid}: {' and '.join(said)}.", rounds_table(ctx, request)


# ------------------------------------------------------------------------- agreement, live


def team_tables(ctx: AppContext, request: gr.Request):
    """(summary markdown, per-annotator table, per-item table, gold table): what the live timer
    refreshes."""
    admin(ctx, request)
    names = {a.id: a.name for a in ctx.store.list_annotators()}
    ag = ctx.store.agreement()
    summary = (f"**{ag.items}** item{'s' if ag.items != 1 else ''} ranked by 2+ annotators · pairwise agreement "
               f"**{_fmt(ag.pairwise_agreement)}** · Krippendorff's α **{_fmt(ag.krippendorff_alpha)}** · "
               f"Kendall's τ **{_fmt(ag.kendall_tau)}** · {len(ctx.store.gold_items())} gold items")
    agreement = ctx.store.annotator_agreement()
    quality = {q["annotator_id"]: q for q in annotator_quality_table(ctx.store, agreement=agreement)}
    people = pd.DataFrame([{
        "annotator": a.name, "rankings": a.rankings, "shared items": a.shared_items,
        "agrees with others": _fmt(a.pairwise_agreement), "agrees with majority": _fmt(a.majority_agreement),
        "gold items": a.gold_items, "gold accuracy": _fmt(a.gold_accuracy),
        "quality (exports)": _quality(quality.get(a.annotator_id)),
        "first shown ranked best": _fmt(a.first_shown_best_rate), "without position bias": _fmt(a.expected_first_rate),
    } for a in agreement], columns=[
        "annotator", "rankings", "shared items", "agrees with others", "agrees with majority", "gold items",
        "gold accuracy", "quality (exports)", "first shown ranked best", "without position bias"])
    items = ctx.store.item_agreement(limit=ITEMS_SHOWN)
    prompts = {i.item_id: ctx.store.get_prompt(i.prompt_id).text for i in items}
    per_item = pd.DataFrame([{
        "item": i.item_id, "round": "–" if i.round_id is None else str(i.round_id), "prompt": _clip(prompts[i.item_id]),
        "annotators": i.annotators, "agreement": _fmt(i.pairwise_agreement), "Kendall τ": _fmt(i.kendall_tau),
        "gold": "gold" if i.gold else "",
        "rankings (id: annotator)": " · ".join(f"#{rid}: {names.get(a, a)}" for rid, a in i.rankings),
    } for i in items], columns=["item", "round", "prompt", "annotators", "agreement", "Kendall τ", "gold",
                                "rankings (id: annotator)"])
    return summary, people, per_item, gold_table(ctx, names)


def _quality(q: dict | None) -> str:
    """The quality an export's min_quality and quality weights use (store/export.py), and what
    it rests on; "not enough data" below MIN_COMPARISONS response pairs."""
    if q is None or (q["measured_by"] is None and not q["comparisons"]):
        return "–"
    if q["measured_by"] is None:
        return f"not enough data ({q['comparisons']} of {MIN_COMPARISONS} comparisons)"
    return f"{q['quality']:.3f} ({q['measured_by']}, {q['comparisons']} comparisons)"


def gold_table(ctx: AppContext, names: dict[int, str]) -> pd.DataFrame:
    rows = []
    for g in ctx.store.gold_items():
        by = f"{names.get(g.annotator_id, g.annotator_id)}'s ranking #{g.ranking_id}" if g.ranking_id else g.source
        rows.append({"item": g.item_id, "reference (response ids, best first)": " > ".join(
            " = ".join(map(str, group)) for group in g.order), "from": by})
    return pd.DataFrame(rows, columns=["item", "reference (response ids, best first)", "from"])


def go_live(ctx: AppContext, request: gr.Request):
    """Opening the Data tab starts the Team tab's refresh timer (admins only)."""
    admin(ctx, request)
    return gr.update(active=True)


def _clip(text: str, n: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 1] + "…"


# ------------------------------------------------------------------------- gold items


def mark_gold(ctx: AppContext, ranking_id, request: gr.Request):
    """Make a ranking the reference of its item. Returns (message, *team_tables)."""
    admin(ctx, request)
    rid = _id_or_none(ranking_id, "Ranking id")
    if rid is None:
        raise gr.Error("Enter the id of a ranking (see the items table) to use as the reference.")
    try:
        gold = ctx.store.set_gold_from_ranking(rid)
    except StoreError as exc:
        raise gr.Error(f"Not marked: {exc}") from None
    msg = (f"Item {gold.item_id} is gold, with ranking #{rid} as its reference: it leaves the regular queue "
           f"and is mixed into annotators' queues at the gold rate ({ctx.store.gold_rate():.0%}).")
    return (msg, *team_tables(ctx, request))


def unmark_gold(ctx: AppContext, item_id, request: gr.Request):
    """The item is no longer gold (back in the regular queue). Returns (message, *team_tables)."""
    admin(ctx, request)
    iid = _id_or_none(item_id, "Item id")
    if iid is None:
        raise gr.Error("Enter the id of a gold item.")
    try:
        ctx.store.remove_gold(iid)
    except StoreError as exc:
        raise gr.Error(f"Not changed: {exc}") from None
    return (f"Item {iid} is no longer gold: it is back in the regular queue.", *team_tables(ctx, request))


def import_gold(ctx: AppContext, file, request: gr.Request):
    """Import gold rankings (store/gold.py describes the file), all or nothing.
    Returns (message, problems by row, *team_tables)."""
    admin(ctx, request)
    path = _path(file)
    if path is None:
        raise gr.Error("Choose a gold file to import first.")
    empty = pd.DataFrame({"row": [], "problem": []})
    name = render.esc(path.name)  # the uploader chose this name: shown as text, never as markup
    try:
        result = ctx.store.import_gold(path)
    except DataError as exc:
        rows = problems_table(exc)
        return (f"**✗ {name} was not imported**: nothing from it was stored; fix the rows below.", rows,
                *team_tables(ctx, request))
    except StoreError as exc:
        raise gr.Error(f"{name}: {exc}") from None
    return (f"**Imported {name}**: {result['rows']} gold items.", empty, *team_tables(ctx, request))
