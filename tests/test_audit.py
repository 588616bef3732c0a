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
    """Records are trimmed one by one: a busy flush after a quiet spell must not take the quiet
    spell's records with it, nor a quiet spell keep a busy one's many times over."""
    client = aioredis.Redis.from_url(redis_url)
    await client.delete(STREAM)
    audit = AuditLog(CommandBatcher(client), keep=1000, flush_s=10, max_records=500)
    for i in range(2000):
        audit.write(f"quiet{i}", time.time(), 200, {"key": "k", "model": "m"})
        await audit.flush()
    kept = written(await client.xrange(STREAM))
    assert 1000 <= len(kept) <= 1100, "Redis trims whole nodes of up to 100 entries"
    assert kept[-1] == "quiet1999"
    for i in range(400):
        audit.write(f"busy{i}", time.time(), 200, {"key": "k", "model": "m"})
    await audit.flush()
    kept = written(await client.xrange(STREAM))
    assert 1000 <= len(kept) <= 1100
    assert kept[-1] == "busy399" and sum(r.startswith("quiet") for r in kept) >= 600
    await client.delete(STREAM)
    await client.aclose()
