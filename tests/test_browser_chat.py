"""The Chat tab in headless Chromium (Playwright) against the served app, its replies sampled by the
real chat sampler on the tiny model: an annotator holds a conversation of 3 turns, ranks the
replies of each with the keyboard and, at the second, ranks a reply they edited (✎ Edit) first;
the conversation goes on from the best reply each time and ends at its last turn. The admin's
export then holds the conversation's 3 turns, each with the history so far as its prompt, the
pairs of each ranking, and the edited answer in the demonstrations."""

from __future__ import annotations

import json

import pytest

from annotate.context import AppContext
from pipeline.config import ModelConfig
from pipeline.orchestrate.chat import ChatService
from store import Store
from tests.fixtures_browser import chromium_browser, downloaded_files, login, serve  # noqa: F401  (the fixture `browser`)
from tests.helpers import tiny_settings

pytestmark = [pytest.mark.browser, pytest.mark.usefixtures("one_thread")]
MESSAGES = ["How can I shop?", "Where is the nearest market?", "Thanks, and for bread?"]
EDIT = "Try the market on the square: it opens at eight."
LOAD_MS = 300_000
"""The first message waits for the sampler to start and load the model (seconds on a loaded machine)."""


@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny_model_dir):
    """(url, store) of the app served in this process, with a chat sampler on the tiny model, 3
    replies per turn and conversations of 3 turns."""
    folder = tmp_path_factory.mktemp("app")
    store = Store(folder / "rlhf.duckdb")
    settings = tiny_settings(tiny_model_dir)
    service = ChatService(store, folder / "runs", timeout_s=120.0, start_timeout_s=LOAD_MS / 1000,
                          model_cfg=ModelConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32"),
                          generate=settings.generate)
    try:
        store.add_annotator("boss", "boss-password", role="admin")
        store.add_annotator("ann", "ann-password")
        store.set_chat_settings(replies=3, max_turns=3)
        with serve(AppContext(store=store, auth=True, data_dir=folder, chat=service, train_settings=settings)) as url:
            yield url, store
    finally:
        service.close()
        store.close()


def replies_on_screen(page, turn: int) -> None:
    """Wait until the turn's 3 replies are shown to rank."""
    page.wait_for_function(f"() => document.querySelectorAll('#rl-chat-item .rl-card').length === 3 && "
                           f"document.querySelector('#rl-chat-status').innerText.includes('{turn} of 3 turns')",
                           timeout=LOAD_MS)


def send(page, text: str) -> None:
    page.fill("#rl-chat-message textarea", text)
    page.click("#rl-chat-send")


def submit(page) -> None:
    """Enter submits the ranking; wait until the replies have left the screen."""
    page.keyboard.press("Enter")
    page.wait_for_function("() => !document.querySelector('#rl-chat-item .rl-card')", timeout=20_000)


