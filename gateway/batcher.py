"""Coalesce the Redis commands of concurrent requests into pipelines.

At thousands of requests a second, one round trip per command costs more in syscalls and
event-loop wakeups than the commands themselves. Commands issued within one loop iteration
go out together as one pipeline; each caller still awaits its own reply.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis


class CommandBatcher:
    def __init__(self, redis: aioredis.Redis, max_batch: int = 512) -> None:
        self.redis = redis
        self.max_batch = max_batch
        self._pending: list[tuple[tuple[Any, ...], asyncio.Future[Any] | None]] = []
        self._scheduled = False
        self._sending: set[asyncio.Task[None]] = set()
        """The pipelines in flight. The loop holds tasks only weakly: one collected mid-flight
        would leave its callers' futures unresolved for good (a stream slot Redis took, never
        given back)."""

    def call(self, *args: Any) -> asyncio.Future[Any]:
        """Queue a command; the future holds its reply (or the Redis error)."""
        fut = asyncio.get_running_loop().create_future()
        self._queue(args, fut)
        return fut

    def fire(self, *args: Any) -> None:
        """Queue a command whose reply nobody waits for (clean-ups, cancels)."""
        self._queue(args, None)

    async def drain(self) -> None:
        """Wait until every command queued so far, and any a reply's callbacks queue in turn
        (a slot given back once Redis answers its take), has had its reply. Shutdown calls it
        before closing the connections, so clean-ups fired by the last requests are not lost."""
        while self._pending or self._sending:
            if self._sending:
                await asyncio.wait(set(self._sending))
            else:
                await asyncio.sleep(0)

    def _queue(self, args: tuple[Any, ...], fut: asyncio.Future[Any] | None) -> None:
        self._pending.append((args, fut))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            task = asyncio.create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any] | None]]) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as p:
                for args, _ in batch:
                    p.execute_command(*args)
                replies = await p.execute(raise_on_error=False)
        except Exception as exc:  # connection loss: every caller learns of it
            replies = [exc] * len(batch)
        for (_, fut), reply in zip(batch, replies):
            if fut is None or fut.done():
                continue
            if isinstance(reply, Exception):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)
