"""The gateway's view of the live workers, refreshed from their heartbeat keys.

Heartbeats are keys with a TTL, so a worker that dies simply disappears; the gateway never
keeps its own list that could go stale. Their names are in a set (``keys.WORKERS``) that the
gateways prune of expired ones, so a read costs the same however many other keys Redis holds.
Reads happen on a timer (not per request), so the cost of knowing the fleet is independent of
the request rate.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, RedisError

from gateway.errors import acl_refusal, acl_refused
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
"""How long one read of the fleet may wait for Redis (it takes about a millisecond) before
the gateway counts Redis as unreachable."""

_FORGET_EXPIRED = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then redis.call('SREM', KEYS[1], KEYS[i]) end
end
"""
"""Drop from the set the heartbeat keys that expired, unless the worker renewed one since it
was read (it adds its name back at each beat anyway). Run when one expired, and also as a probe
of the ACL (see ``PROBE_EVERY_S``): the gateway's audit trail, rate limits and stream slots are
scripts as well, and a Redis user refused them makes the gateway unready (``refused``), not only
once a worker dies. The probe also loads it and runs it by its SHA, with nothing to drop: the
rate limiter's script runs as redis-py's scripts do (EVALSHA, and SCRIPT LOAD when Redis lacks
it), and a user refused those would otherwise be ready, and fail the requests of every key."""
_FORGET_EXPIRED_SHA = hashlib.sha1(_FORGET_EXPIRED.encode()).hexdigest()

PROBE_EVERY_S = 30.0
"""How often a read probes the ACL with the scripting commands (EVAL, SCRIPT LOAD, EVALSHA) when
nothing calls for it sooner; a read probes too when it is the first, and when the one before was
refused or failed (so that a recovery shows at the next read). An ACL tightened at run time, or
another one after a failover, shows within this time. An idle gateway's other reads send
SMEMBERS, MGET and an XLEN per pool, and nothing else."""


