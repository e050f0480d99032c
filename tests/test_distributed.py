"""Training stages on 2 processes (torchrun, a gloo group on CPU) against the same runs on 1, plus a
rank that fails and a cancel of the whole process group.

Every run here is the job runner's command, `python -m torch.distributed.run --nproc_per_node 2
-m pipeline <stage> ... --out RUN_DIR`, with stdout and stderr in RUN_DIR/log.txt as the runner
keeps them, under a timeout so no test can hang. Tiny models; the whole file takes about a minute
and a half on 2 CPU cores (each launch pays ~10 s of imports).
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.config import ModelConfig, RewardConfig, to_cli_args
from pipeline.distributed import CallThrough, Dist
from tests.helpers import free_port
from tests.test_train_reward import marker_pairs, write_jsonl

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def launch(args: list, out: Path, n: int = 2, script: Path | None = None, wait: bool = True, timeout: float = 150,
           extra_env: dict | None = None):
    """The job runner's command for n processes (`-m pipeline`, or a script standing in for it),
    output in out/log.txt, in its own process group."""
    out.mkdir(parents=True, exist_ok=True)
    entry = [str(script)] if script else ["-m", "pipeline"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
           "--master_port", str(free_port()), *entry, *map(str, args), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "20", **(extra_env or {})}
    log = open(out / "log.txt", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if not wait:
        return proc
    try:
        proc.wait(timeout)
    finally:
        stop_group(proc)
    return proc


def stop_group(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def log_of(out: Path) -> str:
    return (out / "log.txt").read_text()


def status_of(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


def metric_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def model_args(cfg: ModelConfig) -> list[str]:
    return to_cli_args(cfg)


# --------------------------------------------------------------------------- helpers on one process


def test_distributed_helpers_on_one_process_are_the_identity():
    dist = Dist(device=torch.device("cpu"))
    assert dist.shard([1, 2, 3]) == [1, 2, 3] and dist.unshard([1, 2, 3], 3) == [1, 2, 3]
    assert dist.reduce_sum({"a": 2.0}) == {"a": 2.0} and dist.loss_scale == 1.0
    assert dist.stop_requested(None) is False and dist.stop_requested("SIGTERM") is True
    halves = [Dist(device=torch.device("cpu"), rank=r, world=2).shard(list(range(5))) for r in (0, 1)]
    assert halves == [[0, 2, 4], [1, 3]]
    oom = dist.describe_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert "--gradient-checkpointing true" in oom and "Tried to allocate 2.00 GiB" in oom
    assert "rank 1 of 2" in Dist(device=torch.device("cpu"), rank=1, world=2).describe_failure(ValueError("x"))
    model = torch.nn.Linear(2, 1)
    wrapped = CallThrough(model)
    x = torch.ones(1, 2)
    assert torch.equal(wrapped(lambda m, t: m(t) * 2, x), model(x) * 2)


# --------------------------------------------------------------------------- reward model


def test_distributed_reward_training_equals_one_process(tmp_path, tiny_model_cfg):
    """Same CLI on 2 processes: each rank takes half of every batch, DDP averages the gradients, so
    the per-step losses, the held-out accuracy and the trained weights are the 1-process run's."""
    from safetensors.torch import load_file

    from pipeline.train_reward import train_reward

    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(44))
    cfg = RewardConfig(epochs=1, lr=1e-2, batch_size=8, grad_accum=2, norm_samples=5, eval_fraction=0.25,
                       max_tokens=300)
    one = tmp_path / "one"
    train_reward(str(data), str(one), cfg, tiny_model_cfg)

    two = tmp_path / "two"
    proc = launch(["train-reward", "--data", data, *to_cli_args(cfg), *model_args(tiny_model_cfg)], two)
    assert proc.returncode == 0, log_of(two)[-3000:]
    assert status_of(two)["state"] == "done"

    lines_one, lines_two = metric_lines(one), metric_lines(two)
    assert [m["step"] for m in lines_two] == [m["step"] for m in lines_one]  # rank 0 alone writes
    for a, b in zip(lines_one, lines_two):
        for key in ("train/loss", "train/accuracy", "train/margin", "train/grad_norm", "eval/accuracy"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
        if "train/tokens" in a:
            assert a["train/tokens"] == b["train/tokens"]
    report = json.loads((two / "eval_report.json").read_text())
    assert report["normalisation"]["samples"] == 5 and report["train/pairs"] == 33
    w_one = load_file(str(one / "checkpoint" / "scalar_head.safetensors"))
    w_two = load_file(str(two / "checkpoint" / "scalar_head.safetensors"))
    # the head's bias cancels in r_c - r_r: its gradient is float noise that Adam scales to full steps
    torch.testing.assert_close(w_two["weight"], w_one["weight"], rtol=1e-4, atol=1e-5)
    a_one = load_file(str(one / "checkpoint" / "adapter_model.safetensors"))
    a_two = load_file(str(two / "checkpoint" / "adapter_model.safetensors"))
    for key in a_one:
        torch.testing.assert_close(a_two[key], a_one[key], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- PPO: cancel and resume


def wait_for_step(out: Path, step: int, proc, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if status_of(out)["step"] >= step:
                return
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s:\n{log_of(out)[-3000:]}")


def cancel_after(args: list, out: Path, step: int = 2, extra_env: dict | None = None) -> int:
    """Launch a long PPO run and SIGTERM its process group (the job runner's cancel) once it logged
    `step`: both ranks stop after the same step, rank 0 wrote one checkpoint and status 'cancelled'.
    Returns the checkpoint's step."""
    proc = launch(args, out, wait=False, extra_env=extra_env)
    try:
        wait_for_step(out, step, proc)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    finally:
        stop_group(proc)
    log = log_of(out)
    assert proc.returncode != 0, log[-3000:]
    status = status_of(out)
    assert status["state"] == "cancelled" and "SIGTERM" in status["error"], status
    saved = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)["step"]
    assert status["step"] == saved and step <= saved and not (out / "policy").exists()
    assert f"cancelled at step {saved} (rank 0 of 2)" in log and f"cancelled at step {saved} (rank 1 of 2)" in log
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]
    return saved


def test_distributed_ppo_cancel_stops_every_rank_at_one_step_and_resume_finishes(tmp_path, tiny_model_dir):
    """SIGTERM to the whole process group (the job runner's cancel): both ranks stop after the same
    step, rank 0 writes one checkpoint and status 'cancelled'; --resume on 2 processes finishes the
    run with each step logged once. The gathered rollout keeps pi_theta / pi_old at 1 before the
    first update, and PPO-ptx trains on both ranks' texts."""
    from tests.test_train_ppo import PROMPTS

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    ptx = tmp_path / "ptx.jsonl"
    ptx.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "ppo"
    args = ["ppo", "--policy", tiny_model_dir, "--reward", "script:count:e", "--prompts", prompts,
            "--batch-size", 8, "--mini-batch-size", 4, "--micro-batch-size", 1, "--max-new-tokens", 8,
            "--device", "cpu", "--lora-r", 4, "--sample-every", 2, "--ptx-coef", 0.1, "--ptx-data", ptx]
    step = cancel_after(args + ["--steps", 500], out)
    assert step < 500
    lines = metric_lines(out)
    assert [m["step"] for m in lines] == list(range(1, step + 1))
    assert all(m["policy/ratio_first"] == pytest.approx(1.0, abs=1e-3) for m in lines)
    assert all(m["ptx/loss"] > 0 for m in lines)

    done = launch(args + ["--steps", step + 2, "--resume"], out)
    assert done.returncode == 0, log_of(out)[-3000:]
    assert status_of(out)["state"] == "done" and (out / "policy" / "model_meta.json").is_file()
    assert [m["step"] for m in metric_lines(out)] == list(range(1, step + 3))


# --------------------------------------------------------------------------- a rank that fails

FAIL_ON_RANK_1 = """
import os, sys
from pipeline import __main__ as entry, train_reward

calls = [0]


def failing(real):
    def forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected failure on rank 1")
        return real(*args, **kwargs)
    return forward


if os.environ["RANK"] == "1":  # a training forward of groups (the default) or pairs
    for name in ("forward_groups", "forward_pairs"):
        setattr(train_reward, name, failing(getattr(train_reward, name)))
sys.argv[0] = "pipeline"
sys.exit(entry.run())
"""


def test_distributed_failure_on_another_rank_fails_the_job_with_its_traceback(tmp_path, tiny_model_cfg):
    """Rank 1 raises in its third forward: the launcher exits non-zero within a bounded time, the
    log holds rank 1's traceback, and rank 0 (whose collective broke) marks the run failed."""
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(40))
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(FAIL_ON_RANK_1)
    out = tmp_path / "rm"
    cfg = RewardConfig(epochs=3, batch_size=4, norm_samples=0)
    t0 = time.time()
    proc = launch(["train-reward", "--data", data, *to_cli_args(cfg), *model_args(tiny_model_cfg)], out,
                  script=script, timeout=120)
    log = log_of(out)
    assert proc.returncode not in (0, None) and time.time() - t0 < 100, log[-3000:]
    assert "RuntimeError: injected failure on rank 1" in log and "Traceback" in log
    status = status_of(out)
    assert status["state"] == "failed", status
    assert "rank 0 of 2" in status["error"], status


