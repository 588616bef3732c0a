"""Tracing is set from the standard OTEL_* variables, and refuses what it cannot do by name; a
worker traces every request it ends, however it ends."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engines.sim import create
from engines.worker import Worker, WorkerSettings
from slogate import keys, protocol, tracing
from slogate.protocol import GenerateRequest, SamplingParams
from slogate.tasks import cancel_and_wait


@pytest.mark.parametrize("env,named", [
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json",
      "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin'"),
])
def test_an_exporter_it_cannot_build_is_refused_by_name(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError) as err:
        tracing.setup("test", env)
    assert named in str(err.value)
    assert not tracing.enabled()


def test_otlp_over_http_is_accepted() -> None:
    try:
        assert tracing.setup("test", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                                      "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
        assert tracing.enabled()
    finally:
        tracing.setup("test", {})


def test_the_traces_own_otlp_endpoint_turns_tracing_on() -> None:
    """The standard variable for the traces' endpoint alone (the exporter reads it) was taken
    for tracing off, and no span was ever sent."""
    try:
        assert tracing.setup("test", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces"})
        assert tracing.enabled()
    finally:
        tracing.setup("test", {})


EXPORTED_ON = """
import json, sys, threading
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from slogate import tracing

threads = []
export = ConsoleSpanExporter.export
def noting_thread(self, spans):
    threads.append(threading.current_thread() is threading.main_thread())
    return export(self, spans)
ConsoleSpanExporter.export = noting_thread
assert tracing.setup("test")
with tracing.span("request"):
    pass
tracing.shutdown()
print(json.dumps(threads))
"""


def test_spans_written_to_a_file_are_written_off_the_callers_thread(tmp_path: Path) -> None:
    """Written as each span ended, on the event loop, the spans held up the requests they
    traced. They are written in batches on the processor's thread now, and all of them by the
    time tracing shuts down."""
    path = tmp_path / "spans.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "file", "SLOGATE_TRACE_FILE": str(path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", EXPORTED_ON], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [False], "exported once, not on the thread that ended the span"
    assert [json.loads(line)["name"] for line in path.read_text().splitlines()] == ["request"]


async def test_a_request_that_ends_without_running_is_traced_too(redis_url: str, monkeypatch) -> None:
    """One whose deadline passed in the queue, and one the engine refused: their traces show
    where their time went (a queue wait), as a finished request's do."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    client = aioredis.Redis.from_url(redis_url)
    worker = Worker(create(decode_base_s=0), client, WorkerSettings(pool="p"))
    task = asyncio.create_task(worker.run())
    parent = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
    now = time.time()
    late = GenerateRequest(id="late", model="m", pool="p", cls="batch", sampling=SamplingParams(max_tokens=3),
                           deadline=now - 1, enqueued_at=now - 5, reply=keys.replies("g"), prompt="hi", trace=parent)
    refused = GenerateRequest(id="refused", model="m", pool="p", cls="batch",
                              sampling=SamplingParams(max_tokens=3, json_schema="{}"), deadline=now + 60,
                              enqueued_at=now, reply=keys.replies("g"), prompt="hi", trace=parent)
    try:
        for req in (late, refused):
            await client.xadd(keys.queue("p"), {protocol.ID_FIELD: req.id, protocol.FIELD: protocol.encode(req)})
        for _ in range(200):
            spans = exporter.get_finished_spans()
            outcomes = {s.attributes["slogate.outcome"] for s in spans if s.name == "queue_wait"}
            if len(outcomes) == 2:
                break
            await asyncio.sleep(0.02)
        assert outcomes == {"deadline_exceeded", "invalid_request_error"}
    finally:
        await cancel_and_wait([task])
        await client.aclose()