def test_a_three_turn_conversation_is_exported_turn_by_turn(app, browser):
    url, store = app
    page = login(browser, url, "ann", "ann-password")
    page.get_by_role("tab", name="Chat").click()

    # turn 1: rank 2 > 3 > 1 with the keys
    send(page, MESSAGES[0])
    replies_on_screen(page, 1)
    page.evaluate("document.activeElement.blur()")  # out of the message box: the keys rank
    for key in "231":
        page.keyboard.press(key)
    submit(page)

    # turn 2: ✎ Edit the third reply, rank the own answer first, then 3 > 1 > 2
    send(page, MESSAGES[1])
    replies_on_screen(page, 2)
    page.click("#rl-chat-item .rl-edit-from[data-pos='3']")
    edited = page.input_value("#rl-chat-edit-text")
    page.fill("#rl-chat-edit-text", EDIT)
    page.keyboard.press("Escape")  # out of the box: the keys rank again
    for key in "e312":
        page.keyboard.press(key)
    assert "✎" in page.inner_text("#rl-chat-rankbar")
    submit(page)
    assert EDIT in page.inner_text("#rl-chat-item")  # the conversation goes on from the own answer

    # turn 3, the last: rank 1 > 2 > 3; the conversation ends
    send(page, MESSAGES[2])
    replies_on_screen(page, 3)
    page.evaluate("document.activeElement.blur()")
    for key in "123":
        page.keyboard.press(key)
    submit(page)
    page.wait_for_function("() => document.querySelector('#rl-chat-status').innerText.includes('is ended')",
                           timeout=20_000)
    assert not page.dialogs
    page.close()

    # what each turn showed, in its display order, as stored (the tiny model's replies are random
    # bytes, which the page's text does not give back exactly)
    ann = store.find_annotator("ann").id
    (conversation,) = store.list_conversations(ann)
    assert conversation.status == "ended"
    turns = store.conversation_turns(conversation.id)
    shown = [[r.text for r in store.get_item(t.item_id, ann).responses] for t in turns]
    assert edited == shown[1][2]  # ✎ Edit started from the reply's own text
    chosen = [shown[0][1], EDIT, shown[2][0]]
    assert [t.reply for t in turns] == chosen

    files = export(browser, url)
    pairs = [p for p in rows(files, "pairs") if p["conversation_id"] == conversation.id]
    by_turn = {t: [p for p in pairs if p["turn"] == t] for t in (1, 2, 3)}
    # each turn's prompt is the conversation so far: the messages, each earlier turn's chosen reply
    for turn, turn_pairs in by_turn.items():
        history = []
        for i in range(turn - 1):
            history += [{"role": "user", "content": MESSAGES[i]}, {"role": "assistant", "content": chosen[i]}]
        history.append({"role": "user", "content": MESSAGES[turn - 1]})
        assert turn_pairs and all(p["prompt"] == history for p in turn_pairs)
    # the pairs of each ranking: 3 of 3 replies; at turn 2, 3 more of the own answer above each reply
    one, two, three = shown
    assert pair_texts(by_turn[1]) == {(one[1], one[2]), (one[1], one[0]), (one[2], one[0])}
    assert pair_texts(by_turn[2]) == {(two[2], two[0]), (two[2], two[1]), (two[0], two[1]),
                                      (EDIT, two[2]), (EDIT, two[0]), (EDIT, two[1])}
    assert pair_texts(by_turn[3]) == {(three[0], three[1]), (three[0], three[2]), (three[1], three[2])}
    rankings = [r for r in rows(files, "rankings") if r["conversation_id"] == conversation.id]
    assert sorted(r["turn"] for r in rankings) == [1, 2, 3]
    (demo,) = [d for d in rows(files, "demonstrations") if d["conversation_id"] == conversation.id]
    assert demo["turn"] == 2 and demo["annotator"] == "ann"
    assert demo["messages"] == [*by_turn[2][0]["prompt"], {"role": "assistant", "content": EDIT}]


def pair_texts(pairs: list[dict]) -> set[tuple[str, str]]:
    return {(p["chosen"][-1]["content"], p["rejected"][-1]["content"]) for p in pairs}


def export(browser, url) -> dict[str, str]:
    """Data > Export as the admin, with the form as it is: {file name: text} of every file offered."""
    admin = login(browser, url, "boss", "boss-password")
    admin.get_by_role("tab", name="Data").click()
    admin.get_by_role("tab", name="Export").click()
    admin.click("#rl-export")
    files = downloaded_files(admin)
    admin.close()
    return files


def rows(files: dict[str, str], kind: str) -> list[dict]:
    """The JSONL rows of the export's pairs, rankings or demonstrations file."""
    def kind_of(name: str) -> str:
        return next((k for k in ("rankings", "demonstrations") if k in name), "pairs")

    (name,) = [n for n in files if n.endswith(".jsonl") and kind_of(n) == kind]
    return [json.loads(line) for line in files[name].splitlines()]
