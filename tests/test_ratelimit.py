from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.ratelimit import RateLimiter


@pytest.fixture
async def client(redis_url: str):
    r = aioredis.Redis.from_url(redis_url)
    yield r
    await r.aclose()


async def test_request_limit_holds_then_says_when(client: aioredis.Redis) -> None:
    rl = RateLimiter(client)
    results = [await rl.check("k", rpm=5, tpm=0, tokens=10) for _ in range(7)]
    assert [d.allowed for d in results] == [True] * 5 + [False] * 2
    denied = results[-1]
    assert denied.reason == "rpm"
    # One request per 12 s refills; the next slot is at most 12 s away and well over 11 s.
    assert 11.0 < denied.retry_after_s <= 12.0


@pytest.mark.parametrize("rpm", [1, 7, 13, 600])
async def test_a_whole_minute_of_requests_fits_in_one_burst(client: aioredis.Redis, rpm: int) -> None:
    rl = RateLimiter(client, period_s=3600.0)  # slow refill: none during the loop
    results = [(await rl.check(f"k{rpm}", rpm=rpm, tpm=0, tokens=1)).allowed for _ in range(rpm + 1)]
    assert results == [True] * rpm + [False]


async def test_token_limit_holds(client: aioredis.Redis) -> None:
    rl = RateLimiter(client)
    assert (await rl.check("k", rpm=0, tpm=1000, tokens=600)).allowed
    second = await rl.check("k", rpm=0, tpm=1000, tokens=600)
    assert not second.allowed and second.reason == "tpm"
    # 200 tokens short: 200/1000 of a minute.
    assert 11.0 < second.retry_after_s <= 12.0
    assert (await rl.check("k", rpm=0, tpm=1000, tokens=400)).allowed


async def test_denied_request_consumes_nothing(client: aioredis.Redis) -> None:
    rl = RateLimiter(client)
    assert (await rl.check("k", rpm=3, tpm=100, tokens=90)).allowed
    # Denied on tokens: its request must not count against the rpm either.
    for _ in range(5):
        assert not (await rl.check("k", rpm=3, tpm=100, tokens=50)).allowed
    assert (await rl.check("k", rpm=3, tpm=100, tokens=10)).allowed
    assert (await rl.check("k", rpm=3, tpm=0, tokens=10)).allowed
    assert not (await rl.check("k", rpm=3, tpm=0, tokens=10)).allowed


async def test_request_larger_than_tpm_never_fits(client: aioredis.Redis) -> None:
    d = await RateLimiter(client).check("k", rpm=10, tpm=100, tokens=101)
    assert (d.allowed, d.reason, d.retry_after_s) == (False, "tokens-over-tpm", 0.0)


async def test_refills(client: aioredis.Redis) -> None:
    rl = RateLimiter(client, period_s=1.0)  # 4 per second: one slot every 250 ms
    for _ in range(4):
        assert (await rl.check("k", rpm=4, tpm=0, tokens=1)).allowed
    denied = await rl.check("k", rpm=4, tpm=0, tokens=1)
    assert not denied.allowed
    await asyncio.sleep(denied.retry_after_s + 0.02)
    assert (await rl.check("k", rpm=4, tpm=0, tokens=1)).allowed
    assert not (await rl.check("k", rpm=4, tpm=0, tokens=1)).allowed


async def test_keys_are_isolated(client: aioredis.Redis) -> None:
    rl = RateLimiter(client)
    for _ in range(2):
        assert (await rl.check("a", rpm=2, tpm=0, tokens=1)).allowed
    assert not (await rl.check("a", rpm=2, tpm=0, tokens=1)).allowed
    assert (await rl.check("b", rpm=2, tpm=0, tokens=1)).allowed
    assert (await rl.check("{odd}key", rpm=2, tpm=0, tokens=1)).allowed


async def test_unlimited_writes_nothing(client: aioredis.Redis) -> None:
    for _ in range(50):
        assert (await RateLimiter(client).check("k", rpm=0, tpm=0, tokens=10)).allowed
    assert await client.dbsize() == 0


async def test_every_key_expires(client: aioredis.Redis) -> None:
    rl = RateLimiter(client)
    await rl.check("a", rpm=60, tpm=6000, tokens=100)
    await rl.check("{b}", rpm=60, tpm=6000, tokens=100)
    keys = await client.keys("slogate:rl:*")
    assert len(keys) == 4
    for key in keys:
        ttl = await client.pttl(key)
        # Expires when the bucket is full again: here 1 s (requests) and 1 s (tokens).
        assert 0 < ttl <= 1001


async def test_survives_a_script_cache_flush(client: aioredis.Redis) -> None:
    rl = RateLimiter(client)
    assert (await rl.check("k", rpm=2, tpm=0, tokens=1)).allowed
    await client.script_flush()  # what a Redis restart or failover does to the cache
    assert (await rl.check("k", rpm=2, tpm=0, tokens=1)).allowed
    assert not (await rl.check("k", rpm=2, tpm=0, tokens=1)).allowed


async def test_two_gateways_share_the_limit(redis_url: str) -> None:
    """Two connection pools stand for two gateway processes hammering the same key."""
    gateways = [
        aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=16))
        for _ in range(2)
    ]
    # Per hour, so no refill happens while the test runs, however slow the machine.
    limiters = [RateLimiter(g, period_s=3600.0) for g in gateways]
    try:
        decisions = await asyncio.gather(*(
            limiters[i % 2].check("shared", rpm=50, tpm=0, tokens=1) for i in range(400)
        ))
        assert sum(d.allowed for d in decisions) == 50
        assert {d.allowed for d in decisions[::2]} == {d.allowed for d in decisions[1::2]} == {True, False}
        decisions = await asyncio.gather(*(
            limiters[i % 2].check("tokens", rpm=0, tpm=1000, tokens=30) for i in range(400)
        ))
        assert sum(d.allowed for d in decisions) == 1000 // 30
    finally:
        for g in gateways:
            await g.aclose()
