"""Where an action's time goes on the server (annotate/timing.py), and what keeps it short.

The first test runs `python app.py --timings FILE` as bench/ui_bench.py does, ranks through the
HTTP API with gradio_client, stops the app with SIGTERM and reads the breakdown it wrote. The
second serves the app in this process and checks that Gradio does not rebuild its monitoring
summary (a pandas frame of up to 10,000 past events) after every event, the cost that grew the
round trip with the app's uptime.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from bench.ui_bench import HttpSession, free_port, seed, start_app
from tests.fixtures_browser import serve

pytestmark = pytest.mark.slow

SUBMITS = 5


def test_the_app_writes_each_actions_server_side_breakdown(tmp_path):
    db, timings = tmp_path / "rlhf.duckdb", tmp_path / "timings.json"
    seed(db, annotators=1, items=20, k=4)
    port = free_port()
    proc = start_app(db, port, timings)
    try:
        session = HttpSession(f"http://127.0.0.1:{port}/", 0)  # signs in, then /refresh shows an item
        for _ in range(SUBMITS):
            assert session.k == 4
            session.submit("2>1>4>3")
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode is not None
    by_phase = defaultdict(list)
    for phase, seconds, _end in json.loads(timings.read_text())["samples"]:
        by_phase[phase].append(seconds)
    actions = SUBMITS + 1  # the first /refresh, then the submits
    for phase in ("join", "queued", "handler", "account", "deliver", "server"):
        assert len(by_phase[phase]) == actions, (phase, by_phase)
    assert len(by_phase["store"]) == SUBMITS  # only a submit writes
    assert all(s >= 0 for v in by_phase.values() for s in v)
    # the server's total holds every part of the same actions
    parts = sum(sum(by_phase[p]) for p in ("join", "queued", "handler", "deliver"))
    assert sum(by_phase["server"]) >= parts * 0.999
    assert sum(by_phase["handler"]) >= sum(by_phase["store"])

    from store import Store

    store = Store(db)
    try:
        assert store.counts()["rankings"] == SUBMITS
    finally:
        store.close()


def test_gradio_does_not_recompute_its_monitoring_summary_per_event(tmp_path, monkeypatch):
    from gradio import queueing
    from gradio_client import Client

    from annotate.context import AppContext
    from store import Store

    monkeypatch.delenv("GRADIO_ANALYTICS_CACHE_FREQUENCY", raising=False)
    built = []
    get_df = queueing.Queue._get_df
    monkeypatch.setattr(queueing.Queue, "_get_df", staticmethod(lambda records: built.append(len(records))
                                                                or get_df(records)))
    store = Store(tmp_path / "rlhf.duckdb")
    try:
        store.add_annotator("local", "local-password", role="admin")
        with serve(AppContext(store=store, auth=False, data_dir=tmp_path)) as url:
            client = Client(url, verbose=False, ssl_verify=False)
            for _ in range(3):
                client.predict(api_name="/refresh")
    finally:
        store.close()
    assert built == []



def test_gradio_tells_waiting_events_their_place_on_a_timer_not_at_every_job(tmp_path):
    """With Gradio's default ('auto') every job start sends each waiting event its place: n
    messages per job with n waiting, the cost that sank 100 annotators (docs/results/
    ui_round_trip.md). The app's queue sends them every QUEUE_STATUS_SECONDS instead."""
    from annotate.context import AppContext
    from annotate.ui import QUEUE_STATUS_SECONDS, build_ui, launch
    from store import Store

    store = Store(tmp_path / "rlhf.duckdb")
    ctx = AppContext(store=store, auth=False, data_dir=tmp_path)
    demo = build_ui(ctx)
    try:
        launch(demo, ctx, host="127.0.0.1", port=free_port(), prevent_thread_lock=True, quiet=True)
        assert demo._queue.live_updates is False
        assert demo._queue.update_intervals == QUEUE_STATUS_SECONDS
    finally:
        demo.close()
        store.close()
