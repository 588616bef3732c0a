"""What the gateway learned of prompt characters a token (:mod:`policies.prompt_tokens`), kept in
Redis: a gateway that starts, and a new replica, price prompts as the fleet learned to, not at
the prior, which under-prices a Chinese-language deployment four times until each key has sent
a few thousand characters to that gateway.

Gateways write the same hash, each its whole view, every ``SAVE_EVERY_S`` when it learned
something; the last writer of a ratio wins, which is fine for what is one figure learned from
the same traffic.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from policies.prompt_tokens import PromptTokens
from slogate import keys

log = logging.getLogger("slogate.gateway")
SAVE_EVERY_S = 10.0
KEEP_S = 7 * 86400
"""How long the ratios outlive the last gateway that saved them."""


async def restore(redis: aioredis.Redis, tokens: PromptTokens) -> None:
    try:
        saved = await redis.hgetall(keys.PROMPT_RATIOS)
    except (RedisError, OSError) as exc:
        log.warning("learned prompt ratios could not be read; prompts are priced at the prior until "
                    "relearned: %s", exc)
        return
    taken = tokens.restore(saved)
    if taken:
        log.info("took up %d learned prompt ratio(s) from %s", taken, keys.PROMPT_RATIOS)


async def save(redis: aioredis.Redis, tokens: PromptTokens) -> bool:
    """False when Redis did not take them (they are saved again with the next change)."""
    saved = tokens.saved()
    if not saved:
        return True
    try:
        async with redis.pipeline(transaction=True) as p:
            p.hset(keys.PROMPT_RATIOS, mapping=saved)
            p.expire(keys.PROMPT_RATIOS, KEEP_S)
            await p.execute()
    except (RedisError, OSError):
        return False  # the fleet view already says Redis is unreachable
    return True


async def keep_saved(redis: aioredis.Redis, tokens: PromptTokens, every_s: float = SAVE_EVERY_S) -> None:
    """Save every ``every_s`` while the gateway learns (the gateway saves once more as it closes)."""
    written = tokens.observed
    while True:
        await asyncio.sleep(every_s)
        seen = tokens.observed
        if seen != written and await save(redis, tokens):
            written = seen
