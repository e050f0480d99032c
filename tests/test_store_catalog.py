"""Accounts, model versions and lineage, settings, responses, runs, metrics and rounds."""

import math

import duckdb
import pytest

from store import InvalidRequest, NotFoundError, Store
from store.users import hash_password, verify_password


def test_accounts(store):
    admin = store.add_annotator(" root ", "correct horse", "admin")
    assert admin.name == "root" and admin.is_admin
    stored = store._one("SELECT password_hash FROM annotators WHERE id = ?", [admin.id])[0]
    assert stored.startswith("scrypt$131072$8$1$") and "correct horse" not in stored
    assert store.authenticate("root", "correct horse").id == admin.id
    assert store.authenticate("root", "wrong horse") is None
    assert store.authenticate("nobody", "correct horse") is None
    with pytest.raises(InvalidRequest, match="already exists"):
        store.add_annotator("root", "another password")
    with pytest.raises(InvalidRequest, match="at least 8"):
        store.add_annotator("short", "1234567")
    with pytest.raises(InvalidRequest, match="role"):
        store.add_annotator("x", "password-x", "boss")
    store.set_password(admin.id, "new password")
    assert store.authenticate("root", "new password").id == admin.id
    with pytest.raises(InvalidRequest, match="last active admin"):
        store.set_role(admin.id, "annotator")
    assert [a.name for a in store.list_annotators()] == ["root"]
    assert store.ensure_annotator("sim-1").name == "sim-1"
    assert store.ensure_annotator("sim-1").id == store.find_annotator("sim-1").id
    # two hashes of one password differ (random salt) and both verify
    h1, h2 = hash_password("pw"), hash_password("pw")
    assert h1 != h2 and verify_password("pw", h1) and verify_password("pw", h2)
    assert not verify_password("pw", "garbage")


