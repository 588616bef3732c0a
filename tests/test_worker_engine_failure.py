"""A worker whose engine raises fails the requests it held and goes on serving, whether the
engine steps on a thread of the worker or in a process of its own."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from engines.engine_process import EngineProcess
from engines.sim import create
from engines.worker import Worker, WorkerSettings
from slogate import keys, protocol
from slogate.protocol import Error, Final, GenerateRequest, SamplingParams

REPLIES = keys.replies("test-gateway")


class FlakyEngine:
    """The sim engine, except that its first step blows up (a stand-in for an OOM)."""

    def __init__(self) -> None:
        self.inner = create(decode_base_s=0)
        self.failed = False
        self.name, self.model_id, self.max_context = "flaky", "m", 8192

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def step(self, arrivals=None, send=None):
        if not self.failed:
            self.failed = True
            raise RuntimeError("CUDA out of memory (simulated)")
        return self.inner.step(arrivals, send)


async def results(client: aioredis.Redis, request_id: str, timeout: float = 5.0) -> list:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        entries = await client.xrange(REPLIES)
        records = [protocol.decode_result(payload) for _, f in entries
                   for rid, payload in protocol.decode_batch(f[protocol.BATCH_FIELD]) if rid == request_id.encode()]
        if records and not isinstance(records[-1], protocol.Delta):
            return records
        await asyncio.sleep(0.02)
    raise AssertionError("no final record")


@pytest.mark.parametrize("place", ["thread", "process"])
async def test_engine_failure_fails_held_requests_then_recovers(redis_url: str, place: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    engine = FlakyEngine() if place == "thread" else EngineProcess(FlakyEngine)
    worker = Worker(engine, client, WorkerSettings(pool="p", claim_idle_s=30))
    task = asyncio.create_task(worker.run())
    try:
        for rid in ("first", "second"):
            req = GenerateRequest(id=rid, model="m", pool="p", cls="interactive", sampling=SamplingParams(max_tokens=3),
                                  deadline=time.time() + 30, enqueued_at=time.time(), reply=REPLIES, prompt="hello")
            await client.xadd(keys.queue("p"), {protocol.ID_FIELD: rid, protocol.FIELD: protocol.encode(req)})
            records = await results(client, rid)
            if rid == "first":
                assert isinstance(records[-1], Error) and records[-1].status == 500
                assert records[-1].code == "engine_error"
            else:
                assert isinstance(records[-1], Final) and records[-1].completion_tokens == 3
        assert (await client.xpending(keys.queue("p"), keys.GROUP))["pending"] == 0
    finally:
        worker.stop()
        await asyncio.wait_for(task, 5)
        await client.aclose()
