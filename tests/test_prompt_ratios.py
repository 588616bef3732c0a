"""The learned prompt ratios in Redis: stale ones dropped at start, a failed save kept for the next."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from gateway import prompt_ratios
from policies.prompt_tokens import PromptTokens
from slogate import keys
from slogate.local_redis import LocalRedis


async def test_a_starting_gateway_takes_up_recent_ratios_and_drops_old_ones(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    now = time.time()
    await client.hset(keys.PROMPT_RATIOS, mapping={
        b'["m","k"]': f"[5000, 10000, {now - 60}]",
        b'["m","gone"]': f"[5000, 20000, {now - prompt_ratios.KEEP_S - 60}]"})
    tokens = PromptTokens()
    await prompt_ratios.restore(client, tokens)
    assert tokens.estimate("m", "k", 400, 0) == 200 and tokens.estimate("m", "gone", 400, 0) == 100
    assert await client.hkeys(keys.PROMPT_RATIOS) == [b'["m","k"]']
    stale = f"[1, 2, {now - prompt_ratios.KEEP_S - 60}]".encode()
    await client.hset(keys.PROMPT_RATIOS, b'["m","old"]', stale)
    read = client.hgetall

    async def rewritten_meanwhile(name):  # another gateway saves a fresh figure after this one read
        saved = await read(name)
        await client.hset(name, b'["m","old"]', f"[1, 2, {now}]")
        return saved

    client.hgetall = rewritten_meanwhile
    await prompt_ratios.restore(client, PromptTokens())
    assert await client.hexists(keys.PROMPT_RATIOS, b'["m","old"]'), "a fresh figure is not dropped as stale"
    await client.aclose()


async def test_what_a_save_could_not_write_goes_with_the_next(own_redis: LocalRedis) -> None:
    client = aioredis.Redis.from_url(own_redis.url, socket_connect_timeout=1)
    tokens = PromptTokens()
    saver = prompt_ratios.RatioSaver(client, tokens)
    for _ in range(5):
        tokens.observe("m", "k", 1200, 0, 600)
    own_redis.stop()
    assert not await saver.save()
    own_redis.start()
    for _ in range(5):
        tokens.observe("m", "j", 1200, 0, 300)
    assert await saver.save()
    later = PromptTokens()
    await prompt_ratios.restore(client, later)
    assert later.chars_per_token("m", "k") == 2.0 and later.chars_per_token("m", "j") == 4.0
    await client.aclose()
