"""Fuzzing with hypothesis: ranking strings, the importers (JSONL, CSV, Parquet; TRL explicit and
conversational, HH transcripts, items to rank, Label Studio and Argilla exports, garbage bytes), the export filters, every admin handler, and every
HTTP endpoint with random arguments. Each bad input must get a clear error naming the problem
(gr.Error / DataError / InvalidRequest, never a crash), and leave the store unchanged (a checksum
of every table); an accepted file must have stored exactly the rows its result counts, and be
refused the second time. Bounded: each test has its max_examples and deadline; all of them together take
well under a minute."""

from __future__ import annotations

import csv
import datetime as dt
import json
import shutil
from pathlib import Path

import gradio as gr
import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from annotate import admin, admin_users, handlers
from annotate.context import AppContext
from store import RankingIn, Store, io
from store.backup import store_checksums
from store.errors import DataError, StoreError
from store.export import load_pairs_snapshot
from store.import_items import import_items
from tests.fixtures_browser import serve
from tests.fixtures_store import seed_items
from tests.helpers import req

BOUNDED = dict(deadline=dt.timedelta(seconds=5), derandomize=True, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Values a row, a form field or a JSON payload may hold.
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=40))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "bot", ""]),
                                           "content": st.text(max_size=20)}), max_size=3)
hh = st.builds(lambda a, b: f"\n\nHuman: {a}\n\nAssistant: {b}", st.text(max_size=15), st.text(max_size=15))
values = st.one_of(scalars, hh, messages, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=5), scalars, max_size=2))
FIELDS = ["prompt", "messages", "chosen", "rejected", "margin", "source", "text", "responses", "response_1",
          "response_2", "model_1", "data", "annotations", "ranking.responses", "ranking.responses.users",
          "ranking.responses.status"]
IMPORTERS = {"prompts": io.import_prompts, "pairs": io.import_pairs,
             "items": lambda store, path: import_items(store, path),
             "labelstudio": lambda store, path: import_items(store, path, fmt="labelstudio"),
             "argilla": lambda store, path: import_items(store, path, fmt="argilla")}
words = st.text(alphabet="abc xyz", min_size=1, max_size=10).filter(str.strip)
good = st.fixed_dictionaries({"prompt": words, "chosen": words, "rejected": words,
                              "responses": st.lists(words, min_size=2, max_size=3, unique=True)})
"""A row every importer but Label Studio's can accept (a pair's chosen may equal its rejected)."""
rows = st.one_of(st.lists(st.dictionaries(st.sampled_from(FIELDS), values, max_size=5), min_size=0, max_size=4),
                 st.lists(good, min_size=1, max_size=3))


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """One store for the module: an admin, an annotator, 6 items and a few rankings."""
    root = tmp_path_factory.mktemp("fuzz")
    s = Store(root / "rlhf.duckdb")
    s.add_annotator("boss", "boss-password", role="admin")
    ann = s.add_annotator("ann", "ann-password")
    for it in seed_items(s, 6, 3)[:3]:
        s.save_ranking(RankingIn(ann.id, it.prompt_id, [[r] for r in it.response_ids]))
    yield AppContext(store=s, auth=True, data_dir=root / "data")
    s.close()


def _unchanged_unless_ok(ctx, call, allowed=(gr.Error,), ignore=("leases",)):
    """Run call(); an exception must be one of `allowed` with a message, and leave every table
    (except `ignore`) as it was. Returns the exception or None."""
    def sums():
        return {t: v for t, v in store_checksums(ctx.store).items() if t not in ignore}

    before = sums()
    try:
        call()
    except allowed as exc:
        assert str(exc).strip() or getattr(exc, "message", ""), f"an error without a message: {exc!r}"
        assert sums() == before
        return exc
    return None


# --------------------------------------------------------------------------- ranking strings


@settings(max_examples=300, **BOUNDED)
@given(text=st.one_of(st.text(alphabet="0123456789>= ,x-", max_size=12), st.text(max_size=12)),
       k=st.integers(2, 8), all_bad=st.booleans())
