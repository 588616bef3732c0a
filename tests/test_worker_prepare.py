"""The worker tokenizes short prompts as they arrive and long ones on a thread of its own,
beside the running step, and serves both."""

from __future__ import annotations

import asyncio
import threading
import time

import redis.asyncio as aioredis

from engines.base import LONG_PROMPT_CHARS, EngineRequest
from engines.sim import create
from engines.worker import Worker, WorkerSettings
from slogate import keys, protocol
from slogate.protocol import Final, GenerateRequest, SamplingParams

REPLIES = keys.replies("test-prepare")


class RecordingEngine:
    """The sim engine, noting which thread prepared each request and what add_request got."""

    def __init__(self) -> None:
        self.inner = create(decode_base_s=0.002)
        self.name, self.model_id, self.max_context = "recording", "m", 1 << 20
        self.prepared_on: dict[str, str] = {}
        self.added_prepared: dict[str, bool] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def prepare(self, request: EngineRequest) -> EngineRequest:
        self.prepared_on[request.id] = threading.current_thread().name
        return EngineRequest(request.id, request.sampling, request.deadline, request.prompt, request.messages,
                             prompt_ids=[1, 2, 3])

    def add_request(self, request: EngineRequest) -> None:
        self.added_prepared[request.id] = request.prompt_ids == [1, 2, 3]
        self.inner.add_request(request)


async def finals(client: aioredis.Redis, ids: set[str], timeout: float = 10.0) -> dict[str, Final]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = {rid.decode(): rec for _, f in await client.xrange(REPLIES)
               for rid, payload in protocol.decode_batch(f[protocol.BATCH_FIELD])
               if isinstance(rec := protocol.decode_result(payload), Final)}
        if ids <= set(got):
            return got
        await asyncio.sleep(0.02)
    raise AssertionError(f"no final record for {ids - set(got)}")


async def test_long_prompts_are_prepared_off_the_loop_and_all_are_served(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    engine = RecordingEngine()
    worker = Worker(engine, client, WorkerSettings(pool="p", claim_idle_s=30))
    task = asyncio.create_task(worker.run())
    prompts = {"short": "score txn 7", "long": "x " * LONG_PROMPT_CHARS,
               "chat": None}
    try:
        for rid, prompt in prompts.items():
            req = GenerateRequest(id=rid, model="m", pool="p", cls="batch", sampling=SamplingParams(max_tokens=3),
                                  deadline=time.time() + 30, enqueued_at=time.time(), reply=REPLIES, prompt=prompt,
                                  messages=[{"role": "user", "content": "y" * (LONG_PROMPT_CHARS + 1)}]
                                  if prompt is None else None)
            await client.xadd(keys.queue("p"), {protocol.ID_FIELD: rid, protocol.FIELD: protocol.encode(req)})
        done = await finals(client, set(prompts))
        assert all(done[rid].completion_tokens == 3 for rid in prompts)
        assert engine.prepared_on["short"] == threading.main_thread().name
        assert engine.prepared_on["long"].startswith("prepare") and engine.prepared_on["chat"].startswith("prepare")
        assert all(engine.added_prepared[rid] for rid in prompts)
        assert (await client.xpending(keys.queue("p"), keys.GROUP))["pending"] == 0
    finally:
        worker.stop()
        await asyncio.wait_for(task, 5)
        await client.aclose()
