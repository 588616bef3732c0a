"""Traces that cross processes, the audit trail, worker metrics and JSON logs."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from slogate import logs
from slogate.local_redis import LocalRedis, free_port
from slogate.processes import ROOT, Stack, http_get
from tests.e2e.conftest import FAST_FLEET, MODEL

SECRET_PROMPT = "txn 991: the customer's secret note"


@pytest.fixture(scope="module")
def traced(redis_server: LocalRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path, int]]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    traces = tmp_path_factory.mktemp("traces")
    metrics_port = free_port()
    gw = Stack(redis_server.url, {**FAST_FLEET, "OTEL_TRACES_EXPORTER": "file", "SLOGATE_LOG_LEVEL": "INFO",
                                  "SLOGATE_TRACE_FILE": str(traces / "gateway.jsonl")}, log_dir=traces)
    gw.gateway()
    workers = Stack(redis_server.url, {**FAST_FLEET, "OTEL_TRACES_EXPORTER": "file",
                                       "SLOGATE_TRACE_FILE": str(traces / "worker.jsonl")}, port=gw.port)
    workers._spawn("worker", "--pool", "interactive", "--engine", "sim", "-o", "decode_base_s=0.001",
                   "--metrics-port", str(metrics_port))
    workers.worker("batch", "sim", "decode_base_s=0.001")
    gw.wait_models(MODEL, pools=2)
    yield gw, traces, metrics_port
    workers.stop()
    gw.stop()


def spans(path: Path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def test_one_trace_links_gateway_and_worker(traced) -> None:
    stack, traces, _ = traced
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 3}) as r:
            assert r.status == 200
            request_id = r.headers["x-request-id"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        gateway_spans = spans(traces / "gateway.jsonl")
        roots = [sp for sp in gateway_spans if sp["attributes"].get("slogate.request_id") == request_id]
        worker_spans = spans(traces / "worker.jsonl")
        if roots and worker_spans:
            break
        time.sleep(0.1)
    assert len(roots) == 1
    trace_id = roots[0]["context"]["trace_id"]
    gateway_names = {sp["name"] for sp in gateway_spans if sp["context"]["trace_id"] == trace_id}
    assert {"POST /v1/chat/completions", "validate", "admit", "enqueue"} <= gateway_names
    mine = [sp for sp in worker_spans if sp["context"]["trace_id"] == trace_id]
    assert {sp["name"] for sp in mine} == {"queue_wait", "prefill", "decode"}
    gateway_ids = {sp["context"]["span_id"] for sp in gateway_spans}
    assert all(sp["parent_id"] in gateway_ids for sp in mine), "worker spans must hang off the gateway's"
    assert all(sp["resource"]["attributes"]["service.name"] == "slogate-worker" for sp in mine)
    admitted = [sp["end_time"] for sp in gateway_spans
                if sp["name"] == "admit" and sp["context"]["trace_id"] == trace_id]
    [queued] = [sp["start_time"] for sp in mine if sp["name"] == "queue_wait"]
    assert queued >= admitted[0], "the queue wait starts when the request is queued, after admission"


async def test_audit_trail_has_every_request_and_no_text(traced) -> None:
    stack, _, _ = traced
    async with aiohttp.ClientSession() as s:
        ok = {"model": MODEL, "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 3}
        async with s.post(stack.url + "/v1/chat/completions", json=ok, headers={"x-request-id": "audit-ok"}) as r:
            answer_body = await r.json()
            answer = answer_body["choices"][0]["message"]["content"]
        async with s.post(stack.url + "/v1/chat/completions", json=ok, headers={"x-request-id": "audit-ok"}) as r:
            again = (await r.json())["id"]
        async with s.post(stack.url + "/v1/chat/completions", json={**ok, "model": "nope"},
                          headers={"x-request-id": "audit-404"}) as r:
            assert r.status == 404
    time.sleep(0.2)
    lines = audit_lines(stack)
    bad = next(r for r in lines if r.get("request_id") == "audit-404")
    assert sorted(r["id"] for r in lines if r.get("request_id") == "audit-ok") == sorted(
        [answer_body["id"], again]), "a repeated x-request-id: each record has its answer's own id"
    good = next(r for r in lines if r.get("id") == answer_body["id"])
    assert good["status"] == 200 and good["key"] == "anonymous" and good["model"] == MODEL
    assert good["cls"] == "interactive" and good["decision"] == "fits" and good["outcome"] == "length"
    assert good["completion_tokens"] == 3 and good["prompt_tokens"] > 0
    assert 0 < good["queue_ms"] < good["ttft_ms"] <= good["latency_ms"], good
    assert bad["status"] == 404 and bad["outcome"] == "rejected" and "id" not in bad
    assert "queue_ms" not in bad and "ttft_ms" not in bad
    text = json.dumps(lines)
    assert SECRET_PROMPT not in text and answer.strip() not in text


def audit_lines(stack: Stack) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "slogate.cli", "audit-export"], capture_output=True,
                         text=True, env=stack.env(), cwd=ROOT, check=True).stdout
    return list(map(json.loads, out.splitlines()))


def audit_records(stack: Stack) -> dict[str, dict]:
    return {r["request_id"]: r for r in audit_lines(stack) if "request_id" in r}


async def test_audit_trail_records_a_client_that_leaves_mid_stream(traced) -> None:
    stack, _, _ = traced
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 2000,
            "stream": True}
    _, _, port = traced
    tokens_before = worker_tokens(port)
    async with aiohttp.ClientSession() as s:
        resp = await s.post(stack.url + "/v1/chat/completions", json=body,
                            headers={"x-request-id": "audit-gone", "x-slogate-class": "interactive"})
        assert resp.status == 200
        events = [await resp.content.readline() for _ in range(6)]
        assert sum(b'"content":" ' in e for e in events) >= 2
        resp.close()
    deadline = time.monotonic() + 5
    while "audit-gone" not in (records := audit_records(stack)) and time.monotonic() < deadline:
        time.sleep(0.1)
    gone = records["audit-gone"]
    assert gone["status"] == 499 and gone["outcome"] == "cancelled"
    assert gone["model"] == MODEL and gone["decision"] and gone["pool"] == gone["cls"]
    assert 2 <= gone["completion_tokens"] < 2000 and gone["prompt_tokens"] > 0
    assert 0 < gone["ttft_ms"] < gone["latency_ms"] and "queue_ms" not in gone, "no final record: no worker's wait"
    assert worker_tokens(port) - tokens_before >= gone["completion_tokens"], "a cancelled stream's tokens count"


def worker_tokens(port: int) -> float:
    text = http_get(f"http://127.0.0.1:{port}/metrics")[1].decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in families["slogate_worker_generated_tokens"].samples if s.name.endswith("_total"))


def judged(stack: Stack) -> dict[tuple[str, str], float]:
    text = http_get(stack.url + "/metrics")[1].decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families.get("slogate_objective_requests")
    return {(s.labels["class"], s.labels["met"]): s.value for s in family.samples if s.name.endswith("_total")} \
        if family else {}


async def test_interactive_requests_are_judged_against_their_objective(traced) -> None:
    stack, _, _ = traced
    before = judged(stack)
    async with aiohttp.ClientSession() as s:
        for cls, stream in (("interactive", False), ("interactive", True), ("batch", False)):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "judge me"}], "max_tokens": 3,
                    "stream": stream}
            async with s.post(stack.url + "/v1/chat/completions", json=body, headers={"x-slogate-class": cls}) as r:
                assert r.status == 200
                await r.read()
    after = judged(stack)
    moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert sum(moved.values()) == 2 and all(cls == "interactive" for cls, _ in moved), moved


async def test_a_client_that_leaves_is_logged_and_traced_with_its_status(traced) -> None:
    stack, traces, _ = traced
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 2000,
            "stream": True}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(stack.url + "/v1/chat/completions", json=body, headers={"x-request-id": "log-gone"})
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()
        async with s.post(stack.url + "/v1/chat/completions", json={**body, "max_tokens": 0},
                          headers={"x-request-id": "trace-400"}) as r:
            assert r.status == 400
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        roots = {sp["attributes"].get("slogate.request_id"): sp for sp in spans(traces / "gateway.jsonl")
                 if sp["kind"] == "SpanKind.SERVER"}
        lines = [json.loads(line) for line in (traces / "gateway-0.log").read_text().splitlines()
                 if line.startswith("{")]
        left = [line for line in lines if line.get("request_id") == "log-gone" and "closed" in line["msg"]]
        at_worker = [sp for sp in spans(traces / "worker.jsonl") if "log-gone" in roots
                     and sp["context"]["trace_id"] == roots["log-gone"]["context"]["trace_id"]]
        if left and {"log-gone", "trace-400"} <= roots.keys() and len(at_worker) == 3:
            break
        time.sleep(0.1)
    assert {sp["name"] for sp in at_worker} == {"queue_wait", "prefill", "decode"}
    assert {sp["attributes"]["slogate.outcome"] for sp in at_worker} == {"cancelled"}
    assert len(left) == 1 and left[0]["level"] == "info"
    assert left[0]["trace_id"] == roots["log-gone"]["context"]["trace_id"][2:]
    assert roots["log-gone"]["attributes"]["http.response.status_code"] == 499
    assert roots["trace-400"]["attributes"]["http.response.status_code"] == 400


def test_worker_serves_its_own_metrics(traced) -> None:
    _, _, port = traced
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    text = body.decode()
    assert status == 200
    assert 'slogate_worker_requests_total{engine="sim",outcome="length",pool="interactive"' in text
    assert "slogate_worker_step_seconds_bucket" in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    outcomes = {s.labels["outcome"]: s.value for s in families["slogate_worker_requests"].samples
                if s.name.endswith("_total")}
    served, cancelled = outcomes.get("length", 0), outcomes.get("cancelled", 0)
    [first_tokens] = [s.value for s in families["slogate_worker_time_to_first_token_seconds"].samples
                      if s.name.endswith("_count")]
    assert served >= 1 and served <= first_tokens <= served + cancelled, \
        "every request that produced text has its first token timed"
    assert "slogate_worker_kv_cache_usage_ratio" in text


def test_json_log_lines_carry_request_id() -> None:
    record = logging.LogRecord("slogate.gateway", logging.WARNING, __file__, 1, "slow %s", ("client",), None)
    token = logs.request_id.set("rid-42")
    try:
        line = json.loads(logs.JsonFormatter().format(record))
    finally:
        logs.request_id.reset(token)
    assert line["msg"] == "slow client" and line["request_id"] == "rid-42" and line["level"] == "warning"
