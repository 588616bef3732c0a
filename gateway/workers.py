"""The gateway's view of the live workers, refreshed from their heartbeat keys.

Heartbeats are keys with a TTL, so a worker that dies simply disappears; the gateway never
keeps its own list that could go stale. Reads happen on a timer (not per request), so the
cost of knowing the fleet is independent of the request rate.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from policies.inflight import InFlight
from policies.predict import PoolSignals
from slogate import keys, protocol
from slogate.protocol import Heartbeat, ModelInfo

log = logging.getLogger("slogate.gateway")


@dataclass
class FleetView:
    """One read of the fleet; never changed after it is made, so what is derived from it is
    computed once per refresh rather than once per request."""

    heartbeats: list[Heartbeat] = field(default_factory=list)
    queue_depth: dict[str, int] = field(default_factory=dict)
    """Entries in each pool's stream: queued or being served (workers delete them when done)."""
    own_at_read: dict[str, int] = field(default_factory=dict)
    """This gateway's own in-flight count per pool when the lengths were read."""

    @cached_property
    def by_pool(self) -> dict[str, list[Heartbeat]]:
        out: dict[str, list[Heartbeat]] = {}
        for hb in self.heartbeats:
            out.setdefault(hb.pool, []).append(hb)
        return out

    @cached_property
    def models(self) -> dict[str, ModelInfo]:
        """Each served model with the smallest context any of its workers allows."""
        out: dict[str, ModelInfo] = {}
        for hb in self.heartbeats:
            for m in hb.models:
                known = out.get(m.id)
                if known is None or m.max_context < known.max_context:
                    out[m.id] = m
        return out

    @cached_property
    def _serving(self) -> dict[str, list[str]]:
        pools: dict[str, set[str]] = {}
        for hb in self.heartbeats:
            for m in hb.models:
                pools.setdefault(m.id, set()).add(hb.pool)
        return {model: sorted(p) for model, p in pools.items()}

    def pools_serving(self, model: str) -> list[str]:
        return self._serving.get(model, [])


STALE_AFTER_S = 2.0
"""How long the fleet view may go without a successful read (at the default poll, 4 missed
reads) before the gateway counts Redis as unreachable."""


class WorkerDirectory:
    def __init__(self, redis: aioredis.Redis, pools: list[str], poll_s: float = 0.5) -> None:
        self.redis = redis
        self.configured_pools = pools
        self.poll_s = poll_s
        self.view = FleetView()
        self._read_at = -math.inf
        """When (monotonic) the last read of the fleet succeeded."""
        self._said_down = False
        """Whether the log says Redis is unreachable, so each outage is one line, from the first
        read on (a gateway started without Redis says so), and so is each recovery."""
        self.own = InFlight()
        """This gateway's requests in flight; the request handlers start and end them."""
        self.unserved_since: dict[str, float] = {}
        """Since when (monotonic) each pool without a live worker has had none."""

    async def refresh(self) -> None:
        try:
            names = [k async for k in self.redis.scan_iter(match=keys.HEARTBEAT_PATTERN, count=1000)]
            raw = await self.redis.mget(names) if names else []
            heartbeats = []
            for data in raw:
                if data is None:
                    continue
                try:
                    heartbeats.append(protocol.decode_heartbeat(data))
                except protocol.ProtocolError as exc:
                    log.warning("ignoring a heartbeat this gateway cannot read: %s", exc)
            pools = sorted({*self.configured_pools, *(hb.pool for hb in heartbeats)})
            async with self.redis.pipeline(transaction=False) as p:
                for pool in pools:
                    p.xlen(keys.queue(pool))
                depths = await p.execute()
        except (RedisError, OSError) as exc:
            if not self._said_down:
                log.error("Redis unreachable: %s", exc)
            self._read_at, self._said_down = -math.inf, True
            return
        self.view = FleetView(heartbeats, dict(zip(pools, depths)),
                              {pool: self.own.count(pool) for pool in pools})
        now = time.monotonic()
        for pool in pools:
            if self.view.by_pool.get(pool):
                self.unserved_since.pop(pool, None)
            else:
                self.unserved_since.setdefault(pool, now)
        if self._said_down:
            log.info("Redis reachable again")
        self._read_at, self._said_down = time.monotonic(), False

    def signals(self) -> dict[str, PoolSignals]:
        """Each pool's requests in flight: this gateway's own, counted as they start and end,
        plus the other gateways' as the last read of the stream's length left them."""
        view, mine = self.view, self.own
        out = {}
        for pool, length in view.queue_depth.items():
            others = max(length - view.own_at_read.get(pool, 0), 0)
            out[pool] = PoolSignals(pool, mine.count(pool) + others, view.by_pool.get(pool, []), mine.ends(pool))
        return out

    @property
    def redis_ok(self) -> bool:
        """Whether Redis answered the fleet read lately. Not just whether the last read failed:
        a frozen Redis fails no read until the client's socket timeout (5 s), and until then the
        gateway would say it is ready and queue requests nobody can take."""
        return time.monotonic() - self._read_at <= max(STALE_AFTER_S, 4 * self.poll_s)

    async def run(self, after_refresh: Callable[[], None] | None = None) -> None:
        while True:
            await self.refresh()
            if after_refresh is not None:
                after_refresh()
            await asyncio.sleep(self.poll_s)

    def ready(self) -> tuple[bool, str]:
        if not self.redis_ok:
            return False, "Redis is unreachable"
        live = self.view.by_pool
        missing = [p for p in self.configured_pools if not live.get(p)]
        if missing:
            return False, f"no live worker in pool(s): {', '.join(missing)}"
        return True, "ok"
