"""Admin handlers of the Data tab: import, generate, statistics, export, flagged prompts, users
(add, reset a password, change a role, deactivate, unlock), guidelines, backup.

Every function starts with `admin(ctx, request)`, which raises `Refused` for anyone who is not a
signed-in admin, before anything is read or written: an annotator reaching these endpoints through
the HTTP API gets an error and nothing happens.

They return plain values (markdown, HTML, pandas DataFrames, file paths) that annotate/ui_admin.py
puts into components; tests call them directly.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import gradio as gr
import pandas as pd

from annotate import monitor, render
from annotate.admin_users import form_text
from annotate.context import AppContext, admin, served_copy
from annotate.handlers import DEFAULT_GUIDELINES, generating
from annotate.train import settings_of
from pipeline.orchestrate.steps import prompt_pool, submit_generate
from store import backup as store_backup
from store import io as store_io
from store.errors import DataError, StoreError
from store.export import export_layout
from store.export_options import ExportOptions, InvalidOption
from store.import_items import import_items
from store.versions import GUIDELINES_KEY


def problems_table(exc: DataError) -> pd.DataFrame:
    """A refused file's problems, one row each ('file' for the file as a whole)."""
    return pd.DataFrame({"row": ["file" if r is None else str(r) for r, _ in exc.errors],
                         "problem": [p for _, p in exc.errors]})


def _path(file) -> Path | None:
    """A gr.File value (a path string, or an object with .name / .path) as a Path."""
    if file is None:
        return None
    for attr in ("path", "name"):
        if hasattr(file, attr) and isinstance(getattr(file, attr), str):
            return Path(getattr(file, attr))
    return Path(str(file))


# ------------------------------------------------------------------------- import


IMPORT_ITEMS = {"items to rank": "items", "Label Studio export": "labelstudio", "Argilla export": "argilla"}
"""The Import form's kinds that are items (store/import_items.py), and the format each reads."""
IMPORT_EVALUATION = "a blind evaluation (items)"
"""The kind that imports items to rank as a blind evaluation between the models they name."""
IMPORT_KINDS = ("prompts", "pairs", *IMPORT_ITEMS, IMPORT_EVALUATION)
DOWNLOADS = "rlhf-loop-downloads"
"""Where exports and backups are served from (context.served_copy), under the temp folder."""


def import_file(ctx: AppContext, file, kind: str, evaluation: str | None, request: gr.Request):
    """Import an uploaded file of prompts, pairs, items to rank, a Label Studio or Argilla export, or
    items of a blind evaluation (`evaluation` names it; default the file's name), all or nothing, while
    the app runs. Returns (summary markdown, table of row errors). On a bad file the table lists
    every problem and nothing is stored."""
    admin(ctx, request)
    path = _path(file)
    if path is None:
        raise gr.Error("Choose a file to import first.")
    empty = pd.DataFrame({"row": [], "problem": []})
    name = render.esc(path.name)  # the uploader chose this name: shown as text, never as markup
    try:
        if kind == "prompts":
            result = store_io.import_prompts(ctx.store, path)
            summary = (f"**Imported {name}**: {result['rows']} rows, {result['added']} new prompts, "
                       f"{result['duplicates']} already stored.")
        elif kind == "pairs":
            result = store_io.import_pairs(ctx.store, path)
            summary = (f"**Imported {name}**: {result['pairs']} preference pairs "
                       f"({result['prompts_added']} new prompts).")
        elif kind == IMPORT_EVALUATION:
            label = (evaluation or "").strip() or path.stem
            result = import_items(ctx.store, path, evaluation=label)
            summary = (f"**Imported {name}** as the blind evaluation **{render.esc(label)}**: {result['items']} "
                       f"prompts, one answer each from {render.esc(', '.join(result['models']))}, in the "
                       "annotation queue with no model names shown. Its results: Models > Blind evaluation.")
        elif kind in IMPORT_ITEMS:
            result = import_items(ctx.store, path, fmt=IMPORT_ITEMS[kind])
            models = render.esc(", ".join(result["models"])) or "none named"
            summary = (f"**Imported {name}**: {result['items']} items to rank ({result['queued']} in the queue, "
                       f"{result['responses']} responses; models: {models})"
                       + (f", {result['pairs']} pairs from its rankings" if result["pairs"] else "")
                       + (f" by {len(people)} people" if (people := result["annotators"]) else "") + ".")
        else:
            raise gr.Error(f"Unknown import kind {kind!r}: choose one of {', '.join(IMPORT_KINDS)}.")
    except DataError as exc:
        rows = problems_table(exc)
        more = f" (and {exc.more} more)" if exc.more else ""
        return (f"**✗ {name} was not imported**: {len(exc.errors)} problem"
                f'{"s" if len(exc.errors) != 1 else ""}{more}. Nothing from this file was stored; fix '
                f"the rows below and upload it again.", rows)
    except StoreError as exc:
        raise gr.Error(f"{name}: {exc}") from None
    return summary, empty


