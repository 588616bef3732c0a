"""Admission control through a real gateway in front of a deliberately small pool."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import aiohttp
import pytest
import redis

from slogate.local_redis import LocalRedis
from slogate.processes import Stack
from tests.e2e.conftest import FAST_FLEET, MODEL
from tests.e2e.test_policies_e2e import SCORE, post


@pytest.fixture(scope="module")
def overloaded(redis_server: LocalRedis) -> Iterator[Stack]:
    """A slow interactive pool (20 ms a step, 4 at a time) with admission control on."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    stack = Stack(redis_server.url, dict(FAST_FLEET))
    stack.gateway()
    stack.worker("interactive", "sim", "decode_base_s=0.02", "decode_s_per_seq=0", "max_batch=4")
    stack.worker("batch", "sim", "decode_base_s=0.02", "decode_s_per_seq=0", "max_batch=4")
    stack.wait_models(MODEL, pools=2)
    yield stack
    stack.stop()


async def test_overload_sheds_interactive_with_retry_after(overloaded: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        async def one() -> tuple[int, dict, dict]:
            async with s.post(overloaded.url + "/v1/chat/completions", json=SCORE) as r:
                return r.status, await r.json(), dict(r.headers)

        results = await asyncio.gather(*(one() for _ in range(80)))
    shed = [r for r in results if r[0] == 429]
    served = [r for r in results if r[0] == 200]
    assert shed, "80 simultaneous requests on 8 slots must shed some"
    assert served, "admission must still let the capacity it has through"
    assert len(shed) + len(served) == 80
    status, body, headers = shed[0]
    assert headers["x-slogate-reason"] == "overloaded"  # a score fits an idle pool: the load is what sheds it
    assert "Retry-After" in headers and int(headers["retry-after-ms"]) > 0
    assert -(-int(headers["retry-after-ms"]) // 1000) == int(headers["Retry-After"]), "the two headers agree"
    assert "objective" in body["error"]["message"]
    async with aiohttp.ClientSession() as s:
        async with s.get(overloaded.url + "/metrics") as r:
            text = await r.text()
    assert 'slogate_admission_decisions_total{class="interactive",decision="shed"' in text


async def test_too_long_for_the_objective_is_told_to_go_batch(overloaded: Stack) -> None:
    body = {**SCORE, "max_tokens": 60}
    status, err, headers = await post(overloaded.url, body, **{"x-slogate-class": "interactive"})
    assert status == 429 and headers["x-slogate-reason"] == "exceeds-objective"
    assert "x-slogate-class: batch" in err["error"]["message"]
    assert headers["x-should-retry"] == "false" and "Retry-After" not in headers and "retry-after-ms" not in headers
    status, _, headers = await post(overloaded.url, body, **{"x-slogate-class": "batch"})
    assert status == 200 and headers["x-slogate-pool"] == "batch"


async def test_too_long_for_the_context_is_not_told_to_go_batch(overloaded: Stack) -> None:
    """Sent as batch it could only come back a 400 (context_length_exceeded)."""
    body = {**SCORE, "max_tokens": 2, "messages": [{"role": "user", "content": "x" * 4 * 8192}]}
    status, err, headers = await post(overloaded.url, body, **{"x-slogate-class": "interactive"})
    assert status == 429 and headers["x-slogate-reason"] == "exceeds-objective"
    assert "exceed the model's context of 8192 tokens" in err["error"]["message"]
    assert "x-slogate-class: batch" not in err["error"]["message"]


async def test_a_model_served_only_by_the_other_class_says_where(tmp_path) -> None:
    server = LocalRedis(tmp_path / "redis").start()
    stack = Stack(server.url, dict(FAST_FLEET))
    try:
        stack.gateway()
        stack.worker("batch", "sim", "decode_base_s=0.001")
        stack.wait_models(MODEL)
        status, err, _ = await post(stack.url, SCORE, **{"x-slogate-class": "interactive"})
        assert status == 503 and err["error"]["code"] == "no_workers"
        assert "only in batch pools (send it with x-slogate-class: batch)" in err["error"]["message"]
        status, _, _ = await post(stack.url, SCORE, **{"x-slogate-class": "batch"})
        assert status == 200
    finally:
        stack.stop()
        server.stop()


async def learned_chars_per_token(url: str) -> float | None:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    name = f'slogate_admission_prompt_chars_per_token{{model="{MODEL}"}}'
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(name)), None)


async def test_the_gateway_learns_how_many_characters_a_token_is(tmp_path) -> None:
    """The sim counts two characters a token here; the gateway starts from four, and a gateway
    started later from what the first learned."""
    server = LocalRedis(tmp_path / "redis").start()
    stack = Stack(server.url, dict(FAST_FLEET))
    try:
        first = stack.gateway()
        worker = stack.worker("interactive", "sim", "chars_per_token=2", "decode_base_s=0.001")
        stack.wait_models(MODEL)
        for i in range(5):
            body = {**SCORE, "messages": [{"role": "user", "content": f"score txn {i} " + "x" * 1000}]}
            status, answer, _ = await post(stack.url, body)
            assert status == 200 and answer["usage"]["prompt_tokens"] == 508  # (1012 + 4) / 2
        assert 1.9 < await learned_chars_per_token(stack.url) < 2.1
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=20) == 0
        stack.gateway()  # a restart: no request has taught it anything
        stack.wait_models(MODEL)
        assert 1.9 < await learned_chars_per_token(stack.url) < 2.1
        worker.kill()
        deadline = time.monotonic() + 10
        while await learned_chars_per_token(stack.url) is not None:  # its model is no longer served
            assert time.monotonic() < deadline, "a model no worker serves keeps its series"
            await asyncio.sleep(0.1)
    finally:
        stack.stop()
        server.stop()
