"""What the gateway's metrics and traces say of a request however it ends: before it was queued,
or in a stream whose status was already sent. A real gateway, Redis and sim worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from engines.base import Engine, EngineRequest
from engines.sim import SimEngine, create
from engines.worker import Worker, WorkerSettings
from gateway import openai_shapes, schema
from gateway.app import make_app
from gateway.state import STATE, GatewayState
from slogate import keys, logs, tracing
from slogate.config import Config
from slogate.tasks import cancel_and_wait

MODEL = "slogate-sim"


@contextlib.asynccontextmanager
async def gateway(redis_url: str, engine: Engine | None = None) -> AsyncIterator[TestClient]:
    """A gateway that queues whatever it is sent, in front of one worker on pool interactive."""
    client = aioredis.Redis.from_url(redis_url)
    worker = Worker(engine or create(decode_base_s=0.02), client,
                    WorkerSettings(pool="interactive", heartbeat_interval_s=0.1))
    running = asyncio.create_task(worker.run())
    try:
        while not await client.smembers(keys.WORKERS):
            await asyncio.sleep(0.01)
        cfg = Config(redis_url=redis_url, admission_control=False, worker_poll_s=0.1)
        async with TestClient(TestServer(make_app(cfg))) as http:
            yield http
    finally:
        await cancel_and_wait([running])
        await client.aclose()


def state_of(http: TestClient) -> GatewayState:
    return http.server.app[STATE]


def refused(state: GatewayState, status: str, code: str) -> float:
    return state.metrics.registry.get_sample_value(
        "slogate_rejected_requests_total", {"status": status, "code": code}) or 0.0


async def eventually(check, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_a_client_that_leaves_before_its_request_is_queued_is_counted(redis_url: str) -> None:
    """It hangs up while its body is still coming: counted as a 499, as the audit trail has it."""
    async with gateway(redis_url) as http:
        state = state_of(http)
        reader, writer = await asyncio.open_connection(http.server.host, http.server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        await writer.drain()
        assert await eventually(lambda: state.handling == 1)
        writer.close()
        await writer.wait_closed()
        assert await eventually(lambda: refused(state, "499", "cancelled") == 1), \
            state.metrics.registry.get_sample_value("slogate_rejected_requests_total")


async def test_requests_for_no_completion_are_not_counted_as_refused_completions(redis_url: str) -> None:
    """A scanner's 404s, or a scrape of /metrics: the metric is about completion requests."""
    async with gateway(redis_url) as http:
        assert (await http.get("/wp-login.php")).status == 404
        assert (await http.get("/v1/completions")).status == 405
        state = state_of(http)
        assert refused(state, "404", "unknown_url") == 0
        assert refused(state, "405", "method_not_allowed") == 1, \
            state.metrics.registry.get_sample_value("slogate_rejected_requests_total")


def break_in(monkeypatch, module: object, name: str) -> None:
    """A bug of the gateway's: ``module.name`` raises."""
    def broken(*args, **kwargs):
        raise RuntimeError(f"a bug in {name}")

    monkeypatch.setattr(module, name, broken)


async def test_a_gateway_failure_before_queueing_is_counted(redis_url: str, monkeypatch) -> None:
    break_in(monkeypatch, schema, "parse")
    async with gateway(redis_url) as http:
        resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert resp.status == 500
        assert refused(state_of(http), "500", "internal_error") == 1


async def test_a_gateway_failure_after_queueing_is_counted_as_one(redis_url: str, monkeypatch) -> None:
    """The client got a 500: counted as that, not by what the worker said (``length``), nor as a
    client that left (``cancelled``, what a request that failed before its last record was)."""
    break_in(monkeypatch, openai_shapes, "full_response")
    async with gateway(redis_url) as http:
        resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert resp.status == 500
        outcomes = {s.labels["outcome"]: s.value for m in state_of(http).metrics.requests.collect()
                    for s in m.samples if s.name.endswith("_total")}
        assert outcomes == {"internal_error": 1}


async def late_stream(http: TestClient) -> str:
    """A stream whose deadline passes after its first tokens: a 200, then an error event."""
    resp = await http.post("/v1/completions", headers={"x-slogate-timeout": "1", "x-slogate-class": "interactive"},
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 1000, "stream": True})
    assert resp.status == 200
    body = (await resp.read()).decode()
    assert '"text"' in body and '"deadline_exceeded"' in body, body
    return resp.headers["x-request-id"]


async def test_a_stream_that_fails_after_its_status_was_sent_is_an_error_in_its_trace(redis_url: str,
                                                                                      monkeypatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    async with gateway(redis_url) as http:
        request_id = await late_stream(http)
    [span] = [s for s in exporter.get_finished_spans()
              if s.kind == SpanKind.SERVER and s.attributes["slogate.request_id"] == request_id]
    assert span.attributes["http.response.status_code"] == 200
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == "deadline_exceeded"


async def test_a_stream_that_fails_after_its_first_token_has_its_time_to_first_token(redis_url: str) -> None:
    """The first token reached its client: a real time to first token, however the stream ended."""
    async with gateway(redis_url) as http:
        await late_stream(http)
        labels = {"class": "interactive", "pool": "interactive", "model": MODEL}
        registry = state_of(http).metrics.registry
        assert registry.get_sample_value("slogate_requests_total", {**labels, "outcome": "deadline_exceeded"}) == 1
        assert registry.get_sample_value("slogate_time_to_first_token_seconds_count", labels) == 1


class UnpreparedEngine(SimEngine):
    """The sim engine, with a ``prepare`` that breaks its promise never to raise."""

    def prepare(self, request: EngineRequest) -> EngineRequest:
        raise RuntimeError("a bug in the tokenizer")


async def test_a_workers_line_about_a_request_carries_the_gateways_request_id(redis_url: str, caplog) -> None:
    """The id the gateway's own lines about it carry (the client's x-request-id): one request
    can be followed from the gateway's log into the worker's."""
    caplog.set_level(logging.WARNING)
    async with gateway(redis_url, UnpreparedEngine(model_id=MODEL)) as http:
        resp = await http.post("/v1/completions", headers={"x-request-id": "follow-me"},
                               json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert resp.status == 200  # the engine tokenizes it itself
    [line] = [r for r in caplog.records if r.name == "slogate.worker" and "preparing request" in r.getMessage()]
    assert line.request_id == "follow-me"
    assert json.loads(logs.JsonFormatter().format(line))["request_id"] == "follow-me"


async def test_a_request_not_streamed_that_fails_after_its_first_tokens_has_no_time_to_first_token(
        redis_url: str) -> None:
    """Its text, held by the worker until the end, reached the gateway with the failure and never
    its client: its end is no first token's time, however the worker's text came."""
    async with gateway(redis_url) as http:
        resp = await http.post("/v1/completions", headers={"x-slogate-timeout": "1", "x-slogate-class": "interactive"},
                               json={"model": MODEL, "prompt": "hi", "max_tokens": 1000})
        assert resp.status == 504
        labels = {"class": "interactive", "pool": "interactive", "model": MODEL}
        registry = state_of(http).metrics.registry
        assert registry.get_sample_value("slogate_requests_total", {**labels, "outcome": "deadline_exceeded"}) == 1
        assert not registry.get_sample_value("slogate_time_to_first_token_seconds_count", labels)
