"""The audit trail keeps the records Redis could not take, and writes them once it can."""

from __future__ import annotations

import json
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.audit import STREAM, AuditLog
from gateway.batcher import CommandBatcher
from slogate.local_redis import LocalRedis


async def test_records_redis_did_not_take_go_out_with_the_next_flush(own_redis: LocalRedis, caplog) -> None:
    client = aioredis.Redis.from_url(own_redis.url, socket_connect_timeout=1)
    audit = AuditLog(CommandBatcher(client), max_entries=100, flush_s=10)
    audit.write("a", time.time(), 200, {"key": "k", "model": "m"})
    own_redis.stop()
    with pytest.raises((RedisError, OSError)):
        await audit.flush()
    assert "audit records could not be written" in caplog.text
    audit.write("b", time.time(), 200, {"key": "k", "model": "m"})
    own_redis.start()
    await audit.flush()
    lines = [json.loads(line) for _, f in await client.xrange(STREAM) for line in f[b"e"].decode().splitlines()]
    assert [r["request_id"] for r in lines] == ["a", "b"]
    await client.aclose()
