"""Gateway and worker child processes on one machine: the end-to-end tests and the
benchmarks drive real processes through this, exactly as they run in production."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from slogate.local_redis import free_port

ROOT = Path(__file__).resolve().parent.parent


def http_get(url: str, api_key: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def python_path() -> str:
    """This checkout first, then whatever PYTHONPATH already holds (packages installed
    beside the interpreter's own, as on a machine where pip can only ``--target`` a folder)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


@dataclass
class Stack:
    redis_url: str
    env_overrides: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log_dir: Path | None = None
    """Where each process's log goes (``<command>-<n>.log``); None: this process's stderr."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLOGATE_REDIS_URL": self.redis_url, "PYTHONPATH": python_path(),
                "SLOGATE_LOG_LEVEL": "WARNING", **self.env_overrides}

    def _spawn(self, *args: str) -> subprocess.Popen[bytes]:
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{args[0]}-{len(self.procs)}.log", "ab")  # noqa: SIM115 - the child holds it
        try:
            proc = subprocess.Popen([sys.executable, "-m", "slogate.cli", *args], env=self.env(), cwd=ROOT,
                                    stderr=log)
        finally:
            if log is not None:
                log.close()
        self.procs.append(proc)
        return proc

    def gateway(self, *extra: str) -> subprocess.Popen[bytes]:
        proc = self._spawn("gateway", "--port", str(self.port), "--host", "127.0.0.1", *extra)
        self.wait_http("/healthz")
        return proc

    def worker(self, pool: str, engine: str = "sim", *options: str, cpus: str | None = None,
               in_process: bool = False, realtime: bool = False) -> subprocess.Popen[bytes]:
        args = ["worker", "--pool", pool, "--engine", engine] + (["--cpus", cpus] if cpus else [])
        args += ["--in-process"] if in_process else []
        args += ["--realtime"] if realtime else []
        for opt in options:
            args += ["-o", opt]
        return self._spawn(*args)

    def wait_http(self, path: str, status: int = 200, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while True:
            if http_get(self.url + path)[0] == status:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"{path} did not answer {status} within {timeout}s")
            time.sleep(0.05)

    def wait_models(self, model: str, pools: int = 1, timeout: float = 60.0, api_key: str | None = None) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            code, body = http_get(self.url + "/v1/models", api_key)
            if code == 200 and any(m["id"] == model and len(m["pools"]) >= pools
                                   for m in json.loads(body)["data"]):
                return
            time.sleep(0.05)
        raise TimeoutError(f"model {model} not served within {timeout}s")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
