"""The app as a process: it never imports torch, and a kill -9 while a job runs loses nothing.

Both run the app in a subprocess, as a user does: the first in a script that builds the UI, serves
it and calls an endpoint; the second with `python app.py` itself, killed with SIGKILL while its
first-batch generation job is writing chunks.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from store import Store
from tests.helpers import alive, free_port, req, wait_for

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "accelerate")

SERVE_AND_CALL = textwrap.dedent("""
    import json, sys
    from annotate import bootstrap
    from annotate.context import AppContext
    from annotate.ui import build_ui, launch
    from pipeline.orchestrate.loop import make_runner
    from store import Store

    db, port = sys.argv[1], int(sys.argv[2])
    store = Store(db)
    jobs = make_runner(store, store.path.parent / "runs")
    bootstrap.ensure_admin(store, auth=False)
    store.add_prompts(["say hi", "count to 3"])
    ctx = AppContext(store=store, auth=False, data_dir=store.path.parent, jobs=jobs)
    demo = build_ui(ctx)
    launch(demo, ctx, port=port, prevent_thread_lock=True, quiet=True)
    from gradio_client import Client

    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    counts = client.predict(api_name="/statistics")[0]
    print(json.dumps({"served": bool(counts), "heavy": sorted(m for m in sys.modules
                                                             if m.split(".")[0] in %r)}))
    demo.close()
    jobs.shutdown()
    store.close()
""" % (HEAVY,))


def test_the_app_process_never_imports_torch(tmp_path):
    out = subprocess.run([sys.executable, "-c", SERVE_AND_CALL, str(tmp_path / "rlhf.duckdb"), str(free_port())],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("{")]
    result = json.loads(line)
    assert result == {"served": True, "heavy": []}


def test_no_model_code_in_the_app_package():
    """Nothing under annotate/ or in app.py imports torch or loads a model."""
    sources = [ROOT / "app.py", *sorted((ROOT / "annotate").glob("*.py"))]
    for path in sources:
        text = path.read_text(encoding="utf-8")
        for needle in ("import torch", "from torch", "from_pretrained", "load_policy", "load_scalar_model",
                       "from pipeline.generate", "from pipeline.responses", "from pipeline.models"):
            assert needle not in text, f"{path.name}: {needle}"


@pytest.mark.slow
def test_a_kill_9_of_the_app_during_generation_leaves_store_and_run_consistent(tmp_path, tiny_model_dir):
    db = tmp_path / "rlhf.duckdb"
    runs = tmp_path / "runs"
    cmd = [sys.executable, "app.py", "--db", str(db), "--port", str(free_port()), "--no-auth",
           "--model", str(tiny_model_dir), "--device", "cpu", "--k", "2", "--first-batch", "600",
           "--max-new-tokens", "48"]
    app = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # the first-batch job has written two chunks: the app has had the first one to ingest
        wait_for(lambda: any(runs.glob("*-generate/chunks/00001.jsonl")), timeout=180,
                 what="the generate job's second chunk")
        wait_for(lambda: any(runs.glob("*-generate/chunks/00002.jsonl")), timeout=60,
                 what="the generate job's third chunk")
        time.sleep(2.0)  # four of the runner's 0.5 s polls: the app has ingested a chunk or more
    finally:
        app.send_signal(signal.SIGKILL)
        app.wait()

    store = Store(db)
    try:
        (run,) = store.list_runs(kind="generate")
        assert run.status == "running"  # nobody has recovered it yet
        # the orphaned job stops by itself: its owner is gone
        wait_for(lambda: not alive(run.outputs["pid"]), timeout=20, what="the orphaned job to stop")
        chunks = len(list((Path(run.run_dir) / "chunks").glob("*.jsonl")))
        per_chunk = json.loads((Path(run.run_dir) / "config.json").read_text())["chunk_prompts"]
        assert chunks * per_chunk < 600  # it was stopped part-way
        # whole chunks only: every item has its K responses, all by the first policy
        counts = store.counts()
        assert counts["items"] >= per_chunk and counts["responses"] == 2 * counts["items"]
        assert counts["items"] % per_chunk == 0 and counts["items"] <= per_chunk * chunks

        # the next owner settles it, and the Data tab says what became of it
        from annotate import admin
        from annotate.context import AppContext
        from pipeline.orchestrate.loop import make_runner

        jobs = make_runner(store, runs)
        try:
            run = store.get_run(run.id)
            assert run.status == "failed" and "interrupted" in run.error
            html = admin.job_html(AppContext(store=store, auth=False, jobs=jobs), req(None))
            assert 'data-status="failed"' in html and "interrupted" in html
            assert store.counts() == counts
        finally:
            jobs.shutdown()
    finally:
        store.close()


def test_the_apps_chat_sampler_starts_at_the_first_message_and_stops_with_the_app(tmp_path, tiny_model_dir):
    """app.py builds its ChatService without starting anything; the first Chat message starts the
    sampler, a process of its own (the app stays without torch), and stopping the app stops it."""
    port = free_port()
    cmd = [sys.executable, "app.py", "--db", str(tmp_path / "rlhf.duckdb"), "--port", str(port), "--no-auth",
           "--model", str(tiny_model_dir), "--device", "cpu", "--no-generate", "--max-new-tokens", "8"]
    app = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    chat_dir = tmp_path / "runs" / "chat"
    try:
        from gradio_client import Client

        wait_for(lambda: _listening(port), timeout=120, what="the app to listen")
        assert not chat_dir.exists()  # nothing started before the first message
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        status, body, message, *_ = client.predict("Say hi.", api_name="/chat_send")  # the state stays on the server
        assert "of 8 turns" in status and 'data-k="4"' in body and message == ""
        (sampler_dir,) = chat_dir.iterdir()
        sampler_pid = json.loads((sampler_dir / "status.json").read_text())["pid"]
        assert alive(sampler_pid)
        # the model is in the sampler's process, not the app's
        assert "libtorch" in Path(f"/proc/{sampler_pid}/maps").read_text()
        assert "libtorch" not in Path(f"/proc/{app.pid}/maps").read_text()
    finally:
        app.send_signal(signal.SIGTERM)
        _, err = app.communicate(timeout=120)
    assert app.returncode == 0, err[-3000:]
    assert not alive(sampler_pid)  # closed with the app, not left behind


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_chat_url_that_is_not_an_address_stops_the_app_naming_it(tmp_path):
    """--chat-url sets the store's chat server (as Data > Team does): a bad one is refused before
    anything starts, exit code 2, and nothing is stored."""
    db = tmp_path / "rlhf.duckdb"
    out = subprocess.run([sys.executable, "app.py", "--db", str(db), "--no-auth", "--no-generate",
                          "--chat-url", "localhost:8000/v1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "--chat-url: the chat server URL 'localhost:8000/v1' is not an http" in out.stderr
    store = Store(db)
    try:
        assert store.chat_server() == ("", "")
    finally:
        store.close()
