"""Every result a gateway waits for arrives on one stream of its own, read by one blocking XREAD.

Workers append the records for this gateway's requests (deltas, final records) to the reply
stream named in the request, each tagged with its request id, all that one worker writes at
once in one entry. One stream per gateway instead of one per request means
a read costs the same whatever the number of open requests, no command creates or deletes a
per-request key, and a request that starts never has to wake a reader blocked on a key set
that did not include it. Read entries are trimmed; the stream expires if its gateway dies.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, RedisError

from gateway.batcher import CommandBatcher
from gateway.errors import acl_refusal, acl_refused
from slogate import keys, protocol
from slogate.crypto import Sealer, SealError
from slogate.protocol import Error, Result

log = logging.getLogger("slogate.gateway")

READING = "reading this gateway's reply stream"
RENEWING = "renewing this gateway's alive key"
TRIMMING = "trimming this gateway's reply stream"
"""The reply reader's commands, as its log, readiness and a failed request name them."""


def _refused(what: str, refusal: str) -> str:
    return f"{what} failed: {acl_refused(refusal)}"


def _entry_id(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


class Quiet:
    """Queued in place of a record when a stream has heard nothing for ``keep_alive_s``."""


QUIET = Quiet()


@dataclass
class Subscription:
    request_id: str
    keep_alive: bool = False
    """Whether it hears ``QUIET`` when no record comes (streams: they send an SSE comment)."""
    records: asyncio.Queue[Result | Quiet] = field(default_factory=asyncio.Queue)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once a record is queued: a stream waits for it before it answers (``STREAM_HOLD_S``)."""
    heard_at: float = field(default_factory=time.monotonic)
    pool: str = ""
    """The pool its request was queued on: a pool left without workers fails its own requests."""
    since: float = field(default_factory=time.monotonic)
    failed: bool = False
    """Ended by the gateway (``fail_all``): one error record is its answer, not one a pass."""


@dataclass
class Loss:
    """Redis lost what it held (``alive`` found gone between two renewals: it restarted empty,
    or a replica that lagged took over). The requests subscribed by ``since`` (monotonic) that
    have heard nothing may be in no queue; which of them a worker holds, the workers' next
    heartbeats tell (:meth:`gateway.state.GatewayState.fail_lost`)."""

    since: float
    found_at: float = field(default_factory=time.monotonic)
    newest_before: dict[tuple[str, str], float] | None = None
    """Each worker's newest heartbeat time this gateway had read when it first looked at the loss
    (``WorkerDirectory.newest``): a beat no newer may come from a replica that lagged, and says
    what the worker held before the loss."""


class ResultMux:
    def __init__(self, redis: aioredis.Redis, batcher: CommandBatcher, sealer: Sealer,
                 block_ms: int = 1000, count: int = 1024, trim_every_s: float = 1.0,
                 keep_alive_s: float = 15.0, redis_grace_s: float = 3.0, alive_ttl_s: float = 5.0) -> None:
        self.redis = redis
        self.batcher = batcher
        self.sealer = sealer
        self.block_ms = block_ms
        self.count = count
        self.trim_every_s = trim_every_s
        self.keep_alive_s = keep_alive_s
        self.redis_grace_s = redis_grace_s
        self.alive_ttl_s = alive_ttl_s
        """How long ``alive`` outlives its last renewal (``Config.alive_ttl_s``)."""
        gateway_id = uuid.uuid4().hex
        self.key = keys.replies(gateway_id)
        self.alive = keys.alive(gateway_id)
        self._last = b"0-0"
        self._trimmed_at = 0.0
        self._trimmed_to: bytes | None = None
        """The id the last XTRIM sent trimmed to, so that a stream nothing was read from since is
        trimmed no more; None before the first, and after one that failed."""
        self._ticked_at = 0.0
        self._set_at: float | None = None
        """When (monotonic) the last renewal known to have set ``alive`` was sent; None before
        the first, and once all requests failed. ``alive`` found missing within ``alive_ttl_s``
        of it means Redis lost it; later, it may have expired (this gateway stalled, or Redis
        refused the renewals while out of memory) with the queues intact."""
        self._failing_since: float | None = None
        self._broken_at: float | None = None
        """When the reader last found Redis gone, until a renewal once it reads again: requests
        subscribed since were queued on the Redis that came back, or failed to queue."""
        self.loss: Loss | None = None
        self.refused: dict[str, str] = {}
        """What Redis's ACL refused this gateway's user at each of the reader's commands' last
        try (``READING``, ``RENEWING``, ``TRIMMING``). The fleet read uses none of them, yet one
        refused fails every request: nothing reads its records, the workers take a gateway whose
        ``alive`` lapsed for gone, or the stream grows for as long as the gateway runs."""
        self._subs: dict[bytes, Subscription] = {}

    def subscribe(self, request_id: str, keep_alive: bool = False, pool: str = "") -> Subscription:
        sub = Subscription(request_id, keep_alive, pool=pool)
        self._subs[request_id.encode()] = sub
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Records that still arrive for it (a cancelled request's last step) are dropped."""
        self._subs.pop(sub.request_id.encode(), None)

    async def run(self) -> None:
        while True:
            self._tick()
            try:
                resp = await self.redis.xread({self.key: self._last}, count=self.count, block=self.block_ms)
                if not resp and self._last != b"0-0" and self._subs:
                    await self._check_position()
            except (RedisError, OSError) as exc:
                now = time.monotonic()
                self._last = b"0-0"  # Redis may come back failed over (``_check_position``): read the stream whole
                self._note(READING, exc)
                if self._failing_since is None:
                    self._failing_since = now
                    self._broken_at = self._broken_at or now
                    if READING not in self.refused:
                        log.warning("reading results from Redis failed (requests in flight fail if it lasts %g s): "
                                    "%s", self.redis_grace_s, exc)
                self._ticked_at = 0.0  # renew ``alive`` as soon as Redis is back: workers take a gap for a death
                if now - self._failing_since >= self.redis_grace_s:
                    refusal = self.refused.get(READING)
                    self.fail_all("lost the connection to Redis" if refusal is None else _refused(READING, refusal),
                                  "redis_unavailable")
                    self._set_at = None  # all failed: ``alive`` found gone once Redis is back loses none
                await asyncio.sleep(0.2)
                continue
            self._note(READING, None)
            if self._failing_since is not None:
                self._failing_since = None
                await self._drop_stale_connections()
            for _, entries in resp or ():
                for entry_id, fields in entries:
                    self._route(entry_id, fields)
                self._last = entries[-1][0]
            self._trim()

    async def _check_position(self) -> None:
        """Called after a read found nothing while requests wait: with none, nothing can be
        missed, and the first to come is checked for at the next empty read. Entry ids come
        from the clock of the Redis that writes them: after a failover to a host whose clock is
        behind, the new stream's entries are below the last id read, and reading after that id
        skipped them. A stream whose newest entry is below it, or that is gone (it expires when
        idle), is read from its start; a record read twice is dropped by its offset
        (:class:`gateway.relay.Relay`)."""
        newest = await self.redis.xrevrange(self.key, count=1)
        if newest and _entry_id(newest[0][0]) >= _entry_id(self._last):
            return
        if newest:
            log.warning("the reply stream's newest entry %s is older than the last one read, %s (Redis failed over "
                        "to a host whose clock is behind?): reading it from its start", newest[0][0].decode(),
                        self._last.decode())
        self._last = b"0-0"

    def _note(self, what: str, exc: BaseException | None) -> None:
        """Keep what the ACL refused ``what`` (``exc``: how its last try failed; None if it did
        not), and log each refusal once, and once more when it is over."""
        refusal = acl_refusal(exc) if isinstance(exc, NoPermissionError) else None
        if refusal == self.refused.get(what):
            return
        if refusal is None:
            del self.refused[what]
            log.info("Redis's ACL allows this gateway's user %s again", what)
        else:
            self.refused[what] = refusal
            log.error("%s", _refused(what, refusal))

    def refusal(self) -> str | None:
        """The first of ``refused``, as readiness and a refused request say it; None if none."""
        return next((_refused(what, refusal) for what, refusal in self.refused.items()), None)

    async def _drop_stale_connections(self) -> None:
        """After an outage, the commands' idle pooled connections may all be dead (a Redis that
        restarted closed them): each would fail the first request to draw it, as a 503."""
        try:
            await self.batcher.redis.connection_pool.disconnect(inuse_connections=False)
        except (RedisError, OSError) as exc:  # the reader must go on whatever closing them says
            log.warning("closing the idle Redis connections after an outage failed: %s", exc)

    def _tick(self) -> None:
        """About once a second (this loop wakes at least once a ``block_ms``): renew ``alive``
        (``alive_ttl_s``), and tell the streams that have heard nothing for ``keep_alive_s``, so
        that they write a comment before a proxy that cuts idle connections (60 s is common)
        cuts a queued or slow stream."""
        now = time.monotonic()
        if now - self._ticked_at < min(1.0, self.keep_alive_s):
            return
        self._ticked_at = now
        self.batcher.call("SET", self.alive, b"1", "PX", round(self.alive_ttl_s * 1000), "GET").add_done_callback(
            functools.partial(self._renewed, now))
        quiet_since = now - self.keep_alive_s
        for sub in self._subs.values():
            if sub.keep_alive and sub.heard_at <= quiet_since:
                sub.heard_at = now
                sub.records.put_nowait(QUIET)

    def _renewed(self, sent: float, done: asyncio.Future[bytes | None]) -> None:
        """``alive`` gone though a renewal sent before this one, less than its TTL ago, set it:
        Redis lost what it held, and a request that has heard nothing may be in no queue, and
        would wait for its deadline, an hour for batch. Gone later than that, it may only have
        expired, and the requests still queued are served as ever."""
        if done.cancelled():
            return
        self._note(RENEWING, done.exception())
        if done.exception() is not None:
            return
        set_at, self._set_at = self._set_at, max(self._set_at or sent, sent)
        lost = set_at is not None and set_at < sent and time.monotonic() - set_at < self.alive_ttl_s
        if done.result() is None and lost and self.loss is None:
            self.loss = Loss(self._broken_at or time.monotonic())
            log.warning("this gateway's alive key was gone from Redis (restarted empty?): the requests no worker "
                        "holds will be failed with a 503 to retry once the workers have said what they hold")
        if self._failing_since is None:
            self._broken_at = None

    def _trim(self) -> None:
        """Drop what has been read since the last trim, at most once a ``trim_every_s``: the
        stream holds only records in flight, and XTRIM stays off the per-request path. Sent
        before anything was read as well, so that a refusal of it shows from the start, and
        again after one that failed, so that the end of a refusal shows too."""
        now = time.monotonic()
        if self._last != self._trimmed_to and now - self._trimmed_at >= self.trim_every_s:
            self._trimmed_at, self._trimmed_to = now, self._last
            self.batcher.call("XTRIM", self.key, "MINID", self._last).add_done_callback(self._trimmed)

    def _trimmed(self, done: asyncio.Future[int]) -> None:
        if done.cancelled():
            return
        self._note(TRIMMING, done.exception())
        if done.exception() is not None:
            self._trimmed_to = None

    def _route(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            records = protocol.decode_batch(fields[protocol.BATCH_FIELD])
        except (protocol.ProtocolError, KeyError) as exc:
            log.error("dropping unreadable reply entry %s: %s", entry_id, exc)
            return
        now = time.monotonic()
        for request_id, sealed in records:
            sub = self._subs.get(request_id)
            if sub is not None:
                sub.records.put_nowait(self._decode(sub, sealed))
                sub.arrived.set()
                sub.heard_at = now

    def _decode(self, sub: Subscription, sealed: bytes) -> Result:
        try:
            return protocol.decode_result(self.sealer.open(sealed, sub.request_id.encode()))
        except (protocol.ProtocolError, SealError) as exc:
            log.error("unreadable result record: %s", exc)
            return Error(f"a worker sent a record this gateway cannot read ({exc})",
                         "protocol_mismatch", 502, attempt=0)

    def fail_all(self, message: str, code: str, pool: str | None = None, since: float | None = None) -> int:
        """End every waiting request (of ``pool``, subscribed by ``since`` on the monotonic
        clock, if given) with a 503 of the gateway's own (attempt 0: the workers are told to stop
        them). Returns how many."""
        return self.fail([sub for sub in self._subs.values()
                          if (pool is None or sub.pool == pool) and (since is None or sub.since <= since)],
                         message, code)

    def fail(self, subs: list[Subscription], message: str, code: str) -> int:
        failed = 0
        for sub in subs:
            if not sub.failed:
                sub.failed = True
                sub.records.put_nowait(Error(message, code, 503, attempt=0))
                sub.arrived.set()
                failed += 1
        return failed

    def unheard(self, since: float) -> list[Subscription]:
        """The waiting requests subscribed by ``since`` that no record has reached."""
        return [sub for sub in self._subs.values() if not sub.arrived.is_set() and sub.since <= since]

    async def close(self) -> None:
        """Delete the stream and ``alive`` through the commands' connections, whose reads time
        out: the reader's has no read timeout (``slogate.config.redis_keepalive``), and a Redis
        that stopped answering held the gateway's exit on it for good (over a Unix socket no
        keepalive probe ever breaks it). Left behind, both expire."""
        try:
            await self.batcher.call("DEL", self.key, self.alive)
        except (RedisError, OSError):
            pass
