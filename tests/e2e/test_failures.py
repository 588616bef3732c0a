"""Cancels, deadlines and dead workers, against real processes and a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import aiohttp
import pytest
import redis

from slogate import protocol
from slogate.local_redis import LocalRedis
from slogate.processes import Stack
from tests.e2e.conftest import FAST_FLEET, MODEL, start_stack
from tests.e2e.test_api import sse_events

STEP_S = 0.02


@pytest.fixture(scope="module")
def slow_stack(redis_server: LocalRedis) -> Iterator[Stack]:
    """Two sim workers per pool at 50 tokens/s each, so requests last long enough to hurt.
    Admission control is off: these tests are about what happens once a request is queued."""
    s = start_stack(redis_server, decode_base_s=STEP_S, workers_per_pool=2,
                    SLOGATE_ADMISSION_CONTROL="0")
    yield s
    s.stop()


def body(max_tokens: int, stream: bool = False, prompt: str = "report on counterparty 7") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def running(client: redis.Redis) -> int:
    total = 0
    for key in client.scan_iter("slogate:hb:*"):
        data = client.get(key)
        if data:
            total += protocol.decode_heartbeat(data).running
    return total


def wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def cancel_keys_expire(client: redis.Redis) -> bool:
    """The only trace a cancelled request leaves is its cancel flag, and that expires."""
    flags = list(client.scan_iter("slogate:cancel:*"))
    return bool(flags) and all(client.pttl(k) > 0 for k in flags)


async def test_client_disconnect_cancels_generation(slow_stack: Stack) -> None:
    client = redis.Redis.from_url(slow_stack.redis_url)
    async with aiohttp.ClientSession() as s:
        resp = await s.post(slow_stack.url + "/v1/chat/completions", json=body(2000, stream=True))
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        await asyncio.to_thread(wait_for, lambda: running(client) == 1, 5, "the request to run")
        resp.close()
    # 2,000 tokens take 40 s; only a cancel honoured at the next step frees the worker sooner.
    await asyncio.to_thread(wait_for, lambda: running(client) == 0 and not any(
        client.xpending(f"slogate:q:{p}", "workers")["pending"] for p in ("interactive", "batch")),
        15, "the worker to drop the cancelled request")
    assert cancel_keys_expire(client)
    client.close()


async def test_non_streamed_disconnect_cancels_too(slow_stack: Stack) -> None:
    client = redis.Redis.from_url(slow_stack.redis_url)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
        with pytest.raises(asyncio.TimeoutError):
            await s.post(slow_stack.url + "/v1/chat/completions", json=body(2000))
    await asyncio.to_thread(wait_for, lambda: running(client) == 0, 15, "the cancel to land")
    client.close()


async def test_deadline_expiry_non_streamed_is_504(slow_stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(slow_stack.url + "/v1/chat/completions", json=body(200),
                          headers={"x-slogate-timeout": "0.4"}) as r:
            assert r.status == 504
            err = (await r.json())["error"]
            assert r.headers["x-slogate-pool"] and r.headers["x-slogate-class"], "which pool it failed in"
    assert err["code"] == "deadline_exceeded" and "deadline" in err["message"]


async def feedback_factor(url: str) -> float:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    return float(next(x for x in text.splitlines() if x.startswith("slogate_admission_feedback_factor ")).split()[1])


async def test_late_answers_and_late_504s_move_the_feedback_loop_once_a_verdict(slow_stack: Stack) -> None:
    """Six interactive requests one after another, each late (10 steps of 20 ms): three answered,
    three that run out of their 0.18 s deadline. However many late answers earlier tests left in
    the loop's window (at most 2), that is two verdicts, each judging only requests sent after
    the one before (admission is off here: the factor is then a metric)."""
    before = await feedback_factor(slow_stack.url)
    async with aiohttp.ClientSession() as s:
        for timeout in (None, None, None, "0.18", "0.18", "0.18"):
            headers = {"x-slogate-timeout": timeout} if timeout else {}
            async with s.post(slow_stack.url + "/v1/chat/completions", json=body(10), headers=headers) as r:
                assert r.status == (504 if timeout else 200) and r.headers["x-slogate-class"] == "interactive"
    assert await feedback_factor(slow_stack.url) == pytest.approx(before * 1.25 ** 2)


async def test_deadline_expiry_streamed_is_an_sse_error(slow_stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(slow_stack.url + "/v1/chat/completions", json=body(200, stream=True),
                          headers={"x-slogate-timeout": "0.4"}) as r:
            assert r.status == 200
            events = await sse_events(r)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "deadline_exceeded"
    assert events[-1] == "[DONE]"
    assert any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content")
               for e in events), "tokens before the deadline should have streamed"


async def test_a_record_lost_between_worker_and_gateway_ends_the_stream_with_an_error(slow_stack: Stack) -> None:
    """Records carry their offsets: one that never reaches the gateway (here deleted from its
    reply stream while the gateway is stopped) is a 502 in the stream, never a hole in the text."""
    client = redis.Redis.from_url(slow_stack.redis_url)
    gateway = slow_stack.procs[0]
    async with aiohttp.ClientSession() as s:
        async with s.post(slow_stack.url + "/v1/chat/completions", json=body(60, stream=True, prompt="lost")) as r:
            assert r.status == 200
            first = await r.content.readline()
            wait_for(lambda: _live_replies(client), 5, "the worker's first record")
            [reply] = _live_replies(client)
            with _stopped(gateway):
                written = client.xlen(reply)
                wait_for(lambda: client.xlen(reply) >= written + 3, 5, "records the gateway has not read")
                lost = client.xrange(reply, "-", "+")[-2][0]
                client.xdel(reply, lost)
            events = await sse_events(r)
    client.close()
    _assert_result_lost(first, events)


def _live_replies(client: redis.Redis) -> list[bytes]:
    """The reply streams of live gateways (whose ``alive`` key is there), once written to."""
    return [k for k in client.scan_iter("slogate:r:*") if client.exists(k.replace(b"slogate:r:", b"slogate:alive:"))]


@contextlib.contextmanager
def _stopped(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """The process stopped (SIGSTOP) meanwhile: it reads nothing of what arrives."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def _records(client: redis.Redis, reply: bytes) -> list[tuple[bytes, protocol.Result]]:
    """The reply stream's entries, each with the last record it holds (encryption is off)."""
    return [(entry_id, protocol.decode_result(protocol.decode_batch(fields[protocol.BATCH_FIELD])[-1][1]))
            for entry_id, fields in client.xrange(reply, "-", "+")]


