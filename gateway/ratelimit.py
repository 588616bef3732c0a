"""Per-API-key requests-per-minute and tokens-per-minute limits, held in Redis.

The limit must hold however many gateway processes run, so the state lives in Redis and one Lua
script reads, decides and writes it atomically (a per-process pre-check would let the real limit
grow with the number of replicas). The algorithm is GCRA, the token bucket written as one
timestamp per limit (the "theoretical arrival time"): O(1) memory per key however high the limit
(a sliding log of a 200k-token TPM would not be), exact at window edges (a fixed window lets
twice the limit through around the boundary), an exact retry-after for free, and a cost per
request, so tokens use the same code as requests. A key may use its whole per-minute allowance
in a burst, then refills smoothly. Time is Redis's own clock (``TIME``), so gateways with skewed
clocks still agree. Both keys of a check share a hash tag, so the script works on Redis Cluster.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from redis.asyncio import Redis

# KEYS: requests state, tokens state. ARGV: rpm, tpm, tokens, period in microseconds.
# Returns {allowed, retry_after_us, reason}. A limit <= 0 is no limit. Nothing is written unless
# both limits allow, and every written key expires when its bucket would be full again.
_GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local rpm, tpm, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local period = tonumber(ARGV[4])
if tpm > 0 and tokens > tpm then
  return {0, 0, 'tokens-over-tpm'}
end
local function step(key, limit, cost)
  if limit <= 0 or cost <= 0 then
    return nil, 0
  end
  local tat = tonumber(redis.call('GET', key)) or now
  if tat < now then
    tat = now
  end
  -- Whole microseconds, rounded down so that exactly `limit` fits in one burst.
  local new_tat = tat + math.floor(cost * period / limit)
  return new_tat, new_tat - period - now
end
local r_tat, r_wait = step(KEYS[1], rpm, 1)
local t_tat, t_wait = step(KEYS[2], tpm, tokens)
if r_wait > 0 or t_wait > 0 then
  if r_wait >= t_wait then
    return {0, math.ceil(r_wait), 'rpm'}
  end
  return {0, math.ceil(t_wait), 'tpm'}
end
if r_tat then
  redis.call('SET', KEYS[1], string.format('%.0f', r_tat), 'PX', math.ceil((r_tat - now) / 1000) + 1)
end
if t_tat then
  redis.call('SET', KEYS[2], string.format('%.0f', t_tat), 'PX', math.ceil((t_tat - now) / 1000) + 1)
end
return {1, 0, 'ok'}
"""


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    retry_after_s: float
    """When a retry of the same request would pass; 0 when allowed, and 0 with reason
    ``tokens-over-tpm`` because then no wait helps (the request alone exceeds the TPM)."""
    reason: str
    """``ok``, ``rpm``, ``tpm`` or ``tokens-over-tpm``."""


class RateLimiter:
    """``period_s`` is the minute of "per minute"; tests shorten it to watch refills."""

    def __init__(self, redis: Redis, prefix: str = "slogate:rl:", period_s: float = 60.0) -> None:
        self._script = redis.register_script(_GCRA)
        self._prefix = prefix
        self._period_us = round(period_s * 1_000_000)

    def _keys(self, key_id: str) -> list[str]:
        # The braces make a Redis Cluster hash tag; an id that has braces itself is hashed so
        # that the tag stays whole.
        tag = key_id if "{" not in key_id and "}" not in key_id else hashlib.sha256(key_id.encode()).hexdigest()
        return [f"{self._prefix}{{{tag}}}:r", f"{self._prefix}{{{tag}}}:t"]

    async def check(self, key_id: str, rpm: int, tpm: int, tokens: int) -> RateDecision:
        """Count one request of ``tokens`` (prompt + max_tokens) against the key's limits, or
        count nothing and say when to retry. ``rpm``/``tpm`` of 0 mean unlimited."""
        allowed, retry_us, reason = await self._script(
            keys=self._keys(key_id), args=[rpm, tpm, max(tokens, 0), self._period_us]
        )
        reason = reason.decode() if isinstance(reason, bytes) else reason
        return RateDecision(bool(allowed), int(retry_us) / 1_000_000, reason)
