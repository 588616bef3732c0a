"""The audit trail: one record per completion request, in a Redis stream of bounded length
(about ``audit_max_entries`` records, however they were batched).

It says who (API key id, never the secret), when, which model and class, what admission
decided, tokens in and out and the outcome; never prompt or completion text. ``request_id`` is
the client's ``x-request-id`` when it sent one, for finding a request by the client's own id;
``id``, the id of the answer (``chatcmpl-...``), is the gateway's and unique to a request that
was queued, so a client cannot repeat or forge it. Records are
gathered for up to ``flush_s`` and written by one script call (``_APPEND``), so auditing costs
no round trip per request and about 2 us of the gateway's CPU a record. Each is a stream entry
of its own (one JSON line): the stream is trimmed by entries, and only an entry per record
makes that a bound on records whatever the rate, the gateway or a retry gathered (an XADD a
record from the gateway would cost it 16 us each). Entries of several lines, as earlier
releases wrote, are read all the same.

A flush Redis did not confirm is sent again, as it was, under its number: the script notes the
numbers it wrote, so a flush whose reply was lost (the connection dropped after Redis ran it)
is not written twice.

Requests refused before they had a caller (no valid key, a wrong method, a draining gateway)
are one record a second for each status, with their count: the trail is trimmed by length, and
anyone who reaches the port could otherwise push every real record out of it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import redis

from gateway.batcher import CommandBatcher
from slogate import keys

log = logging.getLogger("slogate.gateway")
_json = msgspec.json.Encoder()
STREAM = f"{keys.PREFIX}:audit"
FIELDS = ("id", "key", "model", "cls", "pool", "decision", "prompt_tokens", "completion_tokens", "outcome",
          "queue_ms", "ttft_ms")
FLUSHES_KEPT = 1024
"""Flush numbers the script remembers per gateway: far more than it keeps unwritten."""
FLUSHES_TTL_S = 3600
_APPEND = f"""#!lua
local n = tonumber(ARGV[2])
if redis.call('ZSCORE', KEYS[2], n) then return 0 end
for i = 3, #ARGV do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'e', ARGV[i])
end
redis.call('ZADD', KEYS[2], n, n)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', n - {FLUSHES_KEPT})
redis.call('EXPIRE', KEYS[2], {FLUSHES_TTL_S})
return #ARGV - 2
"""
"""KEYS: the stream, and the set of this gateway's flushes written. ARGV: how many records to
keep, the flush's number, then the records, one entry each. With the shebang Redis refuses the
whole script when it is out of memory, rather than failing it halfway, so a flush is written
whole or not at all."""
ANONYMOUS_EVERY_S = 1.0
KEEP_UNWRITTEN = 16
RETRY_S = 1.0


class AuditLog:
    def __init__(self, batcher: CommandBatcher, keep: int, flush_s: float = 0.05,
                 max_records: int = 256) -> None:
        """``keep``: about how many records the stream holds; ``max_records``: the most one
        flush sends (it is sent at once when that many are gathered)."""
        self.batcher = batcher
        self.keep = keep
        self.flush_s = flush_s
        self.max_records = max_records
        self._records: list[str] = []
        self._flushes_key = f"{STREAM}:flushes:{uuid.uuid4().hex}"
        self._flushes = 0
        self._unwritten: list[tuple[int, list[str]]] = []
        """Flushes Redis did not confirm, oldest first, each sent again under its number."""
        self._timer: asyncio.TimerHandle | None = None
        self._anonymous: dict[int, int] = {}
        """Refusals without a caller gathered this second: status -> count."""
        self._anonymous_since = 0.0
        self._failing = False
        self._sending: set[asyncio.Future[Any]] = set()
        """Flushes Redis has not answered yet: closing waits for them all."""
        self._closed = False

    def write(self, request_id: str, started: float, status: int, entry: dict[str, Any]) -> None:
        """Gather a request's record. Outside the request's context: the timers it may start,
        and the lines they and the bound log, are the trail's, about no one request (they
        carried the id and trace of whichever request's record started them)."""
        contextvars.Context().run(self._write, request_id, started, status, entry)

    def _write(self, request_id: str, started: float, status: int, entry: dict[str, Any]) -> None:
        if "key" not in entry:
            if not self._anonymous:
                self._anonymous_since = started
                asyncio.get_running_loop().call_later(ANONYMOUS_EVERY_S, self._add_anonymous)
            self._anonymous[status] = self._anonymous.get(status, 0) + 1
            return
        record = {"ts": round(started, 3), "request_id": request_id, "status": status,
                  "latency_ms": round((time.time() - started) * 1000, 1),
                  **{k: entry[k] for k in FIELDS if k in entry}}
        record.setdefault("outcome", "rejected" if status >= 400 else "ok")
        self._add(record)

    def _add_anonymous(self) -> None:
        for status, count in sorted(self._anonymous.items()):
            self._add({"ts": round(self._anonymous_since, 3), "status": status,
                       "outcome": "unauthenticated" if status == 401 else "rejected", "count": count})
        self._anonymous = {}

    def _add(self, record: dict[str, Any]) -> None:
        self._records.append(_json.encode(record).decode())
        if self._failing:  # the retry timer sends them: not a doomed write per request
            self._bound()
        elif len(self._records) >= self.max_records:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.flush_s, self.flush)

    def _bound(self) -> None:
        excess = len(self._records) + sum(len(r) for _, r in self._unwritten) - KEEP_UNWRITTEN * self.max_records
        if excess <= 0:
            return
        log.warning("dropped %d audit record(s): Redis has been unavailable too long", excess)
        while excess > 0 and self._unwritten:
            number, records = self._unwritten[0]
            if len(records) > excess:
                self._unwritten[0] = (number, records[excess:])
                return
            excess -= len(records)
            del self._unwritten[0]
        del self._records[:excess]

    def flush(self) -> asyncio.Future[Any] | None:
        """Send what is gathered, after the flushes Redis did not confirm; the future fails
        with the error Redis gave, if it did."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        flushes, self._unwritten = self._unwritten, []
        if self._records:
            self._flushes += 1
            flushes.append((self._flushes, self._records))
            self._records = []
        if not flushes:
            return None
        sent = [self._send(number, records) for number, records in flushes]
        if len(sent) == 1:
            return sent[0]
        gathered = asyncio.gather(*sent)
        # A timer's flush awaits nothing: its failure is logged once (``_keep_unwritten``), not
        # by asyncio as an error with a traceback at every retry of an outage.
        gathered.add_done_callback(lambda done: done.cancelled() or done.exception())
        return gathered

    def _send(self, number: int, records: list[str]) -> asyncio.Future[Any]:
        written = self.batcher.call("EVAL", _APPEND, 2, STREAM, self._flushes_key, self.keep, number, *records)
        self._sending.add(written)
        written.add_done_callback(lambda fut: self._keep_unwritten(fut, number, records))
        return written

    def _keep_unwritten(self, written: asyncio.Future[Any], number: int, records: list[str]) -> None:
        """A flush Redis did not confirm is sent again a second later, with the records gathered
        since, up to ``KEEP_UNWRITTEN`` flushes' worth; past that, the oldest are dropped and
        counted. Once closed, none is sent again: ``close`` counts them."""
        self._sending.discard(written)
        exc = asyncio.CancelledError() if written.cancelled() else written.exception()
        if exc is None:
            if self._unwritten:
                return
            self._failing = False
            if self._records and self._timer is None and not self._closed:  # gathered while it was failing
                self._timer = asyncio.get_running_loop().call_later(self.flush_s, self.flush)
            return
        if not self._failing and not self._closed:
            log.warning("audit records could not be written, kept for the next try: %s", exc)
        self._failing = True
        self._unwritten.append((number, records))
        self._unwritten.sort(key=lambda flush: flush[0])
        self._bound()
        if self._timer is None and not self._closed:
            self._timer = asyncio.get_running_loop().call_later(RETRY_S, self.flush)

    async def close(self) -> None:
        """Write what is gathered, and wait for the flushes on their way, before the gateway lets
        go of Redis; what Redis did not take is logged once and sent no more. Not waited for, a
        flush's records were lost without a word, and its retries ran on after close: on closed
        connections, or, Redis hung, holding the gateway's exit (``CommandBatcher.drain``)."""
        self._closed = True
        self._add_anonymous()
        self.flush()
        if self._sending:
            await asyncio.wait(set(self._sending))
        lost = len(self._records) + sum(len(records) for _, records in self._unwritten)
        if lost:
            log.warning("the last %d audit record(s) could not be written: Redis is unavailable", lost)


def export(url: str, count: int | None = None) -> Iterator[str]:
    """The trail as JSON lines, oldest first (``slogate audit-export``)."""
    client = redis.Redis.from_url(url)
    last = "-"
    sent = 0
    try:
        while count is None or sent < count:
            # after the last one read, exclusive: it may be trimmed away meanwhile
            batch = client.xrange(STREAM, min=last if last == "-" else f"({last}", max="+", count=1000)
            if not batch:
                return
            for _, fields in batch:
                # Records are joined by "\n" alone (JSON escapes it inside one); splitlines would
                # also cut at U+2028, U+2029 and the like, which JSON leaves as they are.
                for line in fields[b"e"].decode().split("\n"):
                    yield line
                    sent += 1
                    if count is not None and sent >= count:
                        return
            last = batch[-1][0].decode()
    finally:
        client.close()
