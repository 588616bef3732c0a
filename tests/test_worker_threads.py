"""A worker started on its own pins torch threads as ``slogate up`` would for it: threads that
outnumber the cores spin-wait on each other."""

from __future__ import annotations

import pytest

from slogate.cli import build_parser, main
from slogate.config import load_config
from slogate.up import shared_core_threads, worker_threads


def test_requested_threads_win(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads(load_config(env={}), 5) == 5
    with pytest.raises(ValueError):
        worker_threads(load_config(env={}), 0)


def test_the_environment_slogate_up_sets_is_kept(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads(load_config(env={})) == 3


def test_without_either_the_cores_are_shared_among_the_configs_workers(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    cfg = load_config(env={})
    workers = sum(p.workers for p in cfg.pools.values())
    assert worker_threads(cfg) == shared_core_threads(cfg) == max(1, 8 // max(1, workers))


def test_the_cores_shared_are_those_this_process_may_run_on(monkeypatch) -> None:
    """Under a cpuset (taskset, a container's --cpuset-cpus) os.cpu_count() still counts the
    machine's cores: on 8 with 2 allowed, each of two workers took 4 threads for one core."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    cfg = load_config(env={})
    assert sum(p.workers for p in cfg.pools.values()) == 2
    assert worker_threads(cfg) == shared_core_threads(cfg) == 1


def test_the_worker_command_takes_threads() -> None:
    args = build_parser().parse_args(["worker", "--pool", "interactive", "--threads", "2"])
    assert args.threads == 2


def test_a_worker_for_a_pool_the_config_lacks_names_it_instead_of_serving_made_up_text(capsys, monkeypatch) -> None:
    """Without --engine, a pool of the config gets its engine; a misspelt one got the sim
    engine, whose text no model wrote."""
    monkeypatch.setenv("SLOGATE_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing to reach if it did start
    with pytest.raises(SystemExit):
        main(["worker", "--pool", "interactve"])
    err = capsys.readouterr().err
    assert "'interactve' is not one of the configured pools (interactive, batch)" in err
