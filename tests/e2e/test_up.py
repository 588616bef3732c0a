"""``slogate up``: one command brings the whole stack up and takes it all down again."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.auth import hash_key
from slogate.cpus import can_run_first
from slogate.local_redis import free_port
from slogate.processes import http_get, python_path
from tests.test_cpus import policy, threads


def children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def cmdline(pid: int) -> bytes:
    """A process's command line; empty for one that ended since it was listed."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (ProcessLookupError, FileNotFoundError):
        return b""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):  # gone, or reaped as it is read
        return False


def wait_gone(pids: set[int], timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


def up_env(tmp_path: Path, log_level: str = "WARNING") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOGATE_")}
    env.update(SLOGATE_STATE_DIR=str(tmp_path / "state"), SLOGATE_LOG_LEVEL=log_level, PYTHONPATH=python_path())
    return env


@contextlib.contextmanager
def slogate_up(tmp_path: Path, *args: str, stderr: int | None = None, config: Path | None = None,
               log_level: str = "WARNING", env: dict[str, str] | None = None,
               under: tuple[str, ...] = ()) -> Iterator[subprocess.Popen[str]]:
    """``[UNDER] slogate [--config CONFIG] up ARGS`` in ``tmp_path``, killed if a test leaves it running."""
    top = ["--config", str(config)] if config else []
    up = subprocess.Popen([*under, sys.executable, "-m", "slogate.cli", *top, "up", *args],
                          env={**up_env(tmp_path, log_level), **(env or {})}, cwd=tmp_path, stderr=stderr, text=True)
    try:
        yield up
    finally:
        if up.poll() is None:
            up.kill()


def wait_ready(up: subprocess.Popen[str], port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while http_get(f"http://127.0.0.1:{port}/readyz")[0] != 200:
        assert up.poll() is None, "slogate up exited early"
        assert time.monotonic() < deadline, "stack not ready in time"
        time.sleep(0.1)


def one_torch_worker(tmp_path: Path) -> Path:
    """A config whose interactive pool runs the stream engine and whose batch pool the sim one:
    one worker and its engine process load torch, where by default two did side by side (some
    4 s more on 2 cores), for a test of a real engine's worker that needs only one. The restart
    test keeps ``up``'s defaults, both engines."""
    config = tmp_path / "slogate.yaml"
    config.write_text("pools:\n  interactive: {engine: stream}\n  batch: {engine: sim}\n")
    return config


def test_up_with_sim_engines_serves_and_stops_cleanly(tmp_path: Path) -> None:
    """With ``--realtime``: the event loops of every process and Redis's ahead of the engines,
    whose steps (here the sim engines' threads) are not."""
    port = free_port()
    with slogate_up(tmp_path, "--engine", "sim", "--port", str(port), "-o", "decode_base_s=0.001", "--realtime",
                    stderr=subprocess.PIPE, env={"SLOGATE_PORTT": "9"}) as up:
        wait_ready(up, port, 60)
        status, body = http_get(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "slogate-sim"
        kids = children(up.pid)
        assert len(kids) >= 4, "redis, gateway and one worker per pool"
        if can_run_first():
            for pid in kids:
                main, *others = threads(pid)
                assert (policy(main), {policy(tid) for tid in others} - {os.SCHED_OTHER}) == (os.SCHED_RR, set()), \
                    cmdline(pid)
            assert policy(up.pid) == os.SCHED_OTHER
        workers = [cmdline(pid).split(b"\0") for pid in kids]
        ports = [cmd[cmd.index(b"--metrics-port") + 1].decode() for cmd in workers if b"worker" in cmd]
        assert len(ports) == 2
        for metrics_port in ports:
            status, body = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
            assert status == 200 and b"slogate_worker_step_seconds" in body
        assert (tmp_path / "state" / "redis").is_dir(), "the embedded Redis keeps its files under the state folder"
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=60)
        assert up.returncode == 0
        assert not any(alive(pid) for pid in kids), "every process of the stack is gone"
        assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 0
    assert err.count("SLOGATE_PORTT is not a setting") == 1, "warned once, not once a process"


@pytest.mark.skipif(shutil.which("setpriv") is None or resource.getrlimit(resource.RLIMIT_RTPRIO)[0] > 0,
                    reason="needs setpriv to take CAP_SYS_NICE away, and no real-time priority limit")
def test_up_refused_a_realtime_priority_says_so_once_and_serves(tmp_path: Path) -> None:
    port = free_port()
    with slogate_up(tmp_path, "--engine", "sim", "--port", str(port), "--realtime", stderr=subprocess.PIPE,
                    under=("setpriv", "--bounding-set", "-sys_nice")) as up:
        wait_ready(up, port, 60)
        kids = children(up.pid)
        assert {policy(pid) for pid in kids} == {os.SCHED_OTHER}
        assert not any(b"--realtime" in cmdline(pid) for pid in kids), "refused to up, refused to them"
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=60)
    assert err.count("does not allow a real-time priority") == 1, err
    assert "CAP_SYS_NICE" in err and "ulimit -r" in err


def test_up_gives_its_config_file_to_every_process_and_keeps_the_audit_trail(tmp_path: Path) -> None:
    """The file's model reaches the sim workers too, served under its directory's name as a
    real engine serves it: they advertised its full path."""
    port = free_port()
    model = tmp_path / "models" / "my-llama"
    model.mkdir(parents=True)
    config = tmp_path / "slogate.yaml"
    config.write_text(f"port: {port}\nmodel: {model}\napi_keys:\n  - {{id: payments, sha256: {hash_key('sk-pay')}}}\n")
    score = json.dumps({"model": "my-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})

    def post(key: str | None) -> int:
        headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", score.encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    with slogate_up(tmp_path, "--engine", "sim", config=config) as up:
        wait_ready(up, port, 60)
        assert post(None) == 401, "the gateway started by up reads the api_keys of the file given to up"
        assert post("sk-pay") == 200
        status, body = http_get(f"http://127.0.0.1:{port}/v1/models", "sk-pay")
        assert status == 200 and [(m["id"], sorted(m["pools"])) for m in json.loads(body)["data"]] == [
            ("my-llama", ["batch", "interactive"])], body
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    export = subprocess.run([sys.executable, "-m", "slogate.cli", "--config", str(config), "audit-export"],
                            env=up_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert export.returncode == 0, export.stderr
    assert sorted(json.loads(line)["status"] for line in export.stdout.splitlines()) == [200, 401]
    assert "exported 2 audit entries" in export.stderr


def test_up_started_under_nohup_outlives_its_terminal(tmp_path: Path) -> None:
    """nohup leaves SIGHUP ignored so that a stack outlives the terminal; up's handler for its
    terminal closing replaced that, and ``nohup slogate up &`` stopped at logout."""
    port = free_port()
    nohup = subprocess.Popen([sys.executable, "-m", "slogate.cli", "up", "--engine", "sim", "--port", str(port)],
                             env=up_env(tmp_path), cwd=tmp_path,
                             preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        wait_ready(nohup, port, 60)
        nohup.send_signal(signal.SIGHUP)
        time.sleep(1.0)  # up looks every 0.2 s
        assert nohup.poll() is None, "the terminal closing stopped a stack started under nohup"
        assert http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200
        nohup.send_signal(signal.SIGTERM)
        assert nohup.wait(timeout=60) == 0
    finally:
        if nohup.poll() is None:
            nohup.kill()


def test_a_stack_dies_with_up_killed_outright_and_no_second_up_takes_its_place(tmp_path: Path) -> None:
    """Killed outright (SIGKILL: it runs no code), up left its whole stack running as orphans,
    and a second up then said "ready" on the orphaned gateway's answer before failing on its port."""
    port = free_port()

    def up_again(where: Path, *args: str) -> subprocess.CompletedProcess[str]:
        where.mkdir(exist_ok=True)
        return subprocess.run([sys.executable, "-m", "slogate.cli", "up", "--engine", "sim", *args],
                              env=up_env(where), cwd=where, capture_output=True, text=True, timeout=60)

    with slogate_up(tmp_path, "--engine", "sim", "--port", str(port)) as up:
        wait_ready(up, port, 60)
        kids = children(up.pid)
        same_state = up_again(tmp_path, "--port", str(free_port()))
        assert same_state.returncode == 2 and "another slogate up is running" in same_state.stderr
        same_port = up_again(tmp_path / "other", "--port", str(port))
        assert same_port.returncode == 2 and f"cannot listen on port {port}" in same_port.stderr
        assert "slogate is ready" not in same_port.stderr
        up.kill()
        up.wait()
        wait_gone(kids, 30, "the stack outlived its supervisor")
    export = subprocess.run([sys.executable, "-m", "slogate.cli", "audit-export"], env=up_env(tmp_path),
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert export.returncode == 0, "the dead stack's Redis URL, left in its state directory, is not trusted"


def test_up_stops_when_a_worker_cannot_start(tmp_path: Path) -> None:
    """A model that does not load would fail every restart the same way: the stack stops, says
    why, and exits 2."""
    with slogate_up(tmp_path, "--model", "/nonexistent/model", "--port", str(free_port()),
                    stderr=subprocess.PIPE, log_level="INFO", config=one_torch_worker(tmp_path)) as up:
        _, err = up.communicate(timeout=180)
    assert up.returncode == 2
    assert "configuration error: model directory '/nonexistent/model' does not exist" in err, \
        "the worker says it before it starts an engine process"
    assert "could not start as configured" in err
    assert "slogate is ready" not in err


def test_up_restarts_a_worker_whose_engine_process_died(tmp_path: Path, tiny_model_dir: Path) -> None:
    port = free_port()
    with slogate_up(tmp_path, "--model", str(tiny_model_dir), "--port", str(port), stderr=subprocess.PIPE,
                    log_level="INFO") as up:
        wait_ready(up, port, 240)
        time.sleep(1.0)  # up looks every 0.2 s, and says it is ready once it has seen it
        workers = [pid for pid in children(up.pid) if b"worker" in cmdline(pid)]
        worker, engine = next((w, pid) for w in workers for pid in children(w) if b"spawn_main" in cmdline(pid))
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while alive(worker):
            assert time.monotonic() < deadline, "the worker outlived its engine"
            time.sleep(0.1)
        time.sleep(1.5)
        wait_ready(up, port, 240)
        status, body = http_get(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200 and sorted(json.loads(body)["data"][0]["pools"]) == ["batch", "interactive"]
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=60)
    assert up.returncode == 0
    assert err.count("slogate is ready: http://127.0.0.1:") == 1, "said once, when the stack first answers"
    assert "the engine process exited with code -9" in err
    assert "worker exited with code 1; restarting it" in err


def test_start_up_failures_are_one_line_and_exit_2(tmp_path: Path) -> None:
    """A port in use is the operator's to fix, like a bad config: one line, exit 2 (``up`` then
    stops instead of restarting); an unreachable Redis may come back: exit 1."""
    def slogate(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "slogate.cli", *args], env={**up_env(tmp_path), **env},
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        gateway = slogate("gateway", "--host", "127.0.0.1", "--port", port)
        worker = slogate("worker", "--pool", "interactive", "--engine", "sim", "--metrics-port", port)
    beyond = slogate("worker", "--pool", "interactive", "--engine", "sim", "--metrics-port", "70000",
                     SLOGATE_REDIS_URL="redis://127.0.0.1:1/0")
    unreachable = slogate("audit-export", SLOGATE_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    for run, code in ((gateway, 2), (worker, 2), (beyond, 2), (unreachable, 1)):
        assert run.returncode == code, run.stderr
        assert "Traceback" not in run.stderr
        assert run.stderr.strip().splitlines()[-1].startswith("slogate: ")
    assert "address already in use" in gateway.stderr.lower()
    assert "Redis is unreachable" in unreachable.stderr
    assert "--metrics-port" in beyond.stderr


def test_up_in_front_of_a_server_you_run(tmp_path: Path) -> None:
    """``--engine upstream``: every pool forwards to an OpenAI-compatible server (here a second
    ``slogate up``); without ``--model``, the name to ask it for, the stack stops at once, saying so."""
    server_port, front_port = free_port(), free_port()
    (tmp_path / "server").mkdir()
    (tmp_path / "front").mkdir()
    url = f"url=http://127.0.0.1:{server_port}/v1"
    with slogate_up(tmp_path / "server", "--engine", "sim", "--port", str(server_port)) as server:
        wait_ready(server, server_port, 60)
        with slogate_up(tmp_path / "front", "--engine", "upstream", "--port", str(front_port), "-o", url,
                        stderr=subprocess.PIPE) as nameless:
            _, err = nameless.communicate(timeout=60)
        assert nameless.returncode == 2 and "the upstream engine needs --model" in err
        with slogate_up(tmp_path / "front", "--engine", "upstream", "--model", "slogate-sim", "--port",
                        str(front_port), "-o", url) as front:
            wait_ready(front, front_port, 60)
            ask = json.dumps({"model": "slogate-sim", "max_tokens": 4, "prompt": "risk"}).encode()
            answers = []
            for port in (front_port, server_port):
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", ask,
                                                 {"content-type": "application/json"})
                with urllib.request.urlopen(request, timeout=10) as resp:
                    answers.append(json.loads(resp.read())["choices"][0]["text"])
            assert answers[0] == answers[1] and len(answers[0].split()) == 4
