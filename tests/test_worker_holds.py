"""What a worker holds stays its own and reaches its gateway: records whole and in order when
Redis drops a send, requests finished by the worker that holds them while it drains."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import redis.asyncio as aioredis

from engines.sim import create
from engines.worker import Worker, WorkerSettings
from slogate import keys, protocol
from slogate.local_redis import LocalRedis
from slogate.protocol import Delta, Final, GenerateRequest, SamplingParams
from slogate.tasks import cancel_and_wait

REPLIES = keys.replies("test-gateway")


async def test_a_send_redis_refused_is_sent_again_ahead_of_later_records(own_redis: LocalRedis) -> None:
    """Dropped, the first records would leave a hole in the middle of the stream (the gateway
    joined the text on either side of it) and the acks would leave finished requests to be
    claimed and run again."""
    client = aioredis.Redis.from_url(own_redis.url, socket_connect_timeout=1)
    worker = Worker(create(decode_base_s=0), client, WorkerSettings(pool="p"))
    job = SimpleNamespace(req=SimpleNamespace(id="r1", reply=REPLIES))
    worker._write(job, Delta("a", 0))
    worker._ack([b"1-1"])
    own_redis.stop()
    assert await worker._flush() is False
    worker._write(job, Delta("b", 1))
    worker._write(job, Final("length", 1, 2))
    worker._ack([b"1-2"])
    assert worker._acks == [b"1-1", b"1-2"]
    own_redis.start()
    assert await worker._flush() is True
    assert not worker._replies and not worker._acks
    entries = await client.xrange(REPLIES)
    records = [protocol.decode_result(payload) for _, f in entries
               for _, payload in protocol.decode_batch(f[protocol.BATCH_FIELD])]
    assert [r.text for r in records if isinstance(r, Delta)] == ["a", "b"]
    assert isinstance(records[-1], Final)
    assert await client.pttl(REPLIES) > 0, "the stream's TTL is set again with the retry"
    await client.aclose()


async def test_a_draining_worker_keeps_what_it_holds_from_being_taken_over(redis_url: str) -> None:
    """Its heartbeat went with the drain: past the heartbeat's TTL another worker took over a
    request this one was still streaming, and ran it again."""
    client = aioredis.Redis.from_url(redis_url)
    settings = WorkerSettings(pool="p", heartbeat_interval_s=0.1, heartbeat_ttl_s=0.3, claim_idle_s=0.6)
    worker = Worker(create(decode_base_s=0.02), client, settings)
    task = asyncio.create_task(worker.run())
    req = GenerateRequest(id="r", model="m", pool="p", cls="interactive", sampling=SamplingParams(max_tokens=75),
                          deadline=time.time() + 30, enqueued_at=time.time(), reply=REPLIES, prompt="hello")
    await client.xadd(keys.queue("p"), {protocol.ID_FIELD: "r", protocol.FIELD: protocol.encode(req)})
    try:
        while not worker.inflight:
            await asyncio.sleep(0.01)
        worker.stop()
        beat = keys.heartbeat("p", settings.worker_id)
        for _ in range(10):  # 1 s: past the heartbeat's TTL and the claim's idle time
            await asyncio.sleep(0.1)
            assert worker.inflight, "the request outlives the checks"
            heartbeat = protocol.decode_heartbeat(await client.get(beat))
            assert heartbeat.capacity == 0 and heartbeat.running == 1
            [pending] = await client.xpending_range(keys.queue("p"), keys.GROUP, "-", "+", 10)
            assert pending["time_since_delivered"] < 600, "nobody may claim it"
        await asyncio.wait_for(task, 10)
        assert await client.get(beat) is None
        entries = await client.xrange(REPLIES)
        last = protocol.decode_result(protocol.decode_batch(entries[-1][1][protocol.BATCH_FIELD])[-1][1])
        assert isinstance(last, Final) and last.completion_tokens == 75
    finally:
        await cancel_and_wait([task])
        await client.aclose()
