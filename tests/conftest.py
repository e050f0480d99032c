"""Shared test set-up. Fixtures live in tests/fixtures_*.py, grouped by the layer they build."""

import os

import pytest

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# `make test` runs the suite on pytest-xdist workers, one per core. Each worker, and every process a
# test starts (jobs, torchrun ranks, the app), then computes on one thread: two workers fill two
# cores, where two-thread torch processes sharing them would spin against each other's threads.
# Read before torch is imported; a test run without workers keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

from tests.fixtures_store import *  # noqa: E402,F401,F403
from tests.fixtures_models import *  # noqa: E402,F401,F403


def pytest_addoption(parser):
    parser.addoption("--shuffle", type=int, default=None, metavar="SEED",
                     help="run the modules in a seeded random order, and each module's tests in one too "
                          "(module fixtures are still built once): every test must pass in any order")


def pytest_collection_modifyitems(config, items):
    """--shuffle SEED reorders the tests. Else, on xdist workers, the modules with slow tests go
    first (in file order), so that no long module starts while the other worker has nothing left.
    GPU tests skip cleanly on machines without CUDA."""
    seed = config.getoption("--shuffle")
    if seed is None and os.environ.get("PYTEST_XDIST_WORKER"):
        slow = {item.module.__name__ for item in items if "slow" in item.keywords}
        items.sort(key=lambda item: item.module.__name__ not in slow)  # a stable sort
    if seed is not None:
        import random

        rng, modules = random.Random(seed), {}
        for item in items:
            modules.setdefault(item.module.__name__, []).append(item)
        blocks = list(modules.values())
        rng.shuffle(blocks)
        for block in blocks:
            rng.shuffle(block)
        items[:] = [item for block in blocks for item in block]
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
