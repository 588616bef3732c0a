"""Stopping background tasks that talk to Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


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
