"""``slogate up``: one command brings the whole stack up and takes it all down again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from slogate.local_redis import free_port
from slogate.processes import http_get, python_path


def children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_up_with_sim_engines_serves_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOGATE_")}
    env.update(SLOGATE_STATE_DIR=str(tmp_path / "state"), SLOGATE_LOG_LEVEL="WARNING", PYTHONPATH=python_path())
    up = subprocess.Popen([sys.executable, "-m", "slogate.cli", "up", "--engine", "sim", "--port", str(port),
                           "-o", "decode_base_s=0.001"], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while http_get(f"http://127.0.0.1:{port}/readyz")[0] != 200:
            assert up.poll() is None, "slogate up exited early"
            assert time.monotonic() < deadline, "stack not ready in time"
            time.sleep(0.1)
        status, body = http_get(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "slogate-sim"
        kids = children(up.pid)
        assert len(kids) >= 4, "redis, gateway and one worker per pool"
        assert (tmp_path / "state" / "redis").is_dir(), "the embedded Redis keeps its files under the state folder"
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        assert not any(alive(pid) for pid in kids), "every process of the stack is gone"
        assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 0
    finally:
        if up.poll() is None:
            up.kill()
