"""The audit trail: one record per completion request, in a Redis stream of bounded length.

It says who (API key id, never the secret), when, which model and class, what admission
decided, tokens in and out and the outcome; never prompt or completion text. Writes ride the
gateway's command pipeline, so auditing adds no round trip to a request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import redis

from gateway.batcher import CommandBatcher
from slogate import keys

STREAM = f"{keys.PREFIX}:audit"
FIELDS = ("key", "model", "cls", "pool", "decision", "prompt_tokens", "completion_tokens", "outcome")


def write(batcher: CommandBatcher, max_entries: int, request_id: str, started: float, status: int,
          entry: dict[str, Any]) -> None:
    record = {"ts": round(started, 3), "request_id": request_id, "status": status,
              "latency_ms": round((time.time() - started) * 1000, 1),
              **{k: entry[k] for k in FIELDS if k in entry}}
    record.setdefault("outcome", "rejected" if status >= 400 else "ok")
    batcher.fire("XADD", STREAM, "MAXLEN", "~", max_entries, "*", "e", json.dumps(record))


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
            for entry_id, fields in batch:
                yield fields[b"e"].decode()
                sent += 1
                if count is not None and sent >= count:
                    return
            last = batch[-1][0].decode()
    finally:
        client.close()
