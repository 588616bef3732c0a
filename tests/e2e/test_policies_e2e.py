"""Keys, rate limits, classification and admission through real gateway processes."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import aiohttp
import pytest
import redis
import yaml
from multidict import CIMultiDict

from gateway.auth import hash_key
from slogate import keys
from slogate.local_redis import LocalRedis
from slogate.processes import Stack
from tests.e2e.conftest import FAST_FLEET, MODEL

SCORE = {"model": MODEL, "messages": [{"role": "user", "content": "score txn 7"}], "max_tokens": 4}
RPM = 30


@pytest.fixture(scope="module")
def guarded(redis_server: LocalRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Stack]]:
    """Two gateways on one Redis with API keys and a low per-key rate limit."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    config = tmp_path_factory.mktemp("cfg") / "slogate.yaml"
    config.write_text(yaml.safe_dump({
        "api_keys": [{"id": "payments", "sha256": hash_key("sk-pay")},
                     {"id": "analyst", "sha256": hash_key("sk-ana"), "models": ["other-model"]},
                     {"id": "reports", "sha256": hash_key("sk-rep")},
                     {"id": "small", "sha256": hash_key("sk-small")}],
        "policies": {"rate_limits": {"rpm": 0, "tpm": 0, "per_key": {"payments": {"rpm": RPM},
                                                                     "small": {"tpm": 50}}},
                     "classification": {"key_classes": {"reports": "batch"}}},
    }))
    env = {**FAST_FLEET, "SLOGATE_CONFIG": str(config)}
    stacks = [Stack(redis_server.url, env), Stack(redis_server.url, env)]
    for s in stacks:
        s.gateway()
    stacks[0].worker("interactive", "sim", "decode_base_s=0.001", "decode_s_per_seq=0")
    stacks[0].worker("batch", "sim", "decode_base_s=0.001", "decode_s_per_seq=0")
    for s in stacks:
        s.wait_models(MODEL, pools=2, api_key="sk-pay")
    yield stacks
    for s in stacks:
        s.stop()


