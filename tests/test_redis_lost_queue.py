"""A Redis that restarts empty loses its queues: a request queued and not yet read fails with a
503 to retry rather than wait for its deadline, and one a worker is running goes on though it
has heard nothing yet (a request not streamed hears nothing until its answer), as does one
sent once Redis is back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from engines.sim import create
from engines.worker import Worker, WorkerSettings
from gateway.app import make_app
from gateway.state import STATE
from slogate import keys, protocol
from slogate.config import Config
from slogate.tasks import cancel_and_wait

BODY = {"model": "slogate-sim", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}


@contextlib.asynccontextmanager
async def running_and_queued(redis_url: str, decode_tokens: int, beat_s: float = 0.2,
                             beat_ttl_s: float = 1.0, alive_ttl_s: float = 5.0) -> AsyncIterator[Line]:
    """A gateway in front of one worker that takes one request at a time: it runs one of
    ``decode_tokens`` tokens (0.05 s each), and a second waits unread in the queue. The worker
    beats each ``beat_s``, for ``beat_ttl_s``; the gateway expects 0.2 s and 1 s."""
    async with one_at_a_time(redis_url, beat_s, beat_ttl_s, alive_ttl_s) as line:
        client = aioredis.Redis.from_url(redis_url)
        taken = line.send(decode_tokens)
        while not line.worker.inflight:
            await asyncio.sleep(0.01)
        queued = line.send(4)
        while await client.xlen(keys.queue("interactive")) < 2:  # behind the first, unread: the worker is full
            await asyncio.sleep(0.01)
        await client.aclose()
        line.taken, line.queued = taken, queued
        yield line


@contextlib.asynccontextmanager
async def one_at_a_time(redis_url: str, beat_s: float = 0.2, beat_ttl_s: float = 1.0,
                        alive_ttl_s: float = 5.0) -> AsyncIterator[Line]:
    """A gateway in front of one worker that takes one request at a time, each token 0.05 s;
    the gateway's alive key lives ``alive_ttl_s``."""
    client = aioredis.Redis.from_url(redis_url)
    worker = Worker(create(decode_base_s=0.05, decode_s_per_seq=0, max_batch=1), client,
                    WorkerSettings(pool="interactive", heartbeat_interval_s=beat_s, heartbeat_ttl_s=beat_ttl_s,
                                   intake_factor=1))
    running = asyncio.create_task(worker.run())
    cfg = Config(redis_url=redis_url, admission_control=False, worker_poll_s=0.1, heartbeat_interval_s=0.2,
                 heartbeat_ttl_s=1.0, alive_ttl_s=alive_ttl_s)
    try:
        while not await client.smembers(keys.WORKERS):
            await asyncio.sleep(0.01)
        async with TestClient(TestServer(make_app(cfg))) as http:
            yield Line(http, worker)
    finally:
        await cancel_and_wait([running])
        await client.aclose()


@dataclass
class Line:
    http: TestClient
    worker: Worker
    taken: asyncio.Task[ClientResponse] | None = None
    queued: asyncio.Task[ClientResponse] | None = None

    def send(self, max_tokens: int, n: int = 1) -> asyncio.Task[ClientResponse]:
        return asyncio.create_task(self.http.post(
            "/v1/chat/completions", headers={"x-slogate-class": "interactive", "x-slogate-timeout": "120"},
            json={**BODY, "max_tokens": max_tokens, "n": n}))


async def test_a_redis_that_restarts_empty_fails_only_what_no_worker_holds(own_redis) -> None:
    async with running_and_queued(own_redis.url, 60) as line:  # 3 s of decode
        own_redis.stop()
        own_redis.start()
        assert line.http.server.app[STATE].mux.loss is None, "not found yet: the reader retries each 0.2 s"
        later = line.send(4)  # queued on the Redis back
        lost = await asyncio.wait_for(line.queued, 30)  # its deadline is 120 s away
        assert lost.status == 503, await lost.text()
        assert (await lost.json())["error"]["code"] == "redis_unavailable"
        answered = await asyncio.wait_for(line.taken, 30)
        assert answered.status == 200, await answered.text()
        assert (await answered.json())["usage"]["completion_tokens"] == 60
        assert (await asyncio.wait_for(later, 30)).status == 200


