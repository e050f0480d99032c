"""Plain helpers several test modules share (fixtures live in tests/fixtures_*.py)."""

from __future__ import annotations

import os
import socket
import time
from types import SimpleNamespace

from pipeline.config import GenerateConfig, LoopConfig, ModelConfig, PPOConfig, RewardConfig
from pipeline.orchestrate.steps import LoopSettings


def req(name: str | None):
    """What Gradio passes a handler for a request signed in as `name` (None: nobody signed in)."""
    return SimpleNamespace(username=name)


def tiny_settings(model_dir, prompts_per_round: int = 6) -> LoopSettings:
    """Loop settings that run every job in seconds on the tiny test model."""
    return LoopSettings(
        loop=LoopConfig(prompts_per_round=prompts_per_round),
        model=ModelConfig(model=str(model_dir), device="cpu", dtype="fp32", lora_r=4, lora_alpha=8),
        generate=GenerateConfig(k=3, max_new_tokens=8, temperature=1.0, batch_size=18),
        reward=RewardConfig(batch_size=4, max_length=64, norm_samples=0, eval_fraction=0.25, lr=1e-3),
        ppo=PPOConfig(steps=2, batch_size=4, mini_batch_size=4, micro_batch_size=4, ppo_epochs=1,
                      max_new_tokens=8, sample_every=1),
        ppo_prompts=8,
    )


def wait_for(predicate, timeout: float = 60.0, what: str = "condition", poll_s: float = 0.1):
    """Poll `predicate` until it is true; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def alive(pid: int) -> bool:
    """Whether process `pid` still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
