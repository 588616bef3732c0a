"""What a worker holds stays its own and reaches its gateway: records whole and in order when
Redis drops a send, requests finished by the worker that holds them while it drains."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from engines.base import LONG_PROMPT_CHARS
from engines.engine_process import EngineDied
from engines.sim import create
from engines.worker import Worker, WorkerSettings
from slogate import keys, protocol
from slogate.local_redis import LocalRedis, free_port
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


class HungEngine:
    """The sim engine, except that its steps never end once told to hang."""

    def __init__(self) -> None:
        self.inner = create(decode_base_s=0)
        self.hang = threading.Event()
        self.release = threading.Event()
        self.name, self.model_id, self.max_context = "hung", "m", 8192

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def step(self, arrivals=None, send=None):
        if self.hang.is_set():
            self.release.wait()
        return self.inner.step(arrivals, send)


async def test_a_worker_gives_up_an_engine_that_stops_stepping(redis_url: str) -> None:
    """A hung engine held its requests until their deadlines while the worker's heartbeat
    said all was well, and it kept taking new ones: it takes none, shows no capacity, and
    once ``engine_stall_s`` has passed the worker ends, leaving them pending for others."""
    client = aioredis.Redis.from_url(redis_url)
    engine = HungEngine()
    settings = WorkerSettings(pool="p", heartbeat_interval_s=0.1, heartbeat_ttl_s=0.5, engine_stall_s=4.0,
                              stall_pause_s=1.0)
    worker = Worker(engine, client, settings)
    task = asyncio.create_task(worker.run())
    try:
        engine.hang.set()
        for rid in ("first", "second"):
            req = GenerateRequest(id=rid, model="m", pool="p", cls="interactive", sampling=SamplingParams(max_tokens=5),
                                  deadline=time.time() + 30, enqueued_at=time.time(), reply=REPLIES, prompt="hi")
            await client.xadd(keys.queue("p"), {protocol.ID_FIELD: rid, protocol.FIELD: protocol.encode(req)})
            if rid == "first":
                while not worker.inflight:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(1.5)
        await asyncio.sleep(0.5)
        assert list(worker.inflight) == ["first"], "a stalled engine takes no new request"
        heartbeat = protocol.decode_heartbeat(await client.get(keys.heartbeat("p", settings.worker_id)))
        assert heartbeat.capacity == 0
        with pytest.raises(EngineDied, match="has not finished a step"):
            await asyncio.wait_for(task, 10)
        pending = await client.xpending(keys.queue("p"), keys.GROUP)
        assert pending["pending"] == 1, "left for other workers, not acknowledged"
        assert await client.xlen(keys.queue("p")) == 2
    finally:
        engine.release.set()
        await cancel_and_wait([task])
        await client.aclose()


async def test_acks_never_land_without_the_records_before_them(own_redis: LocalRedis) -> None:
    """Redis out of memory refuses the XADD but takes the XACK: sent apart, the request was
    acknowledged while its answer was not written, and a worker that died then lost it."""
    client = aioredis.Redis.from_url(own_redis.url)
    worker = Worker(create(decode_base_s=0), client, WorkerSettings(pool="p"))
    queue = keys.queue("p")
    await client.xgroup_create(queue, keys.GROUP, id="0", mkstream=True)
    entry = await client.xadd(queue, {"m": "x"})
    await client.xreadgroup(keys.GROUP, "w", {queue: ">"})
    worker._write(SimpleNamespace(req=SimpleNamespace(id="r1", reply=REPLIES)), Final("length", 1, 2))
    worker._ack([entry])
    await client.config_set("maxmemory", 1)
    try:
        assert await worker._flush() is False
        assert (await client.xpending(queue, keys.GROUP))["pending"] == 1, "not acknowledged"
    finally:
        await client.config_set("maxmemory", 0)
    assert await worker._flush() is True
    assert (await client.xpending(queue, keys.GROUP))["pending"] == 0 and await client.xlen(REPLIES) == 1
    await client.aclose()


class SlowTokenizer:
    """The sim engine, with a tokenizer that takes ``prepare_s`` over a prompt."""

    def __init__(self, prepare_s: float) -> None:
        self.inner = create(decode_base_s=0)
        self.prepare_s = prepare_s
        self.name, self.model_id, self.max_context = "slow-tokenizer", "m", 8192

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def prepare(self, request):
        time.sleep(self.prepare_s)
        return request


async def test_a_long_prompt_being_tokenized_is_no_stalled_engine(redis_url: str) -> None:
    """Counted from the request's arrival, a tokenizer slower than ``stall_pause_s`` paused the
    worker's intake, and one slower than ``engine_stall_s`` made it give up a healthy engine."""
    client = aioredis.Redis.from_url(redis_url)
    settings = WorkerSettings(pool="p", heartbeat_interval_s=0.1, heartbeat_ttl_s=0.5, engine_stall_s=1.0,
                              stall_pause_s=0.3)
    worker = Worker(SlowTokenizer(prepare_s=1.5), client, settings)
    task = asyncio.create_task(worker.run())
    req = GenerateRequest(id="long", model="m", pool="p", cls="batch", sampling=SamplingParams(max_tokens=5),
                          deadline=time.time() + 30, enqueued_at=time.time(), reply=REPLIES,
                          prompt="x" * (LONG_PROMPT_CHARS + 1))
    await client.xadd(keys.queue("p"), {protocol.ID_FIELD: "long", protocol.FIELD: protocol.encode(req)})
    try:
        while not worker.inflight:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.6)  # past stall_pause_s, still tokenizing
        heartbeat = protocol.decode_heartbeat(await client.get(keys.heartbeat("p", settings.worker_id)))
        assert heartbeat.capacity > 0 and heartbeat.waiting == 1
        records = []
        while not any(isinstance(r, Final) for r in records):
            assert not task.done(), "the worker must not give its engine up"
            await asyncio.sleep(0.05)
            records = [protocol.decode_result(payload) for _, f in await client.xrange(REPLIES)
                       for _, payload in protocol.decode_batch(f[protocol.BATCH_FIELD])]
        assert records[-1].completion_tokens == 5
    finally:
        await cancel_and_wait([task])
        await client.aclose()


