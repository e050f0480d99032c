"""An annotator's own answer, in headless Chromium (Playwright) against the served app: the annotator
presses ✎ Edit on a response, rewrites it, ranks it with the keyboard (E) above the others and
submits; the admin's export holds it twice: in the pairs (model 'human edit', above the response it
was written from) and in the demonstrations file (TRL's SFT conversational format)."""

from __future__ import annotations

import json

import pytest

from tests.fixtures_browser import chromium_browser, downloaded_files, login, served_store  # noqa: F401  (the fixture `browser`)

pytestmark = pytest.mark.browser
ANSWER = "Paris is the capital of France, on the Seine."


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(url, store) of the app served in this process with one item of three responses."""
    def seed(store):
        mv = store.register_model_version("policy", "seed-policy", base_model="tiny")
        (pid,) = store.add_prompts(["What is the capital of France?"])
        store.add_responses(pid, mv.id, ["Lyon.", "Paris.", "France has no capital."])

    with served_store(tmp_path_factory.mktemp("app"), seed) as app:
        yield app


def test_an_own_answer_reaches_the_pairs_and_the_demonstrations(app, browser, tmp_path):
    url, store = app
    page = login(browser, url, "ann", "ann-password")
    page.wait_for_selector("#rl-item .rl-card")
    texts = [t.strip() for t in page.locator("#rl-item .rl-card .rl-text").all_inner_texts()]
    source = texts.index("Paris.") + 1  # its display position
    # ✎ Edit copies the card's text into the answer box; the annotator rewrites it
    page.click(f"#rl-item .rl-edit-from[data-pos='{source}']")
    assert page.input_value("#rl-edit-text") == "Paris."
    page.fill("#rl-edit-text", ANSWER)
    page.keyboard.press("Escape")  # out of the box: the keys rank again
    # the ranking: the own answer (E) first, then Paris., then the rest
    page.keyboard.press("e")
    assert "✎" in page.inner_text("#rl-rankbar") and "ranked 1st" in page.inner_text("#rl-edit-from")
    page.keyboard.press(str(source))
    others = [p for p in range(1, 4) if p != source]
    page.keyboard.press(str(others[0]))
    old = page.get_attribute("#rl-item .rl-item", "data-token") or ""
    page.keyboard.press("Enter")
    page.wait_for_function("old => { const it = document.querySelector('#rl-item .rl-item'); "
                           "return !it || it.dataset.token !== old; }", arg=old, timeout=10_000)
    # emptied once the item is gone (here the queue's last: Gradio updates the item in place)
    page.wait_for_function("() => document.querySelector('#rl-edit-text').value === ''", timeout=5_000)
    assert "✎" not in page.inner_text("#rl-rankbar")
    page.close()

    admin = login(browser, url, "boss", "boss-password")
    admin.get_by_role("tab", name="Data").click()
    admin.get_by_role("tab", name="Export").click()
    admin.click("#rl-export")
    files = downloaded_files(admin)
    assert "1 demonstrations" in admin.inner_text("#rl-export-msg")
    admin.close()
    pairs_name = next(n for n in files if n.endswith(".jsonl") and "rankings" not in n and "demonstrations" not in n)
    pairs = [json.loads(line) for line in files[pairs_name].splitlines()]
    mine = [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs if p["source"] == "edit"]
    assert sorted(mine) == sorted([(ANSWER, "Paris."), (ANSWER, texts[others[0] - 1]), (ANSWER, texts[others[1] - 1])])
    assert {p["chosen_model"] for p in pairs if p["chosen"][0]["content"] == ANSWER} == {"human edit"}
    (demo,) = [json.loads(line) for line in files["demonstrations.jsonl"].splitlines()]
    assert demo["messages"] == [{"role": "user", "content": "What is the capital of France?"},
                                {"role": "assistant", "content": ANSWER}]
    assert demo["annotator"] == "ann" and demo["edit_of_model"] == "seed-policy"