async def test_the_last_text_record_lost_before_a_final_record_of_its_own_is_an_error(slow_stack: Stack) -> None:
    """A stop string that starts a step's text ends the answer with a final record and no text
    of its own: the text record before it lost on the way (deleted while the gateway is stopped)
    is a 502 in the stream, not an answer that ends short with ``finish_reason: stop``."""
    client = redis.Redis.from_url(slow_stack.redis_url)
    gateway = slow_stack.procs[0]
    async with aiohttp.ClientSession() as s:
        async with s.post(slow_stack.url + "/v1/chat/completions", json=body(40, prompt="lost at the end")) as r:
            words = (await r.json())["choices"][0]["message"]["content"].split()
        # well after the gateway is stopped, and the first time the word comes
        stop = " " + next(w for i, w in enumerate(words) if i >= 25 and w not in words[:i])
        async with s.post(slow_stack.url + "/v1/chat/completions",
                          json={**body(40, stream=True, prompt="lost at the end"), "stop": stop}) as r:
            assert r.status == 200
            first = await r.content.readline()
            with _stopped(gateway):
                [reply] = _live_replies(client)
                wait_for(lambda: isinstance(_records(client, reply)[-1][1], protocol.Final), 5, "the final record")
                *_, (lost, text), (_, final) = _records(client, reply)
                assert isinstance(text, protocol.Delta) and text.text and final.finish_reason == "stop"
                client.xdel(reply, lost)
            events = await sse_events(r)
    client.close()
    _assert_result_lost(first, events)


