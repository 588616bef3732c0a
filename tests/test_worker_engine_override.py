"""``slogate worker --engine`` naming another engine than its pool's: the pool's options are
written for the pool's engine, and are not handed to the other one."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.sim import SimEngine
from slogate.cli import main

CONFIG = """
pools:
  interactive: {engine: stream, workers: 1}
  batch: {engine: paged, workers: 1, options: {kv_cache_bytes: 100000000}}
  sim: {engine: sim, workers: 1, options: {decode_base_s: 0.125}}
"""


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[SimEngine]:
    """The engines the worker command would serve (it starts no worker)."""
    engines: list[SimEngine] = []

    async def serve(engine: SimEngine, *args, **kwargs) -> None:
        engines.append(engine)

    monkeypatch.setattr("engines.worker.run_worker", serve)
    monkeypatch.setenv("SLOGATE_CONFIG", str(tmp_path / "slogate.yaml"))
    (tmp_path / "slogate.yaml").write_text(CONFIG)
    return engines


def test_an_engine_other_than_the_pools_runs_without_the_pools_options(served: list[SimEngine], capsys) -> None:
    """The paged engine's kv_cache_bytes went to the sim engine, which refused it: a worker of
    that pool could not start with --engine sim, nor could ``slogate up --engine sim``."""
    main(["worker", "--pool", "batch", "--engine", "sim", "-o", "decode_base_s=0.25"])
    assert [e.timing.decode_base_s for e in served] == [0.25]
    assert "kv_cache_bytes" in capsys.readouterr().err, "the options left out are named"


def test_the_pools_own_engine_gets_its_options(served: list[SimEngine]) -> None:
    """Named with --engine too, as ``slogate up`` names it."""
    main(["worker", "--pool", "sim"])
    main(["worker", "--pool", "sim", "--engine", "sim"])
    main(["worker", "--pool", "sim", "--engine", "sim", "-o", "max_batch=3"])
    assert [(e.timing.decode_base_s, e.timing.max_batch) for e in served] == [(0.125, 64), (0.125, 64), (0.125, 3)]
