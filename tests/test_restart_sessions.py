"""A restart of the app signs no one out and forgets no lock (annotate/accounts.py, store/sessions.py).

- the session table and the throttle kept in the store: a new process's tables (a restart) know
  every session and lock the old one had; the store holds hashes, never a token; expiry, ending a
  name's sessions and unlocking reach what only the store knows;
- the app as a process (`python app.py`), 20 annotators signed in through the HTTP API, restarted
  once with SIGTERM and once with SIGKILL: every annotator's next request and submission is
  accepted with the cookie it had (no one signed in again), no acknowledged ranking is lost, and
  Sign out still ends a session from before the restart;
- in the browser, a ranking in progress when the app is killed is submitted as made once it is
  back (the page's token names the item; its lease is in the store: annotate/handlers.py
  `_recovered`).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from annotate.accounts import Sessions, Throttle
from store import Store
from tests.fixtures_browser import chromium_browser, login  # noqa: F401  (the fixture `browser`)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_sessions_and_locks_outlive_the_process_that_made_them(store):
    now = [1_000.0]
    clock = lambda: now[0]  # noqa: E731
    before = Sessions(100.0, store=store, clock=clock)
    before["tok-ann"] = "ann"
    before["tok-ann-2"] = "ann"
    before["tok-bea"] = "bea"
    stored = store._cur().execute("SELECT token_sha256, name FROM sessions ORDER BY name").fetchall()
    assert len(stored) == 3 and not any(row[0].startswith("tok") for row in stored)  # hashes only

    after = Sessions(100.0, store=store, clock=clock)  # a restart: an empty table on the same store
    assert after.get("tok-ann") == "ann" and "tok-bea" in after and after.get("tok-nobody") is None
    assert after.end("ann") == 2  # both of ann's, though this process saw only one of them
    assert Sessions(100.0, store=store, clock=clock).get("tok-ann-2") is None
    now[0] = 1_100.0  # bea's session reaches its age limit, counted from its sign-in
    assert Sessions(100.0, store=store, clock=clock).get("tok-bea") is None
    assert store.find_session("tok-bea") is None

    t = Throttle(free=2, base_s=60.0, cap_s=600.0, clock=clock)
    t.persist_in(store)
    for _ in range(3):
        t.failed("ann", "10.0.0.1")
    restarted = Throttle(free=2, base_s=60.0, cap_s=600.0, clock=clock)
    restarted.persist_in(store)
    assert restarted.wait_s("ann", None)[0] == pytest.approx(120.0) and "ann" in restarted.locked_names()
    assert restarted.unlock("ann")
    again = Throttle(free=2, clock=clock)
    again.persist_in(store)
    assert again.wait_s("ann", None)[0] == 0.0 and again.locked_names() == {}


# --------------------------------------------------------------------------- the app as a process


N = 20


@pytest.mark.slow
def test_a_restart_under_twenty_annotators_signs_no_one_out_and_loses_nothing(tmp_path):
    from gradio_client import Client
    from ui_bench import free_port, seed, start_app

    db = tmp_path / "rlhf.duckdb"
    seed(db, N, items=200, k=3)
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    proc = start_app(db, port, tmp_path / "timings-0.json")
    acked: list[str] = []
    try:
        clients = [Client(url, auth=(f"ann{i}", f"bench-pass-{i}"), verbose=False, httpx_kwargs={"timeout": 60})
                   for i in range(N)]

        def submit_all(round_: int) -> None:
            """Each annotator fetches its item and submits a ranking, 20 at once; a failure is the test's."""
            errors = []

            def one(i: int) -> None:
                try:
                    html = clients[i].predict(api_name="/refresh")[0]
                    assert 'data-k="3"' in html, html[:300]
                    comment = f"ann{i} round {round_}"
                    clients[i].predict("2>1>3", False, comment, "", api_name="/submit")
                    acked.append(comment)
                except Exception as exc:  # noqa: BLE001  (reported below, with who)
                    errors.append(f"ann{i}: {exc!r}")

            threads = [threading.Thread(target=one, args=(i,)) for i in range(N)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert not errors, errors[:3]

        submit_all(0)
        for round_, sig in ((1, signal.SIGTERM), (2, signal.SIGKILL)):
            proc.send_signal(sig)
            proc.wait(60)
            proc = start_app(db, port, tmp_path / f"timings-{round_}.json")
            submit_all(round_)  # the same clients, the same cookies: no one signs in again

        # Sign out (every device) still ends a session made before the restarts
        import httpx

        cookies = clients[0].cookies
        assert httpx.get(url + "logout", cookies=cookies, follow_redirects=False, timeout=60).status_code in (302, 307)
        with pytest.raises(Exception, match="401|Unauthorized"):
            clients[0].predict(api_name="/refresh")
        clients[1].predict(api_name="/refresh")  # the others are still signed in (no 401)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:  # noqa: BLE001
            proc.kill()
    with Store(db) as store:
        comments = {r[0] for r in store._cur().execute("SELECT comment FROM rankings").fetchall()}
    assert len(acked) == 3 * N and set(acked) <= comments  # every acknowledged ranking is stored


@pytest.mark.slow
def test_a_page_keeps_its_ranking_in_progress_across_a_kill_of_the_app(tmp_path, browser):
    """In the browser: an annotator ranks the item on screen, the app is SIGKILLed and started again
    before Submit; then Enter submits that ranking as made (no sign-in, no reload: the cookie and
    the item's lease are in the store), and the next item comes."""
    from ui_bench import free_port, seed, start_app

    db = tmp_path / "rlhf.duckdb"
    seed(db, 1, items=10, k=3)
    port = free_port()
    proc = start_app(db, port, tmp_path / "timings-0.json")
    try:
        page = login(browser, f"http://127.0.0.1:{port}/", "ann0", "bench-pass-0")
        page.wait_for_selector("#rl-item .rl-card")
        token = page.get_attribute("#rl-item .rl-item", "data-token")
        for key in ("2", "3", "1"):
            page.keyboard.press(key)
        proc.kill()
        proc.wait(30)
        proc = start_app(db, port, tmp_path / "timings-1.json")
        page.keyboard.press("Enter")
        page.wait_for_function(
            "old => { const it = document.querySelector('#rl-item .rl-item'); return it && it.dataset.token !== old; }",
            arg=token, timeout=30_000)
        assert "Saved" in page.inner_text("#rl-progress") and page.dialogs == []
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    with Store(db) as store:
        (ranking,) = store.list_rankings()
        shown = store.get_item(ranking.item_id, ranking.annotator_id).display_order
    assert str(ranking.item_id) == token.split(".")[0]
    assert ranking.order == [[shown[1]], [shown[2]], [shown[0]]]  # positions 2, 3, 1 as pressed