async def test_a_choice_lost_from_the_queue_fails_its_request_though_the_worker_runs_another(own_redis) -> None:
    """Each choice is a request of its own to the workers, and a heartbeat names what it holds by
    the first characters of each id: one choice running must not vouch for another that Redis
    lost, which would wait for its deadline, 120 s away."""
    async with one_at_a_time(own_redis.url) as line:
        client = aioredis.Redis.from_url(own_redis.url)
        sent = line.send(60, n=2)  # one choice runs for 3 s, the other waits unread behind it
        while not line.worker.inflight or await client.xlen(keys.queue("interactive")) < 2:
            await asyncio.sleep(0.01)
        await client.aclose()
        own_redis.stop()
        own_redis.start()
        lost = await asyncio.wait_for(sent, 30)
        assert lost.status == 503, await lost.text()
        assert (await lost.json())["error"]["code"] == "redis_unavailable"


async def test_a_worker_that_beats_slower_than_the_gateway_expects_keeps_what_it_runs(own_redis) -> None:
    """The worker beats each 3 s, for 7.5 s, where the gateway's own setting says each 0.2 s, for 1 s:
    its first heartbeat after the restart comes well past the gateway's TTL, and the request it
    runs, not streamed, has heard nothing by then. It is answered; the one lost from the queue
    still ends with a 503."""
    async with running_and_queued(own_redis.url, 160, beat_s=3.0, beat_ttl_s=7.5) as line:  # 8 s of decode
        client = aioredis.Redis.from_url(own_redis.url)
        beat = keys.heartbeat("interactive", line.worker.s.worker_id)
        while await client.pttl(beat) < 7_300:  # restart just after a beat: the next one is 3 s away
            await asyncio.sleep(0.01)
        await client.aclose()
        own_redis.stop()
        own_redis.start()
        lost = await asyncio.wait_for(line.queued, 30)
        assert lost.status == 503, await lost.text()
        assert (await lost.json())["error"]["code"] == "redis_unavailable"
        answered = await asyncio.wait_for(line.taken, 30)
        assert answered.status == 200, await answered.text()
        assert (await answered.json())["usage"]["completion_tokens"] == 160


async def test_a_gateway_that_stalled_past_its_alive_ttl_fails_nothing_still_queued(own_redis) -> None:
    """The alive key expired (the gateway's loop stalled, or Redis refused its renewals while out
    of memory) though Redis lost nothing: a request still queued behind a running one is served.
    The key lives 2 s here, not 5 s: renewed each second, it still outlives the gap between two."""
    async with running_and_queued(own_redis.url, 100, alive_ttl_s=2) as line:  # 5 s of decode
        time.sleep(2.5)  # the whole loop stalls: the alive key expires, the queue stays
        served = await asyncio.wait_for(line.queued, 30)
        assert served.status == 200, await served.text()
        assert (await asyncio.wait_for(line.taken, 30)).status == 200


async def test_a_replica_that_lagged_behind_a_heartbeat_does_not_vouch_for_what_the_worker_held(own_redis) -> None:
    """Redis failed over to a replica that lagged: it holds the worker's heartbeat from before it
    took the running request, which the gateway has seen a newer one of. Read as what the
    worker holds, it had the running request failed with a 503 while the worker ran it. The
    worker beats each 3 s, for 7.5 s: its next beat comes well past the gateway's TTL of 1 s."""
    async with one_at_a_time(own_redis.url, beat_s=3.0, beat_ttl_s=7.5) as line:
        client = aioredis.Redis.from_url(own_redis.url)
        beat = keys.heartbeat("interactive", line.worker.s.worker_id)
        stale = await client.get(beat)  # holds nothing yet
        taken = line.send(160)  # 8 s of decode
        while not line.worker.inflight:
            await asyncio.sleep(0.01)
        queued = line.send(4)
        while await client.xlen(keys.queue("interactive")) < 2 or not protocol.decode_heartbeat(
                await client.get(beat)).held:  # the next beat names the running one
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the gateway reads it (each 0.1 s)
        await client.aclose()
        own_redis.stop()
        own_redis.start()
        client = aioredis.Redis.from_url(own_redis.url)
        await client.set(beat, stale, px=6_500)  # what the replica had of it
        await client.sadd(keys.WORKERS, beat)
        await client.aclose()
        lost = await asyncio.wait_for(queued, 30)
        assert lost.status == 503, await lost.text()
        assert (await lost.json())["error"]["code"] == "redis_unavailable"
        answered = await asyncio.wait_for(taken, 30)
        assert answered.status == 200, await answered.text()
        assert (await answered.json())["usage"]["completion_tokens"] == 160
