"""``--cpus`` pins a gateway or worker process to the CPUs it names, and says clearly what is
wrong with a list it cannot use; ``--realtime`` puts its event loop ahead of the engines' steps,
and only its loop."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from slogate import keys
from slogate.cpus import can_run_first, parse_cpus, pin_to
from slogate.processes import ROOT, python_path

needs_realtime = pytest.mark.skipif(not can_run_first(), reason="this host allows no real-time priority")


def policy(tid: int) -> int:
    """A thread's scheduling policy, without the flag that its children do not inherit it."""
    return os.sched_getscheduler(tid) & ~os.SCHED_RESET_ON_FORK


def threads(pid: int) -> list[int]:
    """A process's threads, its main thread first."""
    return [pid, *sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)]


def test_lists_and_ranges_parse_as_taskset_writes_them() -> None:
    assert parse_cpus("0") == {0}
    assert parse_cpus("0,2-3") == {0, 2, 3}
    assert parse_cpus(" 1 , 4-4 ") == {1, 4}


@pytest.mark.parametrize("spec, named", [("a", "'a'"), ("1,", "''"), ("3-1", "'3-1'"), ("-2", "'-2'")])
def test_a_malformed_list_names_the_bad_part(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_cpus(spec)


def test_cpus_the_machine_lacks_are_refused() -> None:
    with pytest.raises(ValueError, match=r"cannot run on CPU\(s\) \[4095\]"):
        pin_to("4095")


def test_a_worker_started_with_cpus_runs_on_those_only(redis_url: str) -> None:
    cpu = min(os.sched_getaffinity(0))
    env = {**os.environ, "SLOGATE_REDIS_URL": redis_url, "PYTHONPATH": python_path(), "SLOGATE_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "slogate.cli", "worker", "--pool", "pinned", "--engine", "sim",
                             "--cpus", str(cpu)], env=env, cwd=ROOT)
    client = redis.Redis.from_url(redis_url)
    try:
        end = time.monotonic() + 30
        while not list(client.scan_iter(match=keys.heartbeat("pinned", "*"))):
            assert proc.poll() is None and time.monotonic() < end, "the pinned worker never sent a heartbeat"
            time.sleep(0.05)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        allowed = next(line.split(":")[1].strip() for line in status.splitlines()
                       if line.startswith("Cpus_allowed_list"))
        assert allowed == str(cpu)
    finally:
        proc.terminate()
        proc.wait(10)
        client.close()


def test_a_worker_given_cpus_it_cannot_have_exits_with_the_reason() -> None:
    env = {**os.environ, "PYTHONPATH": python_path()}
    done = subprocess.run([sys.executable, "-m", "slogate.cli", "worker", "--pool", "p", "--engine", "sim",
                           "--cpus", "4095"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "cannot run on CPU(s) [4095]" in done.stderr


REALTIME_CHILDREN = """
import os, subprocess, sys, threading
from slogate.cpus import run_first
assert run_first()
seen = []
thread = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
thread.start()
thread.join()
child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"], capture_output=True)
print(os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK, seen[0], int(child.stdout))
"""


@needs_realtime
def test_realtime_is_the_callers_alone_not_the_threads_or_processes_it_starts() -> None:
    """An engine started by a worker at a real-time priority must step at an ordinary one."""
    done = subprocess.run([sys.executable, "-c", REALTIME_CHILDREN], env={**os.environ, "PYTHONPATH": python_path()},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(os.SCHED_RR), str(os.SCHED_OTHER), str(os.SCHED_OTHER)]
