"""What the gateway learned of prompt characters a token (:mod:`policies.prompt_tokens`), kept in
Redis: a gateway that starts, and a new replica, price prompts as the fleet learned to, not at
the prior, which under-prices a Chinese-language deployment four times until each key has sent
a few thousand characters to that gateway.

Gateways write the same hash, each only the ratios it learned since its last write, every
``SAVE_EVERY_S``: the last to learn from a key's traffic is the one whose figure stays. A ratio
nobody learned for ``KEEP_S`` is dropped when a gateway starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from policies.prompt_tokens import PromptTokens
from slogate import keys

log = logging.getLogger("slogate.gateway")
SAVE_EVERY_S = 10.0
KEEP_S = 7 * 86400


_DROP_UNCHANGED = """
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
"""
"""Delete the stale entries read (ARGV: name, value, ...) unless a gateway rewrote them since."""


async def restore(redis: aioredis.Redis, tokens: PromptTokens) -> None:
    try:
        saved = await redis.hgetall(keys.PROMPT_RATIOS)
    except (RedisError, OSError) as exc:
        log.warning("learned prompt ratios could not be read; prompts are priced at the prior until "
                    "relearned: %s", exc)
        return
    taken, stale = tokens.restore(saved, time.time(), KEEP_S)
    if taken:
        log.info("took up %d learned prompt ratio(s) from %s", taken, keys.PROMPT_RATIOS)
    if stale:
        with contextlib.suppress(RedisError, OSError):  # the next gateway to start drops them
            pairs = [x for name in stale for x in (name, saved[name])]
            await redis.eval(_DROP_UNCHANGED, 1, keys.PROMPT_RATIOS, *pairs)


@dataclass
class RatioSaver:
    redis: aioredis.Redis
    tokens: PromptTokens
    pending: dict[bytes, bytes] = field(default_factory=dict)
    """Changes not yet written (kept through a failed write, newer ones over older)."""

    async def save(self) -> bool:
        """False when Redis did not take them (they go with the next save)."""
        self.pending.update(self.tokens.take_changes(time.time()))
        if not self.pending:
            return True
        try:
            async with self.redis.pipeline(transaction=True) as p:
                p.hset(keys.PROMPT_RATIOS, mapping=self.pending)
                p.expire(keys.PROMPT_RATIOS, KEEP_S)
                await p.execute()
        except (RedisError, OSError):
            return False  # the fleet view already says Redis is unreachable
        self.pending = {}
        return True

    async def run(self, every_s: float = SAVE_EVERY_S) -> None:
        """Save every ``every_s`` (the gateway saves once more as it closes)."""
        while True:
            await asyncio.sleep(every_s)
            await self.save()
