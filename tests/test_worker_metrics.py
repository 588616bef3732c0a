"""A worker's own metrics say what its engine did: one step time per step, however the engine
hands its outputs on."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engines.base import EngineLoad, EngineRequest, StepOutput
from engines.sim import create
from engines.worker import Worker, WorkerSettings
from slogate import keys, protocol, tracing
from slogate.protocol import GenerateRequest, SamplingParams
from tests.test_worker_engine_failure import REPLIES, results

STEP_S = 0.02


class SendsMidStep:
    """The sim engine, except that each step hands its outputs on halfway through (as the
    stream engine does with a prompt pass's first tokens) and then runs as long again."""

    def __init__(self) -> None:
        self.inner = create(decode_base_s=STEP_S)
        self.steps = 0
        self.name, self.model_id, self.max_context = "mid-step", "m", 8192

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def step(self, arrivals=None, send=None):
        self.steps += 1
        send(self.inner.step(arrivals, send))
        time.sleep(STEP_S)
        return []


async def test_a_step_that_hands_outputs_on_midway_is_timed_once_and_whole(redis_url: str) -> None:
    """Each mid-step hand-over was timed as a step of its own: a 40 ms step showed as one of
    20 ms and one of about 0, the step count doubled and the P50 dragged towards 0."""
    client = aioredis.Redis.from_url(redis_url)
    engine = SendsMidStep()
    worker = Worker(engine, client, WorkerSettings(pool="p", claim_idle_s=30))
    task = asyncio.create_task(worker.run())
    try:
        req = GenerateRequest(id="r", model="m", pool="p", cls="interactive", sampling=SamplingParams(max_tokens=3),
                              deadline=time.time() + 30, enqueued_at=time.time(), reply=REPLIES, prompt="hello")
        await client.xadd(keys.queue("p"), {protocol.ID_FIELD: "r", protocol.FIELD: protocol.encode(req)})
        await results(client, "r")
    finally:
        worker.stop()
        await asyncio.wait_for(task, 5)
        await client.aclose()
    registry = worker.metrics.registry
    labels = {"pool": "p", "worker": worker.s.worker_id, "engine": "mid-step"}
    count = registry.get_sample_value("slogate_worker_step_seconds_count", labels)
    total = registry.get_sample_value("slogate_worker_step_seconds_sum", labels)
    assert engine.steps == 3 and count == 3
    assert total >= 3 * 2 * STEP_S, "each step's time is the whole step's, both halves"


class EndsAtItsDeadline:
    """An engine that finds each request past its deadline at its first step, as the paged
    engine's own sweep does."""

    name, model_id, max_context = "late", "m", 8192

    def __init__(self) -> None:
        self.held: list[EngineRequest] = []

    def prepare(self, request: EngineRequest) -> EngineRequest:
        return request

    def add_request(self, request: EngineRequest) -> None:
        self.held.append(request)

    def abort_request(self, request_id: str) -> None:
        self.held = [r for r in self.held if r.id != request_id]

    def has_unfinished(self) -> bool:
        return bool(self.held)

    def step(self, arrivals=None, send=None) -> list[StepOutput]:
        done, self.held = self.held, []
        return [StepOutput(r.id, prompt_tokens=2, finish_reason="deadline") for r in done]

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self.held), waiting=0, capacity=4)


async def test_a_request_the_engine_ends_at_its_deadline_has_the_one_late_outcome(redis_url: str, monkeypatch) -> None:
    """The engine's own "deadline" and the worker's "deadline_exceeded" (its sweep, or a
    request late when taken) were two outcomes for one thing, in the metric and the spans:
    what counted or searched for one missed the other."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    client = aioredis.Redis.from_url(redis_url)
    worker = Worker(EndsAtItsDeadline(), client, WorkerSettings(pool="p", claim_idle_s=30))
    task = asyncio.create_task(worker.run())
    try:
        req = GenerateRequest(id="r", model="m", pool="p", cls="interactive", sampling=SamplingParams(max_tokens=3),
                              deadline=time.time() + 30, enqueued_at=time.time(), reply=REPLIES, prompt="hello",
                              trace={"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
        await client.xadd(keys.queue("p"), {protocol.ID_FIELD: "r", protocol.FIELD: protocol.encode(req)})
        assert (await results(client, "r"))[-1].finish_reason == "deadline"
    finally:
        worker.stop()
        await asyncio.wait_for(task, 5)
        await client.aclose()
    labels = {"pool": "p", "worker": worker.s.worker_id, "engine": "late"}
    late = {outcome: worker.metrics.registry.get_sample_value("slogate_worker_requests_total",
                                                                {**labels, "outcome": outcome})
            for outcome in ("deadline", "deadline_exceeded")}
    assert late == {"deadline": None, "deadline_exceeded": 1.0}
    assert {s.attributes["slogate.outcome"] for s in exporter.get_finished_spans()} == {"deadline_exceeded"}


async def test_a_workers_metrics_carry_the_step_times_its_heartbeats_report(redis_url: str) -> None:
    """Running and waiting were there, but a decode step's and a prompt token's recent time,
    the load signals gateways admit by, only in heartbeats: an operator could not graph why
    admission refused."""
    client = aioredis.Redis.from_url(redis_url)
    worker = Worker(create(decode_base_s=0.03, decode_s_per_seq=0.001, prefill_s_per_token=0.0005), client,
                    WorkerSettings(pool="p"))
    try:
        beat = worker.heartbeat()
    finally:
        await client.aclose()
    labels = {"pool": "p", "worker": worker.s.worker_id, "engine": "sim"}
    registry = worker.metrics.registry
    assert registry.get_sample_value("slogate_worker_decode_step_seconds", labels) == beat.decode_step_s == 0.031
    assert registry.get_sample_value("slogate_worker_prefill_seconds_per_token", labels) == 0.0005
    worker.metrics.load(EngineLoad(running=1, waiting=0, capacity=4, extra={"prefill_step_s": 0.05}))
    assert registry.get_sample_value("slogate_worker_prefill_step_seconds", labels) == 0.05
