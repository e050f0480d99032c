"""The Train and Models tabs in headless Chromium (Playwright), with a real job runner on a tiny model.

An admin clicks "Train reward model": a snapshot of the seeded pairs is exported, a train-reward
subprocess job runs, the progress bar moves and reaches done, and the new reward model shows up in
the Models tab. "Run a full round" on an under-ranked round asks first; Confirm proceeds.
"""

from __future__ import annotations

import json
import time

import pytest

from store import Store
from store.io import import_pairs
from tests.fixtures_browser import chromium_browser, login, serve  # noqa: F401  (the fixture `browser`)
from tests.helpers import tiny_settings
from tests.test_loop_dpo import open_round

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny_model_dir):
    """(url, store) of the app served in this process, with a job runner whose jobs use the tiny model."""
    from annotate.context import AppContext
    from pipeline.orchestrate.loop import make_runner

    folder = tmp_path_factory.mktemp("train_app")
    store = Store(folder / "rlhf.duckdb")
    store.add_annotator("boss", "boss-password", role="admin")
    pairs = folder / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({
        "prompt": f"How can I shop for the lowest prices, question {i}?",
        "chosen": "Compare stores, use coupons and buy in bulk.", "rejected": "No."}) + "\n" for i in range(40)))
    import_pairs(store, pairs)
    runner = make_runner(store, folder / "runs", poll_s=0.2)
    ctx = AppContext(store=store, auth=True, data_dir=folder, jobs=runner)
    ctx.train_settings = tiny_settings(tiny_model_dir)
    with serve(ctx) as url:
        yield url, store
        runner.shutdown()
    store.close()


BAR_STATE_JS = """() => {
    const job = document.querySelector('#rl-train-job .rl-job');
    if (!job) return [null, null];
    const fill = job.querySelector('.rl-bar-fill');
    const width = /width:\\s*([\\d.]+)%/.exec(fill ? fill.getAttribute('style') || '' : '');
    return [job.getAttribute('data-status'), width ? parseFloat(width[1]) : null];
}"""


def bar_state(page) -> tuple[str | None, float | None]:
    """(data-status, fill width in %) of the monitor's progress bar, read in one evaluation: the
    page's timer replaces the bar between two separate reads (a 'done' read beside the width of
    the 'running' bar it replaced)."""
    status, width = page.evaluate(BAR_STATE_JS)
    return status, width


def test_admin_trains_a_reward_model_and_sees_it_in_the_models_tab(app, browser):
    url, store = app
    page = login(browser, url, "boss", "boss-password")
    page.get_by_role("tab", name="Train").click()
    # 30 training pairs, 4 per step (the settings' batch), 12 epochs: 96 short steps, several
    # seconds even on a fast machine, so the 1 s timer sees the bar part-way
    page.get_by_label("Epochs", exact=True).fill("12")  # the reward form's, not "DPO epochs"
    page.click("#rl-train-reward")
    page.wait_for_selector("#rl-train-msg :text('Queued run #')", timeout=20_000)

    # the progress bar, polled by the page's timer, moves and reaches done
    seen: list[tuple[str, float]] = []
    deadline = time.monotonic() + 600  # generous: a loaded CI machine trains slowly
    while time.monotonic() < deadline:
        status, width = bar_state(page)
        if status is not None and width is not None and (not seen or seen[-1] != (status, width)):
            seen.append((status, width))
        if status in ("done", "failed", "cancelled"):
            break
        time.sleep(0.1)
    assert seen and seen[-1] == ("done", 100.0), seen
    moving = [w for s, w in seen if s == "running" and 0 < w < 100]
    assert moving, f"never saw the bar part-way: {seen}"
    widths = [w for s, w in seen if s in ("running", "done")]
    assert widths == sorted(widths), seen
    (run,) = store.list_runs(kind="train-reward")
    assert run.status == "done"
    # the finished run keeps its plots and log
    page.wait_for_function("() => document.querySelector('#rl-train-log textarea').value.includes('checkpoint')",
                           timeout=20_000)
    assert page.locator(".rl-train-plot:visible").count() >= 2  # losses, accuracy, margin

    # the Models tab lists the new version, with the snapshot it was trained on
    (reward,) = store.list_model_versions("reward")
    page.get_by_role("tab", name="Models").click()
    page.wait_for_function("name => document.querySelector('#rl-models').innerText.includes(name)",
                           arg=reward.name, timeout=20_000)
    table = page.inner_text("#rl-models")
    assert f"#{reward.snapshot_id} ({store.get_snapshot(reward.snapshot_id).counts['pairs']} pairs)" in table
    assert f"#{run.id} train-reward" in table
    page.close()


def test_finishing_an_under_ranked_round_asks_first(app, browser, tiny_model_dir):
    """Run a full round on a round with none of its items ranked: a confirmation naming R of M and
    the threshold appears and nothing starts; Confirm starts the round's policy step (DPO here)."""
    url, store = app
    rnd, _ = open_round(store, tiny_model_dir)
    page = login(browser, url, "boss", "boss-password")
    page.get_by_role("tab", name="Train").click()
    page.locator("#rl-policy-step").get_by_text("DPO", exact=True).click()
    page.click("#rl-run-round")
    asked = f"Round {rnd.id} has 0 of 6 items ranked (threshold 6): finish anyway?"
    page.wait_for_selector(f"#rl-round-confirm-text :text('{asked}')", timeout=20_000)
    assert store.list_runs(kind="train-dpo") == [] and store.get_round(rnd.id).status == "annotating"

    page.click("#rl-round-confirm-yes")
    page.wait_for_selector(f"#rl-train-msg :text('Training on round {rnd.id} (DPO on its pairs')", timeout=20_000)
    page.wait_for_selector("#rl-round-confirm", state="hidden", timeout=10_000)
    (run,) = store.list_runs(kind="train-dpo")
    assert run.inputs["round_id"] == rnd.id and store.get_round(rnd.id).status == "training"
    page.close()
