"""Child processes that die with the process that started them.

``slogate up`` stops its stack in order on Ctrl-C or SIGTERM; killed outright (SIGKILL, an
out-of-memory kill) it runs no code, and its gateway, workers and Redis would go on as
orphans, holding the port and the Redis socket, so that the next ``slogate up`` found a
gateway it had not started answering on its port.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that has the child sent ``sig`` when
    this process dies, however it dies; None where the kernel offers no such thing (not Linux).
    Start the child from the main thread: the kernel ties it to the thread that forked it."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def tether() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before the tether was tied
            os.kill(os.getpid(), sig)

    return tether
