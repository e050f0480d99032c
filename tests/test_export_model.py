"""`python -m pipeline export-model`: standalone Hugging Face folders that plain transformers loads.

A reward model and a policy are trained for a few steps on the tiny model (so the LoRA deltas,
the head and the normalisation are not their initial values), exported, and loaded in a
subprocess that imports only torch and transformers: the policy's logits equal our (unmerged)
policy's, the reward model's scores equal ours. Then the lineage card from the store, the
refusals, and the Models tab's Download (an export-model job) through its handlers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import gradio as gr
import pytest
import torch

from annotate import model_admin
from annotate.context import AppContext, Refused
from pipeline.__main__ import main as cli
from pipeline.config import ModelConfig, PPOConfig, RewardConfig
from pipeline.orchestrate import loop
from tests.helpers import req
from tests.test_train_reward import marker_pairs, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/fixtures_models.py

PROMPTS = ["How can I shop?", "What is the capital of France?", "Tell me about bread.", "Guitar tips?"]
RESPONSES = ["Compare stores and use coupons.", "Paris is the capital of France.", "Mix flour, water and salt.",
             "Start with simple chords."]

# Runs in a fresh interpreter: only torch and transformers, and it says which project modules it saw.
PLAIN = r'''
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

reward_dir, policy_dir, pairs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
tok = AutoTokenizer.from_pretrained(reward_dir)  # the reward model: the recipe of its model card
model = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
         + r.strip() + tok.eos_token for p, r in pairs]
batch = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
with torch.no_grad():
    out = {"scores": (model(**batch).logits[:, 0] + model.config.score_offset).tolist(),
           "padded": int((batch["attention_mask"] == 0).sum())}
tok = AutoTokenizer.from_pretrained(policy_dir)  # the policy: its chat template and logits
model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
enc = tok.apply_chat_template([{"role": "user", "content": pairs[0][0]}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)
with torch.no_grad():
    out.update(ids=enc["input_ids"][0].tolist(), logits=model(**enc).logits[0].tolist())
out["project_modules"] = sorted({m.split(".")[0] for m in sys.modules} & {"pipeline", "store", "annotate", "tests"})
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    """A reward model (3 steps, normalised on 8 samples) and a policy (2 PPO steps against it)."""
    from pipeline.train_ppo import train
    from pipeline.train_reward import train_reward

    root = tmp_path_factory.mktemp("trained")
    model_cfg = ModelConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32", lora=True, lora_r=4, lora_alpha=8)
    data = write_jsonl(root / "pairs.jsonl", marker_pairs(24))
    train_reward(str(data), str(root / "rm"), RewardConfig(batch_size=6, max_steps=3, lr=1e-2, norm_samples=8,
                                                           max_length=64), model_cfg)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    train(PPOConfig(steps=2, batch_size=4, mini_batch_size=4, micro_batch_size=4, max_new_tokens=6, lr=5e-2,
                    sample_every=0), model_cfg, prompts=str(prompts), reward=str(root / "rm" / "checkpoint"),
          out_dir=root / "ppo", policy=str(tiny_model_dir))
    return root, model_cfg


@pytest.fixture(scope="module")
def exported(trained):
    """Both exported with the CLI, then loaded by plain transformers in one fresh interpreter."""
    root, _ = trained
    assert cli(["export-model", str(root / "rm" / "checkpoint"), "--out", str(root / "rm-hf")]) == 0
    assert cli(["export-model", str(root / "ppo" / "policy"), "--out", str(root / "policy-hf")]) == 0
    pairs = json.dumps(list(zip(PROMPTS, RESPONSES)))
    done = subprocess.run([sys.executable, "-c", PLAIN, str(root / "rm-hf"), str(root / "policy-hf"), pairs],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    plain = json.loads(done.stdout.strip().splitlines()[-1])
    assert plain["project_modules"] == []
    return plain


def test_reward_model_export_scores_like_ours(trained, exported):
    from pipeline.models import load_scalar_model
    from pipeline.scoring import score_texts

    root, model_cfg = trained
    rm, tok = load_scalar_model(str(root / "rm" / "checkpoint"), "reward", model_cfg)
    assert rm.reward_std != 1.0 and rm.reward_mean != 0.0  # the normalisation is part of what is checked
    ours = score_texts(rm.eval(), tok, PROMPTS, RESPONSES)
    diff = max(abs(a - b) for a, b in zip(exported["scores"], ours))
    print(f"reward model exported and reloaded: max abs score difference {diff:.2e} over {len(ours)} texts")
    assert diff < 1e-4 and exported["padded"] > 0  # a right-padded batch scores as ours does
    card = (root / "rm-hf" / "README.md").read_text()
    config = json.loads((root / "rm" / "config.json").read_text())
    assert config["data_sha256"] in card and "eval/accuracy" in card and '"batch_size": 6' in card
    assert str(root) not in card  # no paths of this machine


def test_policy_export_is_the_merged_model(trained, exported):
    from pipeline.policy import causal_lm_logits, load_policy
    from pipeline.text import prompt_token_ids

    root, model_cfg = trained
    policy, tok = load_policy(model_cfg, adapter_path=root / "ppo" / "policy")  # adapter unmerged
    assert exported["ids"] == prompt_token_ids(tok, PROMPTS[0])  # the same chat template
    ids = torch.tensor([exported["ids"]])
    with torch.no_grad():
        ours = causal_lm_logits(policy, ids, torch.ones_like(ids))[0]
        with policy.disable_adapter():
            base = causal_lm_logits(policy, ids, torch.ones_like(ids))[0]
    plain = torch.tensor(exported["logits"])
    print(f"policy: max abs logit difference {float((plain - ours).abs().max()):.2e} "
          f"(the adapter moves them by {float((ours - base).abs().max()):.2e})")
    assert torch.allclose(plain, ours, atol=1e-4) and not torch.allclose(plain, base, atol=1e-3)
    files = {p.name for p in (root / "policy-hf").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md"} <= files
    assert "adapter_config.json" not in files and "model_meta.json" not in files
    card = (root / "policy-hf" / "README.md").read_text()
    assert "| KL reference | the base model `" in card  # the convention PPO and DPO share, stated


def register(store, root: Path, base_model: Path) -> tuple:
    """The store's records of the trained pair: snapshot, runs, reward model, policy, a comparison."""
    config = json.loads((root / "rm" / "config.json").read_text())
    snap = store.record_snapshot(str(root / "pairs.jsonl"), "jsonl", {"pairs": 24}, {}, config["data_sha256"])
    rm_run, ppo_run = store.create_run("train-reward"), store.create_run("ppo")
    reward = store.register_model_version("reward", path=str(root / "rm" / "checkpoint"), base_model=str(base_model),
                                          run_id=rm_run.id, snapshot_id=snap.id, meta={"eval": {"eval/accuracy": 0.75}})
    base = store.register_model_version("policy", "base", base_model=str(base_model))
    policy = store.register_model_version("policy", path=str(root / "ppo" / "policy"), parent_id=base.id,
                                          base_model=str(base_model), run_id=ppo_run.id, reward_version_id=reward.id,
                                          meta={"compare/base": {"win_rate": 0.625, "stderr": 0.1, "prompts": 16,
                                                                 "reward": reward.name}})
    return snap, reward, policy