# --------------------------------------------------------------------------- generate


def test_distributed_generate_writes_the_one_process_chunks(tmp_path, tiny_model_dir):
    """Rank r samples chunks r, r + 2, ... with each chunk's own seed; rank 0 writes them all, in
    order: the run directory holds exactly what one process writes."""
    from pipeline.__main__ import main as cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt number {i}, please answer", "id": i}) + "\n"
                               for i in range(5)))
    args = ["generate", "--prompts", prompts, "--model", tiny_model_dir, "--k", 2, "--max-new-tokens", 4,
            "--device", "cpu", "--chunk-prompts", 2, "--seed", 3]
    assert cli([*map(str, args), "--out", str(tmp_path / "one")]) == 0
    proc = launch(args, tmp_path / "two")
    assert proc.returncode == 0, log_of(tmp_path / "two")[-3000:]
    for name in ("00000.jsonl", "00001.jsonl", "00002.jsonl"):
        assert (tmp_path / "two" / "chunks" / name).read_text() == (tmp_path / "one" / "chunks" / name).read_text()
    assert sorted(p.name for p in (tmp_path / "two" / "chunks").iterdir()) == ["00000.jsonl", "00001.jsonl",
                                                                                  "00002.jsonl"]
    assert (tmp_path / "two" / "responses.jsonl").read_text() == (tmp_path / "one" / "responses.jsonl").read_text()
    status = status_of(tmp_path / "two")
    assert (status["state"], status["step"], status["chunks"]) == ("done", 10, 3)


