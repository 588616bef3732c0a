"""A pipeline whose reply is lost after Redis ran it is not sent again, as redis-py's default
retries would (``Redis()`` has them; ``from_url`` in 8.1 not): a request queued by its XADD
would be queued twice, for two workers to run."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.app import commands_redis
from gateway.batcher import CommandBatcher
from slogate import keys
from slogate.config import Config
from slogate.local_redis import LocalRedis
from tests.redis_relay import Relay


async def test_a_queued_request_whose_reply_is_lost_is_queued_once(redis_server: LocalRedis, redis_url: str) -> None:
    queue = keys.queue("p")
    relay = await Relay(redis_server.port, drop_reply_to=queue.encode()).start()
    commands = commands_redis(relay.url, Config().redis_timeout_s)
    client = aioredis.Redis.from_url(redis_url)
    batcher = CommandBatcher(commands)
    try:
        [queued] = await asyncio.gather(batcher.call("XADD", queue, "*", "id", "r1"), return_exceptions=True)
        assert await client.xlen(queue) == 1, "the pipeline was sent again after Redis ran it"
        assert isinstance(queued, RedisConnectionError), "the caller's to answer: a 503 to retry"
        assert await batcher.call("XLEN", queue) == 1, "the next command gets a new connection"
    finally:
        await commands.aclose()
        await client.aclose()
        await relay.close()
