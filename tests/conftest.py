from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from slogate.local_redis import LocalRedis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    server = LocalRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[LocalRedis]:
    """A Redis of this test's own, since the test stops it."""
    server = LocalRedis(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> Iterator[str]:
    """A clean database on the session's real redis-server."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    yield redis_server.url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded tiny Llama model directory, built once per test session (no download)."""
    from engines.runtime.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def engine_device() -> str:
    """Where the engine tests run: the CPU, or the device ``SLOGATE_TEST_DEVICE`` names
    (``cuda`` on a GPU machine), so that one suite checks the engines on either."""
    device = os.environ.get("SLOGATE_TEST_DEVICE", "cpu")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip(f"SLOGATE_TEST_DEVICE={device} but torch sees no CUDA device")
    return device


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """pytest-xdist hands out tests by node id: two tests sharing one would run as one, and the
    other's coverage would vanish from every run without a word."""
    shared = sorted(nodeid for nodeid, count in Counter(item.nodeid for item in items).items() if count > 1)
    if shared:
        raise pytest.UsageError(f"tests share a node id, so pytest-xdist would run one of each: {shared}")