# --------------------------------------------------------------------------- PPO: 2 ranks = 1 rank


def test_distributed_ppo_equals_one_process_and_its_checkpoint_resumes_on_one(tmp_path, tiny_model_dir):
    """The same rollouts on 1 process (8 episodes) and on 2 (4 each): every episode samples with
    its own seeded numbers (ppo_data.episode_uniforms), so both runs see the same episodes, sampled
    from the whole distribution at temperature 1 (no top-k). The update's statistics (policy and value
    losses, gradient norms: sums over both ranks' micro-batches) and the rollout metrics (whole
    gathered batch) equal the 1-process ones, and so do the weights after two updates. Rank 0
    alone wrote the run directory (the same files as one process, each step logged once); the
    2-process checkpoint resumes on 1 process."""
    from pipeline.train_ppo import main as ppo_main
    from tests.test_train_ppo import PROMPTS

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    args = ["--policy", tiny_model_dir, "--reward", "script:count:e", "--prompts", prompts,
            "--batch-size", 8, "--mini-batch-size", 8, "--micro-batch-size", 2, "--max-new-tokens", 8,
            "--temperature", 1.0, "--lr", 1e-2, "--critic-lr", 1e-2, "--device", "cpu",
            "--lora-r", 4, "--sample-every", 1, "--seed", 5]
    one, two = tmp_path / "one", tmp_path / "two"
    assert ppo_main([*map(str, args), "--steps", "2", "--out", str(one)]) == 0
    proc = launch(["ppo", *args, "--steps", 2], two)
    assert proc.returncode == 0, log_of(two)[-3000:]

    assert_same_ppo_runs(one, two, ("policy/adapter_model.safetensors", "checkpoint/critic/adapter_model.safetensors",
                                    "checkpoint/critic/scalar_head.safetensors"))

    assert ppo_main([*map(str, args), "--steps", "3", "--out", str(two), "--resume"]) == 0
    assert [m["step"] for m in metric_lines(two)] == [1, 2, 3] and status_of(two)["state"] == "done"


