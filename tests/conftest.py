"""Shared fixtures."""

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """Real SmolLM2-135M (embedded offline GGUF); skips when its wheel is not installed. Do not mutate."""
    from shift_lightning.models import ModelConfig, ModelLoadError, load_model

    try:
        return load_model(ModelConfig(name_or_path="smollm2-135m"))
    except ModelLoadError as e:
        pytest.skip(str(e))


def pytest_configure(config):
    """Quiet third-party tips (Lightning's "GPU available", litlogger) in the test output."""
    from shift_lightning.recipes.cli import quiet_third_party

    quiet_third_party()
