"""The audit trail keeps the records Redis could not take, and writes them once it can."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.audit import KEEP_UNWRITTEN, RETRY_S, STREAM, AuditLog
from gateway.batcher import CommandBatcher
from slogate.local_redis import LocalRedis


def written(lines: list) -> list[str]:
    return [json.loads(line)["request_id"] for _, f in lines for line in f[b"e"].decode().splitlines()]


async def test_records_redis_did_not_take_are_sent_again_once_it_is_back(own_redis: LocalRedis, caplog) -> None:
    client = aioredis.Redis.from_url(own_redis.url, socket_connect_timeout=1)
    audit = AuditLog(CommandBatcher(client), keep=100, flush_s=10)
    audit.write("a", time.time(), 200, {"key": "k", "model": "m"})
    own_redis.stop()
    with pytest.raises((RedisError, OSError)):
        await audit.flush()
    assert caplog.text.count("audit records could not be written") == 1
    audit.write("b", time.time(), 200, {"key": "k", "model": "m"})
    own_redis.start()
    deadline = time.monotonic() + RETRY_S + 10  # no request comes meanwhile: the retry is its own
    while not await client.exists(STREAM):
        assert time.monotonic() < deadline, "the kept records are sent again"
        await asyncio.sleep(0.05)
    assert written(await client.xrange(STREAM)) == ["a", "b"]
    await client.aclose()


async def test_what_is_kept_through_an_outage_is_bounded(own_redis: LocalRedis, caplog) -> None:
    client = aioredis.Redis.from_url(own_redis.url, socket_connect_timeout=1)
    audit = AuditLog(CommandBatcher(client), keep=100, flush_s=10, max_records=2)
    own_redis.stop()
    for i in range(KEEP_UNWRITTEN * 2 + 10):
        audit.write(f"r{i}", time.time(), 200, {"key": "k", "model": "m"})
        await asyncio.sleep(0.01)
    pending = audit.flush()
    if pending is not None:
        with pytest.raises((RedisError, OSError)):
            await pending
    assert len(audit._records) == KEEP_UNWRITTEN * 2, "the oldest beyond the bound are dropped"
    assert audit._records[-1].find('"r41"') > 0 and "dropped" in caplog.text
    await client.aclose()


async def test_the_trail_keeps_about_as_many_records_however_they_were_batched(redis_url: str) -> None:
    """An entry holds what one flush gathered; a busy gateway's entries hold hundreds, and a
    bound on entries alone would keep that many times more records."""
    client = aioredis.Redis.from_url(redis_url)
    await client.delete(STREAM)
    audit = AuditLog(CommandBatcher(client), keep=1000, flush_s=10, max_records=100)
    for i in range(300 * 100):  # every 100th record fills an entry, which is written at once
        audit.write(f"r{i}", time.time(), 200, {"key": "k", "model": "m"})
        if i % 100 == 99:
            await asyncio.sleep(0)
    deadline = time.monotonic() + 10
    while not (last := await client.xrevrange(STREAM, count=1)) or written(last)[-1] != "r29999":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    entries = await client.xlen(STREAM)
    assert entries <= 1000 // 100 + 100, "trimmed to about 10 entries (Redis trims whole nodes of 100)"
    await client.delete(STREAM)
    await client.aclose()
