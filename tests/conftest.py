"""Shared fixtures."""

import os

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """Real SmolLM2-135M (embedded offline GGUF, fetched into the cache on first use). Do not mutate."""
    from shift_lightning.models import ModelConfig, load_model

    return load_model(ModelConfig(name_or_path="smollm2-135m"))


def pytest_configure(config):
    """Quiet third-party tips (Lightning's "GPU available", litlogger) in the test output."""
    from shift_lightning.recipes.cli import quiet_third_party

    quiet_third_party()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # `make test` runs pytest -n 2: share the cores instead of oversubscribing them
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
