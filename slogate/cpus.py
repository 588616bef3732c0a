"""Where and when a process runs on the CPUs: pinned to a set of them (Linux
``sched_setaffinity``), and ahead of the engines' compute (``--realtime``).

A latency-bound worker that shares its cores with the gateway, Redis and other workers waits
for them in every step; given cores of its own, its steps are not preempted. On 2 cores, the
stream benchmark's worker pinned to one core and everything else to the other cut its TTFT
under load by about a fifth (``benchmarks/stream_engine.py --pin``).

Where there are no cores to spare, the hops of a request (the gateway's loop, Redis, the
worker's loop) each wait for a core the engines' steps hold, a few milliseconds at a time:
on 2 cores at 16 streams that wait was most of the serving path's tail. A real-time priority
for those loops lets each preempt a step the moment its message arrives, and hand it back
within a fraction of a millisecond, as they only move messages.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("slogate")

REALTIME_PRIORITY = 1
"""The lowest real-time priority: above every ordinary process, below the kernel's own
real-time threads and anything an operator placed higher."""


def usable_cpus() -> int:
    """The CPUs this process may run on: under a cpuset (``taskset``, a container's
    ``--cpuset-cpus``) fewer than ``os.cpu_count()``, which counts the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_cpus(spec: str) -> set[int]:
    """``"0,2-3"`` -> ``{0, 2, 3}``: the list format of ``taskset -c`` and cgroups' cpusets."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"--cpus {spec!r}: {part.strip()!r} is not a CPU number or range like 2-5") from None
        if low < 0 or high < low:
            raise ValueError(f"--cpus {spec!r}: {part.strip()!r} is not a range of CPU numbers")
        cpus.update(range(low, high + 1))
    return cpus


def pin_to(spec: str) -> set[int]:
    """Run this process (and the threads it starts later) on the CPUs of ``spec`` only."""
    cpus = parse_cpus(spec)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise ValueError(f"--cpus {spec!r}: cannot run on CPU(s) {sorted(cpus)} here ({exc.strerror}); this "
                         f"machine has {os.cpu_count()}, numbered from 0") from None
    return cpus


def run_first(pid: int = 0) -> bool:
    """Schedule the calling thread (or the process ``pid``'s main thread) round-robin at
    :data:`REALTIME_PRIORITY`, ahead of every ordinary thread; False, with a warning that says
    what is missing, where this host does not allow it.

    Only that thread: the threads and processes it starts later are ordinary ones
    (``SCHED_RESET_ON_FORK``), so an engine it starts, in a process or on a thread, never runs
    its steps at that priority and shuts the cores to everything else. The kernel holds real-time
    threads to 95% of each core (``sched_rt_runtime_us``) should one spin. Round-robin rather than
    first-in-first-out: two such loops on one core take turns even if one is busy for long."""
    try:
        os.sched_setscheduler(pid, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(REALTIME_PRIORITY))
    except PermissionError:
        log.warning("--realtime: this host does not allow a real-time priority%s, so it runs at an ordinary "
                    "one: it needs root or CAP_SYS_NICE (docker: cap_add: [SYS_NICE]), or a real-time priority "
                    "limit (ulimit -r) of at least %d", f" for process {pid}" if pid else "", REALTIME_PRIORITY)
        return False
    except AttributeError:  # not Linux
        log.warning("--realtime: only Linux has the real-time scheduling it asks for; ignored")
        return False
    return True


def can_run_first() -> bool:
    """Whether this host lets this process's threads take a real-time priority (with the warning
    of :func:`run_first` where it does not): tried on a passing thread, so that no thread that
    stays takes it."""
    allowed: list[bool] = []
    probe = threading.Thread(target=lambda: allowed.append(run_first()), name="realtime-probe")
    probe.start()
    probe.join()
    return allowed == [True]
