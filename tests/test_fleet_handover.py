"""How workers hand work over and write to gateways: a lapsed heartbeat, a dead worker's requests
under load, a gateway gone, records lost on the way."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from engines.sim import create
from engines.worker import Worker, WorkerSettings
from gateway.batcher import CommandBatcher
from gateway.results import ResultMux
from slogate import keys, protocol
from slogate.crypto import Sealer
from slogate.protocol import Delta, Error, Final, GenerateRequest, SamplingParams
from slogate.tasks import cancel_and_wait

REPLIES = keys.replies("test-gateway")
Q = keys.queue("p")


def request(rid: str, max_tokens: int, reply: str = REPLIES, stream: bool = True) -> GenerateRequest:
    return GenerateRequest(id=rid, model="m", pool="p", cls="batch", sampling=SamplingParams(max_tokens=max_tokens),
                           deadline=time.time() + 60, enqueued_at=time.time(), reply=reply, prompt=f"hello {rid}",
                           stream=stream)


async def enqueue(client: aioredis.Redis, req: GenerateRequest) -> None:
    await client.xadd(Q, {protocol.ID_FIELD: req.id, protocol.REPLY_FIELD: req.reply,
                          protocol.FIELD: protocol.encode(req)})


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


async def test_a_gateway_whose_key_a_restart_lost_for_less_than_its_renewal_is_not_taken_for_gone(
        redis_url: str) -> None:
    """Redis restarted empty: the gateway's alive key is gone until its next renewal, up to a
    second later. A worker beating every 0.1 s saw it missing at two checks 0.1 s apart and
    stopped every request of a live gateway, whose clients then waited for their deadlines."""
    client = aioredis.Redis.from_url(redis_url)
    alive = keys.alive("test-gateway")
    await client.set(alive, b"1")
    worker = Worker(create(decode_base_s=0.02), client, WorkerSettings(pool="p", heartbeat_interval_s=0.1))
    running = asyncio.create_task(worker.run())
    try:
        req = request("r", 1000)
        req.alive = alive
        await enqueue(client, req)
        while "r" not in worker.inflight:
            await asyncio.sleep(0.01)
        await client.delete(alive)  # the restart
        await asyncio.sleep(0.6)
        await client.set(alive, b"1")  # the gateway's renewal
        await asyncio.sleep(0.5)
        assert "r" in worker.inflight, "a live gateway's request was stopped"
        await client.delete(alive)  # the gateway dies
        for _ in range(50):
            await asyncio.sleep(0.1)
            if "r" not in worker.inflight:
                break
        assert "r" not in worker.inflight, "a gone gateway's request is stopped"
    finally:
        await cancel_and_wait([running])
        await client.aclose()


async def test_records_redis_lost_on_the_way_do_not_trip_the_pools_breaker() -> None:
    """A record that never reaches the gateway (a Redis that restarted or failed over) ends its
    request with a 502, but says nothing of the pool: one blip that catches a few streams must
    not open the pool's breaker for everyone."""
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
            await completions._collect([job], job.sub)
        completions._observe(job)
    assert state.admission.breaker("interactive").state(time.time()) == "closed", \
        "a Redis fault opened the pool's circuit"


async def test_a_flush_a_bug_breaks_leaves_its_request_to_be_claimed_and_run_again(redis_url, monkeypatch) -> None:
    """A send that fails for a bug, not Redis, loses its records and acks; the request must not
    stay this worker's for ever, but be claimed after claim_idle_s and run again."""
    client = aioredis.Redis.from_url(redis_url)
    worker = Worker(create(decode_base_s=0.005), client,
                    WorkerSettings(pool="p", heartbeat_interval_s=0.1, heartbeat_ttl_s=0.3, claim_idle_s=0.6))
    real, calls = protocol.encode_batch, []

    def flaky(records):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in a write")
        return real(records)

    monkeypatch.setattr(protocol, "encode_batch", flaky)
    task = asyncio.create_task(worker.run())
    try:
        await enqueue(client, request("r", 3))
        await asyncio.sleep(3.0)
        pending = (await client.xpending(Q, keys.GROUP))["pending"]
        assert (await finals(client), pending, worker._unacked) == (["r"], 0, set())
    finally:
        await cancel_and_wait([task])
        await client.aclose()


