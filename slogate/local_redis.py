"""A private redis-server on a free port: the embedded default of ``slogate up`` and the
fixture of the tests. Real Redis, not a fake, so what passes here passes in production."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from slogate.tether import die_with_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_MAX_SOCKET_PATH = 100
"""sun_path holds 108 bytes on Linux and 104 on macOS, the terminating NUL included."""


class LocalRedis:
    def __init__(self, state_dir: Path, port: int | None = None, persist: bool = False,
                 tethered: bool = False) -> None:
        """``tethered``: it stops when this process dies, however it dies (:mod:`slogate.tether`)."""
        self.state_dir = Path(state_dir)
        self.port = port or free_port()
        self.persist = persist
        self.tethered = tethered
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        return self.state_dir.resolve() / "redis.sock"

    @property
    def url(self) -> str:
        """Its Unix socket, where the path fits one (about 100 bytes): the gateway and the
        workers on this machine spend a tenth less CPU in each command than over TCP loopback,
        and Redis a fifth less. TCP (``tcp_url``) stays open for tools."""
        return f"unix://{self.socket_path}?db=0" if self._socket_fits() else self.tcp_url

    @property
    def tcp_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _socket_fits(self) -> bool:
        return len(bytes(self.socket_path)) <= _MAX_SOCKET_PATH

    def start(self, timeout: float = 10.0) -> "LocalRedis":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed: install it (apt-get install redis-server) "
                "or point SLOGATE_REDIS_URL at a running Redis"
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        args = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.state_dir),
            *(["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"] if self._socket_fits() else []),
            "--save", "60 1000" if self.persist else "", "--appendonly", "no",
            "--logfile", str(self.state_dir / "redis.log"), "--daemonize", "no",
        ]
        # Its own session: a Ctrl-C at the terminal must reach the supervisor, which stops Redis
        # last, after the processes that still need it have drained.
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=die_with_parent() if self.tethered else None)
        client = redis.Redis(port=self.port)
        end = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    log = (self.state_dir / "redis.log")
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server did not start on port {self.port}: {tail}")
                time.sleep(0.02)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