def assert_same_ppo_runs(one: Path, two: Path, weight_files: tuple) -> None:
    """A 2-process PPO run (two) against the 1-process one: each step logged once, with the same
    rollout and update figures (the update's: sums over both ranks' micro-batches), the same
    saved weights, and the same files (rank 0 alone wrote the run directory)."""
    from safetensors.torch import load_file

    assert status_of(two)["state"] == "done"
    assert [m["step"] for m in metric_lines(two)] == [m["step"] for m in metric_lines(one)]
    for m1, m2 in zip(metric_lines(one), metric_lines(two)):
        for key in ("objective/score", "objective/kl", "gen/length_mean", "gen/eos_rate", "val/value_mean",
                    "policy/loss", "val/loss", "policy/grad_norm", "val/grad_norm", "policy/ratio_first",
                    "policy/approxkl"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-3, abs=1e-5), key
    for name in weight_files:
        w1, w2 = load_file(one / name), load_file(two / name)
        assert w1.keys() == w2.keys()
        for key in w1:
            torch.testing.assert_close(w2[key], w1[key], atol=2e-5, rtol=1e-4)

    def files(run):  # event files are named by time and pid: one per run (rank 0 alone writes)
        return sorted("tensorboard/events.*" if p.name.startswith("events.out.tfevents.") else str(p.relative_to(run))
                      for p in run.rglob("*") if p.name != "log.txt")

    assert files(two) == files(one) and files(two).count("tensorboard/events.*") == 1


# --------------------------------------------------------------------------- FSDP (full fine-tuning)

# what `accelerate launch --config_file configs/accelerate/fsdp.yaml` exports to each process
FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
            "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
            "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_OFFLOAD_PARAMS": "false"}


def test_fsdp_settings_from_the_launcher_environment():
    from pipeline.distributed import FSDPSettings, fsdp_settings

    assert fsdp_settings({}) is None
    assert fsdp_settings(FSDP_ENV) == FSDPSettings(reshard_after_forward=True, wrap_classes=("LlamaDecoderLayer",))
    assert fsdp_settings({**FSDP_ENV, "FSDP_RESHARD_AFTER_FORWARD": "false",
                          "FSDP_TRANSFORMER_CLS_TO_WRAP": ""}) == FSDPSettings(False, ())
    for bad, match in ((("FSDP_VERSION", "1"), "FSDP2"), (("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"), "FULL"),
                       (("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"), "TRANSFORMER"),
                       (("FSDP_OFFLOAD_PARAMS", "true"), "offload")):
        with pytest.raises(ValueError, match=match):
            fsdp_settings({**FSDP_ENV, bad[0]: bad[1]})
    config = (ROOT / "configs" / "accelerate" / "fsdp.yaml").read_text()  # the shipped file says the same
    for line in ("distributed_type: FSDP", "fsdp_version: 2", "fsdp_reshard_after_forward: true",
                 "fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer", "fsdp_state_dict_type: FULL_STATE_DICT"):
        assert line in config


