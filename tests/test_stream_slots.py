"""A key's stream slots: taken before admission, and never held by a stream that never started."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import make_app
from gateway.auth import hash_key
from gateway.batcher import CommandBatcher
from gateway.completions import _stream_slot
from gateway.state import STATE
from policies import config as policy_config
from slogate import keys, protocol
from slogate.config import ApiKeyConfig, Config, load_config
from slogate.protocol import Heartbeat, ModelInfo


async def test_a_stream_refused_for_the_key_limit_books_no_prompt(redis_url: str) -> None:
    """Refused with 429 too_many_streams, it is never queued: it must leave no prompt booked
    against the pool, where it would push every other key's requests back."""
    r = aioredis.Redis.from_url(redis_url)
    hb = Heartbeat(worker_id="w1", pool="interactive", engine="sim", models=[ModelInfo("m", 8192)], running=0,
                   waiting=0, capacity=8, prefill_s_per_token=1e-4, decode_step_s=0.005)
    name = keys.heartbeat("interactive", "w1")
    await r.set(name, protocol.encode(hb), px=60_000)
    await r.sadd(keys.WORKERS, name)
    await r.zadd(keys.stream_slots("a"), {"open-elsewhere": time.time() + 600})  # key a's one stream is open
    no_probes = policy_config.load({"admission": {"probe_interval_s": 1e12}})
    cfg = Config(redis_url=redis_url, max_streams_per_key=1, policies=no_probes,
                 api_keys=[ApiKeyConfig("a", hash_key("secret-a")), ApiKeyConfig("b", hash_key("secret-b"))])
    async with TestClient(TestServer(make_app(cfg))) as client:
        state = client.server.app[STATE]
        resp = await client.post("/v1/completions", headers={"Authorization": "Bearer secret-a",
                                                             "x-slogate-class": "interactive"},
                                 json={"model": "m", "prompt": "x" * 4000, "max_tokens": 4, "stream": True})
        assert resp.status == 429 and (await resp.json())["error"]["code"] == "too_many_streams"
        # Key b's interactive request: 0.04 s on this idle pool, within the 0.125 s budget.
        d = state.admission.decide(cls="interactive", stream=False, prompt_tokens=200, max_tokens=4,
                                   signals=state.directory.signals(), now=time.time(), model="m")
        assert (d.outcome, d.reason) == ("admit", "fits"), (d, state.admission.prompts["interactive"])
    await r.aclose()


async def test_a_client_that_leaves_while_its_slot_is_taken_does_not_keep_it(redis_url: str) -> None:
    """The client hangs up while Redis takes the slot: Redis took it all the same, and it must
    be given back, not held until the stream's deadline (an hour for batch)."""
    client = aioredis.Redis.from_url(redis_url)
    state = SimpleNamespace(keys=SimpleNamespace(enabled=True), batcher=CommandBatcher(client),
                            cfg=load_config(env={}))

    async def handler() -> None:
        async with _stream_slot(state, "payments", time.time() + 3600):
            await asyncio.sleep(10)

    task = asyncio.create_task(handler())
    await asyncio.sleep(0)  # the EVAL is queued; its reply has not come
    task.cancel()  # the client disconnects (aiohttp cancels the handler)
    await asyncio.gather(task, return_exceptions=True)
    await state.batcher.drain()  # Redis has answered the take, and then the give-back
    assert await client.zcard(keys.stream_slots("payments")) == 0
    await client.aclose()
