"""Logging: one JSON object a line, carrying the request id and trace id of the request being
served (or the one a line is :func:`about`), so a log line can be joined to its trace and to the
client's ``x-request-id``."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

from slogate import tracing

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or request_id.get()
        if rid:
            entry["request_id"] = rid
        trace_id = tracing.current_trace_id()
        if trace_id:
            entry["trace_id"] = trace_id
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def about(rid: str | None) -> dict[str, str | None]:
    """``extra`` for a line about one request logged outside its context (a worker serves many
    at once from one task): the line carries the request's id, as the gateway's lines about it do."""
    return {"request_id": rid}


def setup(level: str, fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