async def test_a_finished_request_whose_records_wait_for_redis_is_not_run_again(own_redis: LocalRedis) -> None:
    """Redis out of memory refuses the records (XADD) but not claims (XAUTOCLAIM): a request
    this worker finished, whose ack waits with its records, must not be claimed and run again."""
    client = aioredis.Redis.from_url(own_redis.url)
    settings = WorkerSettings(pool="p", heartbeat_interval_s=0.1, heartbeat_ttl_s=0.5, claim_idle_s=0.6)
    worker = Worker(create(decode_base_s=0.02), client, settings)
    task = asyncio.create_task(worker.run())
    req = GenerateRequest(id="r", model="m", pool="p", cls="interactive", sampling=SamplingParams(max_tokens=10),
                          deadline=time.time() + 60, enqueued_at=time.time(), reply=REPLIES, prompt="hello")
    try:
        await client.xadd(keys.queue("p"), {protocol.ID_FIELD: "r", protocol.FIELD: protocol.encode(req)})
        while not worker.inflight:
            await asyncio.sleep(0.005)
        await client.config_set("maxmemory", 1)
        try:
            await asyncio.sleep(2.0)  # finished meanwhile; its records and ack wait for Redis
        finally:
            await client.config_set("maxmemory", 0)
        await asyncio.sleep(1.0)
        records = [protocol.decode_result(payload) for _, f in await client.xrange(REPLIES)
                   for _, payload in protocol.decode_batch(f[protocol.BATCH_FIELD])]
        finals = [r for r in records if isinstance(r, Final)]
        ends = [(type(r).__name__, r.attempt) for r in records if not isinstance(r, Delta)]
        assert len(finals) == 1, ends
    finally:
        await cancel_and_wait([task])
        await client.aclose()


async def test_a_worker_refused_by_a_redis_that_cannot_take_writes_takes_new_work_once_it_can(
        own_redis: LocalRedis) -> None:
    """A Redis turned replica (a failover: READONLY) or unable to persist (MISCONF) refuses the
    intake's read with an error reply: the intake ended there, and the worker went on beating,
    with capacity, and never read its queue again."""
    client = aioredis.Redis.from_url(own_redis.url)
    worker = Worker(create(decode_base_s=0), client, WorkerSettings(pool="p", heartbeat_interval_s=0.1))
    task = asyncio.create_task(worker.run())
    req = GenerateRequest(id="r", model="m", pool="p", cls="interactive", sampling=SamplingParams(max_tokens=3),
                          deadline=time.time() + 60, enqueued_at=time.time(), reply=REPLIES, prompt="hello")
    try:
        while not await client.exists(keys.heartbeat("p", worker.s.worker_id)):
            await asyncio.sleep(0.01)
        await client.replicaof("127.0.0.1", free_port())  # a master that is not there: read-only
        try:
            await asyncio.sleep(1.0)
        finally:
            await client.replicaof("NO", "ONE")
        await client.xadd(keys.queue("p"), {protocol.ID_FIELD: "r", protocol.FIELD: protocol.encode(req)})
        for _ in range(100):
            if await client.exists(REPLIES):
                break
            await asyncio.sleep(0.05)
        assert not task.done(), task
        records = [protocol.decode_result(payload) for _, f in await client.xrange(REPLIES)
                   for _, payload in protocol.decode_batch(f[protocol.BATCH_FIELD])]
        assert records and isinstance(records[-1], Final), "the request queued after the outage is served"
    finally:
        await cancel_and_wait([task])
        await client.aclose()


async def test_a_worker_that_must_create_its_group_while_redis_refuses_writes_waits_for_it(
        own_redis: LocalRedis) -> None:
    """A worker starting during a failover, or whose queue a Redis restarted empty lost, creates
    the consumer group: refused with READONLY, the intake (or the worker's start) ended there."""
    client = aioredis.Redis.from_url(own_redis.url)
    worker = Worker(create(decode_base_s=0), client, WorkerSettings(pool="p"))
    await client.replicaof("127.0.0.1", free_port())  # a master that is not there: read-only
    try:
        joining = asyncio.create_task(worker._ensure_group())
        await asyncio.sleep(0.6)
        assert not joining.done(), joining
    finally:
        await client.replicaof("NO", "ONE")
    try:
        await asyncio.wait_for(joining, 5)
        assert [g["name"] for g in await client.xinfo_groups(keys.queue("p"))] == [keys.GROUP.encode()]
    finally:
        await cancel_and_wait([joining])
        await client.aclose()
