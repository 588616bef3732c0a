"""A request Redis refuses to queue (out of memory) was never a worker's: it ends with a 503,
and no cancel follows it."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import make_app
from slogate import keys, protocol
from slogate.config import Config
from slogate.protocol import Heartbeat, ModelInfo


async def test_a_request_redis_refused_to_queue_is_not_cancelled_every_second(redis_url: str) -> None:
    """Its cancel was retried each second until its deadline (an hour for batch), as for a
    request whose XADD reply was lost: during a long out-of-memory spell they piled up."""
    r = aioredis.Redis.from_url(redis_url)
    hb = Heartbeat(worker_id="w1", pool="interactive", engine="sim", models=[ModelInfo("m", 8192)], running=0,
                   waiting=0, capacity=8)
    name = keys.heartbeat("interactive", "w1")
    await r.set(name, protocol.encode(hb), px=60_000)
    await r.sadd(keys.WORKERS, name)
    cancels = r.pubsub()
    await cancels.subscribe(keys.CANCEL_CHANNEL)
    try:
        async with TestClient(TestServer(make_app(Config(redis_url=redis_url, admission_control=False)))) as client:
            await r.config_set("maxmemory", 1)
            try:
                resp = await client.post("/v1/completions", headers={"x-slogate-class": "interactive"},
                                         json={"model": "m", "prompt": "hi", "max_tokens": 4})
                assert resp.status == 503, await resp.text()
                assert "cannot queue" in (await resp.json())["error"]["message"]
                await asyncio.sleep(2.5)  # two retries' worth
            finally:
                await r.config_set("maxmemory", 0)
        told = []
        while (message := await cancels.get_message(timeout=0.2)) is not None:
            if message["type"] == "message":
                told.append(message["data"])
        assert told == [], "workers were told to cancel a request none of them could have"
    finally:
        await cancels.aclose()
        await r.aclose()