async def post(url: str, body: dict, key: str | None = None, **headers: str) -> tuple[int, dict, dict]:
    """Status, JSON body (or {} for a stream) and headers."""
    if key:
        headers["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.content_type == "text/event-stream":
                await r.read()
                return r.status, {}, dict(r.headers)
            return r.status, await r.json(), dict(r.headers)


async def test_missing_and_unknown_keys_are_401(guarded: list[Stack]) -> None:
    status, body, _ = await post(guarded[0].url, SCORE)
    assert status == 401 and body["error"]["code"] == "missing_api_key"
    status, body, _ = await post(guarded[0].url, SCORE, key="sk-wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body, _ = await post(guarded[0].url, SCORE, Authorization="Basic abc")
    assert status == 401 and "Bearer" in body["error"]["message"]


async def test_models_need_a_key_and_list_only_what_the_key_may_use(guarded: list[Stack]) -> None:
    async with aiohttp.ClientSession() as s:
        async def models(key: str | None) -> tuple[int, dict]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with s.get(guarded[0].url + "/v1/models", headers=headers) as r:
                return r.status, await r.json()

        status, body = await models(None)
        assert status == 401 and body["error"]["code"] == "missing_api_key"
        status, body = await models("sk-pay")
        assert status == 200 and [m["id"] for m in body["data"]] == [MODEL]
        status, body = await models("sk-ana")  # may use only "other-model", which nothing serves
        assert status == 200 and body["data"] == []


async def test_key_limited_to_other_models_is_403(guarded: list[Stack]) -> None:
    status, body, _ = await post(guarded[0].url, SCORE, key="sk-ana")
    assert status == 403 and body["error"]["param"] == "model"
    status, body, _ = await post(guarded[0].url, {**SCORE, "model": "other-model"}, key="sk-ana")
    assert status == 404 and "(served: none)" in body["error"]["message"], "only the models the key may use"
    assert MODEL not in body["error"]["message"]


async def test_key_default_class_and_reason_headers(guarded: list[Stack]) -> None:
    status, _, headers = await post(guarded[0].url, SCORE, key="sk-rep")
    assert status == 200
    assert headers["x-slogate-class"] == "batch" and headers["x-slogate-reason"] == "key-default"
    status, _, headers = await post(guarded[0].url, SCORE, key="sk-rep", **{"x-slogate-class": "interactive"})
    assert headers["x-slogate-class"] == "interactive" and headers["x-slogate-reason"] == "header"


async def test_rate_limit_holds_across_two_gateways(guarded: list[Stack]) -> None:
    async def burst(stack: Stack) -> list[tuple[int, dict, dict]]:
        return [await post(stack.url, SCORE, key="sk-pay") for _ in range(25)]

    results = [r for rs in await asyncio.gather(*(burst(s) for s in guarded)) for r in rs]
    ok = [r for r in results if r[0] == 200]
    limited = [r for r in results if r[0] == 429]
    assert len(ok) <= RPM, "the two gateways together let more through than the key's limit"
    assert len(ok) >= RPM - 2, "the limit should allow a whole minute's worth in a burst"
    assert len(ok) + len(limited) == 50
    status, body, headers = limited[0]
    assert body["error"]["code"] == "rate_limit_exceeded" and "payments" in body["error"]["message"]
    assert int(headers["Retry-After"]) >= 1 and headers["x-slogate-reason"] == "rate-limit:rpm"
    other = await post(guarded[1].url, SCORE, key="sk-rep")
    assert other[0] == 200, "another key is not limited by this one"


async def test_a_request_over_the_whole_tpm_is_told_not_to_retry(guarded: list[Stack]) -> None:
    status, body, headers = await post(guarded[0].url, {**SCORE, "max_tokens": 60}, key="sk-small")
    assert status == 429 and headers["x-slogate-reason"] == "rate-limit:tokens-over-tpm"
    assert headers["x-should-retry"] == "false" and "Retry-After" not in headers
    assert "50 tokens per minute" in body["error"]["message"]
    status, _, _ = await post(guarded[0].url, SCORE, key="sk-small")
    assert status == 200


async def test_concurrent_streams_per_key_are_capped(guarded: list[Stack], redis_server: LocalRedis) -> None:
    client = redis.Redis.from_url(redis_server.url)
    slots = keys.stream_slots("reports")
    client.zadd(slots, {f"open-{i}": time.time() + 100 for i in range(64)})
    try:
        status, body, headers = await post(guarded[1].url, {**SCORE, "stream": True}, key="sk-rep")
    finally:
        client.delete(slots)
        client.close()
    assert status == 429 and body["error"]["code"] == "too_many_streams"
    status, _, _ = await post(guarded[1].url, {**SCORE, "stream": True}, key="sk-rep")
    assert status == 200


async def test_the_slots_of_a_gateway_that_died_free_at_their_streams_end(
        guarded: list[Stack], redis_server: LocalRedis) -> None:
    """A gateway killed with streams open never releases their slots: they must not lock the
    key out. A stream's slot is held while it runs and released when it ends."""
    client = redis.Redis.from_url(redis_server.url)
    slots = keys.stream_slots("reports")
    client.zadd(slots, {f"dead-{i}": time.time() - 1 for i in range(64)})
    try:
        body = {**SCORE, "stream": True, "max_tokens": 300}
        async with aiohttp.ClientSession() as s, s.post(guarded[1].url + "/v1/chat/completions", json=body,
                                                         headers={"Authorization": "Bearer sk-rep"}) as r:
            assert r.status == 200
            await r.content.readline()
            assert client.zcard(slots) == 1, "the dead gateway's slots are dropped, this stream holds one"
            await r.read()
        await asyncio.sleep(0.3)
        assert client.zcard(slots) == 0
    finally:
        client.delete(slots)
        client.close()


async def test_a_key_that_is_not_utf8_is_refused_as_unknown(guarded: list[Stack]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", guarded[0].port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfesk-pay\r\n"
                 b"Connection: close\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in answer, answer[:200]


@pytest.mark.parametrize("keys", [("sk-pay", "sk-wrong"), ("sk-wrong", "sk-pay"), ("sk-pay", "sk-pay")])
async def test_two_authorization_headers_are_refused_whichever_comes_first(guarded: list[Stack],
                                                                           keys: tuple[str, str]) -> None:
    """The first was taken: a proxy that checks the last one and this gateway would disagree on
    who is calling, and the same request passed or failed by the headers' order."""
    headers = CIMultiDict(("Authorization", f"Bearer {key}") for key in keys)
    async with aiohttp.ClientSession() as s:
        for method, path, body in (("POST", "/v1/chat/completions", SCORE), ("GET", "/v1/models", None)):
            async with s.request(method, guarded[0].url + path, json=body, headers=headers) as r:
                status, answer = r.status, await r.json()
            assert status == 401, (path, answer)
            assert answer["error"]["code"] == "invalid_api_key"
            assert "one Authorization header, got 2" in answer["error"]["message"]


async def test_requests_without_a_key_cannot_flood_the_audit_trail(guarded: list[Stack],
                                                                   redis_server: LocalRedis) -> None:
    """One record a second with their count, however many come: the trail is trimmed by
    length, and they must not push the real records out."""
    client = redis.Redis.from_url(redis_server.url)

    def refused() -> list[dict]:
        return [r for _, fields in client.xrange("slogate:audit") for line in fields[b"e"].splitlines()
                if (r := json.loads(line))["status"] in (401, 405)]

    await asyncio.sleep(1.2)  # earlier tests' refusals are written
    before = refused()
    for _ in range(40):
        assert (await post(guarded[0].url, SCORE))[0] == 401
    async with aiohttp.ClientSession() as s:
        for _ in range(20):
            async with s.get(guarded[0].url + "/v1/chat/completions") as r:
                assert r.status == 405
    await asyncio.sleep(1.5)
    new = refused()[len(before):]
    client.close()
    counts = {status: sum(r["count"] for r in new if r["status"] == status) for status in (401, 405)}
    assert counts == {401: 40, 405: 20} and len(new) <= 6
    assert {r["outcome"] for r in new if r["status"] == 401} == {"unauthenticated"}


async def test_n_choices_reserve_max_tokens_n_times(guarded: list[Stack]) -> None:
    """Each choice may take max_tokens: four of 15 are more than a 50-token minute, one is not."""
    status, body, headers = await post(guarded[0].url, {**SCORE, "max_tokens": 15, "n": 4}, key="sk-small")
    assert status == 429 and headers["x-slogate-reason"] == "rate-limit:tokens-over-tpm"
    needs = int(re.search(r"needs (\d+)\)", body["error"]["message"]).group(1))
    assert 60 < needs < 75, "max_tokens four times, the prompt once"
    status, _, _ = await post(guarded[0].url, {**SCORE, "max_tokens": 15}, key="sk-small")
    assert status == 200
