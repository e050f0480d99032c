"""Regenerate the Argilla 2.x export fixtures in this folder.

Every export file here is written by Argilla's own code, not by hand:

* a real Argilla server (the ``argilla-server`` package, same version as the
  ``argilla`` SDK) runs in-process on 127.0.0.1 with a throw-away SQLite
  database; only its search engine (Elasticsearch) is replaced by a no-op
  stub, because the endpoints used here read and write the SQL database only;
* the dataset and records are created with the ``argilla`` SDK;
* human annotations are POSTed to the server exactly as the Argilla web UI
  sends them (``POST /api/v1/records/{id}/responses``, body built like
  ``RecordRepository.createRequest`` in argilla-frontend);
* the SDK exports (``Dataset.to_disk``, ``records.to_datasets``,
  ``records.to_list``, ``Dataset.to_hub``) and the server-side job behind the
  UI's "Export to Hub" button (``export_dataset_to_hub_job`` ->
  ``HubDatasetExporter``) run unmodified. Only the network calls to the
  Hugging Face Hub are replaced: ``datasets.Dataset.push_to_hub`` writes the
  same parquet shard path locally (``data/train-00000-of-00001.parquet``, via
  ``Dataset.to_parquet``, the call push_to_hub makes per shard) and
  ``HfApi.upload_folder`` copies the folder locally.

Usage (needs network access to PyPI only for the install):

    python -m venv venv && venv/bin/pip install "argilla==2.8.0" "argilla-server==2.8.0"
    venv/bin/python make_fixtures.py            # rewrites the fixtures next to this file

UUIDs are made reproducible by seeding ``uuid.uuid4``; timestamps
(inserted_at/updated_at/last_activity_at) change on every run.
"""

import asyncio
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

# argilla's records.to_list()/to_datasets() order some columns by iterating a
# set of strings, so the column order depends on PYTHONHASHSEED: pin it.
if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable] + sys.argv)

# ---------------------------------------------------------------------------
# Reproducible ids: must happen before argilla / argilla_server are imported
# (they bind uuid4 at import time in default values).
_rng = random.Random(20250101)
uuid.uuid4 = lambda: uuid.UUID(int=_rng.getrandbits(128), version=4)

HERE = Path(__file__).resolve().parent
WORK = Path(tempfile.mkdtemp(prefix="argilla-fixtures-"))