# ------------------------------------------------------------------------- generation


def generate(ctx: AppContext, n_prompts: float, k: float, max_new_tokens: float, temperature: float,
             top_p: float, version: str | None, request: gr.Request):
    """Queue a generate job: K responses for up to `n_prompts` prompts that have none, with the
    chosen policy version (default: the active one). Items reach the queue chunk by chunk while
    it runs. Returns (progress bar, timer update): the tab's timer polls the job until it ends."""
    admin(ctx, request)
    if ctx.jobs is None:
        raise gr.Error("This app runs without a job runner, so it cannot generate.")
    mv = None
    if version:
        mv = ctx.store.find_model_version(version)
        if mv is None or mv.kind != "policy":
            raise gr.Error(f"No policy version named {version!r}.")
    prompts = prompt_pool(ctx.store, ctx.jobs, limit=int(n_prompts))
    if not prompts:
        raise gr.Error("Every prompt already has responses (or is being generated for): import more prompts first.")
    settings = settings_of(ctx)
    cfg = dataclasses.replace(settings.generate, k=int(k), max_new_tokens=int(max_new_tokens),
                              temperature=float(temperature), top_p=float(top_p))
    try:
        submit_generate(ctx.store, ctx.jobs, prompts, dataclasses.replace(settings, generate=cfg), mv, label="data-tab")
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
    return job_poll(ctx, request)


def job_poll(ctx: AppContext, request: gr.Request):
    """(progress bar, timer update) of the newest generate job: the timer keeps ticking only while
    one is queued or running, so an idle admin page polls nothing."""
    return job_html(ctx, request), gr.update(active=generating(ctx) is not None)


def job_html(ctx: AppContext, request: gr.Request) -> str:
    """The newest generate job's progress bar."""
    admin(ctx, request)
    run = generating(ctx) or next(iter(ctx.store.list_runs(kind="generate", limit=1)), None)
    if run is None:
        pool = ctx.store.counts()["prompts_in_pool"]
        return render.render_job("Generation", 0, 0, "idle", f"{pool} prompts have no responses yet.")
    return monitor.job_bar(run, run.config.get("label"))


def policy_choices(ctx: AppContext, request: gr.Request):
    """The Generate form's model choice: every policy version, the active one selected."""
    admin(ctx, request)
    active = ctx.store.active_policy()
    names = [mv.name for mv in ctx.store.list_model_versions("policy")]
    return gr.update(choices=names, value=active.name if active is not None else None)


# ------------------------------------------------------------------------- statistics


def statistics(ctx: AppContext, request: gr.Request):
    """(counts, per-annotator table, agreement table, position-bias table, per-annotator plot data,
    position plot data) for the Data tab's overview."""
    admin(ctx, request)
    store = ctx.store
    c = store.counts()
    counts = pd.DataFrame({
        "what": ["prompts", "prompts without responses", "responses", "items in queue",
                 "items still to rank", "rankings", "pairs", "flagged prompts", "conversations",
                 "conversation turns", "flagged conversations", "annotators", "snapshots"],
        "count": [c["prompts"], c["prompts_in_pool"], c["responses"], c["items"], c["items_remaining"],
                  c["rankings"], c["pairs"], c["flagged_prompts"], c["conversations"], c["conversation_turns"],
                  c["flagged_conversations"], c["annotators"], c["snapshots"]],
    })
    people = pd.DataFrame([{
        "annotator": s.name, "role": s.role, "rankings": s.rankings, "today": s.rankings_today,
        "pairs": s.pairs, "skips": s.skips, "all bad": s.all_bad,
        "median s": None if s.median_duration_s is None else round(s.median_duration_s, 1),
    } for s in store.annotator_stats()])
    a = store.agreement()
    agreement = pd.DataFrame({
        "measure": ["items ranked by 2+ annotators", "compared response pairs", "pairwise agreement",
                    "Krippendorff's alpha (ordinal)", "Kendall's tau-b (mean)"],
        "value": [str(a.items), str(a.comparisons), _fmt(a.pairwise_agreement),
                  _fmt(a.krippendorff_alpha), _fmt(a.kendall_tau)],
    })
    b = store.position_bias()
    bias = pd.DataFrame({
        "measure": ["rankings", "first-shown response ranked best", "expected without position bias"],
        "value": [str(b.rankings), _fmt(b.first_shown_best_rate), _fmt(b.expected_rate)],
    })
    by_position = pd.DataFrame({
        "position": [f"#{i + 1}" for i in range(len(b.best_rate_by_position))],
        "best rate": list(b.best_rate_by_position),
    })
    per_annotator = (people[["annotator", "rankings"]] if len(people)
                     else pd.DataFrame({"annotator": [], "rankings": []}))
    return counts, people, agreement, bias, per_annotator, by_position


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3f}"


