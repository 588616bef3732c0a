"""``slogate up``: the whole stack on one machine, under one supervisor.

Each part runs as its own process, exactly as it would in a fleet (so what works here works
with replicas), and the supervisor stops them all on Ctrl-C, SIGTERM or SIGHUP (a second one
stops them at once); they die with it if it is killed outright. A worker that exits
on its own is restarted; its requests stay pending in Redis meanwhile. One that cannot start
as configured (a model that does not load) stops the stack: a restart would fail the same way.
"""

from __future__ import annotations

import fcntl
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, TextIO

from slogate.config import Config, unknown_variables
from slogate.cpus import can_run_first, run_first, usable_cpus
from slogate.local_redis import LocalRedis, free_port
from slogate.tether import die_with_parent

log = logging.getLogger("slogate.up")
REAL_ENGINES = {"stream", "paged"}
CANNOT_START = 2
"""The exit code of a ``slogate`` command that could not start as configured."""


def _tiny_model(state_dir: Path) -> str:
    """Built by a process of its own: torch's threads would stay in this one, and a process
    with threads cannot safely run the tether (:mod:`slogate.tether`) as it starts the stack."""
    target = state_dir / "models" / "tiny"
    if not (target / "config.json").exists():
        log.info("building the tiny model under %s (first run only)", target)
        built = subprocess.run([sys.executable, "-m", "slogate.cli", "tiny-model", str(target)],
                               stdout=subprocess.DEVNULL)
        if built.returncode != 0:  # its reason is above, on stderr
            raise RuntimeError(f"building the tiny model under {target} failed (exit code {built.returncode})")
    return str(target)