def test_distributed_fsdp_reward_training_equals_one_process_and_resumes(tmp_path, tiny_model_cfg):
    """Full fine-tuning with every weight sharded over 2 processes (FSDP2, one unit per decoder
    layer): the losses, held-out accuracy and the gathered checkpoint are the 1-process run's; the
    checkpoint (whole weights and optimiser state, saved by rank 0) resumes on 2 sharded processes."""
    import dataclasses

    from safetensors.torch import load_file

    from pipeline.train_reward import train_reward

    full = dataclasses.replace(tiny_model_cfg, lora=False)
    data = write_jsonl(tmp_path / "pairs.jsonl", marker_pairs(44))
    cfg = RewardConfig(epochs=1, lr=1e-3, batch_size=8, grad_accum=1, norm_samples=0, eval_fraction=0.25,
                       max_tokens=300, max_steps=3)
    one = tmp_path / "one"
    train_reward(str(data), str(one), cfg, full)
    two = tmp_path / "two"
    proc = launch(["train-reward", "--data", data, *to_cli_args(cfg), *model_args(full)], two, extra_env=FSDP_ENV)
    assert proc.returncode == 0, log_of(two)[-3000:]
    assert status_of(two)["state"] == "done"
    lines_one, lines_two = metric_lines(one), metric_lines(two)
    assert [m["step"] for m in lines_two] == [m["step"] for m in lines_one] == [1, 2, 3, 3]
    for a, b in zip(lines_one, lines_two):
        for key in ("train/loss", "train/accuracy", "train/grad_norm", "eval/accuracy", "eval/margin"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
    w_one, w_two = load_file(str(one / "checkpoint" / "model.safetensors")), load_file(
        str(two / "checkpoint" / "model.safetensors"))
    assert w_one.keys() == w_two.keys() and len(w_one) > 10
    # Adam divides each gradient by its running size, so a weight whose gradient is near zero moves
    # by up to lr whichever way rounding tips it: summed in another order (two shards), such a weight
    # can land a small share of lr apart (1.75e-5 seen at lr 1e-3 on one CPU). Gradients not averaged
    # over the ranks would put most weights ~lr apart.
    for key in w_one:
        torch.testing.assert_close(w_two[key], w_one[key], rtol=1e-4, atol=1e-4)
    head_one = load_file(str(one / "checkpoint" / "scalar_head.safetensors"))
    head_two = load_file(str(two / "checkpoint" / "scalar_head.safetensors"))
    torch.testing.assert_close(head_two["weight"], head_one["weight"], rtol=1e-4, atol=1e-4)

    # as a cancel at step 3 of 5 leaves the run directory: a checkpoint, no report, status 'cancelled'
    (two / "eval_report.json").unlink()
    (two / "status.json").write_text(json.dumps({**status_of(two), "state": "cancelled"}))
    config = json.loads((two / "config.json").read_text())
    config["reward"]["max_steps"] = 5  # the run's own settings win on --resume
    (two / "config.json").write_text(json.dumps(config))
    proc = launch(["train-reward", "--data", data, *to_cli_args(cfg), *model_args(full), "--resume"], two,
                  extra_env=FSDP_ENV)
    assert proc.returncode == 0, log_of(two)[-3000:]
    assert [m["step"] for m in metric_lines(two) if "train/loss" in m] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(m["train/loss"]) for m in metric_lines(two) if "train/loss" in m)
    assert status_of(two)["state"] == "done"
