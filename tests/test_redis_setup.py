"""What the gateway says of a Redis set up in a way it cannot work well with."""

from __future__ import annotations

import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import make_app
from slogate.config import Config
from slogate.local_redis import LocalRedis


async def test_a_redis_that_evicts_keys_when_full_is_named_at_startup(own_redis: LocalRedis, caplog) -> None:
    """Under an eviction policy a full Redis drops keys: a queue, a heartbeat, the gateway's alive
    key (its loss fails every request that heard nothing), or the audit trail's flush numbers (a
    flush sent again after its reply was lost is written twice). Nothing said so."""
    client = aioredis.Redis.from_url(own_redis.url)
    await client.config_set("maxmemory", "1gb")
    await client.config_set("maxmemory-policy", "allkeys-lru")
    await client.aclose()
    async with TestClient(TestServer(make_app(Config(redis_url=own_redis.url)))):
        pass
    assert "maxmemory-policy allkeys-lru" in caplog.text and "noeviction" in caplog.text


async def test_a_redis_that_refuses_writes_when_full_is_not_warned_of(own_redis: LocalRedis, caplog) -> None:
    client = aioredis.Redis.from_url(own_redis.url)
    await client.config_set("maxmemory", "1gb")
    await client.config_set("maxmemory-policy", "noeviction")
    await client.aclose()
    async with TestClient(TestServer(make_app(Config(redis_url=own_redis.url)))):
        pass
    assert "maxmemory-policy" not in caplog.text
