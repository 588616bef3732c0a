"""The locust scenarios of ``loadtests/``, run headless for a few seconds against a stack."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from slogate.local_redis import LocalRedis
from slogate.processes import ROOT, http_get, python_path
from tests.e2e.conftest import start_stack


def _workload(path: Path) -> Path:
    rows = [{"id": "s", "class_hint": "interactive", "endpoint": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": "score txn 1"}], "max_tokens": 4}},
            {"id": "r", "class_hint": "batch", "endpoint": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": "credit report"}], "max_tokens": 400, "stream": True}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_credit_report_whose_stream_ends_in_an_error_is_a_failure(redis_server: LocalRedis, tmp_path: Path) -> None:
    """A stream that fails after its 200 (here its pool's last worker dies) ends with an error
    event; ReportWriter counted it as a report written."""
    stack = start_stack(redis_server, decode_base_s=0.02, SLOGATE_WORKERLESS_GRACE_S="1")
    batch_worker = stack.procs[-1]
    env = {**os.environ, "PYTHONPATH": python_path(), "SLOGATE_WORKLOAD": str(_workload(tmp_path / "mix.jsonl"))}
    locust = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"), "--host", stack.url,
         "--headless", "-u", "1", "-r", "1", "-t", "10s", "--only-summary", "--csv", str(tmp_path / "run"),
         "ReportWriter"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while b"slogate_gateway_requests_in_flight 1.0" not in http_get(stack.url + "/metrics")[1]:
            assert locust.poll() is None and time.monotonic() < deadline, "no credit report reached the gateway"
            time.sleep(0.05)
        time.sleep(0.5)  # streaming by now: 400 tokens take 8 s
        batch_worker.send_signal(signal.SIGKILL)
        assert locust.wait(timeout=60) is not None
    finally:
        if locust.poll() is None:
            locust.kill()
        stack.stop()
    with open(tmp_path / "run_failures.csv") as f:
        failures = [row["Error"] for row in csv.DictReader(f) if row["Name"] == "credit-report"]
    assert any("no_live_worker" in error for error in failures), failures
