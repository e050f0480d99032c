"""Login throttling: failures per name and per client address earn exponentially growing locks,
refused through Gradio's real /login route (plain HTTP POSTs); admins see locked accounts and
unlock them."""

from __future__ import annotations


import httpx
import pytest

from annotate import admin_users
from annotate.accounts import Throttle
from annotate.context import AppContext, Refused
from store import Store
from tests.fixtures_browser import serve
from tests.helpers import req


def test_locks_grow_exponentially_up_to_the_cap_and_a_success_clears_them():
    now = [0.0]
    t = Throttle(free=5, base_s=1.0, cap_s=10.0, clock=lambda: now[0])
    for _ in range(4):
        t.failed("ann", "10.0.0.1")
    assert t.wait_s("ann", "10.0.0.1")[0] == 0  # four failures are free
    t.failed("ann", "10.0.0.1")
    assert t.wait_s("ann", "10.0.0.1") == (1.0, "the account 'ann'")
    assert t.wait_s("bea", "10.0.0.2")[0] == 0  # others are not affected
    waits = []
    for _ in range(6):
        t.failed("ann", "10.0.0.1")
        waits.append(t.wait_s("ann", "10.0.0.1")[0])
    assert waits == [2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert t.locked_names() == {"ann": 10.0}
    now[0] = 9.5
    assert t.wait_s("ann", None)[0] == pytest.approx(0.5)
    now[0] = 10.0
    assert t.wait_s("ann", None)[0] == 0 and t.locked_names() == {}
    t.succeeded("ann")
    t.failed("ann", None)
    assert t.wait_s("ann", None)[0] == 0  # counting starts again


def test_an_address_is_locked_after_its_own_allowance_of_failures_across_names():
    now = [0.0]
    t = Throttle(free=5, free_per_address=8, base_s=1.0, cap_s=60.0, clock=lambda: now[0])
    for i in range(8):
        t.failed(f"guess{i}", "10.0.0.9")
    wait, what = t.wait_s("someone-else", "10.0.0.9")
    assert wait == 1.0 and what == "your address (10.0.0.9)"
    assert t.wait_s("someone-else", "10.0.0.10")[0] == 0
    assert t.unlock("guess1") and not t.unlock("never-failed")


@pytest.fixture
def ctx(tmp_path):
    path = tmp_path / "rlhf.duckdb"
    s = Store(path)
    s.add_annotator("boss", "boss-password", role="admin")
    s.add_annotator("ann", "ann-password")
    yield AppContext(store=s, auth=True, data_dir=tmp_path)
    s.close()


def _login(url: str, name: str, password: str) -> httpx.Response:
    return httpx.post(url + "login", data={"username": name, "password": password}, timeout=60)


def test_over_http_failures_lock_the_name_the_admin_sees_it_and_unlocks_it(ctx):
    from gradio_client import Client

    ctx.throttle = Throttle(free=3, base_s=60.0, cap_s=600.0)  # long enough that the test never races it
    with serve(ctx) as url:
        boss = Client(url, auth=("boss", "boss-password"), verbose=False, ssl_verify=False)
        for _ in range(3):
            r = _login(url, "ann", "wrong-password")
            assert r.status_code == 400 and "Incorrect credentials" in r.text
        r = _login(url, "ann", "ann-password")  # the right password, but the name is locked
        assert r.status_code == 429
        assert "Too many failed sign-ins for the account 'ann': try again in" in r.json()["detail"]
        assert "access-token" not in " ".join(r.cookies.keys())
        users = boss.predict(api_name="/users")
        locked = {row[1]: row[-1] for row in users["data"]}
        assert locked["ann"].endswith(" s") and locked["boss"] == "–"
        # an annotator cannot unlock anyone
        with pytest.raises(Refused):
            admin_users.unlock(ctx, "ann", req("ann"))
        msg, _ = boss.predict("ann", api_name="/unlock")
        assert "ann** is unlocked" in msg
        r = _login(url, "ann", "ann-password")
        assert r.status_code == 200 and r.json() == {"success": True}


def test_over_http_guessing_names_from_one_address_locks_the_address(ctx):
    ctx.throttle = Throttle(free=100, free_per_address=3, base_s=60.0)
    with serve(ctx) as url:
        for i in range(3):
            assert _login(url, f"guess-{i}", "password-guess").status_code == 400
        r = _login(url, "ann", "ann-password")
        assert r.status_code == 429 and "your address (127.0.0.1)" in r.json()["detail"]
