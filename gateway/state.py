"""What a gateway process holds: its settings and its handles on Redis."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

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
    held: int = 0
    """Batch requests held back before queueing (``gateway.admit``): a drain waits for them too."""
    started_at: float = field(default_factory=time.time)

    def cancel(self, request_id: str, deadline: float) -> None:
        """Tell whichever worker holds the request to stop: a key for workers that have not
        picked it up yet (and for one that lost the channel a while), a message for the one
        running it. Sent again each second until Redis takes it or the deadline passes: a
        request cancelled during an outage would otherwise run to its end for nobody."""
        ttl_ms = int(max(1.0, deadline - time.time() + self.cfg.result_ttl_s) * 1000)
        flagged = self.batcher.call("SET", keys.cancel(request_id), "1", "PX", ttl_ms)
        self.batcher.fire("PUBLISH", keys.CANCEL_CHANNEL, request_id)
        flagged.add_done_callback(lambda fut: self._cancel_again(fut, request_id, deadline))

    def _cancel_again(self, flagged: asyncio.Future[Any], request_id: str, deadline: float) -> None:
        if flagged.cancelled() or flagged.exception() is None or time.time() >= deadline:
            return
        asyncio.get_running_loop().call_later(CANCEL_RETRY_S, self.cancel, request_id, deadline)


CANCEL_RETRY_S = 1.0

STATE = web.AppKey("state", GatewayState)