def _assert_result_lost(first: bytes, events: list) -> None:
    """The stream began, then ended in one ``result_lost`` error and no finish."""
    assert first.startswith(b"data: ")
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "result_lost"
    assert "lost on its way from the worker" in errors[0]["error"]["message"]
    assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"] for e in events)


def _holder_pid(client: redis.Redis, pool: str) -> int:
    pending = client.xpending_range(f"slogate:q:{pool}", "workers", "-", "+", 10)
    assert len(pending) == 1
    return int(pending[0]["consumer"].decode().split("-")[-2])


def _kill_holder(client: redis.Redis, stack: Stack) -> subprocess.Popen:
    """SIGKILL the interactive worker that holds the one pending request; its process."""
    pid = _holder_pid(client, "interactive")
    victim = next(p for p in stack.procs if p.pid == pid)
    os.kill(pid, signal.SIGKILL)
    victim.wait()
    return victim


@pytest.mark.parametrize("stream", [False, True])
async def test_worker_killed_mid_request_is_finished_by_another(slow_stack: Stack, stream: bool) -> None:
    client = redis.Redis.from_url(slow_stack.redis_url)
    prompt = f"kill test {stream}"
    async with aiohttp.ClientSession() as s:
        async with s.post(slow_stack.url + "/v1/chat/completions", json=body(60, prompt=prompt)) as r:
            expected = (await r.json())["choices"][0]["message"]["content"]
        task = asyncio.create_task(s.post(slow_stack.url + "/v1/chat/completions",
                                          json=body(60, stream=stream, prompt=prompt)))
        await asyncio.to_thread(wait_for, lambda: running(client) == 1, 5, "the request to start")
        await asyncio.sleep(0.3)
        victim = _kill_holder(client, slow_stack)
        resp = await task
        assert resp.status == 200
        if stream:
            events = await sse_events(resp)
            chunks = [e for e in events if isinstance(e, dict)]
            assert not any("error" in c for c in chunks)
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            text = (await resp.json())["choices"][0]["message"]["content"]
        resp.release()
    assert text == expected, "the retry must neither lose nor repeat tokens"
    wait_for(lambda: client.xpending("slogate:q:interactive", "workers")["pending"] == 0, 3, "ack")
    slow_stack.procs.remove(victim)
    slow_stack.worker("interactive", "sim", f"decode_base_s={STEP_S}", "decode_s_per_seq=0")
    client.close()


def test_requests_of_a_gateway_that_died_stop_on_the_workers(tmp_path) -> None:
    """Once its alive key expires (2 s here, not 5 s)."""
    server = LocalRedis(tmp_path / "redis").start()
    client = redis.Redis.from_url(server.url)
    stack = Stack(server.url, {**FAST_FLEET, "SLOGATE_ADMISSION_CONTROL": "0", "SLOGATE_ALIVE_TTL_S": "2"})
    gateway = stack.gateway()
    stack.worker("batch", "sim", f"decode_base_s={STEP_S}", "decode_s_per_seq=0")
    stack.wait_models(MODEL)
    try:
        async def start_and_leave() -> None:
            async with aiohttp.ClientSession() as s:
                request = s.post(stack.url + "/v1/chat/completions", json=body(3000, stream=True),
                                 headers={"x-slogate-class": "batch"})
                async with request as r:
                    await r.content.readline()  # running: 3,000 steps, a minute
                    gateway.send_signal(signal.SIGKILL)
                    gateway.wait()

        asyncio.run(start_and_leave())
        wait_for(lambda: running(client) == 1, 5, "the request to be running")
        wait_for(lambda: running(client) == 0, 20, "the worker to stop the dead gateway's request")
    finally:
        stack.stop()
        client.close()
        server.stop()


