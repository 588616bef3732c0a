"""Start-up objects are frozen out of later collections, after garbage is collected."""

from __future__ import annotations

import subprocess
import sys

from slogate.processes import ROOT

PROGRAM = """
import gc, weakref
from slogate.heap import freeze_startup_heap

class Node:
    pass

kept = [Node() for _ in range(1000)]
cycle = Node(); cycle.self = cycle
dead = weakref.ref(cycle)
del cycle
frozen = freeze_startup_heap()
assert dead() is None, "the cycle start-up left behind must be collected, not frozen"
assert frozen >= 1000 and gc.get_freeze_count() == frozen
assert not any(o is kept for o in gc.get_objects()), "frozen objects are no longer walked"
print("ok")
"""


def test_startup_garbage_is_collected_and_survivors_are_frozen() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
