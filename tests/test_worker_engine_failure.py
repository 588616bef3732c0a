"""A worker whose engine raises fails the requests it held and goes on serving, whether the
engine steps on a thread of the worker or in a process of its own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
import redis.asyncio as aioredis

from engines.engine_process import EngineDied, EngineProcess
from engines.sim import create
from engines.worker import LoopFailed, Worker, WorkerSettings
from slogate import keys, protocol
from slogate.local_redis import LocalRedis
from slogate.processes import python_path
from slogate.protocol import Error, Final, GenerateRequest, SamplingParams
from slogate.tasks import cancel_and_wait

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


class DyingEngine:
    """The sim engine, except that its process exits right after the step that finishes a
    request has been reported (a segfault, the OOM killer)."""

    def __init__(self) -> None:
        self.inner = create(decode_base_s=0.05)
        self.name, self.model_id, self.max_context = "dying", "m", 8192

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def step(self, arrivals=None, send=None):
        outputs = self.inner.step(arrivals, send)
        if any(o.finish_reason for o in outputs):
            send(outputs)
            os._exit(3)
        return outputs


async def test_what_an_engine_reported_before_it_died_still_reaches_the_gateway(redis_url: str) -> None:
    """The worker ends with its engine, but the records of the steps the engine finished go
    out first: cut off, a finished request would run again elsewhere, and a sampled stream
    could not resume. Redis pauses writes while they wait, so they are queued, not yet sent,
    when the engine dies."""
    client = aioredis.Redis.from_url(redis_url)
    worker = Worker(EngineProcess(DyingEngine), client, WorkerSettings(pool="p", claim_idle_s=30))
    task = asyncio.create_task(worker.run())
    try:
        req = GenerateRequest(id="r", model="m", pool="p", cls="interactive", stream=True, reply=REPLIES,
                              sampling=SamplingParams(max_tokens=4), deadline=time.time() + 30,
                              enqueued_at=time.time(), prompt="hello")
        await client.xadd(keys.queue("p"), {protocol.ID_FIELD: "r", protocol.FIELD: protocol.encode(req)})
        while not await client.xlen(REPLIES):  # the first token is out
            await asyncio.sleep(0.005)
        await client.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
        with pytest.raises(EngineDied):
            await asyncio.wait_for(task, 10)
        records = await results(client, "r")
        assert isinstance(records[-1], Final) and records[-1].completion_tokens == 4
        assert (await client.xpending(keys.queue("p"), keys.GROUP))["pending"] == 0, "acknowledged"
    finally:
        await client.execute_command("CLIENT", "UNPAUSE")
        await client.aclose()


class UnreadableLoadEngine(FlakyEngine):
    """Steps fine, but what it reports of its load cannot be read (a bug, or an option of the
    wrong type that nothing checked): the heartbeat loop fails on it."""

    def load(self):
        raise TypeError("unsupported operand type(s) for *: 'float' and 'str'")


async def test_a_worker_whose_loop_fails_ends_instead_of_serving_on_unseen(redis_url: str) -> None:
    """Its heartbeat loop died unseen while the worker ran on: it said it was serving, and
    no gateway ever routed to it. Now the worker ends with the loop's error, for its supervisor
    to see and restart it."""
    client = aioredis.Redis.from_url(redis_url)
    worker = Worker(UnreadableLoadEngine(), client, WorkerSettings(pool="p"))
    try:
        with pytest.raises(LoopFailed, match="failed: unsupported operand") as failed:
            await asyncio.wait_for(worker.run(), 10)
        assert isinstance(failed.value.__cause__, TypeError)
    finally:
        await client.aclose()


FAILING_LOOP_WORKER = """
import engines.registry, engines.sim

class LoadFails(engines.sim.SimEngine):
    def load(self):
        raise RuntimeError("a bug in a loop of a running worker")

engines.registry.create_engine = lambda *args, **kwargs: LoadFails()
from slogate.cli import main
main(["worker", "--pool", "interactive", "--engine", "sim"])
"""


def test_a_worker_whose_loop_fails_exits_for_its_supervisor_to_restart_it(redis_server: LocalRedis) -> None:
    """Exit code 2 says a worker cannot start as configured, and slogate up stops the whole
    stack for it rather than restart the worker. A loop's RuntimeError or ValueError (a bug,
    long after the start) took that code, as any start-up error of those types does."""
    env = {**os.environ, "PYTHONPATH": python_path(), "SLOGATE_REDIS_URL": redis_server.url}
    run = subprocess.run([sys.executable, "-c", FAILING_LOOP_WORKER], env=env, capture_output=True, text=True,
                         check=False, timeout=60)
    assert run.returncode == 1, run.stderr
    assert "a bug in a loop of a running worker" in run.stderr


async def test_a_cancel_message_that_is_no_request_id_is_skipped(redis_url: str) -> None:
    """Any Redis client may publish on the cancel channel: one message that was not UTF-8 ended
    the cancel loop with a UnicodeDecodeError and, since a failed loop ends its worker, every
    worker of every pool at once (slogate up, told exit 2, then stopped the stack)."""
    client = aioredis.Redis.from_url(redis_url)
    worker = Worker(create(decode_base_s=0.02), client, WorkerSettings(pool="p"))
    task = asyncio.create_task(worker.run())
    try:
        req = GenerateRequest(id="r", model="m", pool="p", cls="interactive", reply=REPLIES,
                              sampling=SamplingParams(max_tokens=1000), deadline=time.time() + 60,
                              enqueued_at=time.time(), prompt="hello")
        await client.xadd(keys.queue("p"), {protocol.ID_FIELD: "r", protocol.FIELD: protocol.encode(req)})
        while "r" not in worker.inflight or not (await client.pubsub_numsub(keys.CANCEL_CHANNEL))[0][1]:
            await asyncio.sleep(0.01)
        await client.publish(keys.CANCEL_CHANNEL, b"\xff\xfe")
        await client.publish(keys.CANCEL_CHANNEL, "r")
        for _ in range(100):
            if task.done() or "r" not in worker.inflight:
                break
            await asyncio.sleep(0.05)
        assert not task.done(), task
        assert "r" not in worker.inflight, "the cancel after it still stops its request"
    finally:
        await cancel_and_wait([task])
        await client.aclose()


async def _attach_fails() -> None:
    raise OSError("the engine's socket could not join the loop")


@pytest.mark.parametrize("place", ["thread", "process"])
async def test_a_worker_whose_engine_cannot_attach_leaves_nothing_running(redis_url: str, place: str) -> None:
    """The engine loop started its sender before attaching the engine: an attach that raised left
    the sender running for good, and an engine process running until the worker's process ended."""
    client = aioredis.Redis.from_url(redis_url)
    engine = create(decode_base_s=0) if place == "thread" else EngineProcess(create)
    worker = Worker(engine, client, WorkerSettings(pool="p"))
    worker.engine.attach = _attach_fails
    try:
        with pytest.raises(OSError, match="could not join the loop"):
            await asyncio.wait_for(worker.run(), 10)
        await asyncio.sleep(0)
        left = [t.get_coro().__qualname__ for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not [name for name in left if name.startswith("Worker.")], left
        if place == "process":
            assert engine._proc.exitcode is not None, "the engine process ended with the worker's run"
    finally:
        await client.aclose()