async def test_an_unreadable_entry_with_a_reply_field_that_is_not_utf8_leaves_the_intake_running(redis_url) -> None:
    client = aioredis.Redis.from_url(redis_url)
    await client.xgroup_create(Q, keys.GROUP, id="0", mkstream=True)
    worker = Worker(create(decode_base_s=0.005), client, WorkerSettings(pool="p"))
    task = asyncio.create_task(worker.run())
    try:
        await client.xadd(Q, {protocol.ID_FIELD: "bad", protocol.REPLY_FIELD: b"\xff\xfe", protocol.FIELD: b"junk"})
        await enqueue(client, request("good", 5))
        for _ in range(40):
            await asyncio.sleep(0.05)
            if await finals(client):
                break
        assert await finals(client) == ["good"]
    finally:
        await cancel_and_wait([task])
        await client.aclose()


async def test_an_unreadable_entry_naming_a_key_that_is_no_reply_stream_is_not_answered_there(redis_url) -> None:
    """The reply field is not authenticated: one that names another kind of key (whose XADD
    would fail every later send with it) gets no answer there, and no TTL."""
    client = aioredis.Redis.from_url(redis_url)
    await client.sadd(keys.WORKERS, "someone")  # any non-stream key
    await client.xgroup_create(Q, keys.GROUP, id="0", mkstream=True)
    worker = Worker(create(decode_base_s=0.005), client, WorkerSettings(pool="p"))
    task = asyncio.create_task(worker.run())
    try:
        await client.xadd(Q, {protocol.ID_FIELD: "bad", protocol.REPLY_FIELD: keys.WORKERS, protocol.FIELD: b"junk"})
        await enqueue(client, request("good", 5))
        await asyncio.sleep(2.0)
        ttl = await client.pttl(keys.WORKERS)
        assert (await finals(client), worker._send_failing, ttl) == (["good"], False, -1)
    finally:
        await cancel_and_wait([task])
        await client.aclose()


async def test_an_unreadable_entry_taken_over_is_answered_with_its_attempt(redis_url) -> None:
    """Claimed as a third delivery (its gateway relaying attempt 2), its answer says attempt 3:
    one of attempt 1 would be dropped there as stale."""
    client = aioredis.Redis.from_url(redis_url)
    worker = Worker(create(decode_base_s=0.005), client, WorkerSettings(pool="p"))
    await worker._accept([(b"5-0", {protocol.ID_FIELD: b"x", protocol.REPLY_FIELD: REPLIES.encode(),
                                     protocol.FIELD: b"junk"})], attempts={b"5-0": 3})
    (rid, sealed), = worker._replies[REPLIES]
    err = protocol.decode_result(worker.sealer.open(sealed, rid))
    assert isinstance(err, Error) and err.attempt == 3, err
    await client.aclose()


@pytest.mark.parametrize("orphans,new", [(1, 24), (8, 40)])
async def test_a_dead_workers_requests_go_before_new_work_however_full_the_live_worker_is(
        redis_url: str, orphans: int, new: int) -> None:
    """Worker 'dead' read the oldest requests and died. The live one, with room for 2 at a
    time, is kept full by the newer ones: the dead one's still go first, all of them, not only
    those the first takeover had room for."""
    client = aioredis.Redis.from_url(redis_url)
    await client.xgroup_create(Q, keys.GROUP, id="0", mkstream=True)
    for i in range(orphans):
        await enqueue(client, request(f"orphan{i}", 5))
    await client.xreadgroup(keys.GROUP, "dead", {Q: ">"}, count=orphans)
    for i in range(new):
        await enqueue(client, request(f"new{i}", 5))
    await asyncio.sleep(0.4)  # idle past the heartbeat TTL a takeover asks of them
    settings = WorkerSettings(pool="p", worker_id="live", heartbeat_interval_s=0.1, heartbeat_ttl_s=0.3,
                              claim_idle_s=30, intake_factor=1)
    worker = Worker(create(decode_base_s=0.01, max_batch=2), client, settings)
    task = asyncio.create_task(worker.run())
    try:
        while len(await finals(client)) < orphans + new:
            await asyncio.sleep(0.05)
        order = await finals(client)
        last = max(order.index(f"orphan{i}") for i in range(orphans))
        assert last < orphans + 6, f"the last orphan finished {last + 1}th of {orphans + new}: {order}"
    finally:
        await cancel_and_wait([task])
        await client.aclose()
