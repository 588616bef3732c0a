"""A worker whose engine runs in a process of its own: the same answers as the engine run in
process, cancels free the engine's memory, and a dead engine process stops the worker with its
requests left pending for others (a failing step: test_worker_engine_failure.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from transformers import AutoTokenizer

from engines.base import EngineRequest
from engines.engine_process import EngineDied, EngineProcess
from engines.registry import create_engine, start_engine_process
from engines.stepping import Step
from engines.worker import CLEANUP_S, Worker, WorkerSettings
from slogate import keys, protocol
from slogate.processes import python_path
from slogate.protocol import Delta, Final, GenerateRequest, SamplingParams
from slogate.tasks import cancel_and_wait
from tests.e2e.test_up import children, wait_gone

REPLIES = keys.replies("test-engine-process")
PROMPTS = {"en": "The gateway accepts", "zh": "你好，世界。 🚀 launch", "digits": "0 1 2"}


def request(rid: str, prompt: str, max_tokens: int, stream: bool = True) -> GenerateRequest:
    return GenerateRequest(id=rid, model="m", pool="p", cls="interactive", stream=stream,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           deadline=time.time() + 60, enqueued_at=time.time(), reply=REPLIES, prompt=prompt)


async def send(client: aioredis.Redis, req: GenerateRequest) -> None:
    await client.xadd(keys.queue("p"), {protocol.ID_FIELD: req.id, protocol.FIELD: protocol.encode(req)})


async def records(client: aioredis.Redis) -> dict[str, list]:
    out: dict[str, list] = {}
    for _, f in await client.xrange(REPLIES):
        for rid, payload in protocol.decode_batch(f[protocol.BATCH_FIELD]):
            out.setdefault(rid.decode(), []).append(protocol.decode_result(payload))
    return out


async def wait_for(check, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if result := await check():
            return result
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


async def settled(client: aioredis.Redis, ids: set[str]) -> dict[str, list]:
    async def check():
        got = await records(client)
        done = {rid for rid, recs in got.items() if not isinstance(recs[-1], Delta)}
        return got if ids <= done else None
    return await wait_for(check)


def in_process_text(model_dir: Path, prompt: str, max_tokens: int) -> str:
    engine = create_engine("stream", str(model_dir), {"warmup": False}, threads=1)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engine.add_request(EngineRequest("ref", sampling, time.time() + 60, prompt))
    text = ""
    while engine.has_unfinished():
        text += "".join(o.text for o in engine.step())
    return text


async def test_stream_engine_in_a_process_matches_in_process_and_cancel_frees_kv(
        redis_url: str, tiny_model_dir: Path) -> None:
    client = aioredis.Redis.from_url(redis_url)
    engine = start_engine_process("stream", str(tiny_model_dir), {"warmup": False}, threads=1)
    assert engine.name == "stream" and engine.model_id == tiny_model_dir.name
    sampling = SamplingParams(max_tokens=1)
    prepared = engine.prepare(EngineRequest("p", sampling, time.time() + 60, "0 1 2"))
    assert prepared.prompt_ids == AutoTokenizer.from_pretrained(tiny_model_dir)("0 1 2").input_ids  # tokenized here
    worker = Worker(engine, client, WorkerSettings(pool="p", claim_idle_s=30))
    task = asyncio.create_task(worker.run())
    try:
        for rid, prompt in PROMPTS.items():
            await send(client, request(rid, prompt, 12))
        got = await settled(client, set(PROMPTS))
        for rid, prompt in PROMPTS.items():
            deltas = [r for r in got[rid] if isinstance(r, Delta)]
            assert isinstance(got[rid][-1], Final) and got[rid][-1].completion_tokens == 12
            assert "".join(d.text for d in deltas) == in_process_text(tiny_model_dir, prompt, 12)

        await send(client, request("long", "a long answer", 400))
        await wait_for(lambda: _has_delta(client, "long"))
        assert engine.load().running == 1
        await client.publish(keys.CANCEL_CHANNEL, "long")

        async def freed():
            load = engine.load()
            return load.running == 0 and load.extra["kv_bytes"] == 0 and "long" not in worker.inflight
        await wait_for(freed)
        assert (await client.xpending(keys.queue("p"), keys.GROUP))["pending"] == 0
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
        await client.aclose()
    assert engine._proc.exitcode == 0


async def _has_delta(client: aioredis.Redis, rid: str) -> bool:
    return any(isinstance(r, Delta) for r in (await records(client)).get(rid, []))


async def _worker_holding(client: aioredis.Redis) -> tuple[EngineProcess, asyncio.Task]:
    """A worker with a sim engine process that is streaming a long request ("held")."""
    engine = EngineProcess(partial(create_engine, "sim", None, {"decode_base_s": 0.05}))
    task = asyncio.create_task(Worker(engine, client, WorkerSettings(pool="p", claim_idle_s=30)).run())
    await send(client, request("held", "hello", 1000))
    await wait_for(lambda: _has_delta(client, "held"))
    return engine, task


async def test_a_dead_engine_process_stops_the_worker_and_leaves_its_requests_pending(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        engine, task = await _worker_holding(client)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineDied, match="exited with code -9"):
            await asyncio.wait_for(task, 10)
        pending = await client.xpending(keys.queue("p"), keys.GROUP)
        assert pending["pending"] == 1  # not acknowledged: another worker claims it
    finally:
        await client.aclose()


async def test_an_engine_process_closed_while_it_holds_work_ends_by_itself() -> None:
    """Its socket closed only once the loop ran again, and the close blocked the loop on the
    process: the engine stepped on for the whole timeout and was killed (exit code -9)."""
    engine = EngineProcess(partial(create_engine, "sim", None, {"decode_base_s": 0.05}))
    await engine.attach()
    engine.send(("add", EngineRequest("held", SamplingParams(max_tokens=1000), time.time() + 60, "hello")))
    assert isinstance(await engine.next(), Step)
    await engine.aclose(10)
    assert engine._proc.exitcode == 0


async def test_a_worker_stopped_while_its_engine_process_holds_work_lets_the_engine_end_by_itself(
        redis_url: str) -> None:
    """As when its grace is over: the worker's run is cancelled, and its engine ends on the
    closed socket rather than being killed once the close's timeout has passed."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        engine, task = await _worker_holding(client)
        await cancel_and_wait([task], every_s=CLEANUP_S)  # as run_worker does when the grace is over
        assert (await client.xpending(keys.queue("p"), keys.GROUP))["pending"] == 1
    finally:
        await client.aclose()
    assert engine._proc.exitcode == 0


