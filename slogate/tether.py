"""Child processes that die with the process that started them.

``slogate up`` stops its stack in order on Ctrl-C or SIGTERM; killed outright (SIGKILL, an
out-of-memory kill) it runs no code, and its gateway, workers and Redis would go on as
orphans, holding the port and the Redis socket, so that the next ``slogate up`` found a
gateway it had not started answering on its port. Likewise a worker's engine process, which
may spend minutes building a model for a worker that is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


def tie_to_parent(parent: int, sig: int = signal.SIGKILL, prctl: Callable[..., int] | None = None) -> None:
    """Have this process sent ``sig`` when its parent (pid ``parent``) dies, however it dies;
    if it is gone already, exit now. Nothing where the kernel offers no such thing. The kernel
    ties it to the parent's thread that started this process: start it from the main thread."""
    prctl = prctl or _prctl()
    if prctl is None:
        return
    prctl(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:  # the parent died before the tie was made
        os._exit(1)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: :func:`tie_to_parent` in the child,
    before it runs the new program; None where there is no such tie (not Linux). The library
    is looked up here, not in the child, which between fork and exec should do as little as it
    can."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()
    return lambda: tie_to_parent(parent, sig, prctl)