# ------------------------------------------------------------------------- export


@dataclasses.dataclass(frozen=True)
class ExportForm:
    """The Data tab's export form, by name: its controls' values as Gradio passes them, which
    `options()` reads into the export's ExportOptions (store/export_options.py). The field order
    is the order the tab passes its components in (annotate/ui_admin.py builds that list from these
    fields; annotate/bind.py `bind_form` turns it back into this record), and so the order of the
    /export API's values. The defaults are for Python callers; the tab's and the API's come from
    its components (a test fraction of 0.1 there)."""

    fmt: str = "jsonl"
    include_all_bad: bool = False
    include_imported: bool = True
    annotators: list[str] | None = None
    since: str = ""
    min_agreement: float = 0.0
    test_fraction: float = 0.0
    trl_format: str = "conversational"
    margin_column: bool = False
    license: str = "unknown"  # noqa: A003 (the dataset card's field)
    min_quality: float = 0.0
    quality_weights: bool = False

    def options(self) -> ExportOptions:
        """The export's options from the form: a blank field, no annotator chosen and a minimum at
        0 set no filter, a blank license is 'unknown'. ExportOptions checks them; gr.Error says
        its problem under the field's label."""
        test_fraction, license = _blank_as_none(self.test_fraction), _blank_as_none(self.license)  # noqa: A001
        try:
            return ExportOptions(
                format=self.fmt, trl_format=self.trl_format, annotators=self.annotators or None,
                since=_blank_as_none(self.since), min_agreement=_zero_as_none(self.min_agreement),
                include_all_bad=self.include_all_bad, include_imported=self.include_imported,
                test_fraction=0.0 if test_fraction is None else test_fraction, margin_column=self.margin_column,
                license="unknown" if license is None else license, min_quality=_zero_as_none(self.min_quality),
                quality_weights=self.quality_weights)
        except InvalidOption as exc:
            raise gr.Error(f"{EXPORT_LABELS.get(exc.field, exc.field)} {exc.problem}.") from None


EXPORT_LABELS = {"format": "Format", "trl_format": "TRL format", "annotators": "Annotators", "since": "Since",
                 "min_agreement": "Minimum agreement", "include_all_bad": "Include 'all bad' rankings",
                 "include_imported": "Include imported pairs", "test_fraction": "Test fraction",
                 "margin_column": "Margin column", "license": "License", "min_quality": "Minimum annotator quality",
                 "quality_weights": "Weight pairs by annotator quality"}
"""How the Data tab's messages name each export option (its controls' labels, annotate/ui_admin.py)."""


def _blank_as_none(value):
    """A form's value with blank text (or None) as None, other text stripped."""
    return (value.strip() or None) if isinstance(value, str) else value


def _zero_as_none(value):
    """A form's minimum with 0 (or blank) as None: a slider at 0 sets no filter."""
    value = _blank_as_none(value)
    try:
        return None if not isinstance(value, bool) and float(value) == 0 else value
    except (TypeError, ValueError):
        return value  # (ExportOptions refuses it, naming the field)


def export(ctx: AppContext, form: ExportForm, request: gr.Request):
    """Export the pairs as a snapshot (a folder: pairs, rankings, demonstrations when annotators
    wrote their own answers, dataset card and manifest, recorded in the store) and hand back its
    files to download: the pairs, rankings, demonstrations, README.md and snapshot.json for jsonl
    and parquet, the folder zipped for datasets. A minimum quality > 0 leaves out annotators
    measured below it; quality weights add the `weight` column (store/export.py: annotator quality).
    Returns (file paths, summary markdown)."""
    admin(ctx, request)
    options = form.options()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    try:
        snap = store_io.export_dataset(ctx.store, ctx.export_dir / f"export-{stamp}", options)
    except StoreError as exc:
        raise gr.Error(f"Export failed: {exc}") from None
    folder = Path(snap.path)
    if options.format == "datasets":
        downloads = [served_copy(folder, DOWNLOADS)]
    else:
        layout = export_layout(folder, options.format)
        downloads = [served_copy(p, DOWNLOADS) for p in (layout.pairs, layout.rankings, layout.demonstrations, layout.card,
                                                layout.manifest) if p.exists()]
    return [str(p) for p in downloads], _export_summary(snap, options)