def test_fuzz_ranking_strings(text, k, all_bad):
    try:
        groups = handlers.parse_ranking(text, k, all_bad)
    except gr.Error as exc:
        assert repr(text.replace(" ", "")) in exc.message or "Rank all" in exc.message
        return
    flat = sorted(p for g in groups for p in g)
    assert flat == list(range(1, k + 1)) and all(groups)


# --------------------------------------------------------------------------- importers


def _write(path: Path, fmt: str, data: list[dict]) -> bool:
    """Write rows as JSONL, CSV or Parquet; False when the format cannot hold them (Parquet needs
    one type per column)."""
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    elif fmt == "csv":
        cols = sorted({k for r in data for k in r}) or ["prompt"]
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            for r in data:
                w.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in r.items()})
    else:
        try:
            pq.write_table(pa.Table.from_pylist(data) if data else pa.table({"prompt": pa.array([], pa.string())}), path)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
            return False  # (OverflowError: an integer beyond int64)
    return True


@settings(max_examples=60, **BOUNDED)
@given(data=rows, fmt=st.sampled_from(["jsonl", "csv", "parquet"]), kind=st.sampled_from(list(IMPORTERS)))
def test_fuzz_importers(ctx, tmp_path, data, fmt, kind):
    path = tmp_path / f"fuzz.{fmt}"
    if not _write(path, fmt, data):
        return
    fn = IMPORTERS[kind]
    before, result = _counts(ctx.store), {}
    exc = _unchanged_unless_ok(ctx, lambda: result.update(fn(ctx.store, path)), allowed=(DataError,))
    if exc is not None:
        assert exc.errors and all(isinstance(p, str) and p for _, p in exc.errors)
        assert str(path) in str(exc) and "nothing from this file was stored" in str(exc)
        return
    # accepted: every row stored, as the result says, and nothing else
    assert result["rows"] == len(data)
    grew = {t: n - before[t] for t, n in _counts(ctx.store).items()}
    if kind == "prompts":
        assert grew == {"prompts": result["added"], "items": 0, "pairs": 0}
        assert result["added"] + result["duplicates"] == len(data)
    else:
        assert grew == {"prompts": result["prompts_added"], "items": len(data), "pairs": result["pairs"]}
        assert kind != "pairs" or result["pairs"] == len(data)
        # the same file again is refused, naming it, and changes nothing
        again = _unchanged_unless_ok(ctx, lambda: fn(ctx.store, path), allowed=(DataError,))
        assert again is not None and "already imported" in str(again)


def _counts(store) -> dict[str, int]:
    cur = store.cursor()
    return {t: cur.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("prompts", "items", "pairs")}


@settings(max_examples=30, **BOUNDED)
@given(raw=st.binary(max_size=200), suffix=st.sampled_from([".jsonl", ".csv", ".parquet", ".json"]),
       kind=st.sampled_from(list(IMPORTERS)))
def test_fuzz_importers_with_garbage_bytes(ctx, tmp_path, raw, suffix, kind):
    path = tmp_path / f"garbage{suffix}"
    path.write_bytes(raw)
    fn = IMPORTERS[kind]
    _unchanged_unless_ok(ctx, lambda: fn(ctx.store, path), allowed=(DataError,))


# --------------------------------------------------------------------------- export filters


@settings(max_examples=15, **BOUNDED)
@given(fmt=st.one_of(st.sampled_from(["jsonl", "parquet"]), st.text(max_size=8)),
       all_bad=values, imported=values, annotators=st.one_of(st.none(), st.lists(st.sampled_from(["ann", "boss", "x", ""]), max_size=2)),
       since=st.one_of(st.text(max_size=12), st.dates().map(str)), min_agreement=scalars, test_fraction=scalars)
@example(fmt="jsonl", all_bad=True, imported=True, annotators=None, since="", min_agreement=None, test_fraction=0.2)
@example(fmt="parquet", all_bad=False, imported=False, annotators=["ann"], since="2020-01-01", min_agreement=0.5,
         test_fraction=0.0)  # (examples that pass: their checks always run)
