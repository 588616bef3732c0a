from __future__ import annotations

from pathlib import Path

import pytest

from engines.runtime.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded tiny Llama model directory, built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")
