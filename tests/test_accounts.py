"""Accounts: password hashing and its upgrade, own password change, an admin's reset, role change,
deactivation (at once, rankings kept), session expiry; through the handlers and through HTTP
(gradio_client against the app served in this process)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import gradio as gr
import pytest

from annotate import accounts, admin, admin_users, handlers
from annotate.context import AppContext, Refused
from store import Store
from store.users import SCRYPT_N, hash_password, needs_rehash, verify_password
from tests.fixtures_browser import serve
from tests.fixtures_store import open_copy, seed_items
from tests.helpers import req

PASSWORDS = {"boss": "boss-password", "ann": "ann-password", "bea": "bea-password"}


@pytest.fixture(scope="module")
def accounts_db(tmp_path_factory) -> Path:
    """A closed store file with boss (admin), ann and bea (annotators) and 6 items of 2 responses
    (scrypt hashing the accounts once per module, not per test)."""
    path = tmp_path_factory.mktemp("accounts") / "rlhf.duckdb"
    with Store(path) as s:
        for name, password in PASSWORDS.items():
            s.add_annotator(name, password, role="admin" if name == "boss" else "annotator")
        seed_items(s, 6, 2)
    return path


@pytest.fixture
def ctx(accounts_db, tmp_path):
    s = open_copy(accounts_db, tmp_path / "db")
    yield AppContext(store=s, auth=True, data_dir=tmp_path / "data")
    s.close()


def _hash_of(store, name: str) -> str:
    return store._one("SELECT password_hash FROM annotators WHERE name = ?", [name])[0]


# --------------------------------------------------------------------------- hashing


def test_new_hashes_use_todays_scrypt_cost_and_old_ones_are_upgraded_at_sign_in(ctx):
    stored = _hash_of(ctx.store, "ann")
    scheme, n, r, p, *_ = stored.split("$")
    assert (scheme, int(n), int(r), int(p)) == ("scrypt", 2**17, 8, 1) and SCRYPT_N >= 2**17
    assert not needs_rehash(stored)
    # a hash made with the cost of older versions (n = 2**14) keeps working ...
    import hashlib
    import secrets

    salt = secrets.token_bytes(16)
    key = hashlib.scrypt(b"old-password", salt=salt, n=2**14, r=8, p=1, dklen=32)
    old = f"scrypt${2**14}$8$1${salt.hex()}${key.hex()}"
    ann = ctx.store.find_annotator("ann")
    with ctx.store._tx() as cur:
        cur.execute("UPDATE annotators SET password_hash = ? WHERE id = ?", [old, ann.id])
    assert needs_rehash(old)
    assert ctx.store.authenticate("ann", "wrong-password") is None
    assert _hash_of(ctx.store, "ann") == old  # a failed sign-in changes nothing
    # ... and is replaced by one at today's cost at the next successful sign-in
    signed_in = ctx.store.authenticate("ann", "old-password")
    assert signed_in is not None and signed_in.last_login_at is not None
    upgraded = _hash_of(ctx.store, "ann")
    assert upgraded != old and not needs_rehash(upgraded) and verify_password("old-password", upgraded)


def test_stored_hashes_asking_for_too_much_memory_or_malformed_are_refused_quickly():
    t0 = time.perf_counter()
    for stored in ("scrypt$1099511627776$8$1$00$00", "scrypt$16384$8$1$zz$00", "bcrypt$x", "", "scrypt$0$8$1$00$00"):
        assert verify_password("anything", stored) is False
    assert time.perf_counter() - t0 < 0.5
    assert verify_password("x" * 10_000, hash_password("x" * 1024)) is False  # over the length limit


# --------------------------------------------------------------------------- handlers


def test_change_own_password(ctx):
    with pytest.raises(gr.Error, match="differ"):
        handlers.change_password(ctx, "ann-password", "new-password-1", "new-password-2", req("ann"))
    with pytest.raises(gr.Error, match="current password is not right"):
        handlers.change_password(ctx, "not-it", "new-password-1", "new-password-1", req("ann"))
    with pytest.raises(gr.Error, match="at least 8 characters"):
        handlers.change_password(ctx, "ann-password", "short", "short", req("ann"))
    with pytest.raises(Refused):
        handlers.change_password(ctx, "ann-password", "new-password-1", "new-password-1", req(None))
    assert ctx.store.authenticate("ann", "ann-password") is not None  # nothing changed so far
    msg = handlers.change_password(ctx, "ann-password", "new-password-1", "new-password-1", req("ann"))
    assert "Password changed for **ann**" in msg
    assert ctx.store.authenticate("ann", "new-password-1") is not None
    assert ctx.store.authenticate("ann", "ann-password") is None


def test_deactivation_applies_to_the_next_request_and_keeps_the_rankings(ctx):
    state, *_ = handlers.load(ctx, None, req("ann"))
    state = handlers.submit(ctx, handlers.Submission("1>2", False, "", ""), state, req("ann"))[0]  # ann's account is now cached
    assert len(ctx.store.list_rankings()) == 1
    msg, table = admin_users.deactivate(ctx, "ann", req("boss"))
    assert "deactivated" in msg and table.set_index("name").loc["ann", "active"] == "no"
    with pytest.raises(Refused, match="deactivated"):
        handlers.submit(ctx, handlers.Submission("2>1", False, "", ""), state, req("ann"))
    with pytest.raises(Refused, match="deactivated"):
        handlers.load(ctx, None, req("ann"))
    assert ctx.store.authenticate("ann", "ann-password") is None  # cannot sign in either
    assert len(ctx.store.list_rankings()) == 1  # its ranking stays
    assert "can sign in again" in admin_users.activate(ctx, "ann", req("boss"))[0]
    state, *_ = handlers.load(ctx, None, req("ann"))
    assert state.current is not None


def test_role_change_and_password_reset(ctx):
    handlers.open_page(ctx, None, req("bea"))  # cached as an annotator
    with pytest.raises(Refused):
        admin_users.users_table(ctx, req("bea"))
    msg, _ = admin_users.change_role(ctx, "bea", "admin", req("boss"))
    assert "now an admin" in msg
    assert len(admin_users.users_table(ctx, req("bea"))) == 3  # at once
    msg, _ = admin_users.reset_password(ctx, "bea", "", req("boss"))
    generated = msg.split("One-time password: `")[1].split("`")[0]
    assert ctx.store.authenticate("bea", generated) is not None
    assert ctx.store.authenticate("bea", "bea-password") is None
    admin_users.reset_password(ctx, "bea", "chosen-password", req("boss"))
    assert ctx.store.authenticate("bea", "chosen-password") is not None
    with pytest.raises(gr.Error, match="at least 8"):
        admin_users.reset_password(ctx, "bea", "short", req("boss"))
    with pytest.raises(gr.Error, match="no annotator named 'nobody'"):
        admin_users.change_role(ctx, "nobody", "admin", req("boss"))
    with pytest.raises(gr.Error, match="Role must be one of"):
        admin_users.change_role(ctx, "bea", "owner", req("boss"))


def test_the_last_active_admin_cannot_be_demoted_or_deactivated(ctx):
    for call in (lambda: admin_users.change_role(ctx, "boss", "annotator", req("boss")),
                 lambda: admin_users.deactivate(ctx, "boss", req("boss"))):
        with pytest.raises(gr.Error, match="last active admin"):
            call()
    assert ctx.store.find_annotator("boss").is_admin and ctx.store.find_annotator("boss").active
    admin_users.change_role(ctx, "bea", "admin", req("boss"))
    admin_users.deactivate(ctx, "boss", req("bea"))  # now there is another admin
    with pytest.raises(Refused):
        admin_users.users_table(ctx, req("boss"))


def test_annotators_are_refused_every_account_action_and_nothing_changes(ctx):
    from store.backup import store_checksums

    before = store_checksums(ctx.store)
    calls = [lambda r: admin_users.reset_password(ctx, "boss", "taken-over!", r),
             lambda r: admin_users.change_role(ctx, "ann", "admin", r),
             lambda r: admin_users.deactivate(ctx, "boss", r), lambda r: admin_users.activate(ctx, "ann", r),
             lambda r: admin_users.unlock(ctx, "ann", r), lambda r: admin_users.users_table(ctx, r),
             lambda r: admin.backup(ctx, r)]
    for call in calls:
        for who in ("ann", None, "nobody"):
            with pytest.raises(Refused):
                call(req(who))
    assert store_checksums(ctx.store) == before
    assert not (ctx.data_dir / "backups").exists()


def test_sessions_expire_each_on_its_own_clock_and_end_for_one_name():
    now = [0.0]
    sessions = accounts.Sessions(max_age_s=100.0, clock=lambda: now[0])
    sessions["t1"] = "ann"
    now[0] = 60.0
    sessions["t2"] = "ann"
    sessions["t3"] = "bea"
    assert sessions.get("t1") == "ann" and "t2" in sessions
    now[0] = 100.0
    assert sessions.get("t1") is None and "t1" not in sessions  # 100 s old: gone
    assert sessions.get("t2") == "ann" and sessions["t3"] == "bea"
    assert sessions.end("ann") == 1 and sessions.get("t2") is None and sessions.get("t3") == "bea"
    now[0] = 161.0
    assert sessions.get("t3") is None and len(sessions) == 0


# --------------------------------------------------------------------------- through HTTP


def _client(url: str, name: str, password: str | None = None):
    from gradio_client import Client

    # httpx's 5 s read timeout fails on a loaded machine (scrypt and the app share its cores)
    return Client(url, auth=(name, password or PASSWORDS[name]), verbose=False, ssl_verify=False,
                  httpx_kwargs={"timeout": 60})


def test_over_http_deactivation_ends_sessions_and_annotators_are_refused_account_actions(ctx):
    from store.backup import store_checksums

    with serve(ctx) as url:
        boss, ann = _client(url, "boss"), _client(url, "ann")
        assert 'data-k="2"' in ann.predict(api_name="/refresh")[0]
        before = store_checksums(ctx.store)
        for api, args in (("/reset_password", ("boss", "taken-over!")), ("/set_role", ("ann", "admin")),
                          ("/deactivate", ("boss",)), ("/unlock", ("ann",)), ("/backup", ())):
            with pytest.raises(Exception, match="admins only"):
                ann.predict(*args, api_name=api)
        assert store_checksums(ctx.store) == before

        msg, _ = boss.predict("ann", api_name="/deactivate")
        assert "1 open session ended" in msg
        with pytest.raises(Exception, match="401 Unauthorized"):
            ann.predict(api_name="/refresh")  # the cookie no longer signs anyone in
        with pytest.raises(ValueError, match="Could not login"):
            _client(url, "ann")  # and the account cannot sign in again
        boss.predict("ann", api_name="/activate")
        ann = _client(url, "ann")
        assert 'data-k="2"' in ann.predict(api_name="/refresh")[0]

        # own password change through the API
        msg = ann.predict("ann-password", "ann-new-password", "ann-new-password", api_name="/change_password")
        assert "Password changed" in msg
        _client(url, "ann", "ann-new-password")


def test_over_http_a_session_expires_after_its_age_limit(ctx):
    ctx.session_hours = 3 / 3600  # 3 s
    with serve(ctx) as url:
        ann = _client(url, "ann")
        assert 'data-k="2"' in ann.predict(api_name="/refresh")[0]
        time.sleep(3.2)
        with pytest.raises(Exception, match="401 Unauthorized"):
            ann.predict(api_name="/refresh")
        ann = _client(url, "ann")  # signing in again starts a new session
        assert 'data-k="2"' in ann.predict(api_name="/refresh")[0]


# --------------------------------------------------------------------------- command line


def test_cli_manages_accounts(accounts_db, tmp_path, capsys):
    from store.__main__ import main

    db = tmp_path / "cli.duckdb"
    shutil.copy(accounts_db, db)
    args = ["--db", str(db), "users"]
    assert main(args + ["passwd", "ann", "--password", "cli-password"]) == 0
    assert main(args + ["passwd", "ann", "--password", "short"]) == 1
    assert "at least 8 characters" in capsys.readouterr().err
    assert main(args + ["reset", "bea"]) == 0
    bea_password = capsys.readouterr().out.split("password: ")[1].strip()
    assert main(args + ["role", "bea", "admin"]) == 0
    assert main(args + ["deactivate", "ann"]) == 0
    assert main(args + ["deactivate", "nobody"]) == 1
    assert "no annotator named 'nobody'" in capsys.readouterr().err
    assert main(args + ["list"]) == 0
    listing = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()}
    assert "DEACTIVATED" in listing["ann"] and "admin" in listing["bea"] and "active" in listing["boss"]
    with Store(db) as s:
        assert s.authenticate("ann", "cli-password") is None  # deactivated
        assert s.authenticate("bea", bea_password).is_admin
    assert main(args + ["activate", "ann"]) == 0
    with Store(db) as s:
        assert s.authenticate("ann", "cli-password") is not None
