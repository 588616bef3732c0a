"""The serving-path benchmark's split of a request's TTFT, from its spans (pure logic)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from benchmarks.serving_path import HOPS, UNTRACED_HOPS, audit_hops, hops, schedstat, tail_report, trace_hops

BASE = datetime(2026, 12, 1, 5, 0, tzinfo=timezone.utc).timestamp()


def stamp(ms: float) -> str:
    """A time ``ms`` after BASE, as the span exporter writes it."""
    return datetime.fromtimestamp(BASE + ms / 1000, timezone.utc).isoformat().replace("+00:00", "Z")


def span(name: str, start_ms: float, end_ms: float, trace: str = "t1", **attributes: str) -> dict:
    return {"name": name, "start_time": stamp(start_ms), "end_time": stamp(end_ms),
            "context": {"trace_id": trace}, "attributes": attributes}


def request_spans(trace: str, request_id: str, at_ms: float = 0.0) -> list[dict]:
    """Gateway span at +1 ms, sealing at +2.5, taken at +4, first output at +11."""
    return [
        span("POST /v1/completions", at_ms + 1, at_ms + 40, trace, **{"slogate.request_id": request_id}),
        span("validate", at_ms + 1.2, at_ms + 2, trace),
        span("enqueue", at_ms + 2.5, at_ms + 6, trace),
        span("queue_wait", at_ms + 1, at_ms + 4, trace),
        span("prefill", at_ms + 4, at_ms + 11, trace),
        span("decode", at_ms + 11, at_ms + 39, trace),
    ]


def test_hops_split_the_ttft_at_each_handover() -> None:
    split = hops(request_spans("t1", "r1"), sent=BASE, first=BASE + 0.0135)
    assert split is not None and list(split) == HOPS
    expected = {"to the gateway": 1.0, "gateway": 1.5, "to a worker": 1.5, "worker to first token": 7.0,
                "back to the client": 2.5}
    assert {k: round(v * 1000, 3) for k, v in split.items()} == expected
    assert sum(split.values()) == pytest.approx(0.0135, abs=1e-6)


def test_the_tail_table_follows_the_slowest_requests_hop_by_hop() -> None:
    """Of 40 requests, the 2 slowest lost their time on the way to a worker; the 4 around the
    median spent 1 ms in each hop."""
    def split(to_worker_ms: float) -> dict[str, float]:
        return {hop: (to_worker_ms if hop == "to a worker" else 1.0) / 1000 for hop in HOPS}

    traced = {16: [split(1.0 + i / 100) for i in range(38)] + [split(20.0), split(30.0)]}
    headers, rows = tail_report(traced)
    assert headers == ["hop", "16 streams, around the median ms", "16 streams, slowest 5% ms"]
    table = {row[0]: row[1:] for row in rows}
    assert table["to a worker"] == [pytest.approx(1.195, abs=0.01), 25.0]
    assert table["worker to first token"] == [1.0, 1.0]
    assert table["TTFT, traced"] == [pytest.approx(5.195, abs=0.01), 29.0]


def test_a_request_whose_worker_spans_are_missing_has_no_split() -> None:
    gateway_only = [sp for sp in request_spans("t1", "r1") if sp["name"] not in ("queue_wait", "prefill")]
    assert hops(gateway_only, sent=BASE, first=BASE + 0.02) is None


def test_trace_hops_joins_requests_to_their_traces_by_request_id(tmp_path: Path) -> None:
    spans = request_spans("a", "first") + request_spans("b", "second", at_ms=100)
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(sp) + "\n" for sp in reversed(spans)))
    sent = [("second", BASE + 0.1, BASE + 0.1135), ("lost", BASE, BASE + 0.01), ("first", BASE, BASE + 0.0125)]
    joined = trace_hops(path, sent)
    assert len(joined) == 2
    assert [round(h["back to the client"] * 1000, 3) for h in joined] == [2.5, 1.5]


def test_audit_hops_split_the_untraced_ttft_by_the_gateways_record() -> None:
    """Sent at 0, first text at the client at 12 ms; the gateway says 3 ms to a worker and
    10.5 ms to the first token. A request without a final record (no ``queue_ms``) or never
    recorded has no split."""
    records = {"r1": {"request_id": "r1", "queue_ms": 3.0, "ttft_ms": 10.5},
               "r2": {"request_id": "r2", "ttft_ms": 4.0}}
    sent = [("r1", BASE, BASE + 0.012), ("r2", BASE, BASE + 0.005), ("r3", BASE, BASE + 0.005)]
    [split] = audit_hops(records, sent)
    assert list(split) == UNTRACED_HOPS
    assert [round(v * 1000, 3) for v in split.values()] == [3.0, 7.5, 1.5]


def test_schedstat_counts_time_running_and_time_waiting_for_a_core() -> None:
    """Two busy processes pinned to one core: each runs about half the time and waits the rest."""
    cpu = min(os.sched_getaffinity(0))
    rivals = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for rival in rivals:
            os.sched_setaffinity(rival.pid, {cpu})
        before = schedstat(rivals[0].pid)
        time.sleep(0.4)
        ran, waited = (a - b for a, b in zip(schedstat(rivals[0].pid), before))
    finally:
        for rival in rivals:
            rival.kill()
            rival.wait()
    assert ran >= 0.08
    assert waited >= 0.08
