"""With a key configured, a Redis dump taken mid-request holds no customer text."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import redis

from slogate.crypto import generate_key
from slogate.local_redis import LocalRedis
from slogate.processes import Stack
from tests.e2e.conftest import FAST_FLEET, MODEL

PROMPT = "客户 4711 的交易备注: wire to account CH93-0076-2011-6238-5295-7"


def dump_everything(client: redis.Redis) -> bytes:
    out = []
    for key in client.scan_iter("*"):
        kind = client.type(key)
        if kind == b"stream":
            for _, fields in client.xrange(key):
                out += list(fields.values())
        elif kind == b"string":
            out.append(client.get(key) or b"")
    return b"".join(out)


async def test_prompts_and_completions_are_sealed_in_redis(redis_server: LocalRedis) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    stack = Stack(redis_server.url, {**FAST_FLEET, "SLOGATE_ENCRYPTION_KEYS": f"k1:{generate_key()}"})
    stack.gateway()
    stack.worker("interactive", "sim", "decode_base_s=0.03", "decode_s_per_seq=0")
    stack.worker("batch", "sim", "decode_base_s=0.03", "decode_s_per_seq=0")
    stack.wait_models(MODEL, pools=2)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 30,
                "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                seen, done = [], False
                async for line in r.content:
                    done = done or line.startswith(b"data: [DONE]")
                    if line.startswith(b"data: {") and b'"content":"' in line:
                        seen.append(json.loads(line[6:])["choices"][0]["delta"]["content"])
                    if len(seen) == 5:
                        dump = await asyncio.to_thread(dump_everything, client)
        words = [w for w in "".join(seen).split() if len(w) > 3]
        assert len(seen) >= 5 and words
        assert b"CH93" not in dump and "客户".encode() not in dump
        assert not any(w.encode() in dump for w in words), "completion text must not sit in Redis in the clear"
        assert done, "the stream still completes normally"
    finally:
        stack.stop()
        client.close()


async def test_a_request_no_worker_can_open_is_answered_at_once(redis_server: LocalRedis) -> None:
    """The gateway seals with k1, the workers hold only k2: the request cannot run, and its
    client hears so at once, not at its deadline (an hour for batch)."""
    redis.Redis.from_url(redis_server.url).flushdb()
    stack = Stack(redis_server.url, {**FAST_FLEET, "SLOGATE_ENCRYPTION_KEYS": f"k1:{generate_key()}"})
    stack.gateway()
    stack.env_overrides["SLOGATE_ENCRYPTION_KEYS"] = f"k2:{generate_key()}"
    for pool in ("interactive", "batch"):
        stack.worker(pool, "sim", "decode_base_s=0.001")
    stack.wait_models(MODEL, pools=2)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            async with s.post(stack.url + "/v1/chat/completions", json=body, headers={"x-slogate-class": "batch"}) as r:
                status, answer = r.status, await r.json()
        assert (status, answer["error"]["code"]) == (502, "protocol_mismatch"), answer
    finally:
        stack.stop()
