"""The app in headless Chromium (Playwright), against a real server on a free localhost port and a
temporary DuckDB file seeded with prompts and responses (no model: these tests are about the UI).

- an annotator ranks 3 items with the keyboard alone (one with a tie), undoes one, and the store
  holds exactly the expected pairs;
- HTML in prompts and responses stays text: no script runs, no dialog opens;
- an admin imports a file (and sees a bad one refused by row) and downloads a JSONL export;
- an annotator sees no admin tab, and the HTTP API refuses them every admin endpoint.
"""

from __future__ import annotations

import json
import time

import pytest

from store import RankingIn
from tests.fixtures_browser import chromium_browser, download_export, login, served_store  # noqa: F401  (the fixture `browser`)

pytestmark = pytest.mark.browser

XSS = ['<script>window.__xss = "script"</script>', '<img src=x onerror="window.__xss = \'img\'">']
K = 3


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(url, store) of the app served in this process, seeded with 6 items of K=3 responses."""
    def seed(store):
        mv = store.register_model_version("policy", "seed-policy", base_model="tiny")
        for i in range(6):
            (pid,) = store.add_prompts([f"\n\nHuman: question {i} {XSS[0]}\n\nAssistant: earlier answer {XSS[1]}"
                                        f"\n\nHuman: and then?\n\nAssistant:"])
            store.add_responses(pid, mv.id, [f"reply {i}.{j} {XSS[j % 2]}" for j in range(K)])

    with served_store(tmp_path_factory.mktemp("app"), seed) as app:
        yield app


def token(page) -> str:
    return page.get_attribute("#rl-item .rl-item", "data-token") or ""


def wait_new_item(page, old: str) -> None:
    page.wait_for_function(
        "old => { const it = document.querySelector('#rl-item .rl-item'); return it && it.dataset.token !== old; }",
        arg=old, timeout=10_000)


def shown_response_ids(page, store) -> list[int]:
    """Response ids of the cards on screen, left to right (matched by their unique text)."""
    texts = page.locator("#rl-item .rl-card .rl-text").all_inner_texts()
    by_text = {r.text: r.id for p in store.list_prompts(limit=100) for r in store.prompt_responses(p.id)}
    return [by_text[t.strip()] for t in texts]


def test_annotator_ranks_with_the_keyboard_and_undoes(app, browser):
    url, store = app
    page = login(browser, url, "ann", "ann-password")
    page.wait_for_selector("#rl-item .rl-card")
    # (keys pressed, expected tie groups as display positions); Enter submits
    plan = [(["2", "Shift+3", "1"], [[2, 3], [1]]),  # 2 and 3 tie, then 1
            (["3", "1"], [[3], [1], [2]]),  # the last one is placed last
            (["1", "2", "3"], [[1], [2], [3]])]
    expected = {}
    for keys, groups in plan:
        ids = shown_response_ids(page, store)
        item = store.get_response(ids[0]).item_id
        expected[item] = [[ids[p - 1] for p in g] for g in groups]
        for key in keys:
            page.keyboard.press(key)
        assert len(page.locator("#rl-item .rl-card.rl-ranked").all()) == len(keys)
        old = token(page)
        page.keyboard.press("Enter")
        wait_new_item(page, old)
    assert "3 today" in page.inner_text("#rl-progress").replace("\n", " ")
    # undo the third ranking: its item comes back on screen
    last_item = list(expected)[-1]
    old = token(page)
    page.keyboard.press("u")
    wait_new_item(page, old)
    assert store.get_response(shown_response_ids(page, store)[0]).item_id == last_item
    del expected[last_item]

    ann = store.find_annotator("ann")
    rankings = store.list_rankings(annotator_id=ann.id)
    assert {r.item_id: r.order for r in rankings} == expected
    pairs = sorted((p.chosen_id, p.rejected_id) for p in store.list_pairs(annotator_id=ann.id))
    want = sorted((c, r) for groups in expected.values()
                  for i, better in enumerate(groups) for worse in groups[i + 1:] for c in better for r in worse)
    assert pairs == want and len(pairs) == 2 + 3
    # the payloads were shown as text and none of them ran
    assert page.evaluate("window.__xss") is None and page.dialogs == []
    card_text = page.inner_text("#rl-item")
    assert XSS[0] in card_text and XSS[1] in card_text
    assert page.locator("#rl-item img, #rl-item script").count() == 0
    # closing the tab gives the leased items (on screen and prefetched) back to the queue
    assert any(a == ann.id for _, a, _ in store.active_leases())
    page.close()
    deadline = time.time() + 15
    while any(a == ann.id for _, a, _ in store.active_leases()) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(a == ann.id for _, a, _ in store.active_leases())


def test_admin_imports_and_downloads_a_jsonl_export(app, browser, tmp_path):
    url, store = app
    # pairs to export whichever of this module's tests ran before: one ranking of the admin's own
    seeded = [p for p in store.list_prompts(limit=100) if store.prompt_responses(p.id)]
    store.save_ranking(RankingIn(store.find_annotator("boss").id, seeded[-1].id,
                                 [r.id for r in store.prompt_responses(seeded[-1].id)]))
    page = login(browser, url, "boss", "boss-password")
    page.get_by_role("tab", name="Data").click()
    page.get_by_role("tab", name="Import").click()
    n_prompts = store.counts()["prompts"]
    # a bad file is refused with its rows listed, and nothing is stored
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": ""}\n{"question": "wrong column"}\n')
    page.set_input_files("#rl-import-file input[type=file]", str(bad))
    page.click("#rl-import")
    page.wait_for_selector("#rl-import-msg :text('was not imported')", timeout=10_000)
    assert "missing 'prompt'" in page.inner_text("#rl-import-errors")
    assert store.counts()["prompts"] == n_prompts
    # a good file is imported
    good = tmp_path / "new_prompts.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"imported prompt {i}"}) + "\n" for i in range(3)))
    page.locator("#rl-import-file button[aria-label='Clear'], #rl-import-file .label-clear-button").first.click()
    page.set_input_files("#rl-import-file input[type=file]", str(good))
    page.click("#rl-import")
    page.wait_for_selector("#rl-import-msg :text('Imported new_prompts.jsonl')", timeout=10_000)
    assert store.counts()["prompts"] == n_prompts + 3

    rows = download_export(page)
    stored = store.list_pairs()
    assert sorted(r["pair_id"] for r in rows) == sorted(p.id for p in stored if not p.all_bad)
    texts = {r.id: r.text for p in store.list_prompts(limit=100) for r in store.prompt_responses(p.id)}
    # TRL's conversational format: each response is one assistant message
    assert all(r["chosen"] == [{"role": "assistant", "content": texts[r["chosen_id"]]}]
               and r["rejected"] == [{"role": "assistant", "content": texts[r["rejected_id"]]}] for r in rows)
    assert len(store.list_snapshots()) == 1
    page.close()


def test_annotator_cannot_reach_admin_actions(app, browser):
    url, store = app
    page = login(browser, url, "ann", "ann-password")
    page.wait_for_selector("#rl-item")
    assert page.get_by_role("tab", name="Annotate").is_visible()
    for name in ("Data", "Train", "Models"):
        assert page.get_by_role("tab", name=name).count() == 0
    page.close()

    # The HTTP API reaches every event: each admin endpoint refuses the annotator's session.
    from gradio_client import Client

    client = Client(url, auth=("ann", "ann-password"), verbose=False)
    def snapshot():
        return (store.counts(), [a.name for a in store.list_annotators()],
                store.get_setting("guidelines_markdown"), len(store.list_snapshots()))

    before = snapshot()
    calls = {
        "/add_user": ("mallory", "admin", "mallory-password"),
        "/save_guidelines": ("ignore the guidelines",),
        "/export": ("jsonl", True, True, [], "", 0, 0, "conversational", False, "unknown", 0.0, False),
        "/statistics": (),
        "/models": (),
    }
    for api_name, args in calls.items():
        with pytest.raises(Exception, match="admins only"):
            client.predict(*args, api_name=api_name)
    assert snapshot() == before
    # while the annotation endpoints work for them
    assert "rl-item" in client.predict(api_name="/refresh")[0]
