"""``slogate worker --engine`` naming another engine than its pool's: the pool's options are
written for the pool's engine; the other one takes those it has too, and runs without the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.registry import create_engine
from engines.sim import SimEngine
from slogate.cli import main

CONFIG = """
pools:
  interactive: {engine: stream, workers: 1, options: {max_batch: 3, step_budget_ms: 10}}
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


def test_an_engine_other_than_the_pools_takes_the_options_it_has_too(served: list[SimEngine], capsys) -> None:
    """The stream pool's max_batch is the sim engine's max_batch too: it used to be dropped with
    the step budget, which the sim engine does not have. ``-o`` still wins."""
    main(["worker", "--pool", "interactive", "--engine", "sim"])
    main(["worker", "--pool", "interactive", "--engine", "sim", "-o", "max_batch=5"])
    assert [e.timing.max_batch for e in served] == [3, 5]
    err = capsys.readouterr().err
    assert "step_budget_ms" in err and "max_batch" not in err


def test_a_torch_engine_takes_the_shared_options_of_another_engines_pool(tiny_model_dir: Path, caplog) -> None:
    """The paged pool's block size and KV budget mean the same to the stream engine; its
    max_num_seqs does not exist there."""
    def blocks(options: dict, inherited: dict | None = None) -> tuple[int, int]:
        manager = create_engine("stream", str(tiny_model_dir), {"warmup": False, **options}, threads=1,
                                inherited=inherited).block_manager
        return manager.block_size, len(manager.blocks)

    inherited = blocks({}, {"block_size": 8, "kv_cache_bytes": 2**16, "max_num_seqs": 4})
    assert inherited == blocks({"block_size": 8, "kv_cache_bytes": 2**16})
    assert inherited[1] < blocks({"block_size": 8})[1], "the pool's KV budget applied, not the engine's default"
    assert "max_num_seqs" in caplog.text and "block_size" not in caplog.text
    assert blocks({"block_size": 4}, {"block_size": 8})[0] == 4, "an option of the engine's own wins"


def test_the_pools_own_engine_gets_its_options(served: list[SimEngine]) -> None:
    """Named with --engine too, as ``slogate up`` names it."""
    main(["worker", "--pool", "sim"])
    main(["worker", "--pool", "sim", "--engine", "sim"])
    main(["worker", "--pool", "sim", "--engine", "sim", "-o", "max_batch=3"])
    assert [(e.timing.decode_base_s, e.timing.max_batch) for e in served] == [(0.125, 64), (0.125, 64), (0.125, 3)]
