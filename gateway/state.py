"""What a gateway process holds: its settings and its handles on Redis."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web

from gateway.audit import AuditLog
from gateway.auth import KeyStore
from gateway.batcher import CommandBatcher
from gateway.errors import APIError, acl_refused
from gateway.holds import HoldLine
from gateway.metrics import GatewayMetrics
from gateway.ratelimit import RateLimiter
from gateway.results import ResultMux
from gateway.workers import WorkerDirectory
from policies.admission import AdmissionController
from slogate import keys, protocol
from slogate.config import Config
from slogate.crypto import Sealer

log = logging.getLogger("slogate.gateway")


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
    handling: int = 0
    """Requests past the draining check, at any stage (a body still arriving, admission, queued,
    answering): a drain waits for them all."""
    in_flight: int = 0
    holds: HoldLine = field(default_factory=HoldLine)
    """Batch requests held back before queueing (``gateway.admit``): a drain wakes them, and
    waits for them too."""
    started_at: float = field(default_factory=time.time)
    unsent_cancels: dict[str, float] = field(default_factory=dict)
    """Cancels Redis has not taken yet: request id -> its deadline, when they stop."""
    cancel_retries: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    closing: bool = False
    """Shutting down: a cancel Redis refuses is not sent again (``send_cancels_now``)."""
    cutting_off: bool = False
    """Set as aiohttp's shutdown begins, after the grace and the second that follows it, in which
    what is still open takes its 503 ``shutting_down``: aiohttp then waits for the open handlers
    half a second more (``shutdown_timeout``) and cancels those still open (``cut_off``)."""

    def cut_off(self, request: web.Request) -> bool:
        """Whether the gateway ended ``request``, whose handler was cancelled, and it is counted as
        its 503 ``shutting_down``: once ``cutting_off`` (a stream whose client stopped reading: its
        write never completes), unless its client closed the connection first, in aiohttp's last
        wait too. A handler cancelled before was cancelled by its client leaving (a 499)."""
        return self.cutting_off and not getattr(request.protocol, "closed_by_client", False)

    def redis_trouble(self) -> str | None:
        """Why Redis can serve no request now, as readiness and a refused request say it: it is
        unreachable, or its ACL refuses the fleet read or the reply reader a command; None if
        neither."""
        directory = self.directory
        if directory.refused is not None:
            return acl_refused(directory.refused)
        if not directory.redis_ok:
            return "Redis is unreachable"
        return self.mux.refusal()

    def drain(self) -> None:
        """Take no new requests; the held ones learn it at once, not at their next look."""
        self.draining = True
        self.holds.wake_all()

    def fail_unserved(self) -> None:
        """End the requests of a pool that has had no live worker for ``workerless_grace_s``
        (counted from the later of the pool's loss and the request's start), with a 503, and
        cancel them, so a worker that comes later skips them. A worker that restarts within the
        grace takes them over; past it, a client would otherwise wait to its deadline (an hour
        for batch) with nothing sent."""
        grace = self.cfg.workerless_grace_s
        cutoff = time.monotonic() - grace
        for pool, since in self.directory.unserved_since.items():
            if since > cutoff:
                continue
            failed = self.mux.fail_all(f"pool '{pool}' has had no live worker for {grace:g} s; the request was "
                                       "cancelled; retry once a worker serves the pool", "no_live_worker",
                                       pool, cutoff)
            if failed:
                log.warning("ended %d engine request(s) (a request's choices are one each) of pool %r with 503: "
                            "no live worker for %g s", failed, pool, grace)

    def fail_lost(self) -> None:
        """After Redis lost its queues (:class:`gateway.results.Loss`), end with a 503 each
        request that had heard nothing and that no worker holds: it was queued and not yet read,
        and would wait for its deadline. Decided from a read of the fleet at least
        ``heartbeat_ttl_s`` after the loss was found, and once each worker seen before it is back
        or gone (``WorkerDirectory.missing``, by that worker's own TTL): one that beats slower than
        this gateway expects, or late, may be running requests that hear nothing until their
        answer. A pool with a worker of a release that does not say what it holds keeps its
        requests waiting, as before. Nor is a worker's heartbeat taken for what it holds unless it is
        newer than those read of it before: after a failover to a replica that lagged, the one
        there may be from before the worker took the requests it runs (or ended others).
        Decided once each worker beats again, or its beat from the replica expires."""
        loss = self.mux.loss
        if loss is None:
            return
        if loss.newest_before is None:
            loss.newest_before = dict(self.directory.newest)
        if time.monotonic() - loss.found_at < self.cfg.heartbeat_ttl_s:
            return
        if any(seen_at < loss.found_at for seen_at, _ in self.directory.missing.values()):
            return
        beats = [hb for hbs in self.directory.view.by_pool.values() for hb in hbs]
        if any(hb.ts and hb.ts <= loss.newest_before.get((hb.pool, hb.worker_id), 0.0) for hb in beats):
            return
        self.mux.loss = None
        held = {rid for hb in beats for rid in hb.held or ()}
        unsaid = {hb.pool for hb in beats if hb.held is None}
        lost = [sub for sub in self.mux.unheard(loss.since)
                if sub.pool not in unsaid and sub.request_id[:protocol.HELD_ID_CHARS] not in held]
        failed = self.mux.fail(lost, "Redis lost the request before a worker took it (it restarted empty or "
                                     "failed over); retry the request", "redis_unavailable")
        if failed:
            log.warning("ended %d engine request(s) (a request's choices are one each) with 503: Redis lost them "
                        "from its queues, and no worker holds them", failed)

    def after_refresh(self) -> None:
        """What the directory runs after each read of the fleet: both look at the workers."""
        self.fail_unserved()
        self.fail_lost()

    def cancel(self, request_id: str, deadline: float) -> None:
        """Tell whichever worker holds the request to stop: a key for workers that have not
        picked it up yet (and for one that lost the channel a while), a message for the one
        running it. Sent again each second until Redis takes it or the deadline passes: a
        request cancelled during an outage would otherwise run to its end for nobody. A cancel
        of a request whose cancel is still being sent is that one: sent too, it would start a
        second chain of re-sends."""
        if request_id in self.unsent_cancels:
            return
        self.unsent_cancels[request_id] = deadline
        self._send_cancel(request_id, deadline)

    def _send_cancel(self, request_id: str, deadline: float) -> None:
        self.cancel_retries.pop(request_id, None)
        ttl_ms = int(max(1.0, deadline - time.time() + self.cfg.result_ttl_s) * 1000)
        flagged = self.batcher.call("SET", keys.cancel(request_id), "1", "PX", ttl_ms)
        self.batcher.fire("PUBLISH", keys.CANCEL_CHANNEL, request_id)
        flagged.add_done_callback(lambda fut: self._cancel_again(fut, request_id, deadline))

    def _cancel_again(self, flagged: asyncio.Future[Any], request_id: str, deadline: float) -> None:
        if flagged.cancelled() or flagged.exception() is None or time.time() >= deadline:
            self.unsent_cancels.pop(request_id, None)
        elif not self.closing:
            self.cancel_retries[request_id] = asyncio.get_running_loop().call_later(
                CANCEL_RETRY_S, self._send_cancel, request_id, deadline)

    def send_cancels_now(self) -> None:
        """At shutdown: each cancel waiting for its retry goes at once, and none after it. The
        retries ran until their requests' deadlines, an hour for batch, and while Redis hung
        they held the gateway's exit as long (``CommandBatcher.drain``); left pending, they were
        dropped without a word. ``log_unsent_cancels`` says what Redis did not take."""
        self.closing = True
        for request_id, retry in list(self.cancel_retries.items()):
            retry.cancel()
            self._send_cancel(request_id, self.unsent_cancels[request_id])

    def log_unsent_cancels(self) -> None:
        """Once the last commands had their replies: the cancels Redis did not take, in one line."""
        if self.unsent_cancels:
            log.warning("%d cancel(s) could not be sent to Redis before the gateway stopped: the workers stop "
                        "those requests once they find this gateway gone", len(self.unsent_cancels))


CANCEL_RETRY_S = 1.0

STATE = web.AppKey("state", GatewayState)

REQUEST_ID = web.RequestKey("request_id", str)
AUDIT = web.RequestKey("audit", dict[str, Any])
"""What the request's audit record says beyond its status: filled in as the request goes."""
COUNTED = web.RequestKey("counted", bool)
"""Queued, so counted in ``slogate_requests_total`` by its outcome and not as refused."""
STREAM_ERROR = web.RequestKey("stream_error", APIError)
"""An error sent inside a stream whose status already said 200, for the request's span."""