class WorkerDirectory:
    def __init__(self, redis: aioredis.Redis, pools: list[str], poll_s: float = 0.5,
                 heartbeat_ttl_s: float = 3.0) -> None:
        self.redis = redis
        self.configured_pools = pools
        self.poll_s = poll_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        """The TTL of a heartbeat that does not say its own (``Heartbeat.ttl_s``)."""
        self.view = FleetView()
        self._view_read_at = 0.0
        """When (monotonic) the read that made ``view`` began."""
        self.missing: dict[tuple[str, str], tuple[float, float]] = {}
        """Each worker (pool, id) of an earlier read that the reads since lack, until it is back
        or gone: when (monotonic) the last read that had it began, and when it counts as gone (its
        own TTL after the first read without it). Just after Redis restarted empty every worker is
        missing until its next beat, which one that beats slower than this gateway expects sends
        well after this gateway's TTL: until then, what it holds is not known."""
        self._read_ok = False
        self._reading_since: float | None = None
        """When (monotonic) the read of the fleet under way started; None between reads."""
        self._said_down = False
        """Whether the log says Redis is unreachable, so each outage is one line, from the first
        read on (a gateway started without Redis says so), and so is each recovery."""
        self.refused: str | None = None
        """What Redis's ACL refused this gateway's user at the last read; None if nothing."""
        self._probed_at: float | None = None
        """When (monotonic) the last probe of the ACL that succeeded began; None before the first
        read and after one that was refused or failed."""
        self.newest: dict[tuple[str, str], float] = {}
        """The newest heartbeat time (``Heartbeat.ts``, by the worker's own clock) read of each
        worker (pool, id) present or missing, by which a beat from a Redis that lags is told."""
        self.own = InFlight()
        """This gateway's requests in flight; the request handlers start and end them."""
        self.unserved_since: dict[str, float] = {}
        """Since when (monotonic) each pool without a live worker has had none."""

    async def refresh(self) -> bool:
        """Read the fleet; False when Redis did not answer."""
        self._reading_since = started = time.monotonic()
        try:
            names = sorted(await self.redis.smembers(keys.WORKERS))
            raw = await self.redis.mget(names) if names else []
            heartbeats = []
            for data in raw:
                if data is None:
                    continue
                try:
                    heartbeats.append(protocol.decode_heartbeat(data))
                except protocol.ProtocolError as exc:
                    log.warning("ignoring a heartbeat this gateway cannot read: %s", exc)
            # A pool seen once stays: one whose last worker died is still watched (``unserved_since``).
            pools = sorted({*self.configured_pools, *self.view.queue_depth, *(hb.pool for hb in heartbeats)})
            expired = [name for name, data in zip(names, raw) if data is None]
            probe = self._probed_at is None or started - self._probed_at >= PROBE_EVERY_S
            async with self.redis.pipeline(transaction=False) as p:
                for pool in pools:
                    p.xlen(keys.queue(pool))
                if expired or probe:
                    p.eval(_FORGET_EXPIRED, 1 + len(expired), keys.WORKERS, *expired)
                if probe:
                    p.script_load(_FORGET_EXPIRED).evalsha(_FORGET_EXPIRED_SHA, 1, keys.WORKERS)
                depths = (await p.execute())[:len(pools)]
        except NoPermissionError as exc:
            refusal = acl_refusal(exc)
            if self.refused is None:
                log.error("%s", acl_refused(refusal))
            self._read_ok, self._reading_since, self.refused, self._probed_at = False, None, refusal, None
            return False
        except (RedisError, OSError) as exc:
            if not self._said_down:
                log.error("Redis unreachable: %s", exc)
            # Not the ACL's doing: readiness says Redis is down, and a refusal found once it is back is logged again.
            self._read_ok, self._reading_since, self._said_down, self.refused = False, None, True, None
            self._probed_at = None
            return False
        if probe:
            self._probed_at = started
        now = time.monotonic()
        self._note_missing(heartbeats, now)
        self._note_newest(heartbeats)
        self.view = FleetView(heartbeats, dict(zip(pools, depths)),
                              {pool: self.own.count(pool) for pool in pools})
        self._view_read_at = started
        for pool in pools:
            if self.view.by_pool.get(pool):
                self.unserved_since.pop(pool, None)
            else:
                self.unserved_since.setdefault(pool, now)
        if self._said_down:
            log.info("Redis reachable again")
        if self.refused is not None:
            log.info("Redis's ACL allows this gateway's user what it needs again")
        self._read_ok, self._reading_since, self._said_down, self.refused = True, None, False, None
        return True

    def _note_missing(self, heartbeats: list[Heartbeat], now: float) -> None:
        """Update ``missing`` from a read made at ``now``, before it replaces ``view``."""
        present = {(hb.pool, hb.worker_id) for hb in heartbeats}
        for hb in self.view.heartbeats:
            if (hb.pool, hb.worker_id) not in present:
                self.missing.setdefault((hb.pool, hb.worker_id),
                                        (self._view_read_at, now + (hb.ttl_s or self.heartbeat_ttl_s)))
        self.missing = {w: seen for w, seen in self.missing.items() if w not in present and seen[1] > now}

    def _note_newest(self, heartbeats: list[Heartbeat]) -> None:
        """Update ``newest`` from a read, after ``missing``: a worker neither present nor missing
        is gone, and forgotten."""
        newest = {w: ts for w, ts in self.newest.items() if w in self.missing}
        for hb in heartbeats:
            worker = (hb.pool, hb.worker_id)
            newest[worker] = max(hb.ts, self.newest.get(worker, 0.0))
        self.newest = newest

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
        """Whether the last read of the fleet succeeded and none has been waiting for Redis
        longer than ``STALE_AFTER_S``: a frozen Redis fails no read until the commands' read
        timeout (``redis_timeout_s``, 5 s by default), and until then the gateway would say it
        is ready and queue requests nobody can take."""
        since = self._reading_since
        return self._read_ok and (since is None or time.monotonic() - since <= STALE_AFTER_S)

    async def run(self, after_refresh: Callable[[], None] | None = None) -> None:
        """Refresh every ``poll_s``, calling ``after_refresh`` after each read that succeeded
        (what it acts on is then current)."""
        while True:
            if await self.refresh() and after_refresh is not None:
                after_refresh()
            await asyncio.sleep(self.poll_s)

    def ready(self) -> tuple[bool, str]:
        if self.refused is not None:
            return False, acl_refused(self.refused)
        if not self.redis_ok:
            return False, "Redis is unreachable"
        live = self.view.by_pool
        missing = [p for p in self.configured_pools if not live.get(p)]
        if missing:
            return False, f"no live worker in pool(s): {', '.join(missing)}"
        return True, "ok"