def test_a_version_of_the_store_gets_its_lineage_on_the_card(trained, store, store_path, tmp_path, tiny_model_dir):
    root, _ = trained
    snap, reward, policy = register(store, root, tiny_model_dir)
    store.close()  # the CLI opens the store itself, as when no app runs
    assert cli(["export-model", policy.name, "--db", str(store_path), "--out", str(tmp_path / "hf")]) == 0
    card = (tmp_path / "hf" / "README.md").read_text()
    for fact in (f"| Trained from | base |", f"| Reward model | {reward.name} |", snap.sha256, "pairs.jsonl",
                 "(24 pairs)", "win rate vs base", '"kl_control"', "objective/score",
                 "| Training stage | ppo, ", "| Reward model's loss | Bradley-Terry |"):
        assert fact in card, fact


def test_bad_sources_are_refused_with_the_reason(trained, store, store_path, tmp_path, capsys, tiny_model_dir):
    root, _ = trained
    register(store, root, tiny_model_dir)
    store.close()
    cases = [(["policy-v9", "--db", str(store_path)], "no model version of that name or id"),
             (["nothing", "--db", str(tmp_path / "none.duckdb")], "no store at"),
             ([str(root / "ppo" / "checkpoint" / "critic")], "a critic checkpoint"),
             ([str(root)], "no model_meta.json"),
             (["base", "--db", str(store_path), "--dtype", "fp32"], None)]  # the base model itself: fine
    for args, reason in cases:
        out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
        rc = cli(["export-model", *args, "--out", str(out)])
        err = capsys.readouterr().err
        assert (rc, reason is None or reason in err) == (0 if reason is None else 2, True), (args, err)
    assert cli(["export-model", str(root / "rm" / "checkpoint"), "--out", str(root)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_the_models_tab_downloads_a_version_through_a_job(trained, store, tmp_path, tiny_model_dir):
    root, _ = trained
    _, reward, _ = register(store, root, tiny_model_dir)
    store.add_annotator("boss", "boss-password", role="admin")
    store.add_annotator("ann", "ann-password")
    ctx = AppContext(store=store, auth=True, data_dir=tmp_path / "data",
                     jobs=loop.make_runner(store, tmp_path / "runs", poll_s=0.2))
    try:
        for refused in (lambda: model_admin.export_model(ctx, reward.name, req("ann")),
                        lambda: model_admin.export_poll(ctx, req("ann"))):
            with pytest.raises(Refused, match="admins only"):
                refused()
        with pytest.raises(gr.Error, match="base model used as is"):
            model_admin.export_model(ctx, "base", req("boss"))
        assert store.list_runs(kind="export-model") == []
        bar, file, timer = model_admin.export_model(ctx, reward.name, req("boss"))
        assert timer["active"] and file is None and f"export {reward.name}" in bar
        run = ctx.jobs.wait(store.list_runs(kind="export-model", limit=1)[0].id, timeout=240)
        assert run.status == "done", run.error
        bar, file, timer = model_admin.export_poll(ctx, req("boss"))
        assert 'data-status="done"' in bar and not timer["active"]
        assert Path(file).name == f"{reward.name}.zip" and not Path(file).is_relative_to(tmp_path)
        names = set(zipfile.ZipFile(file).namelist())
        assert {f"{reward.name}/{n}" for n in ("config.json", "model.safetensors", "README.md",
                                               "tokenizer_config.json")} <= names
        card = zipfile.ZipFile(file).read(f"{reward.name}/README.md").decode()
        assert "eval/accuracy | 0.75" in card and "(24 pairs)" in card  # the store's lineage reached the job
    finally:
        ctx.jobs.shutdown()


def test_the_app_side_of_a_download_imports_no_torch():
    """The Models tab queues the export and reads the lineage in the app process, which never loads torch."""
    code = ("import sys, annotate.model_admin, pipeline.orchestrate.steps, store.lineage; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'peft', 'tensorboard'}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
