"""Browser fixtures: the app served in the test process, and headless Chromium (Playwright) to drive it.

Used by tests/test_browser.py and tests/test_browser_train.py: each builds its own AppContext
(seeded store, job runner or not) in a module-scoped `app` fixture, serves it with `serve`, and
imports `chromium_browser` (the fixture `browser`) and `login`.
"""

from __future__ import annotations

import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["CHROMIUM", "chromium_browser", "download_export", "login", "serve", "served_store"]

CHROMIUM = "/usr/bin/chromium"


@contextmanager
def serve(ctx):
    """The app of `ctx` served from this process on a free localhost port; yields its URL and
    closes the server on exit (the caller owns, and closes, the store and the job runner)."""
    import gradio as gr  # noqa: F401  (imported before the app so a missing install fails here)

    from annotate.ui import build_ui, launch

    demo = build_ui(ctx)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch(demo, ctx, host="127.0.0.1", port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@contextmanager
def served_store(folder: Path, seed=None):
    """A store in `folder` with the accounts boss (admin, 'boss-password') and ann
    ('ann-password'), seeded by seed(store) if given, served with sign-in; yields (url, store)."""
    from annotate.context import AppContext
    from store import Store

    store = Store(folder / "rlhf.duckdb")
    try:
        store.add_annotator("boss", "boss-password", role="admin")
        store.add_annotator("ann", "ann-password")
        if seed is not None:
            seed(store)
        with serve(AppContext(store=store, auth=True, data_dir=folder)) as url:
            yield url, store
    finally:
        store.close()


def download_export(page) -> list[dict]:
    """Data > Export with the form as it is: the rows of the pairs file it offers first (JSONL)."""
    import json

    page.get_by_role("tab", name="Export").click()
    page.click("#rl-export")
    link = page.locator("#rl-export-file a").first
    link.wait_for(timeout=15_000)
    with page.expect_download() as info:
        link.click()
    return [json.loads(line) for line in Path(info.value.path()).read_text().splitlines()]


def downloaded_files(page) -> dict[str, str]:
    """{file name: text} of every file the Export panel offers (after #rl-export was clicked)."""
    page.locator("#rl-export-file a").first.wait_for(timeout=15_000)
    files = {}
    for link in page.locator("#rl-export-file a").all():
        with page.expect_download() as info:
            link.click()
        files[info.value.suggested_filename] = Path(info.value.path()).read_text()
    return files


@pytest.fixture(scope="module", name="browser")
def chromium_browser():
    """Headless system Chromium, as the fixture `browser`; the test skips where it is not installed.
    (Named apart from its fixture so that a test module imports it without its `browser` arguments
    shadowing the import.)"""
    executable = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    if not executable:
        pytest.skip("needs the system chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable,
                              args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield b
        b.close()


def login(browser, url, name, password):
    """A new page logged in as `name`. Dialogs are dismissed and their messages kept in
    page.dialogs (a test can assert none opened); downloads are accepted."""
    page = browser.new_page(viewport={"width": 1440, "height": 1000}, accept_downloads=True)
    page.dialogs = []
    page.on("dialog", lambda d: (page.dialogs.append(d.message), d.dismiss()))
    page.goto(url)
    page.fill("input[type=text]", name)
    page.fill("input[type=password]", password)
    page.keyboard.press("Enter")
    page.wait_for_selector("#rl-header-box .rl-user", timeout=20_000)
    return page
