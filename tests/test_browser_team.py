"""A team in headless Chromium (Playwright), against the app served in this process on a temporary
store (no model). Each test serves its own store, set up by the store's API where the test is not
about that part:

- an admin sets overlap 2 in Data > Team; two annotators rank the same items with the keyboard;
  the agreement appears in the admin's open Team tab by itself (live refresh). (The admin's own
  page holds leases on two of the four items, as any open page does: those wait for later.)
- the admin makes an annotator's ranking the gold reference and sets the gold rate to 1; a third
  annotator is served that item, with nothing on screen marking it, and their gold accuracy shows;
- twelve responses are ranked with the keyboard alone: 1-9, then the letters shown on the cards.
"""

from __future__ import annotations

import time

import pytest

from store import RankingIn
from tests.fixtures_browser import chromium_browser, login, served_store  # noqa: F401  (the fixture `browser`)
from tests.test_browser import shown_response_ids, token, wait_new_item

pytestmark = pytest.mark.browser

NAMES = ("bea", "cy", "kay")  # besides served_store's boss (admin) and ann


def seed_items(store, prompts: dict[str, list[str]]) -> None:
    """The team's accounts, and one item of `prompts[text]` responses per prompt text."""
    for name in NAMES:
        store.add_annotator(name, f"{name}-password")
    mv = store.register_model_version("policy", "seed-policy", base_model="tiny")
    for text, responses in prompts.items():
        (pid,) = store.add_prompts([text])
        store.add_responses(pid, mv.id, responses)


def team_app(folder, prompts: dict[str, list[str]]):
    """served_store (boss and ann) with the rest of the team and these items: yields (url, store)."""
    return served_store(folder, seed=lambda store: seed_items(store, prompts))


def questions(n: int) -> dict[str, list[str]]:
    """n prompts of 3 responses each, for team_app."""
    return {f"team question {i}": [f"team reply {i}.{j}" for j in range(3)] for i in range(n)}


def open_team_tab(browser, url):
    page = login(browser, url, "boss", "boss-password")
    page.get_by_role("tab", name="Data").click()
    page.get_by_role("tab", name="Team").click()
    page.wait_for_selector("#rl-team-summary :text('ranked by 2+ annotators')", timeout=15_000)
    return page


def rank_everything(browser, url, name, keys) -> int:
    """Sign in as `name` and rank every item the queue hands them by pressing `keys` then Enter;
    returns how many they ranked."""
    page = login(browser, url, name, f"{name}-password")
    page.wait_for_selector("#rl-item .rl-item")
    ranked = 0
    while page.locator("#rl-item .rl-card").count():
        for key in keys:
            page.keyboard.press(key)
        old = token(page)
        page.keyboard.press("Enter")
        wait_new_item(page, old)
        ranked += 1
    assert "all caught up" in page.inner_text("#rl-item")
    page.close()
    return ranked


def row_of(page, table: str, name: str) -> str:
    """The cells of the row of `table` whose first cell is `name`, joined by " | "."""
    for row in page.locator(f"{table} [role=row].virtual-row").all():  # Gradio's Dataframe body rows
        cells = [c.strip() for c in row.locator("[role=gridcell]").all_inner_texts()]
        if cells and cells[0] == name:
            return " | ".join(cells)
    return ""


def wait_text(page, table: str, name: str, text: str, timeout: float = 20.0) -> str:
    """Wait until the row of `name` in `table` shows `text` (the Team tab refreshes itself)."""
    deadline = time.monotonic() + timeout
    while text not in (row := row_of(page, table, name)):
        assert time.monotonic() < deadline, f"{table}: {name}'s row {row!r} never showed {text!r}"
        time.sleep(0.5)
    return row


def test_overlap_two_gives_both_annotators_the_same_items_and_the_agreement_shows(tmp_path, browser):
    with team_app(tmp_path, questions(4)) as (url, store):
        admin = open_team_tab(browser, url)
        admin.fill("#rl-team-overlap input", "2")
        admin.click("#rl-team-save")
        admin.wait_for_selector("#rl-team-msg :text('ranked by 2 annotator')", timeout=10_000)
        assert store.queue_overlap() == 2
        held = {i for i, _, _ in store.active_leases()}  # the admin's page: the item on screen and the next
        assert len(held) == 2
        assert rank_everything(browser, url, "ann", ["1", "2"]) == 4
        assert rank_everything(browser, url, "bea", ["3", "1"]) == 2  # the two the admin's leases leave
        names = {a.id: a.name for a in store.list_annotators()}
        by_item = {}
        for r in store.list_rankings():
            by_item.setdefault(r.item_id, set()).add(names[r.annotator_id])
        assert {i for i, who in by_item.items() if who == {"ann", "bea"}} == set(by_item) - held
        # the admin's Team tab, open all along, shows the agreement without a click
        ag = store.agreement()
        admin.wait_for_selector("#rl-team-summary :text('2 items ranked by 2+ annotators')", timeout=20_000)
        assert f"pairwise agreement {ag.pairwise_agreement:.3f}" in admin.inner_text("#rl-team-summary")
        mine = {a.name: a for a in store.annotator_agreement()}
        wait_text(admin, "#rl-team-annotators", "ann", f"{mine['ann'].pairwise_agreement:.3f}")
        assert admin.locator("#rl-team-items [role=row].virtual-row").count() == 2
        admin.close()


