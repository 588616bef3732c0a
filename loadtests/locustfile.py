"""The financial-risk mix as a locust scenario.

Many short interactive risk-score calls (not streamed, max_tokens <= 8) and a trickle of long
batch credit reports (streamed, max_tokens >= 256), replayed from the standard workload file
so that runs on different days are comparable. See loadtests/README.md.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from pathlib import Path

from locust import FastHttpUser, HttpUser, between, events, task

WORKLOAD = Path(os.environ.get(
    "SLOGATE_WORKLOAD", Path(__file__).resolve().parents[2] / "shared" / "workloads" / "risk-mix.jsonl"))
MODEL = os.environ.get("SLOGATE_MODEL_NAME", "slogate-sim")
FIRST_TEXT = re.compile(rb'"content":"[^"]')
"""A chunk that carries text: the role chunk before it has empty content."""
ERROR_EVENT = re.compile(rb'data: (\{"error":.*)')
"""How a stream that fails after its 200 ends (quotes inside a chunk's text are escaped)."""


def _load(path: Path) -> tuple[list[dict], list[dict]]:
    if not path.is_file():
        raise SystemExit(f"workload {path} not found: the standard mix is shared/workloads/risk-mix.jsonl beside "
                         "the checkout; set SLOGATE_WORKLOAD=PATH/risk-mix.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    scores = [r["body"] for r in rows if r["class_hint"] == "interactive" and not r["body"].get("stream")]
    reports = [r["body"] for r in rows if r["class_hint"] == "batch"]
    return scores, reports


SCORES, REPORTS = _load(WORKLOAD)
_score_iter = itertools.cycle(SCORES)
_report_iter = itertools.cycle(REPORTS)


class RiskScorer(FastHttpUser):
    """A payment system scoring transactions: short, latency-bound, not streamed."""

    weight = 20
    wait_time = between(0.0, 0.05)

    @task
    def score(self) -> None:
        body = {**next(_score_iter), "model": MODEL}
        with self.client.post("/v1/chat/completions", json=body, name="risk-score",
                              catch_response=True) as resp:
            if resp.status_code == 429:  # reported once, as a SHED row, not as an answer
                resp.request_meta["request_type"] = "SHED"
                resp.success()
            elif resp.status_code != 200:
                resp.failure(f"{resp.status_code}: {resp.text[:200]}")


class ReportWriter(HttpUser):
    """An analyst job writing counterparty credit reports: long, streamed, throughput-bound.
    On requests, not geventhttpclient: its reads wait for a whole chunk size, which put the
    first text a token late."""

    weight = 1
    wait_time = between(1.0, 3.0)

    @task
    def report(self) -> None:
        body = {**next(_report_iter), "model": MODEL, "stream": True}
        start = time.perf_counter()
        first = None
        with self.client.post("/v1/chat/completions", json=body, name="credit-report", stream=True,
                              catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"{resp.status_code}")
                return
            seen, tail = b"", b""
            for chunk in resp.iter_content(chunk_size=None):
                seen = seen[-32:] + chunk  # a match may straddle two chunks
                if first is None and FIRST_TEXT.search(seen):
                    first = time.perf_counter()
                tail = (tail + chunk)[-4096:]
            failed = ERROR_EVENT.search(tail)
            if failed:  # the report was not written, whatever the status said
                resp.failure(f"error event: {failed[1][:200].decode(errors='replace')}")
                return
        if first is not None:
            events.request.fire(request_type="TTFT", name="credit-report",
                                response_time=(first - start) * 1000, response_length=0,
                                exception=None, context={})