def test_model_versions_and_lineage(store):
    base = store.register_model_version("policy", base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert base.name == "policy-v1"
    run = store.create_run("train-reward", {"lr": 1e-5}, "runs/rm1")
    snap = store.record_snapshot("pairs.parquet", "parquet", {"pairs": 10}, {}, "ab" * 32)
    rm = store.register_model_version("reward", path="runs/rm1/ckpt", run_id=run.id, snapshot_id=snap.id,
                                      parent_id=None, meta={"acc": 0.7})
    pol2 = store.register_model_version("policy", parent_id=base.id, reward_version_id=rm.id)
    pol3 = store.register_model_version("policy", "my-policy", parent_id=pol2.id)
    assert pol2.name == "policy-v2" and rm.name == "reward-v1"
    assert [v.id for v in store.model_lineage(pol3.id)] == [pol3.id, pol2.id, base.id]
    assert [v.id for v in store.list_model_versions("policy")] == [base.id, pol2.id, pol3.id]
    assert store.find_model_version("my-policy") == pol3
    assert store.update_model_version(rm.id, meta={"mean": 0.1}).meta == {"acc": 0.7, "mean": 0.1}
    with pytest.raises(InvalidRequest, match="already exists"):
        store.register_model_version("policy", "my-policy")
    with pytest.raises(NotFoundError, match="parent"):
        store.register_model_version("policy", parent_id=999)
    with pytest.raises(InvalidRequest, match="kind"):
        store.register_model_version("judge")
    with pytest.raises(InvalidRequest, match="reward"):
        store.add_responses(store.add_prompts(["p"])[0], rm.id, ["a", "b"])  # only policies write responses
    assert store.set_active_policy(pol2.id) == store.active_policy() == store.get_model_version(pol2.id)
    with pytest.raises(InvalidRequest, match="not a policy"):
        store.set_active_policy(rm.id)


def test_settings(store):
    assert store.get_setting("guidelines_markdown", "none yet") == "none yet"
    store.set_setting("guidelines_markdown", "# Rank by helpfulness")
    store.set_setting("queue_overlap", 2)
    assert store.get_setting("guidelines_markdown") == "# Rank by helpfulness"
    assert store.queue_overlap() == 2
    store.close()
    reopened = Store(store.path)
    try:
        assert reopened.get_setting("guidelines_markdown") == "# Rank by helpfulness"
    finally:
        reopened.close()


def test_responses_items_and_pool(store, store_policy):
    p1, p2, p3 = store.add_prompts(["a", "b", {"prompt": "c", "source": "mine"}])
    rnd = store.create_round(store_policy.id)
    rs = store.add_responses(p1, store_policy.id, [("x", 5, "eos", {"temperature": 0.7}), {"text": "y"}],
                             round_id=rnd.id)
    assert [(r.text, r.token_count, r.finish_reason, r.sampling) for r in rs] == [
        ("x", 5, "eos", {"temperature": 0.7}), ("y", None, None, {})]
    assert store.get_prompt(p1).round == rnd.id and store.get_prompt(p2).round is None
    assert [p.id for p in store.prompts_without_responses()] == [p2, p3]
    assert [p.id for p in store.prompts_without_responses(limit=1)] == [p2]
    assert store.round_counts(rnd.id) == {"prompts": 1, "items": 1, "rankings": 0, "ranked_items": 0, "pairs": 0}
    with pytest.raises(NotFoundError, match="prompt"):
        store.add_responses(999, store_policy.id, ["a", "b"])
    with pytest.raises(InvalidRequest, match="empty"):
        store.add_prompts(["  "])
    item = store.get_item(rs[0].item_id)
    assert item.prompt.id == p1 and [r.id for r in item.responses] == [r.id for r in rs]


def test_runs_and_metrics(store):
    run = store.create_run("ppo", {"steps": 10}, "runs/ppo-1", inputs={"policy": 1})
    assert run.status == "queued" and run.started_at is None
    run = store.update_run(run.id, status="running")
    assert run.started_at is not None and run.finished_at is None
    n = store.add_metrics(run.id, [(s, k, float(s)) for s in range(500) for k in ("objective/kl", "policy/loss")])
    assert n == 1000
    store.add_metrics(run.id, [(3, "objective/kl", 99.0), (3, "val/loss", float("nan"))])
    kl = store.metrics(run.id, keys=["objective/kl"])
    assert len(kl) == 500 and kl[3].value == 99.0 and kl[4].value == 4.0
    assert math.isnan(store.metrics(run.id, keys=["val/loss"])[0].value)
    assert len(store.metrics(run.id, since_step=497)) == 4 and store.last_metric_step(run.id) == 499
    with pytest.raises(InvalidRequest, match="number"):
        store.add_metrics(run.id, [(1, "x", "high")])
    run = store.update_run(run.id, status="failed", error="CUDA OOM", outputs={"log_tail": "..."})
    assert run.finished_at is not None and run.error == "CUDA OOM" and run.outputs == {"log_tail": "..."}
    with pytest.raises(InvalidRequest, match="already ended"):
        store.update_run(run.id, status="done")
    assert store.update_run(run.id, status="failed").status == "failed"  # same status: no-op
    other = store.create_run("train-reward")
    assert [r.id for r in store.list_runs()] == [other.id, run.id]
    assert [r.id for r in store.list_runs(status="failed")] == [run.id]


def test_rounds(store, store_policy):
    r1 = store.create_round(store_policy.id, {"n_prompts": 8})
    assert r1.status == "generating" and r1.config == {"n_prompts": 8}
    rm = store.register_model_version("reward")
    r1 = store.update_round(r1.id, status="training", reward_version_id=rm.id, meta={"rankings": 5})
    assert r1.reward_version_id == rm.id and r1.finished_at is None
    r1 = store.update_round(r1.id, status="done", meta={"kl": 0.1})
    assert r1.finished_at is not None and r1.meta == {"rankings": 5, "kl": 0.1}
    r2 = store.create_round(store_policy.id)
    assert [r.id for r in store.list_rounds()] == [r1.id, r2.id]
    with pytest.raises(InvalidRequest, match="status"):
        store.update_round(r2.id, status="exploded")


def test_settings_written_together_are_all_written_or_none(store):
    store.set_setting("queue_overlap", 2)
    store.set_settings({"queue_overlap": 3, "guidelines_markdown": "# New"})
    assert (store.queue_overlap(), store.get_setting("guidelines_markdown")) == (3, "# New")
    with pytest.raises(duckdb.ConstraintException, match="NOT NULL"):  # the second row has no key
        store.set_settings({"queue_overlap": 4, None: "no key"})
    assert store.queue_overlap() == 3  # the first row was rolled back with it, cache included
    store.close()
    reopened = Store(store.path)
    try:
        assert reopened.queue_overlap() == 3
    finally:
        reopened.close()