os.environ.update(
    {
        "ARGILLA_HOME_PATH": str(WORK / "home"),
        "ARGILLA_DATABASE_URL": f"sqlite:///{WORK / 'argilla.db'}",
        "ARGILLA_ENABLE_TELEMETRY": "0",
        "HF_HOME": str(WORK / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
)

import httpx  # noqa: E402
import uvicorn  # noqa: E402
import datasets  # noqa: E402
import huggingface_hub  # noqa: E402

import argilla as rg  # noqa: E402
from argilla_server._version import __version__ as SERVER_VERSION  # noqa: E402
from argilla_server import _app  # noqa: E402
from argilla_server.database import ALEMBIC_CONFIG_FILE  # noqa: E402
from argilla_server.search_engine.base import SearchEngine  # noqa: E402
from argilla_server.settings import settings as server_settings  # noqa: E402

OWNER_API_KEY = "owner.apikey.fixture"
ALICE_API_KEY = "alice.apikey.fixture"
BOB_API_KEY = "bob.apikey.fixture"
WORKSPACE = "argilla"
DATASET_NAME = "rlhf-ranking-fixture"
OPTIONS = ["response-1", "response-2", "response-3"]


# ---------------------------------------------------------------------------
# Server side stubs: no Elasticsearch, no Hugging Face Hub.
class NoopSearchEngine(SearchEngine):
    @classmethod
    async def new_instance(cls):
        return cls()

    async def close(self):
        pass

    async def ping(self):
        return True

    async def info(self):
        return {}

    async def _noop(self, *args, **kwargs):
        return None

    create_index = delete_index = configure_metadata_property = _noop
    index_records = partial_record_update = delete_records = _noop
    update_record_response = delete_record_response = _noop
    update_record_suggestion = delete_record_suggestion = _noop
    configure_index_vectors = _noop

    async def get_dataset_progress(self, *args, **kwargs):
        return {}

    async def get_dataset_user_progress(self, *args, **kwargs):
        return {}

    async def search(self, *args, **kwargs):
        raise NotImplementedError("search is not available in the fixture server")

    async def compute_metrics_for(self, *args, **kwargs):
        raise NotImplementedError

    async def similarity_search(self, *args, **kwargs):
        raise NotImplementedError


SearchEngine.registered_classes[server_settings.search_engine] = NoopSearchEngine


async def _noop_async():
    return None


_app.configure_search_engine = _noop_async
_app.configure_redis = lambda: None

# No Redis/rq worker: the only job enqueued in this flow is the one that PATCH
# /datasets/{id} (called by Dataset.create) schedules to recompute the status of
# records that already have responses; at that point the dataset has none.
from argilla_server.jobs import dataset_jobs  # noqa: E402

dataset_jobs.update_dataset_records_status_job.delay = lambda *a, **k: None

# Where the stubbed Hub calls write, keyed by repo_id.
HUB_TARGETS = {}


def _fake_push_to_hub(self, repo_id, config_name="default", split=None, data_dir=None, **kwargs):
    split = str(split or self.split or "train")
    data_dir = data_dir or (config_name if config_name != "default" else "data")
    target = HUB_TARGETS[repo_id] / data_dir / f"{split}-00000-of-00001.parquet"
    target.parent.mkdir(parents=True, exist_ok=True)
    self.to_parquet(str(target))


def _fake_upload_folder(self, *, repo_id, folder_path, **kwargs):
    shutil.copytree(folder_path, HUB_TARGETS[repo_id], dirs_exist_ok=True)


datasets.Dataset.push_to_hub = _fake_push_to_hub
huggingface_hub.HfApi.upload_folder = _fake_upload_folder
huggingface_hub.HfApi.create_repo = lambda self, *a, **k: None


# ---------------------------------------------------------------------------
def start_server():
    import alembic.config

    alembic.config.main(argv=["-c", ALEMBIC_CONFIG_FILE, "upgrade", "head"])

    from argilla_server.cli.database.users.create import _create
    from argilla_server.enums import UserRole

    async def create_users():
        await _create("Owner", "owner", UserRole.owner, "12345678", api_key=OWNER_API_KEY, workspace=[WORKSPACE])
        await _create("Alice", "alice", UserRole.annotator, "12345678", api_key=ALICE_API_KEY, workspace=[WORKSPACE])
        await _create("Bob", "bob", UserRole.annotator, "12345678", api_key=BOB_API_KEY, workspace=[WORKSPACE])

    asyncio.run(create_users())

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(_app.create_server_app(), host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    else:
        raise RuntimeError("argilla server did not start")
    return server, thread, f"http://127.0.0.1:{port}"


def ui_response(api_url, api_key, record_server_id, status, ranks, settings_options):
    """Send a response the way the Argilla web UI does.

    The UI keeps the ranking options in the question's option order and only sets
    ``rank`` on each (``RankingQuestionAnswer.valuesAnswered`` returns all options,
    unranked ones with ``rank: null``); ``createRequest`` only includes questions
    that are fully or partially answered, so an untouched question is omitted.
    """
    values = {}
    if ranks:
        values["ranking"] = {
            "value": [
                {**opt, "id": f"ranking_{opt['value']}", "rank": ranks.get(opt["value"])} for opt in settings_options
            ]
        }
    r = httpx.post(
        f"{api_url}/api/v1/records/{record_server_id}/responses",
        headers={"X-Argilla-Api-Key": api_key},
        json={"status": status, "values": values},
    )
    r.raise_for_status()


def dump_json(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def main():
    server, thread, api_url = start_server()
    try:
        run(api_url)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        shutil.rmtree(WORK, ignore_errors=True)


def run(api_url):
    client = rg.Argilla(api_url=api_url, api_key=OWNER_API_KEY)
    alice = client.users("alice")
    bob = client.users("bob")

    settings = rg.Settings(
        fields=[
            rg.TextField(name="prompt"),
            rg.TextField(name="response-1"),
            rg.TextField(name="response-2"),
            rg.TextField(name="response-3"),
        ],
        questions=[rg.RankingQuestion(name="ranking", values=OPTIONS)],
    )
    dataset = rg.Dataset(name=DATASET_NAME, workspace=WORKSPACE, settings=settings, client=client)
    dataset.create()

    def rec(i, prompt, **kw):
        return rg.Record(
            id=i,
            fields={
                "prompt": prompt,
                "response-1": f"{prompt} -> answer A",
                "response-2": f"{prompt} -> answer B",
                "response-3": f"{prompt} -> answer C",
            },
            **kw,
        )

    # The SDK only accepts a *submitted* ranking response when it carries ranks:
    # plain values (["response-3", ...]) are sent as [{"value": ...}] (rank None)
    # and the server rejects them. Demonstrate, then log the accepted form.
    try:
        dataset.records.log(
            [
                rec(
                    "tmp-rejected",
                    "tmp",
                    responses=[rg.Response("ranking", ["response-3", "response-1", "response-2"], user_id=alice.id, status="submitted")],
                )
            ]
        )
        print("NOTE: plain-value submitted ranking was ACCEPTED by the server")
    except Exception as e:  # noqa: BLE001
        print("plain-value submitted ranking rejected by server:", type(e).__name__, str(e).splitlines()[0][:300])

    records = [
        rec("r1-both-submitted", "What is 2+2?"),
        rec("r2-both-submitted-tie", "Name a primary colour."),
        rec("r3-one-discarded", "Translate 'chat' to English."),
        rec("r4-draft", "Write a haiku about rain."),
        rec(
            "r5-suggestion-only",
            "Summarise the plot of Hamlet.",
            suggestions=[
                rg.Suggestion("ranking", ["response-3", "response-1", "response-2"], score=[0.91, 0.55, 0.12], agent="reward-model-v1")
            ],
        ),
        rec("r6-no-responses", "What is the capital of France?"),
        rec("r7-discarded-without-values", "Is this prompt offensive?"),
        rec(
            "r8-sdk-logged-response",
            "Sort these numbers: 3 1 2.",
            responses=[
                rg.Response(
                    "ranking",
                    [
                        {"value": "response-3", "rank": 1},
                        {"value": "response-1", "rank": 2},
                        {"value": "response-2", "rank": 3},
                    ],
                    user_id=alice.id,
                    status="submitted",
                )
            ],
        ),
    ]
    dataset.records.log(records)

    server_ids = {r.id: r._server_id for r in dataset.records(with_responses=False, with_suggestions=False)}
    raw_ds = httpx.get(
        f"{api_url}/api/v1/datasets/{dataset.id}/questions", headers={"X-Argilla-Api-Key": OWNER_API_KEY}
    ).json()
    options = raw_ds["items"][0]["settings"]["options"]

    ui = lambda key, rid, status, ranks: ui_response(api_url, key, server_ids[rid], status, ranks, options)  # noqa: E731
    # r1: both users submit different full rankings
    ui(ALICE_API_KEY, "r1-both-submitted", "submitted", {"response-2": 1, "response-1": 2, "response-3": 3})
    ui(BOB_API_KEY, "r1-both-submitted", "submitted", {"response-1": 1, "response-2": 2, "response-3": 3})
    # r2: alice full ranking; bob puts two options in the same slot (a tie)
    ui(ALICE_API_KEY, "r2-both-submitted-tie", "submitted", {"response-3": 1, "response-1": 2, "response-2": 3})
    ui(BOB_API_KEY, "r2-both-submitted-tie", "submitted", {"response-1": 1, "response-3": 1, "response-2": 2})
    # r3: alice submits; bob ranks and then presses "Discard"
    ui(ALICE_API_KEY, "r3-one-discarded", "submitted", {"response-1": 1, "response-3": 2, "response-2": 3})
    ui(BOB_API_KEY, "r3-one-discarded", "discarded", {"response-2": 1, "response-1": 2, "response-3": 3})
    # r4: alice saves a partial ranking as draft
    ui(ALICE_API_KEY, "r4-draft", "draft", {"response-2": 1})
    # r7: bob discards without ranking anything (values == {})
    ui(BOB_API_KEY, "r7-discarded-without-values", "discarded", {})

    # Raw server state, for reference (server JSON, pretty-printed here).
    api_records = httpx.get(
        f"{api_url}/api/v1/datasets/{dataset.id}/records",
        params=[("include", "responses"), ("include", "suggestions"), ("limit", 100)],
        headers={"X-Argilla-Api-Key": OWNER_API_KEY},
    ).json()
    dump_json(HERE / "api_records.json", api_records)
    dump_json(
        HERE / "users.json",
        [{"id": str(u.id), "username": u.username, "role": u.role} for u in (client.users("owner"), alice, bob)],
    )

    # Fresh handle, as a user would do: client.datasets(name=...)
    ds = client.datasets(name=DATASET_NAME, workspace=WORKSPACE)

    # 1. Dataset.to_disk
    out = HERE / "to_disk"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    ds.to_disk(str(out))

    # 2. records.to_datasets -> JSON Lines (+ its features)
    hf = ds.records.to_datasets()
    (HERE / "to_datasets.jsonl").unlink(missing_ok=True)
    hf.to_json(str(HERE / "to_datasets.jsonl"))
    dump_json(HERE / "to_datasets.features.json", hf.features.to_dict())

    # 3. records.to_list(flatten=True) (to_list(flatten=False) == to_disk/records.json)
    flat = ds.records.to_list(flatten=True)
    dump_json(HERE / "to_list_flatten.json", flat)
    nested = ds.records.to_list(flatten=False)
    with open(out / "records.json") as f:
        assert json.load(f) == nested, "to_list(flatten=False) differs from records.json"
    by_names = ds.records.to_dict(flatten=True, orient="names")
    assert by_names == {k: [r[k] for r in flat] for k in flat[0]}, "to_dict(flatten=True) != transposed to_list"

    # 4a. SDK Dataset.to_hub
    repo_sdk = "fixture/argilla-sdk-to-hub"
    HUB_TARGETS[repo_sdk] = HERE / "hub_sdk"
    shutil.rmtree(HUB_TARGETS[repo_sdk], ignore_errors=True)
    ds.to_hub(repo_id=repo_sdk)

    # 4b. The UI's "Export to Hub" (server job, run here directly instead of via the rq worker)
    from argilla_server.jobs.hub_jobs import export_dataset_to_hub_job

    repo_ui = "fixture/argilla-ui-export-to-hub"
    HUB_TARGETS[repo_ui] = HERE / "hub_ui"
    shutil.rmtree(HUB_TARGETS[repo_ui], ignore_errors=True)
    asyncio.run(
        export_dataset_to_hub_job(
            name=repo_ui, subset="default", split="train", private=False, token="unused", dataset_id=ds.id
        )
    )

    # The rows HubDatasetExporter generates, before datasets builds the table
    # (HFDataset.from_generator takes its columns from the first row, see README).
    from sqlalchemy.orm import selectinload
    from argilla_server.contexts.hub import HubDatasetExporter
    from argilla_server.database import AsyncSessionLocal
    from argilla_server.models import Dataset as DatasetModel

    async def load_dataset_like_the_job():
        async with AsyncSessionLocal() as db:
            return await DatasetModel.get_or_raise(
                db,
                ds.id,
                options=[
                    selectinload(DatasetModel.fields),
                    selectinload(DatasetModel.questions),
                    selectinload(DatasetModel.metadata_properties),
                    selectinload(DatasetModel.vectors_settings),
                ],
            )

    exporter_rows = list(HubDatasetExporter(asyncio.run(load_dataset_like_the_job()))._rows_generator())
    with open(HERE / "hub_ui.exporter_rows.jsonl", "w") as f:
        for row in exporter_rows:
            f.write(json.dumps(row, default=str) + "\n")

    # Readable copy of the UI export's parquet (datasets' own to_json) and its features.
    cache = str(WORK / "hf" / "cache")
    ui_rows = datasets.Dataset.from_parquet(str(HERE / "hub_ui/data/train-00000-of-00001.parquet"), cache_dir=cache)
    (HERE / "hub_ui.rows.jsonl").unlink(missing_ok=True)
    ui_rows.to_json(str(HERE / "hub_ui.rows.jsonl"))
    dump_json(HERE / "hub_ui.features.json", ui_rows.features.to_dict())
    # The SDK's to_hub pushes exactly the records.to_datasets() table.
    sdk_rows = datasets.Dataset.from_parquet(str(HERE / "hub_sdk/data/train-00000-of-00001.parquet"), cache_dir=cache)
    assert sdk_rows.features == hf.features and sdk_rows.to_list() == hf.to_list(), "hub_sdk parquet != to_datasets"

    for d in HERE.rglob("*"):
        os.chmod(d, 0o755 if d.is_dir() else 0o644)
    print("argilla", rg.__version__, "argilla-server", SERVER_VERSION, "datasets", datasets.__version__)


if __name__ == "__main__":
    sys.exit(main())
