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

Requests refused before they had a caller (no valid key, a wrong method, a draining gateway)
are one record a second for each status, with their count: the trail is trimmed by length, and
anyone who reaches the port could otherwise push every real record out of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import redis
from redis.exceptions import RedisError

from gateway.batcher import CommandBatcher
from slogate import keys

log = logging.getLogger("slogate.gateway")
_json = msgspec.json.Encoder()
STREAM = f"{keys.PREFIX}:audit"
FIELDS = ("id", "key", "model", "cls", "pool", "decision", "prompt_tokens", "completion_tokens", "outcome")
_APPEND = """
for i = 2, #ARGV do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'e', ARGV[i])
end
return #ARGV - 1
"""
"""KEYS: the stream. ARGV: how many records to keep, then the records, one entry each."""
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
        self._timer: asyncio.TimerHandle | None = None
        self._anonymous: dict[int, int] = {}
        """Refusals without a caller gathered this second: status -> count."""
        self._anonymous_since = 0.0
        self._failing = False

    def write(self, request_id: str, started: float, status: int, entry: dict[str, Any]) -> None:
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
        excess = len(self._records) - KEEP_UNWRITTEN * self.max_records
        if excess > 0:
            del self._records[:excess]
            log.warning("dropped %d audit record(s): Redis has been unavailable too long", excess)

    def flush(self) -> asyncio.Future[Any] | None:
        """Send what is gathered; the future fails with the error Redis gave, if it did."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._records:
            return None
        records, self._records = self._records, []
        written = self.batcher.call("EVAL", _APPEND, 1, STREAM, self.keep, *records)
        written.add_done_callback(lambda fut: self._keep_unwritten(fut, records))
        return written

    def _keep_unwritten(self, written: asyncio.Future[Any], records: list[str]) -> None:
        """Records Redis did not take are sent again a second later, with those written since,
        up to ``KEEP_UNWRITTEN`` flushes' worth; past that, the oldest are dropped and counted."""
        exc = asyncio.CancelledError() if written.cancelled() else written.exception()
        if exc is None:
            self._failing = False
            if self._records and self._timer is None:  # gathered while it was failing: no timer ran
                self._timer = asyncio.get_running_loop().call_later(self.flush_s, self.flush)
            return
        if not self._failing:
            log.warning("audit records could not be written, kept for the next try: %s", exc)
            self._failing = True
        self._records[:0] = records
        self._bound()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RETRY_S, self.flush)

    async def close(self) -> None:
        """Write what is gathered before the gateway lets go of Redis."""
        self._add_anonymous()
        pending = self.flush()
        if pending is not None:
            try:
                await pending
            except RedisError:
                log.warning("the last audit records could not be written: Redis is unavailable")


def export(url: str, count: int | None = None) -> Iterator[str]:
    """The trail as JSON lines, oldest first (``slogate audit-export``)."""
    client = redis.Redis.from_url(url)
    last = "-"
    sent = 0
    try:
        while count is None or sent < count:
            batch = client.xrange(STREAM, min=last, max="+", count=1000)
            if last != "-":
                batch = batch[1:]
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
