"""What a gateway process holds: its settings and its handles on Redis."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from aiohttp import web

from gateway.audit import AuditLog
from gateway.auth import KeyStore
from gateway.batcher import CommandBatcher
from gateway.metrics import GatewayMetrics
from gateway.ratelimit import RateLimiter
from gateway.results import ResultMux
from gateway.workers import WorkerDirectory
from policies.admission import AdmissionController
from slogate import keys
from slogate.config import Config
from slogate.crypto import Sealer


@dataclass
class GatewayState:
    cfg: Config
    redis: aioredis.Redis
    batcher: CommandBatcher
    mux: ResultMux
    directory: WorkerDirectory
    metrics: GatewayMetrics
    admission: AdmissionController
    keys: KeyStore
    limiter: RateLimiter
    sealer: Sealer
    audit: AuditLog
    draining: bool = False
    in_flight: int = 0
    started_at: float = field(default_factory=time.time)

    def cancel(self, request_id: str, deadline: float) -> None:
        """Tell whichever worker holds the request to stop: a key for workers that have not
        picked it up yet, a message for the one running it."""
        ttl_ms = int(max(1.0, deadline - time.time() + self.cfg.result_ttl_s) * 1000)
        self.batcher.fire("SET", keys.cancel(request_id), "1", "PX", ttl_ms)
        self.batcher.fire("PUBLISH", keys.CANCEL_CHANNEL, request_id)


STATE = web.AppKey("state", GatewayState)