async def test_a_dead_workers_requests_are_taken_over_when_its_heartbeat_expires(tmp_path) -> None:
    """Long before ``claim_idle_s`` (a minute here): the heartbeat's second is enough."""
    server = LocalRedis(tmp_path / "redis").start()
    client = redis.Redis.from_url(server.url)
    stack = Stack(server.url, {**FAST_FLEET, "SLOGATE_CLAIM_IDLE_S": "60", "SLOGATE_ADMISSION_CONTROL": "0"})
    stack.gateway()
    for _ in range(2):
        stack.worker("interactive", "sim", f"decode_base_s={STEP_S}", "decode_s_per_seq=0")
    stack.wait_models(MODEL)
    try:
        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            task = asyncio.create_task(s.post(stack.url + "/v1/chat/completions", json=body(100)))
            await asyncio.to_thread(wait_for, lambda: running(client) == 1, 5, "the request to start")
            _kill_holder(client, stack)
            resp = await task
            assert resp.status == 200
            assert (await resp.json())["usage"]["completion_tokens"] == 100
        wait_for(lambda: len(client.xinfo_consumers("slogate:q:interactive", "workers")) == 1, 15,
                 "the dead worker to leave the consumer group")
    finally:
        stack.stop()
        client.close()
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_pool_left_without_workers_ends_its_requests_and_no_later_worker_runs_them(
        tmp_path, stream: bool) -> None:
    """Before, a batch request whose only worker died waited to its deadline (an hour) with
    nothing sent; a worker that came back then ran it for nobody. The 503s are no fault of the
    pool's: counted by its breaker, they had it refuse the next requests once a worker was back."""
    server = LocalRedis(tmp_path / "redis").start()
    client = redis.Redis.from_url(server.url)
    stack = Stack(server.url, {**FAST_FLEET, "SLOGATE_CLAIM_IDLE_S": "60", "SLOGATE_WORKERLESS_GRACE_S": "1"})
    stack.gateway()
    worker = stack.worker("batch", "sim", f"decode_base_s={STEP_S}", "decode_s_per_seq=0")
    stack.wait_models(MODEL)
    batch = {"x-slogate-class": "batch"}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            url = stack.url + "/v1/chat/completions"
            tasks = [asyncio.create_task(s.post(url, json=body(3000, stream), headers=batch)) for _ in range(6)]
            await asyncio.to_thread(wait_for, lambda: running(client) == 6, 5, "the requests to start")
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            for resp in await asyncio.gather(*tasks):
                if stream:
                    assert resp.status == 200
                    events = await sse_events(resp)
                    error = next(e["error"] for e in events if isinstance(e, dict) and "error" in e)
                    assert events[-1] == "[DONE]"
                else:
                    assert resp.status == 503
                    error = (await resp.json())["error"]
                assert error["code"] == "no_live_worker" and "pool 'batch'" in error["message"]
                resp.release()
            wait_for(lambda: len(list(client.scan_iter("slogate:cancel:*"))) == 6, 3, "the requests' cancels")
            stack.worker("batch", "sim", f"decode_base_s={STEP_S}", "decode_s_per_seq=0")
            # Run, they would hold the new worker for a minute (3,000 steps of 20 ms).
            await asyncio.to_thread(wait_for, lambda: client.xpending("slogate:q:batch", "workers")["pending"] == 0,
                                    20, "the new worker to take the dead one's requests over and drop them")
            await asyncio.to_thread(stack.wait_models, MODEL)  # it takes them over before its first heartbeat
            async with s.post(url, json=body(5), headers=batch) as resp:
                assert resp.status == 200, await resp.text()
    finally:
        stack.stop()
        client.close()
        server.stop()