def test_fuzz_export_filters(ctx, fmt, all_bad, imported, annotators, since, min_agreement, test_fraction):
    before = sorted(ctx.export_dir.glob("*")) if ctx.export_dir.exists() else []
    snapshots = len(ctx.store.list_snapshots())
    out = {}
    form = admin.ExportForm(fmt=fmt, include_all_bad=all_bad, include_imported=imported, annotators=annotators,
                            since=since, min_agreement=min_agreement, test_fraction=test_fraction)
    exc = _unchanged_unless_ok(ctx, lambda: out.update(result=admin.export(ctx, form, req("boss"))))
    if exc is not None:  # nothing half-written was left behind, and no snapshot recorded
        assert (sorted(ctx.export_dir.glob("*")) if ctx.export_dir.exists() else []) == before
        assert len(ctx.store.list_snapshots()) == snapshots
        return
    # accepted: one snapshot recorded, its file holds the pairs it counts, each one passing the filters
    files, summary = out["result"]
    snap = ctx.store.list_snapshots()[-1]
    assert len(ctx.store.list_snapshots()) == snapshots + 1 and f"Snapshot #{snap.id}" in summary
    assert all(Path(f).is_file() for f in files)
    rows = load_pairs_snapshot(snap.path)
    assert len(rows) == snap.counts["pairs"] > 0
    for row in rows:
        assert all_bad or not row["all_bad"]
        assert imported or row["ranking_id"] is not None
        assert not annotators or row["annotator"] in annotators
        assert row["agreement"] >= (float(min_agreement) if min_agreement else 0.0)


# --------------------------------------------------------------------------- admin handlers


ADMIN_CALLS = {  # handler -> number of form inputs
    admin.unflag: 1, admin_users.reset_password: 2, admin_users.change_role: 2, admin_users.deactivate: 1, admin_users.activate: 1,
    admin_users.unlock: 1, admin_users.add_user: 3, admin.save_guidelines: 1,
}


@settings(max_examples=40, **BOUNDED)
@given(which=st.sampled_from(sorted(ADMIN_CALLS, key=lambda f: f.__name__)), args=st.lists(values, min_size=3, max_size=3),
       as_=st.sampled_from(["boss", "ann", None]))
@example(which=admin_users.add_user, args=["newbie", "annotator", ""], as_="boss")
@example(which=admin_users.change_role, args=["newbie", "admin", None], as_="boss")
@example(which=admin_users.deactivate, args=["newbie", None, None], as_="boss")
@example(which=admin_users.activate, args=["newbie", None, None], as_="boss")
@example(which=admin.save_guidelines, args=["Rank the helpful answer first.", None, None], as_="boss")
def test_fuzz_admin_handlers(ctx, which, args, as_):
    if which in (admin_users.add_user, admin_users.reset_password) and isinstance(args[-1], str) and len(args[-1]) >= 8:
        args[-1] = args[-1][:7]  # a valid new password costs a scrypt hash: keep examples fast
    out = {}
    exc = _unchanged_unless_ok(ctx, lambda: out.update(result=which(ctx, *args[:ADMIN_CALLS[which]], req(as_))))
    if as_ != "boss":
        assert exc is not None  # refused, and nothing changed
    if exc is not None:
        return
    # accepted: what the message says was done is in the store
    msg = out["result"] if isinstance(out["result"], str) else out["result"][0]
    if which is admin_users.add_user:
        account = ctx.store.find_annotator(args[0])
        assert account is not None and account.role == args[1] and f"**{account.name}**" in msg
    elif which is admin_users.change_role:
        assert ctx.store.find_annotator(args[0]).role == args[1]
    elif which in (admin_users.deactivate, admin_users.activate):
        assert ctx.store.find_annotator(args[0]).active == (which is admin_users.activate)
    elif which is admin.save_guidelines:
        assert admin.load_guidelines(ctx, req("boss")) in (args[0], admin.DEFAULT_GUIDELINES)
    elif which is admin.unflag:
        assert not ctx.store.is_flagged(int(args[0]))


# --------------------------------------------------------------------------- HTTP endpoints


