"""PPO with full fine-tuning sharded by FSDP2 over 2 processes (torchrun, a gloo group on CPU, with the
settings `accelerate launch --config_file configs/accelerate/fsdp.yaml` exports), against one process.

Every forward pass of a sharded model is a collective, so a rank that runs one pass fewer than the
other hangs the job. The policy here is built to make the ranks' work differ: its EOS row is scaled
so that responses sampled at temperature 0.05 end at once (a token or two) for some prompts and run on (mostly to
the length limit) for one other, and the prompts file puts the short ones on rank 0 and the long
ones on rank 1, so rank 0 must keep stepping its finished rows while rank 1 samples. Each episode
samples with its own seeded numbers, so both runs sample the same responses. It also ties its LM head to its
input embeddings, as SmolLM2 does (one shard unit holds both). Each launch runs under a timeout;
the file takes about 40 s on 2 cores.
"""

import json

import pytest
import torch

from pipeline.ppo_data import prompt_order
from tests.test_distributed import (
    FSDP_ENV, assert_same_ppo_runs, cancel_after, launch, log_of, metric_lines, status_of,
)
from tests.tiny import build_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/fixtures_models.py

SEED = 5
SHORT = ["How can I shop?", "What is the capital of France?", "Tell me about bread.", "Tell me about bread."]
LONG = "Guitar tips?"  # the one prompt whose responses mostly run to the 12-token limit


def eos_model_dir(out):
    """A tiny Llama with tied embeddings whose EOS logit is scaled by 10: at temperature 0.05 the
    responses to SHORT end with EOS as their first token, those to LONG run on (checked below)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tiny_tokenizer()
    # a template that leaves system messages out (ours included): the layout SHORT and LONG were
    # chosen on, so that which responses end at once depends on these prompts alone
    tok.chat_template = ("{% for message in messages if message['role'] != 'system' %}"
                         "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_token_id] *= 10.0
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def uneven_prompts(path):
    """8 prompts: the first step's rank-0 half (prompt_order's first 4) gets SHORT, rank 1's half LONG."""
    order = prompt_order(8, 0, 8, SEED)
    rows = [None] * 8
    for k, i in enumerate(order):
        rows[i] = SHORT[k] if k < 4 else LONG
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    return path


def ppo_args(tmp_path) -> list:
    model = eos_model_dir(tmp_path / "model")
    prompts = uneven_prompts(tmp_path / "prompts.jsonl")
    return ["--policy", model, "--reward", "script:count:e", "--prompts", prompts, "--lora", "false",
            "--batch-size", 8, "--mini-batch-size", 8, "--micro-batch-size", 2, "--max-new-tokens", 12,
            "--temperature", 0.05, "--lr", 1e-3, "--critic-lr", 1e-3, "--device", "cpu",
            "--sample-every", 1, "--seed", SEED]


def test_distributed_fsdp_ppo_equals_one_process_with_uneven_responses_and_resumes_on_one(tmp_path):
    """The same rollouts on 1 process (8 episodes) and on 2 sharded ones (4 each, rank 0's ending at
    once, rank 1's running 12 tokens): the run finishes, and its update statistics, gathered weights
    (policy, critic) and files are the 1-process run's; rank 0 alone wrote them; the checkpoint
    (whole weights, optimiser state keyed by name) resumes on 1 process."""
    from safetensors.torch import load_file

    from pipeline.train_ppo import main as ppo_main

    args = ppo_args(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    assert ppo_main([*map(str, args), "--steps", "2", "--out", str(one)]) == 0
    proc = launch(["ppo", *args, "--steps", 2], two, extra_env=FSDP_ENV, timeout=120)
    assert proc.returncode == 0, log_of(two)[-3000:]
    assert json.loads((two / "config.json").read_text())["fsdp"] is True

    # rank 0's 4 episodes (the sample table's, rank 0's first) end at once, rank 1's run on
    first = metric_lines(one)[0]
    table = [json.loads(line) for line in (one / "samples" / "step_1.jsonl").read_text().splitlines()]
    assert all(r["finish_reason"] == "eos" and r["tokens"] <= 2 for r in table), table
    rank0 = sum(r["tokens"] for r in table)
    assert 8 * first["gen/length_mean"] - rank0 >= 4 * 8, first  # rank 1: 8 tokens an episode or more
    assert_same_ppo_runs(one, two, ("policy/model.safetensors", "checkpoint/critic/model.safetensors",
                                    "checkpoint/critic/scalar_head.safetensors"))
    start, trained = load_file(tmp_path / "model" / "model.safetensors"), load_file(two / "policy/model.safetensors")
    assert start.keys() == trained.keys() and not torch.equal(trained["model.norm.weight"], start["model.norm.weight"])

    assert ppo_main([*map(str, args), "--steps", "3", "--out", str(two), "--resume"]) == 0
    assert [m["step"] for m in metric_lines(two)] == [1, 2, 3] and status_of(two)["state"] == "done"


def test_distributed_fsdp_ppo_cancel_saves_one_checkpoint_that_resumes_on_one(tmp_path):
    """SIGTERM to the sharded job's process group: both ranks stop after the same step, every rank
    takes part in gathering the weights and rank 0 writes one checkpoint; it resumes on 1 process."""
    from pipeline.train_ppo import main as ppo_main

    args = ppo_args(tmp_path)
    out = tmp_path / "ppo"
    step = cancel_after(["ppo", *args, "--steps", 500], out, extra_env=FSDP_ENV)
    assert step < 500

    assert ppo_main([*map(str, args), "--steps", str(step + 1), "--out", str(out), "--resume"]) == 0
    assert [m["step"] for m in metric_lines(out)] == list(range(1, step + 2))
    assert status_of(out)["state"] == "done" and (out / "policy" / "model.safetensors").is_file()