def queued(client: redis.Redis, prompt: str) -> list[protocol.GenerateRequest]:
    """The requests for ``prompt`` in the queues (encryption is off)."""
    requests = [protocol.decode_request(fields[protocol.FIELD]) for pool in ("interactive", "batch")
                for _, fields in client.xrange(f"slogate:q:{pool}", "-", "+")]
    return [r for r in requests if r.messages and r.messages[0]["content"] == prompt]


def idle(client: redis.Redis) -> bool:
    return running(client) == 0 and not any(
        client.xpending(f"slogate:q:{p}", "workers")["pending"] for p in ("interactive", "batch"))


async def test_a_client_that_leaves_cancels_every_choice_each_seeded_apart(slow_stack: Stack) -> None:
    client = redis.Redis.from_url(slow_stack.redis_url)
    payload = {**body(2000, stream=True, prompt="leave n"), "n": 3, "seed": 41, "temperature": 0.8}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(slow_stack.url + "/v1/chat/completions", json=payload)
        assert (await resp.content.readline()).startswith(b"data: ")
        await asyncio.to_thread(wait_for, lambda: running(client) == 3, 5, "the three choices to run")
        requests = queued(client, "leave n")
        resp.close()
    first = min((r.id for r in requests), key=len)
    assert {r.id for r in requests} == {first, f"1-{first}", f"2-{first}"}
    assert sorted(r.sampling.seed for r in requests) == [41, 42, 43], "one seed for all would draw one sample"
    await asyncio.to_thread(wait_for, lambda: idle(client), 15, "the workers to drop every choice")
    client.close()


def _spoil(client: redis.Redis, request_id: str) -> None:
    """A record for ``request_id`` that its gateway cannot read, as a worker of another
    protocol would send: that choice fails with a 502 of the gateway's own."""
    [reply] = _live_replies(client)
    client.xadd(reply, {protocol.BATCH_FIELD: protocol.encode_batch([(request_id.encode(), b"\x01garbage")])})


@pytest.mark.parametrize("stream", [False, True])
async def test_one_failed_choice_fails_the_request_and_cancels_the_others(slow_stack: Stack, stream: bool) -> None:
    client = redis.Redis.from_url(slow_stack.redis_url)
    prompt = f"fail one {stream}"
    async with aiohttp.ClientSession() as s:
        sent = asyncio.create_task(s.post(slow_stack.url + "/v1/chat/completions",
                                          json={**body(2000, stream=stream, prompt=prompt), "n": 3}))
        await asyncio.to_thread(wait_for, lambda: running(client) == 3, 5, "the three choices to run")
        [second] = [r.id for r in queued(client, prompt) if r.id.startswith("1-")]
        await asyncio.sleep(0.2)  # every choice well under way
        _spoil(client, second)
        resp = await sent
        if stream:
            assert resp.status == 200
            events = await sse_events(resp)
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            assert len(errors) == 1 and errors[0]["error"]["code"] == "protocol_mismatch"
            assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
            assert {c["index"] for e in events if isinstance(e, dict) for c in e.get("choices", ())} == {0, 1, 2}
            assert not any(c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", ()))
        else:
            assert resp.status == 502
            assert (await resp.json())["error"]["code"] == "protocol_mismatch"
        resp.release()
    await asyncio.to_thread(wait_for, lambda: idle(client), 15, "the workers to drop every choice")
    client.close()


async def test_choices_past_their_deadline_are_one_504(slow_stack: Stack) -> None:
    timeout = {"x-slogate-timeout": "0.4"}
    async with aiohttp.ClientSession() as s:
        async with s.post(slow_stack.url + "/v1/chat/completions", json={**body(200), "n": 2}, headers=timeout) as r:
            assert r.status == 504 and (await r.json())["error"]["code"] == "deadline_exceeded"
        async with s.post(slow_stack.url + "/v1/chat/completions", json={**body(200, stream=True), "n": 2},
                          headers=timeout) as r:
            events = await sse_events(r)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "deadline_exceeded"
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
