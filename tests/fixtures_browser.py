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

__all__ = ["CHROMIUM", "chromium_browser", "login", "serve"]

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