def shared_core_threads(cfg: Config) -> int:
    """Torch threads per worker when all of ``cfg``'s workers share the cores this process may
    run on: threads that outnumber the cores spin-wait on each other and run several times
    slower (measured on 2 cores)."""
    return max(1, usable_cpus() // max(1, sum(p.workers for p in cfg.pools.values())))


def worker_threads(cfg: Config, requested: int | None = None) -> int:
    """A worker's torch threads: ``requested``, else ``OMP_NUM_THREADS`` (what ``slogate up``
    hands its workers), else the share of the cores ``slogate up`` would give it."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be at least 1, got {requested}")
        return requested
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return shared_core_threads(cfg)


def _worker_commands(cfg: Config, engine: str | None, options: dict[str, Any]) -> list[list[str]]:
    cmds = []
    for pool, pool_cfg in cfg.pools.items():
        name = engine or pool_cfg.engine
        cmd = [sys.executable, "-m", "slogate.cli", "worker", "--pool", pool, "--engine", name]
        if name in REAL_ENGINES and cfg.model:
            cmd += ["--model", cfg.model]
        for key, value in options.items():
            cmd += ["-o", f"{key}={json.dumps(value)}"]
        cmds += [[*cmd, "--metrics-port", str(free_port())] for _ in range(pool_cfg.workers)]
    return cmds


def _local_host(host: str) -> str:
    """Where this machine reaches a server listening on ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _ready(url: str) -> bool:
    """Whether the gateway answers ``/readyz`` with 200: it listens, and every pool has a worker
    (a model can take minutes to load; "ready" is the line to wait for)."""
    try:
        with _DIRECT.open(url, timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return False


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""This machine's own gateway: never through an ``http_proxy`` the environment names."""


def private_redis_dir(cfg: Config) -> Path:
    """Where ``up``'s own Redis keeps its data, and while it runs, its URL (in ``url``)."""
    return Path(cfg.state_dir).resolve() / "redis"


def run_up(cfg: Config, engine: str | None = None, options: dict[str, Any] | None = None,
           config_path: str | None = None, realtime: bool = False) -> int:
    """``config_path``: the file ``cfg`` was read from, which every process started here reads too.
    ``realtime``: the serving loops ahead of the engines' steps (:func:`slogate.cpus.run_first`)."""
    state_dir = Path(cfg.state_dir).resolve()
    lock = _lock(state_dir)
    if lock is None:
        log.error("another slogate up is running with state directory %s; stop it first, or give this one "
                  "its own (state_dir)", state_dir)
        return CANNOT_START
    taken = _port_taken(cfg.host, cfg.port)
    if taken:
        log.error("cannot listen on port %d: %s; stop what listens there, or pass --port", cfg.port, taken)
        return CANNOT_START
    if engine is None and not cfg.model and any(p.engine in REAL_ENGINES for p in cfg.pools.values()):
        cfg.model = _tiny_model(state_dir)
    redis = None
    if not cfg.redis_url:
        redis = LocalRedis(private_redis_dir(cfg), persist=True, tethered=True).start()
        cfg.redis_url = redis.url
        (redis.state_dir / "url").write_text(redis.url)
        log.info("started redis-server on %s (state in %s)", redis.url, redis.state_dir)
    if realtime:  # refused here, refused to every process: said once, here
        realtime = run_first(redis.proc.pid) if redis is not None else can_run_first()
    env = {**os.environ, "SLOGATE_REDIS_URL": cfg.redis_url}
    for name in unknown_variables(env):  # warned about once, by this process; each child would again
        del env[name]
    env.setdefault("OMP_NUM_THREADS", str(shared_core_threads(cfg)))
    if cfg.model:
        env["SLOGATE_MODEL"] = cfg.model
    config_args = ["--config", str(Path(config_path).resolve())] if config_path else []
    flags = ["--realtime"] if realtime else []
    gateway_cmd = [sys.executable, "-m", "slogate.cli", *config_args, "gateway", "--port", str(cfg.port),
                   "--host", cfg.host, *flags]
    worker_cmds = [[*c[:3], *config_args, *c[3:], *flags] for c in _worker_commands(cfg, engine, options or {})]
    procs: dict[int, tuple[list[str], subprocess.Popen[bytes]]] = {}
    stopping = False
    code = 0

    def on_signal(signum: int, frame: Any) -> None:
        """The first stops the stack in order, letting requests finish; a second, at once."""
        nonlocal stopping, code
        if stopping:
            log.warning("stopping at once")
            code = 1
            for _, proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
        stopping = True

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: its terminal closed
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue  # started under nohup, to outlive its terminal
        signal.signal(sig, on_signal)
    # Their own sessions: a Ctrl-C at the terminal reaches this supervisor, which stops them in
    # order; tethered, they stop when it dies, however it dies.
    start = lambda cmd: subprocess.Popen(cmd, env=env, start_new_session=True,  # noqa: E731
                                         preexec_fn=die_with_parent())
    for i, cmd in enumerate([gateway_cmd, *worker_cmds]):
        procs[i] = (cmd, start(cmd))
    log.info("starting the gateway on port %d and %d worker(s); Ctrl-C stops them", cfg.port, len(worker_cmds))
    for cmd in worker_cmds:
        log.info("worker of pool %s: metrics on http://127.0.0.1:%s/metrics", cmd[cmd.index("--pool") + 1],
                 cmd[cmd.index("--metrics-port") + 1])
    readyz = f"http://{_local_host(cfg.host)}:{cfg.port}/readyz"
    ready = False
    try:
        while not stopping:
            time.sleep(0.2)
            for i, (cmd, proc) in list(procs.items()):
                if proc.poll() is None:
                    continue
                if i == 0:
                    log.error("the gateway exited with code %s; stopping", proc.returncode)
                    stopping, code = True, 1
                    break
                if proc.returncode == CANNOT_START:
                    log.error("a worker could not start as configured (its reason is above); stopping")
                    stopping, code = True, CANNOT_START
                    break
                log.warning("worker exited with code %s; restarting it", proc.returncode)
                time.sleep(1.0)
                procs[i] = (cmd, start(cmd))
            if not stopping and not ready and _ready(readyz):
                ready = True
                log.info("slogate is ready: http://%s:%d/v1", _local_host(cfg.host), cfg.port)
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 35
        for _, proc in procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        if redis is not None:
            (redis.state_dir / "url").unlink(missing_ok=True)
            redis.stop()
        lock.close()
    return code


def _lock(state_dir: Path) -> TextIO | None:
    """The state directory's lock, held for as long as the stack runs; None if another holds it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = open(state_dir / "up.lock", "w")  # noqa: SIM115 - the caller holds it
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


def running_redis_url(cfg: Config) -> str | None:
    """The URL of the Redis of a ``slogate up`` running on ``cfg``'s state directory, if one is.
    The file that names it outlives an ``up`` killed outright, while its Redis dies with it."""
    url_file = private_redis_dir(cfg) / "url"
    if not url_file.exists():
        return None
    lock = _lock(Path(cfg.state_dir).resolve())
    if lock is None:
        return url_file.read_text().strip()
    url_file.unlink(missing_ok=True)
    lock.close()
    return None


def _port_taken(host: str, port: int) -> str | None:
    """Why the gateway could not listen on ``port``, found before anything starts: a gateway
    still there (an earlier stack's) would otherwise answer this stack's readiness probe."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
