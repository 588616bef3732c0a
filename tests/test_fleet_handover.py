"""How workers hand work over and write to gateways: a lapsed heartbeat, a dead worker's requests
under load, a gateway gone, records lost on the way."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from engines.sim import create
from engines.worker import Worker, WorkerSettings
from gateway.batcher import CommandBatcher
from gateway.results import ResultMux
from slogate import keys, protocol
from slogate.crypto import Sealer
from slogate.protocol import Delta, Final, GenerateRequest, SamplingParams
from slogate.tasks import cancel_and_wait

REPLIES = keys.replies("test-gateway")


def request(rid: str, max_tokens: int, reply: str = REPLIES, stream: bool = True) -> GenerateRequest:
    return GenerateRequest(id=rid, model="m", pool="p", cls="batch", sampling=SamplingParams(max_tokens=max_tokens),
                           deadline=time.time() + 60, enqueued_at=time.time(), reply=reply, prompt=f"hello {rid}",
                           stream=stream)


async def enqueue(client: aioredis.Redis, req: GenerateRequest) -> None:
    await client.xadd(keys.queue("p"), {protocol.ID_FIELD: req.id, protocol.FIELD: protocol.encode(req)})


async def finals(client: aioredis.Redis) -> list[str]:
    """The request ids whose Final record is on REPLIES, in the order written."""
    out = []
    for _, fields in await client.xrange(REPLIES):
        for rid, payload in protocol.decode_batch(fields[protocol.BATCH_FIELD]):
            if isinstance(protocol.decode_result(payload), Final):
                out.append(rid.decode())
    return out


async def test_a_stream_its_gateway_deleted_on_close_is_not_recreated_without_a_ttl(redis_url: str) -> None:
    """A gateway deletes its reply stream as it stops; a record a worker still writes for it (a
    step already under way) creates it again, and it must expire like any other."""
    client = aioredis.Redis.from_url(redis_url)
    mux = ResultMux(client, CommandBatcher(client), Sealer())
    worker = Worker(create(decode_base_s=0), client, WorkerSettings(pool="p"))
    job = SimpleNamespace(req=SimpleNamespace(id="r1", reply=mux.key))
    worker._write(job, Delta("a", 0))
    assert await worker._flush()
    assert await client.pttl(mux.key) > 0
    await mux.close()  # the gateway stops
    worker._write(job, Delta("b", 1))
    assert await worker._flush()
    assert await client.pttl(mux.key) > 0, f"{mux.key} now has no TTL: it stays in Redis for ever"
    await client.aclose()


async def test_a_worker_whose_heartbeat_lapsed_does_not_keep_running_what_another_took_over(redis_url: str) -> None:
    """Worker a is alive, but its heartbeat lapses for 0.6 s (an event-loop stall, a partition
    from Redis). b takes its request over, as it should for a dead worker; once a beats again,
    it must drop the request, not run it beside b and claim it back."""
    client = aioredis.Redis.from_url(redis_url)
    fast = dict(heartbeat_interval_s=0.1, heartbeat_ttl_s=0.3, claim_idle_s=1.5)
    a = Worker(create(decode_base_s=0.02), client, WorkerSettings(pool="p", worker_id="a", **fast))
    b = Worker(create(decode_base_s=0.02), client, WorkerSettings(pool="p", worker_id="b", **fast))
    ta = asyncio.create_task(a.run())
    tb = None
    try:
        await enqueue(client, request("r", 150))
        while "r" not in a.inflight:
            await asyncio.sleep(0.01)
        tb = asyncio.create_task(b.run())
        beat = a.heartbeat

        def lapse():
            raise RedisError("heartbeat lapse")

        a.heartbeat = lapse
        await asyncio.sleep(0.6)
        a.heartbeat = beat
        for _ in range(20):
            await asyncio.sleep(0.1)
            if "r" in b.inflight:
                break
        assert "r" in b.inflight, "b took the request over"
        await asyncio.sleep(1.0)  # a beats again and runs a claim pass
        holders = [w.s.worker_id for w in (a, b) if "r" in w.inflight]
        assert len(holders) == 1, f"one request runs on {holders} at once"
    finally:
        await cancel_and_wait([t for t in (ta, tb) if t])
        await client.aclose()


async def test_a_dead_workers_request_is_taken_over_even_while_new_work_keeps_the_worker_full(
        redis_url: str) -> None:
    """Worker 'dead' read request 'orphan' (older than all the rest) and died. The live worker
    is kept full by a backlog; the orphan must still go before the backlog, not after it."""
    client = aioredis.Redis.from_url(redis_url)
    await client.xgroup_create(keys.queue("p"), keys.GROUP, id="0", mkstream=True)
    await enqueue(client, request("orphan", 10))
    await client.xreadgroup(keys.GROUP, "dead", {keys.queue("p"): ">"}, count=1)
    for i in range(24):
        await enqueue(client, request(f"new{i}", 10))
    settings = WorkerSettings(pool="p", worker_id="live", heartbeat_interval_s=0.1, heartbeat_ttl_s=0.3,
                              claim_idle_s=30, intake_factor=1)
    worker = Worker(create(decode_base_s=0.02, max_batch=2), client, settings)
    task = asyncio.create_task(worker.run())
    try:
        while len(await finals(client)) < 25:
            await asyncio.sleep(0.05)
        order = await finals(client)
        assert order.index("orphan") < 6, f"the orphan finished {order.index('orphan') + 1}th of 25: {order}"
    finally:
        await cancel_and_wait([task])
        await client.aclose()


async def test_records_redis_lost_on_the_way_do_not_trip_the_pools_breaker() -> None:
    """A record that never reaches the gateway (a Redis that restarted or failed over) ends its
    request with a 502, but says nothing of the pool: one blip that catches a few streams must
    not open the pool's breaker for everyone."""
    import pytest

    from gateway import completions, schema
    from gateway.errors import APIError
    from gateway.metrics import GatewayMetrics
    from gateway.results import Subscription
    from policies.admission import AdmissionController
    from slogate.config import Config

    cfg = Config()
    state = SimpleNamespace(metrics=GatewayMetrics(), admission=AdmissionController(cfg.policies))
    sampling = SamplingParams(max_tokens=20, temperature=0)
    parsed = schema.ParsedRequest("chat", "m", True, False, sampling, True,
                                  messages=[{"role": "user", "content": "hi"}])
    for i in range(cfg.policies.circuit.consecutive_failures):
        gen = GenerateRequest(id=f"r{i}", model="m", pool="interactive", cls="interactive", sampling=sampling,
                              deadline=time.time() + 30, enqueued_at=time.time(), reply=REPLIES, stream=True)
        job = completions._Job(state, parsed, gen, Subscription(gen.id, pool="interactive"), time.time(), {})
        job.sub.records.put_nowait(Delta("hello ", 0))
        job.sub.records.put_nowait(Delta("there", 12))  # "wor" ... lost with the Redis that restarted
        with pytest.raises(APIError):
            await completions._collect(job)
        completions._observe(job)
    assert state.admission.breaker("interactive").state(time.time()) == "closed", \
        "a Redis fault opened the pool's circuit"
