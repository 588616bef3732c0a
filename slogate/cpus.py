"""Pinning a process to a set of CPUs (Linux ``sched_setaffinity``).

A latency-bound worker that shares its cores with the gateway, Redis and other workers waits
for them in every step; given cores of its own, its steps are not preempted. On 2 cores, the
stream benchmark's worker pinned to one core and everything else to the other cut its TTFT
under load by about a fifth (``benchmarks/stream_engine.py --pin``).
"""

from __future__ import annotations

import os


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