ENDPOINTS = {  # api name -> inputs (gr.State inputs are not part of the API)
    "submit": 7, "skip": 1, "flag": 2, "undo": 0, "refresh": 0, "change_password": 3,
    "statistics": 0, "generate": 6, "export": 12, "unflag": 1, "flagged": 0, "add_user": 3,
    "reset_password": 2, "set_role": 2, "deactivate": 1, "activate": 1, "unlock": 1, "users": 0,
    "backup": 0, "save_guidelines": 1, "save_queue": 2, "save_round": 3, "mark_gold": 1, "unmark_gold": 1,
    "import_gold": 1, "export_model": 1,
}
ADMIN_ONLY = set(ENDPOINTS) - {"submit", "skip", "flag", "undo", "refresh", "change_password"}


def _call(http: httpx.Client, api: str, data: list) -> tuple[str, str]:
    """POST /gradio_api/call/<api>, then read its result stream: (event, data)."""
    r = http.post(f"gradio_api/call/{api}", json={"data": data})
    if r.status_code != 200:
        return "rejected", f"{r.status_code} {r.text}"
    event_id = r.json()["event_id"]
    event = payload = ""
    with http.stream("GET", f"gradio_api/call/{api}/{event_id}") as stream:
        for line in stream.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                payload = line[5:].strip()
                if event in ("complete", "error"):
                    break
    return event, payload


@pytest.fixture(scope="module")
def served(ctx, tmp_path_factory):
    """The module's app served once, with an annotator signed in over plain HTTP."""
    with serve(ctx) as url:
        http = httpx.Client(base_url=url, timeout=30)
        assert http.post("login", data={"username": "ann", "password": "ann-password"}).status_code == 200
        yield http
        http.close()


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30)),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=2),
                           max_leaves=5)


# What a refused call may still write: the leases and skips of serving the next item, and the
# throttle's count of a wrong current password (change_password counts it, as sign-in does).
WRITTEN_BY_REFUSALS = ("leases", "skips", "login_failures")


@settings(max_examples=60, **BOUNDED)
@given(api=st.sampled_from(sorted(ENDPOINTS)), args=st.lists(json_values, min_size=12, max_size=12))
def test_fuzz_every_http_endpoint_as_an_annotator(ctx, served, api, args):
    if api == "change_password" and isinstance(args[1], str) and args[1] == args[2] and len(args[1]) >= 8:
        args[1] = args[1] + "!"  # keep the annotator's password: later examples sign in with it
    before = {t: v for t, v in store_checksums(ctx.store).items() if t not in WRITTEN_BY_REFUSALS}
    event, payload = _call(served, api, args[:ENDPOINTS[api]])
    assert event in ("complete", "error", "rejected"), (event, payload)
    if api in ADMIN_ONLY:  # refused by the handler, or by Gradio before it (an input of the wrong type)
        assert event != "complete", payload
    if event == "error":
        message = (json.loads(payload) or {}).get("error") if payload.startswith("{") else payload
        assert message and message != "null", f"{api}: an error without a message ({payload})"
    if event != "complete":
        assert {t: v for t, v in store_checksums(ctx.store).items() if t not in WRITTEN_BY_REFUSALS} == before
    assert served.get("gradio_api/info").status_code == 200  # the server is still up


def test_the_fuzzed_endpoints_take_the_inputs_the_app_declares(ctx):
    """ENDPOINTS must follow the app: an endpoint fuzzed with too few inputs is refused by Gradio
    before our handler runs, and the test would no longer reach the handler's role check."""
    from annotate.ui import build_ui

    demo = build_ui(ctx)
    declared = {fn.api_name: sum(not isinstance(block, gr.State) for block in fn.inputs)
                for fn in demo.fns.values() if isinstance(fn.api_name, str)}
    assert {api: declared.get(api) for api in ENDPOINTS} == ENDPOINTS


def test_fuzz_tests_leave_no_files_behind(ctx):
    # runs after the others in this module: the refused exports and backups wrote nothing
    assert not (ctx.data_dir / "backups").exists()
    leftovers = [p.name for p in ctx.export_dir.glob(".*")] if ctx.export_dir.exists() else []
    assert leftovers == []
    shutil.rmtree(ctx.data_dir, ignore_errors=True)
