"""Stopping background tasks that talk to Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task], every_s: float = 0.05) -> None:
    """Cancel the tasks until they end. redis-py's asyncio client (8.1) can swallow a
    CancelledError that lands just as a command starts, and a loop around that command then
    runs on: a gateway or worker would never finish shutting down. A repeated cancel lands
    elsewhere within a turn or two of the loop."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=every_s)


async def despite_cancels(cleanup: Awaitable[None]) -> None:
    """Await ``cleanup`` to its end, then raise the cancel if one came meanwhile. A task's last
    cleanup (ending an engine process) would otherwise be cut short by :func:`cancel_and_wait`,
    which cancels the task again every few milliseconds until it ends: ``cleanup`` must end
    by itself, and soon. The cleanup's own failure outranks the cancel, as it would in a
    ``finally``: read off the ended task, it is raised even when a cancel lands in the same
    turn; and a cleanup that is itself cancelled (the loop closing) raises its cancel."""
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError
