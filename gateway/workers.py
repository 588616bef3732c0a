"""The gateway's view of the live workers, refreshed from their heartbeat keys.

Heartbeats are keys with a TTL, so a worker that dies simply disappears; the gateway never
keeps its own list that could go stale. Reads happen on a timer (not per request), so the
cost of knowing the fleet is independent of the request rate.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from functools import cached_property

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from slogate import keys, protocol
from policies.predict import PoolSignals
from slogate.protocol import Heartbeat, ModelInfo

log = logging.getLogger("slogate.gateway")


@dataclass
class FleetView:
    """One read of the fleet; never changed after it is made, so what is derived from it is
    computed once per refresh rather than once per request."""

    heartbeats: list[Heartbeat] = field(default_factory=list)
    queue_depth: dict[str, int] = field(default_factory=dict)

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
    def backlog(self) -> dict[str, tuple[int, list[Heartbeat]]]:
        """Per pool: entries in its stream that no worker holds yet, and its workers."""
        out = {}
        for pool, depth in self.queue_depth.items():
            workers = self.by_pool.get(pool, [])
            out[pool] = (max(depth - sum(hb.running + hb.waiting for hb in workers), 0), workers)
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


class WorkerDirectory:
    def __init__(self, redis: aioredis.Redis, pools: list[str], poll_s: float = 0.5) -> None:
        self.redis = redis
        self.configured_pools = pools
        self.poll_s = poll_s
        self.view = FleetView()
        self.redis_ok = False
        self._enqueued: dict[str, int] = {}

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
            if self.redis_ok:
                log.error("Redis unreachable: %s", exc)
            self.redis_ok = False
            return
        self.view = FleetView(heartbeats, dict(zip(pools, depths)))
        self._enqueued = {}
        self.redis_ok = True

    def note_enqueued(self, pool: str) -> None:
        self._enqueued[pool] = self._enqueued.get(pool, 0) + 1

    def signals(self) -> dict[str, PoolSignals]:
        """Each pool's backlog that no worker has taken yet, plus what this gateway queued since
        the last read: a burst is judged on the queue it builds, not on a stale, empty one."""
        return {pool: PoolSignals(pool, backlog + self._enqueued.get(pool, 0), workers)
                for pool, (backlog, workers) in self.view.backlog.items()}

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.poll_s)

    def ready(self) -> tuple[bool, str]:
        if not self.redis_ok:
            return False, "Redis is unreachable"
        live = self.view.by_pool
        missing = [p for p in self.configured_pools if not live.get(p)]
        if missing:
            return False, f"no live worker in pool(s): {', '.join(missing)}"
        return True, "ok"