def _export_summary(snap, options: ExportOptions) -> str:
    """The markdown line under Export: what the snapshot holds and which filters made it."""
    c = snap.counts
    margin = " with a margin column" if options.margin_column else ""
    summary = (f"**Snapshot #{snap.id}** · {options.format}, TRL {options.trl_format}{margin} · "
               f"{c.get('pairs', 0)} pairs ({c.get('train', 0)} train, {c.get('test', 0)} test) from "
               f"{c.get('prompts', 0)} prompts, {c.get('rankings', 0)} rankings"
               + (f", {c['demonstrations']} demonstrations (annotators' own answers)" if c.get("demonstrations") else "")
               + f" · saved as `{Path(snap.path).name}` "
               f"(with its dataset card README.md) · sha256 `{snap.sha256[:12]}`")
    if "min_quality" in snap.filters:
        left_out, quality = snap.filters["excluded_annotators"], options.min_quality
        summary += (f" · left out below quality {quality:g}: {render.esc(', '.join(left_out))}" if left_out
                    else f" · no annotator measured below quality {quality:g}")
    if options.quality_weights:
        summary += " · pairs weighted by annotator quality (column `weight`; see the card)"
    return summary


# ------------------------------------------------------------------------- flagged prompts


def flagged_table(ctx: AppContext, request: gr.Request) -> pd.DataFrame:
    """Prompts annotators flagged (their items are out of the queue), oldest flag first, with the
    reasons given. Prompt text is shown as plain text (the table never renders markup)."""
    admin(ctx, request)
    rows = [{"prompt id": p.id, "flags": len(reasons), "reasons": " · ".join(r for r in reasons if r) or "–",
             "prompt": _clip(p.text, 200)} for p, reasons in ctx.store.flagged_prompts()]
    return pd.DataFrame(rows, columns=["prompt id", "flags", "reasons", "prompt"])


def unflag(ctx: AppContext, prompt_id, request: gr.Request):
    """Put a flagged prompt's items back in the queue (rankings made before the flag are kept).
    Returns (message, flagged table)."""
    admin(ctx, request)
    try:
        pid = int(prompt_id)
    except (TypeError, ValueError, OverflowError):
        pid = 0
    if not 0 < pid < 2**63:
        raise gr.Error(f"Prompt id must be a number from the table, not {prompt_id!r}.")
    if not ctx.store.is_flagged(pid):
        raise gr.Error(f"Prompt {pid} is not flagged.")
    ctx.store.unflag_prompt(pid)
    remaining = ctx.store.items_remaining()
    return (f"Prompt {pid} is back in the queue ({remaining} item{'s' if remaining != 1 else ''} still to rank).",
            flagged_table(ctx, request))


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 1] + "…"


# ------------------------------------------------------------------------- backup


def backup(ctx: AppContext, request: gr.Request):
    """Back the whole database up while annotators keep working (store/backup.py) into
    data_dir/backups, and hand back a copy to download. Returns (file path, summary markdown)."""
    admin(ctx, request)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    try:
        info = store_backup.backup(ctx.store, ctx.data_dir / "backups" / f"rlhf-{stamp}.duckdb")
    except StoreError as exc:
        raise gr.Error(f"Backup failed: {exc}") from None
    t = info["tables"]
    summary = (f"**Backup** `{Path(info['path']).name}` · {info['bytes'] / 2**20:.1f} MiB · "
               f"{t['rankings'][0]} rankings, {t['pairs'][0]} pairs, {t['prompts'][0]} prompts, "
               f"{t['annotators'][0]} accounts · restore with `python -m store restore FILE` (app stopped)")
    return str(served_copy(Path(info["path"]), DOWNLOADS)), summary


# ------------------------------------------------------------------------- guidelines


def save_guidelines(ctx: AppContext, text: str, request: gr.Request) -> str:
    admin(ctx, request)
    ctx.store.set_setting(GUIDELINES_KEY, form_text(text, "Guidelines"))
    return "Guidelines saved: annotators see them on their next page load."


def load_guidelines(ctx: AppContext, request: gr.Request) -> str:
    admin(ctx, request)
    return ctx.store.get_setting(GUIDELINES_KEY, "") or DEFAULT_GUIDELINES