def test_an_engine_that_cannot_build_names_the_reason(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="could not build its engine.*unknown stream engine options: max_bach"):
        EngineProcess(partial(create_engine, "stream", str(tmp_path), {"max_bach": 4}))


def _no_tokenizer():
    raise OSError("tokenizer.json is missing")


def test_a_tokenizer_that_cannot_load_is_named_after_the_engine_builds() -> None:
    with pytest.raises(RuntimeError, match="cannot load the tokenizer: tokenizer.json is missing"):
        EngineProcess(partial(create_engine, "sim", None, {}), _no_tokenizer)


def test_an_engine_process_is_refused_off_the_main_thread() -> None:
    """It would be tied to the thread that started it, and end with it."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(EngineProcess, partial(create_engine, "sim", None, {}))
        with pytest.raises(RuntimeError, match="from the main thread"):
            future.result(timeout=30)


def test_an_engine_process_dies_with_its_worker_even_while_it_builds() -> None:
    """A worker killed while its engine was still loading a model left the engine building it,
    for minutes, for nobody."""
    building = "import functools, time; from engines.engine_process import EngineProcess; " \
               "EngineProcess(functools.partial(time.sleep, 120))"
    worker = subprocess.Popen([sys.executable, "-c", building], env={**os.environ, "PYTHONPATH": python_path()})
    try:
        deadline = time.monotonic() + 30
        while not children(worker.pid):
            assert time.monotonic() < deadline, "the engine process did not start"
            time.sleep(0.05)
        time.sleep(0.5)  # past the tie, into the build
        engine = children(worker.pid)
    finally:
        worker.kill()
        worker.wait()
    wait_gone(engine, 10, "the engine process outlived its worker")


def test_a_process_whose_parent_is_already_gone_exits_at_the_tie() -> None:
    tied = subprocess.run([sys.executable, "-c", "from slogate.tether import tie_to_parent; tie_to_parent(1); "
                                                 "print('survived')"],
                          env={**os.environ, "PYTHONPATH": python_path()}, capture_output=True, text=True, timeout=30)
    assert tied.returncode == 1 and "survived" not in tied.stdout
