"""How a worker meets Redis errors when it joins its pool's queue: one that retrying cannot
fix ends it, with a line that says what is wrong; one that passes is waited out."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from functools import partial

import pytest
import redis
import redis.asyncio as aioredis

from engines.engine_process import EngineProcess
from engines.registry import create_engine
from engines.sim import create
from engines.worker import QueueUnusable, Worker, WorkerSettings
from slogate import keys, protocol
from slogate.processes import python_path
from slogate.protocol import Final, GenerateRequest, SamplingParams
from slogate.tasks import cancel_and_wait

REPLIES = keys.replies("test-gateway")


def test_a_queue_key_that_is_no_stream_ends_the_worker_naming_it(redis_url: str) -> None:
    """The key held a string (another application's, or a hand-made test): the worker retried
    its XGROUP CREATE every half second for good, serving nothing, with a warning each time."""
    client = redis.Redis.from_url(redis_url)
    client.set(keys.queue("p"), "not a stream")
    env = {**os.environ, "PYTHONPATH": python_path(), "SLOGATE_REDIS_URL": redis_url}
    try:
        run = subprocess.run([sys.executable, "-m", "slogate.cli", "worker", "--pool", "p", "--engine", "sim"],
                             env=env, capture_output=True, text=True, check=False, timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError("the worker did not end within 30 s") from None
    finally:
        client.close()
    assert run.returncode == 1, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("slogate: ") and keys.queue("p") in last and "WRONGTYPE" in last, last


async def test_a_redis_busy_with_a_script_is_waited_out(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """BUSY passes once the script ends: the worker joins then, and serves."""
    client = aioredis.Redis.from_url(redis_url)
    await client.config_set("busy-reply-threshold", 10)
    busy = threading.Thread(target=_run_script_for, args=(redis_url, 1.5))
    busy.start()
    worker = Worker(create(decode_base_s=0), client, WorkerSettings(pool="p"))
    task = None
    try:
        while not await _busy(client):
            await asyncio.sleep(0.01)
        with caplog.at_level(logging.WARNING, "slogate.worker"):
            task = asyncio.create_task(worker.run())
            req = GenerateRequest(id="r", model="m", pool="p", cls="interactive", sampling=SamplingParams(max_tokens=2),
                                  deadline=time.time() + 30, enqueued_at=time.time(), reply=REPLIES, prompt="hi")
            while True:
                try:
                    await client.xadd(keys.queue("p"), {protocol.ID_FIELD: "r", protocol.FIELD: protocol.encode(req)})
                    break
                except redis.ResponseError:  # BUSY here too
                    await asyncio.sleep(0.05)
            entries = []
            for _ in range(200):
                if entries := await client.xrange(REPLIES):
                    break
                await asyncio.sleep(0.05)
        assert any("BUSY" in r.getMessage() for r in caplog.records), "the worker met BUSY"
        records = [protocol.decode_result(payload) for _, f in entries
                   for _, payload in protocol.decode_batch(f[protocol.BATCH_FIELD])]
        assert isinstance(records[-1], Final), records
    finally:
        busy.join()
        await client.config_set("busy-reply-threshold", 5000)
        await cancel_and_wait([task] if task else [])
        await client.aclose()


def _run_script_for(url: str, seconds: float) -> None:
    script = ("local s = redis.call('TIME') local t = s "
              "while (t[1] - s[1]) * 1000000 + (t[2] - s[2]) < tonumber(ARGV[1]) do t = redis.call('TIME') end")
    with redis.Redis.from_url(url) as client:
        client.eval(script, 0, int(seconds * 1e6))


async def _busy(client: aioredis.Redis) -> bool:
    try:
        await client.ping()
    except redis.ResponseError as exc:
        return "BUSY" in str(exc)
    return False


async def test_a_worker_that_cannot_use_its_queue_ends_its_engine_process(redis_url: str) -> None:
    """The worker's run ended with QueueUnusable before its engine loop started, and the engine
    loop is what closed the engine: its process lived on, for as long as the worker's own."""
    client = aioredis.Redis.from_url(redis_url)
    await client.set(keys.queue("p"), "not a stream")
    engine = EngineProcess(partial(create_engine, "sim", None, {}))
    try:
        with pytest.raises(QueueUnusable, match="WRONGTYPE"):
            await Worker(engine, client, WorkerSettings(pool="p")).run()
    finally:
        await client.aclose()
    assert not engine._proc.is_alive()


async def test_a_worker_stopped_while_it_waits_for_redis_ends_its_engine_process() -> None:
    """Cancelled while it still retried joining the queue of a Redis that is not there."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
    engine = EngineProcess(partial(create_engine, "sim", None, {}))
    task = asyncio.create_task(Worker(engine, client, WorkerSettings(pool="p")).run())
    try:
        await asyncio.sleep(0.3)  # a failed join or two, each followed by a wait
        assert not task.done()
        await cancel_and_wait([task])
    finally:
        await client.aclose()
    assert task.cancelled() and not engine._proc.is_alive()
