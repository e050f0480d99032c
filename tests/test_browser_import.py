"""Items to rank from two named models, in headless Chromium (Playwright) against the served app:
an admin imports them in Data > Import, an annotator ranks them with the keyboard alone (the
model names never on screen), says by keyboard how much better each best response is than the
second and comments on one, the admin exports, and every downloaded pair names the model that
wrote each of its responses, its top pair the strength, and each pair its ranking's comment."""

from __future__ import annotations

import json
import time
import pytest

from store import records
from store.queue import LEASE_SECONDS_KEY
from tests.fixtures_browser import chromium_browser, download_export, login, served_store  # noqa: F401  (the fixture `browser`)

pytestmark = pytest.mark.browser

ITEMS = [
    {"prompt": "Name a prime number.", "responses": [{"text": "Seven is prime.", "model": "alpha-model"},
                                                      {"text": "Nine is prime.", "model": "beta-model"}]},
    {"messages": [{"role": "user", "content": "Capital of France?"}],
     "responses": [{"text": "Paris.", "model": "beta-model"}, {"text": "Lyon.", "model": "alpha-model"},
                   {"text": "Paris, on the Seine.", "model": "alpha-model"}]},
    {"prompt": "Say hello.", "responses": [{"text": "Hello!", "model": "alpha-model"},
                                           {"text": "Go away.", "model": "beta-model"}]},
]
MODEL_OF = {r["text"]: r["model"] for row in ITEMS for r in row["responses"]}
STRENGTHS = list(records.STRENGTHS)


def _same_item(a: str, b: str) -> bool:
    return any({a, b} <= {r["text"] for r in row["responses"]} for row in ITEMS)


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


LEASE_S = 30


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(url, store) of the app served in this process: an admin and an annotator, no items, leases
    of LEASE_S seconds (an item a closed page held goes back to the queue by then, even when the
    server learns of the close late: a loaded machine delays it)."""
    with served_store(tmp_path_factory.mktemp("app"), lambda store: store.set_setting(LEASE_SECONDS_KEY, LEASE_S)) as app:
        yield app


def test_imported_items_are_ranked_by_keyboard_and_exported_with_their_models(app, browser, tmp_path):
    url, store = app
    # 1. the admin imports the file as items to rank
    path = tmp_path / "two_models.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ITEMS), encoding="utf-8")
    admin = login(browser, url, "boss", "boss-password")
    admin.get_by_role("tab", name="Data").click()
    admin.get_by_role("tab", name="Import").click()
    admin.locator("#rl-import-kind label", has_text="items to rank").click()
    admin.set_input_files("#rl-import-file input[type=file]", str(path))
    admin.click("#rl-import")
    admin.wait_for_selector("#rl-import-msg :text('Imported two_models.jsonl')", timeout=10_000)
    assert "3 items to rank (3 in the queue" in admin.inner_text("#rl-import-msg")
    assert {mv.name: mv.kind for mv in store.list_model_versions()}.keys() >= {"alpha-model", "beta-model"}
    admin.close()  # an admin's page waiting for items takes some too (and gives them back when closed)
    boss = store.find_annotator("boss")
    wait_until(lambda: not any(a == boss.id for _, a, _ in store.active_leases()), timeout=3 * LEASE_S)

    # 2. the annotator ranks each item by keyboard: the cards in reverse display order, the best
    #    over the second by the n-th strength (0 pressed n times), and a comment on the first
    page = login(browser, url, "ann", "ann-password")
    expected = {}  # response text -> tie group index
    strength_of, comment_of = {}, {}  # the best response's text -> what was said with its ranking
    for n in range(len(ITEMS)):
        page.wait_for_selector("#rl-item .rl-card")
        texts = [t.strip() for t in page.locator("#rl-item .rl-card .rl-text").all_inner_texts()]
        assert not {"alpha-model", "beta-model"} & set(page.inner_text("#rl-item").split())  # blind
        for rank, position in enumerate(range(len(texts), 0, -1)):
            page.keyboard.press(str(position))
            expected[texts[position - 1]] = rank
        for _ in range(n + 1):
            page.keyboard.press("0")
        strength_of[texts[-1]] = STRENGTHS[n]
        assert f"Best vs second: {STRENGTHS[n]}" in page.inner_text("#rl-rankbar")
        if n == 0:
            page.keyboard.press("c")
            page.keyboard.type("the best is exact")
            page.keyboard.press("Escape")
            comment_of[texts[-1]] = "the best is exact"
        old = page.get_attribute("#rl-item .rl-item", "data-token") or ""
        page.keyboard.press("Enter")
        page.wait_for_function(
            "old => { const it = document.querySelector('#rl-item .rl-item'); return !it || it.dataset.token !== old; }",
            arg=old, timeout=10_000)
    ann = store.find_annotator("ann")
    rankings = store.list_rankings(annotator_id=ann.id)
    assert len(rankings) == 3 and len(store.list_pairs()) == 1 + 3 + 1
    assert sorted(r.strength for r in rankings) == sorted(STRENGTHS[:3])
    page.close()

    # 3. the admin exports and downloads the pairs: each side names its model
    admin = login(browser, url, "boss", "boss-password")
    admin.get_by_role("tab", name="Data").click()
    rows = download_export(admin)
    assert len(rows) == 5
    for r in rows:
        chosen, rejected = r["chosen"][0]["content"], r["rejected"][0]["content"]
        assert expected[chosen] < expected[rejected]  # as ranked on screen
        assert (r["chosen_model"], r["rejected_model"]) == (MODEL_OF[chosen], MODEL_OF[rejected])
        top_pair = expected[chosen] == 0 and expected[rejected] == 1
        assert r["strength"] == (strength_of[chosen] if top_pair else None)
        best = next(t for t, g in expected.items() if g == 0 and _same_item(t, chosen))
        assert r["rationale"] == comment_of.get(best)
    assert {r["chosen_model"] for r in rows} | {r["rejected_model"] for r in rows} == {"alpha-model", "beta-model"}
    admin.close()