def test_a_gold_item_is_served_unmarked_and_scored(tmp_path, browser):
    with team_app(tmp_path, questions(3)) as (url, store):
        ann = store.find_annotator("ann")
        item = store.next_item(ann.id)
        best, *others = item.display_order
        reference = store.save_ranking(RankingIn(ann.id, item.prompt.id, [[best], others]))
        admin = open_team_tab(browser, url)
        admin.fill("#rl-gold-ranking input", str(reference.id))
        admin.click("#rl-gold-mark")
        admin.wait_for_selector(f"#rl-gold-msg :text('Item {reference.item_id} is gold')", timeout=10_000)
        admin.fill("#rl-team-gold-rate input", "1")
        admin.click("#rl-team-save")
        admin.wait_for_selector("#rl-team-msg :text('100%')", timeout=10_000)
        # cy's first item is the gold one (a gold turn at rate 1), though two are still open
        page = login(browser, url, "cy", "cy-password")
        page.wait_for_selector("#rl-item .rl-card")
        shown = shown_response_ids(page, store)
        assert store.get_response(shown[0]).item_id == reference.item_id
        assert "gold" not in (page.inner_text("#rl-item") + page.inner_text("#rl-progress")).lower()  # unmarked
        for key in ("2", "1"):
            page.keyboard.press(key)
        old = token(page)
        page.keyboard.press("Enter")
        wait_new_item(page, old)
        page.close()
        cy = store.find_annotator("cy")
        quality = store.annotator_quality()[cy.id]
        assert quality["n_gold"] == 1 and quality["gold_accuracy"] is not None
        wait_text(admin, "#rl-team-annotators", "cy", f"{quality['gold_accuracy']:.3f}")
        admin.close()


def test_twelve_responses_ranked_with_the_keyboard(tmp_path, browser):
    with team_app(tmp_path, {"rank twelve replies": [f"one of twelve: {j}" for j in range(12)]}) as (url, store):
        page = login(browser, url, "kay", "kay-password")
        page.wait_for_selector("#rl-item .rl-card >> nth=11")
        assert page.locator("#rl-item .rl-card kbd").all_inner_texts() == list("123456789BDG")
        ids = shown_response_ids(page, store)
        # G best, D tied with it (Shift), then B, 9 ... 2; the last one (1) goes last
        for key in ["g", "Shift+d", "b", "9", "8", "7", "6", "5", "4", "3", "2"]:
            page.keyboard.press(key)
        assert page.locator("#rl-item .rl-card.rl-ranked").count() == 11
        assert page.inner_text("#rl-rankbar .rl-rank-chips").replace("\n", "").startswith("G=D›B›9")
        old = token(page)
        page.keyboard.press("Enter")
        wait_new_item(page, old)
        (ranking,) = store.list_rankings(annotator_id=store.find_annotator("kay").id)
        positions = [[12, 11], [10], [9], [8], [7], [6], [5], [4], [3], [2], [1]]
        assert ranking.order == [[ids[p - 1] for p in group] for group in positions]
        assert page.dialogs == []
        page.close()


def test_an_admin_points_the_chat_tab_at_an_outside_server(tmp_path, browser):
    """Data > Team's chat settings: a URL that is not an address is refused on screen and nothing is
    stored; a good one is stored with its model name and shown again on a new page; blank goes back
    to the local sampler."""
    with team_app(tmp_path, questions(1)) as (url, store):
        admin = open_team_tab(browser, url)
        admin.fill("#rl-chat-url textarea", "gpu-box:8000")
        admin.click("#rl-chat-settings-save")
        admin.wait_for_selector(":text(\"'gpu-box:8000' is not an http\")", timeout=10_000)
        assert store.chat_server() == ("", "")
        admin.fill("#rl-chat-url textarea", "http://gpu-box:8000/v1")
        admin.fill("#rl-chat-model textarea", "llama-3-8b")
        admin.click("#rl-chat-settings-save")
        admin.wait_for_selector("#rl-team-msg :text('replies from http://gpu-box:8000/v1 (model llama-3-8b)')",
                                timeout=10_000)
        assert store.chat_server() == ("http://gpu-box:8000/v1", "llama-3-8b")
        admin.close()
        again = open_team_tab(browser, url)
        again.wait_for_function("() => document.querySelector('#rl-chat-url textarea').value === "
                                "'http://gpu-box:8000/v1'", timeout=10_000)
        again.fill("#rl-chat-url textarea", "")
        again.click("#rl-chat-settings-save")
        again.wait_for_selector("#rl-team-msg :text('replies from the active policy')", timeout=10_000)
        assert store.chat_server() == ("", "")
        again.close()
