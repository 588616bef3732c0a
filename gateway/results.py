"""Read every in-flight request's result stream with one blocking XREAD.

A blocking read per request would hold one Redis connection per open request; instead one
reader blocks on all of them at once and hands each record to its request's queue. A request
that starts while the reader is blocked wakes it through a tiny per-gateway stream, written in
the same pipeline as the request itself, so waking costs no extra round trip.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.batcher import CommandBatcher
from slogate import keys, protocol
from slogate.crypto import Sealer, SealError
from slogate.protocol import Error, Result

log = logging.getLogger("slogate.gateway")


@dataclass
class Subscription:
    request_id: str
    key: bytes
    records: asyncio.Queue[Result] = field(default_factory=asyncio.Queue)
    last_id: bytes = b"0-0"


class ResultMux:
    def __init__(self, redis: aioredis.Redis, batcher: CommandBatcher, sealer: Sealer,
                 block_ms: int = 2000, count: int = 256) -> None:
        self.redis = redis
        self.sealer = sealer
        self.batcher = batcher
        self.block_ms = block_ms
        self.count = count
        self.wake_key = f"{keys.PREFIX}:wake:{uuid.uuid4().hex}".encode()
        self._wake_last = b"0-0"
        self._subs: dict[bytes, Subscription] = {}
        self._has_subs = asyncio.Event()
        self._blocked = False
        self._wake_sent = False

    def __len__(self) -> int:
        return len(self._subs)

    def subscribe(self, request_id: str) -> Subscription:
        sub = Subscription(request_id, keys.result(request_id).encode())
        self._subs[sub.key] = sub
        self._has_subs.set()
        if self._blocked and not self._wake_sent:
            self._wake_sent = True
            self.batcher.fire("XADD", self.wake_key, "MAXLEN", "1", "*", "w", "1")
            self.batcher.fire("PEXPIRE", self.wake_key, 60_000)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop reading and delete the stream: a finished request leaves no key behind."""
        self._subs.pop(sub.key, None)
        self.batcher.fire("DEL", sub.key)

    async def run(self) -> None:
        while True:
            if not self._subs:
                self._has_subs.clear()
                await self._has_subs.wait()
            streams = {key: sub.last_id for key, sub in self._subs.items()}
            streams[self.wake_key] = self._wake_last
            self._blocked, self._wake_sent = True, False
            try:
                resp = await self.redis.xread(streams, count=self.count, block=self.block_ms)
            except (RedisError, OSError) as exc:
                self._fail_all(f"lost the connection to Redis: {exc}")
                await asyncio.sleep(0.2)
                continue
            finally:
                self._blocked = False
            for key, entries in resp or ():
                if key == self.wake_key:
                    self._wake_last = entries[-1][0]
                    continue
                sub = self._subs.get(key)
                if sub is None:
                    continue
                sub.last_id = entries[-1][0]
                for _, fields in entries:
                    sub.records.put_nowait(self._decode(sub, fields))

    def _fail_all(self, message: str) -> None:
        for sub in list(self._subs.values()):
            sub.records.put_nowait(Error(message, "redis_unavailable", 503, attempt=0))

    async def close(self) -> None:
        try:
            await self.redis.delete(self.wake_key)
        except RedisError:
            pass


    def _decode(self, sub: Subscription, fields: dict[bytes, bytes]) -> Result:
        try:
            return protocol.decode_result(self.sealer.open(fields[protocol.FIELD], sub.request_id.encode()))
        except (protocol.ProtocolError, SealError, KeyError) as exc:
            log.error("unreadable result record: %s", exc)
            return Error(f"a worker sent a record this gateway cannot read ({exc})",
                         "protocol_mismatch", 502, attempt=0)
