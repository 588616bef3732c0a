"""A worker cut off from Redis without a word (a network partition, Redis back on another
host) reconnects, where its intake would wait for the reply to a read for good without a read
timeout (redis-py before 8.0 set none; the worker now sets its own)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from engines import worker
from engines.sim import create
from engines.worker import INTAKE_BLOCK_MS, READ_TIMEOUT_S, Worker, WorkerSettings, worker_redis
from slogate import keys, protocol
from slogate.local_redis import LocalRedis
from slogate.protocol import Final, GenerateRequest, SamplingParams
from slogate.tasks import cancel_and_wait
from tests.redis_relay import Relay

REPLIES = keys.replies("test-gateway")


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


async def test_a_worker_whose_connections_go_silent_reconnects_and_serves(redis_server: LocalRedis, redis_url: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Its reads time out after 1.5 s here, not 5 s: still past the intake's block."""
    monkeypatch.setattr(worker, "READ_TIMEOUT_S", 1.5)
    relay = await Relay(redis_server.port).start()
    client = aioredis.Redis.from_url(redis_url)
    worker_client = worker_redis(relay.url)
    assert worker_client.connection_pool.connection_kwargs["socket_timeout"] == 1.5 > INTAKE_BLOCK_MS / 1000
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
