"""A worker cut off from Redis without a word (a network partition, Redis back on another
host) reconnects, where its intake waited for the reply to a read for good: the worker set no
read timeout, and redis-py before 8.0 sets none either."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from engines.sim import create
from engines.worker import INTAKE_BLOCK_MS, READ_TIMEOUT_S, Worker, WorkerSettings, worker_redis
from slogate import keys, protocol
from slogate.local_redis import LocalRedis
from slogate.protocol import Final, GenerateRequest, SamplingParams
from slogate.tasks import cancel_and_wait

REPLIES = keys.replies("test-gateway")


class Relay:
    """A TCP relay to Redis. :meth:`cut` silences the connections open at the time, as a
    partition does (nothing passes either way, nothing closes); connections opened later pass."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = ""
        self._live: list[list[bool]] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> Relay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"
        return self

    def cut(self) -> None:
        for live in self._live:
            live[0] = False

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        live = [True]
        self._live.append(live)
        self._writers += [writer, up_writer]
        await asyncio.gather(_pipe(reader, up_writer, live), _pipe(up_reader, writer, live), return_exceptions=True)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, live: list[bool]) -> None:
    try:
        while data := await src.read(65536):
            if live[0]:
                dst.write(data)
                await dst.drain()
    finally:
        dst.close()


async def served(client: aioredis.Redis, request_id: str, within_s: float) -> bool:
    req = GenerateRequest(id=request_id, model="m", pool="p", cls="interactive", sampling=SamplingParams(max_tokens=2),
                          deadline=time.time() + 120, enqueued_at=time.time(), reply=REPLIES, prompt="hello")
    await client.xadd(keys.queue("p"), {protocol.ID_FIELD: request_id, protocol.FIELD: protocol.encode(req)})
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        for _, fields in await client.xrange(REPLIES):
            for rid, payload in protocol.decode_batch(fields[protocol.BATCH_FIELD]):
                if rid == request_id.encode() and isinstance(protocol.decode_result(payload), Final):
                    return True
        await asyncio.sleep(0.05)
    return False


async def test_a_worker_whose_connections_go_silent_reconnects_and_serves(redis_server: LocalRedis,
                                                                         redis_url: str) -> None:
    relay = await Relay(redis_server.port).start()
    client = aioredis.Redis.from_url(redis_url)
    worker_client = worker_redis(relay.url)
    task = asyncio.create_task(Worker(create(decode_base_s=0), worker_client, WorkerSettings(pool="p")).run())
    try:
        assert await served(client, "before", 10)
        relay.cut()
        # The intake's XREADGROUP ends in Redis meanwhile, its empty reply lost: what comes
        # next is not handed to the silent connection, and waits for a read that reaches Redis.
        await asyncio.sleep(1.0)
        assert await served(client, "after", 60), "the worker still waits on a connection that went silent"
    finally:
        await cancel_and_wait([task])
        await worker_client.aclose()
        await client.aclose()
        await relay.close()


def test_the_worker_sets_its_own_read_timeout_past_its_intakes_block() -> None:
    """Not redis-py's default, which is none before 8.0 (and 5 s since)."""
    client = worker_redis("redis://127.0.0.1:1/0")
    assert client.connection_pool.connection_kwargs["socket_timeout"] == READ_TIMEOUT_S > INTAKE_BLOCK_MS / 1000
