"""The ``slogate`` command: ``up`` (everything), ``gateway``, ``worker``, ``audit-export``,
``gen-key``, ``hash-key`` and ``tiny-model``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any

from redis.exceptions import RedisError

from slogate import logs
from slogate.config import (
    DEFAULT_REDIS_URL,
    ENGINES,
    Config,
    ConfigError,
    load_config,
    missing_model_dir,
    redacted,
    unknown_variables,
)
from slogate.up import CANNOT_START


def engine_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values are read as JSON when they parse (numbers, booleans)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"engine option {pair!r} must look like KEY=VALUE")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out


def _run(main: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def cmd_gateway(args: argparse.Namespace, cfg: Config) -> None:
    from gateway.app import serve
    from slogate.cpus import pin_to, run_first

    if args.cpus:
        pin_to(args.cpus)
    if args.realtime:
        run_first()
    _run(serve(cfg, grace_s=args.grace))


def cmd_worker(args: argparse.Namespace, cfg: Config) -> None:
    if not args.pool.strip():
        raise ConfigError("--pool: must name a pool")
    if args.pool not in cfg.pools and args.engine is None:  # a misspelt pool would serve made-up text
        raise ConfigError(f"--pool: {args.pool!r} is not one of the configured pools ({', '.join(cfg.pools)}); "
                          "configure it, or name its engine with --engine")
    if not 0 <= args.metrics_port <= 65535:  # found once the model has loaded, as a traceback
        raise ConfigError(f"--metrics-port: must be 0 (off) to 65535, got {args.metrics_port}")
    from engines.engine_process import EngineDied
    from engines.registry import TORCH_ENGINES, create_engine, start_engine_process
    from engines.worker import LoopFailed, run_worker
    from slogate.cpus import pin_to, run_first
    from slogate.up import worker_threads

    threads = args.threads
    if args.cpus:
        cpus = pin_to(args.cpus)
        threads = len(cpus) if threads is None else threads
    pool_cfg = cfg.pools.get(args.pool)
    engine_name = args.engine or (pool_cfg.engine if pool_cfg else "sim")
    pool_options = pool_cfg.options if pool_cfg else {}
    # A pool's options are written for its engine (the paged one's KV budget, the sim one's
    # timings). Another engine named with --engine (``slogate up --engine sim`` names it for
    # every pool) takes those it has too and runs without the rest, which it would refuse.
    own, inherited = (pool_options, {}) if pool_cfg is None or pool_cfg.engine == engine_name else ({}, pool_options)
    options = {**own, **engine_options(args.option)}
    model, threads = args.model or cfg.model, worker_threads(cfg, threads)
    if engine_name in TORCH_ENGINES and model and (missing := missing_model_dir(model)):
        raise ConfigError(missing)
    if engine_name in TORCH_ENGINES and not args.in_process:
        engine = start_engine_process(engine_name, model, options, threads, cfg.log_level, cfg.log_format, inherited)
    else:
        engine = create_engine(engine_name, model, options, threads=threads, inherited=inherited)
    if args.realtime:
        run_first()
    try:
        _run(run_worker(engine, cfg, args.pool, grace_s=args.grace, metrics_port=args.metrics_port))
    except (EngineDied, LoopFailed) as exc:
        print(f"slogate: {exc}; the requests this worker held stay pending for other workers", file=sys.stderr)
        sys.exit(1)


def cmd_tiny_model(args: argparse.Namespace, cfg: Config) -> None:
    from engines.registry import quiet_model_loading
    from engines.runtime.tiny_model import build_tiny_model

    quiet_model_loading()
    path = build_tiny_model(args.dir, size=args.size, seed=args.seed)
    print(path)


def cmd_hash_key(args: argparse.Namespace, cfg: Config) -> None:
    from gateway.auth import hash_key

    # stripped as the gateway strips what follows "Bearer", or a key typed with a CR or a space
    # would hash to what no request matches
    secret = (args.secret if args.secret is not None else sys.stdin.readline()).strip()
    if not secret:
        raise ValueError("hash-key: the key is empty")
    print(hash_key(secret))


def cmd_audit_export(args: argparse.Namespace, cfg: Config) -> None:
    """With no Redis configured, the trail is in ``slogate up``'s own Redis: the running one, or
    its saved data read through a Redis of this command's own that saves nothing back."""
    from gateway.audit import export
    from slogate.local_redis import LocalRedis
    from slogate.up import private_redis_dir, running_redis_url

    url, own = cfg.redis_url or running_redis_url(cfg), None
    private = private_redis_dir(cfg)
    if not url and (private / "dump.rdb").exists():
        own = LocalRedis(private).start()
        url = own.url
    url = url or DEFAULT_REDIS_URL
    sent = 0
    try:
        for line in export(url, args.count):
            print(line)
            sent += 1
    finally:
        if own is not None:
            own.stop()
    print(f"slogate: exported {sent} audit entries from {own.state_dir if own else redacted(url)}", file=sys.stderr)


def cmd_gen_key(args: argparse.Namespace, cfg: Config) -> None:
    from slogate.crypto import check_key_id, generate_key

    check_key_id(args.id, "--id: ")  # refused now, not when the key is deployed
    print(f"{args.id}:{generate_key()}")


def cmd_up(args: argparse.Namespace, cfg: Config) -> None:
    from slogate.up import run_up

    sys.exit(run_up(cfg, engine=args.engine, options=engine_options(args.option),
                    config_path=args.config or os.environ.get("SLOGATE_CONFIG"), realtime=args.realtime))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slogate", description=__doc__)
    parser.add_argument("--config", help="YAML config file (default: $SLOGATE_CONFIG)")
    common = argparse.ArgumentParser(add_help=False)  # so that --config may follow the command too
    common.add_argument("--config", default=argparse.SUPPRESS, help="YAML config file (default: $SLOGATE_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kwargs)

    def realtime(cmd: argparse.ArgumentParser, what: str) -> None:
        cmd.add_argument("--realtime", action="store_true",
                         help=f"run {what} at a real-time priority (Linux; root or CAP_SYS_NICE), so that it "
                              "preempts the engines' steps when a message arrives: for hosts where it shares "
                              "cores with them")

    up = add("up", help="run Redis (unless SLOGATE_REDIS_URL is set), the gateway and "
                                   "one worker per pool, and stop them all on Ctrl-C")
    up.add_argument("--model", help="local model directory or hub id (default: build the tiny model)")
    up.add_argument("--engine", choices=["sim", "upstream"],
                    help="sim: simulated engines in every pool; upstream: every pool forwards to an "
                         "OpenAI-compatible server (-o url=http://HOST:PORT/v1, --model: its model's name)")
    up.add_argument("--port", type=int, help="the gateway's port (default: the config's, 8000)")
    up.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option for every worker (e.g. -o decode_base_s=0.004)")
    realtime(up, "the gateway's and the workers' event loops and the Redis it starts")
    up.set_defaults(func=cmd_up)

    gw = add("gateway", help="run one gateway process")
    gw.add_argument("--port", type=int, help="port to listen on (default: the config's, 8000)")
    gw.add_argument("--host", help="address to listen on (default: the config's, 0.0.0.0)")
    gw.add_argument("--grace", type=float, default=30.0,
                    help="seconds open requests get on SIGTERM (a second signal ends them at once)")
    gw.add_argument("--cpus", help="run on these CPUs only, e.g. 0 or 0,2-3 (default: any)")
    realtime(gw, "its event loop")
    gw.set_defaults(func=cmd_gateway)

    wk = add("worker", help="run one engine worker for a pool")
    wk.add_argument("--pool", required=True, help="the pool whose queue it serves (e.g. interactive, batch)")
    wk.add_argument("--engine", choices=ENGINES,
                    help="stream: latency first; paged: throughput (paged KV cache); sim: no model; upstream: "
                         "an OpenAI-compatible server, -o url=http://HOST:PORT/v1 (default: the pool's engine "
                         "in the config)")
    wk.add_argument("--model", help="local model directory or hub id (default: the config's model)")
    wk.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option (e.g. -o max_batch=8)")
    wk.add_argument("--threads", type=int,
                    help="torch threads (default: $OMP_NUM_THREADS, else the cores shared among the config's "
                         "workers, as `slogate up` sets them; with --cpus, one per CPU)")
    wk.add_argument("--cpus", help="run on these CPUs only, e.g. 1 or 2-5: cores of its own keep a latency-bound "
                                   "worker's steps from waiting on other processes (default: any)")
    wk.add_argument("--in-process", action="store_true",
                    help="step the engine on a thread of the worker. Without it the stream and paged "
                         "engines run in a process of their own, so the engine's Python and the worker's "
                         "Redis I/O never wait for each other's GIL")
    wk.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics (0: off)")
    wk.add_argument("--grace", type=float, default=30.0,
                    help="seconds held requests get on SIGTERM (a second signal ends the grace at once, "
                         "leaving them to other workers)")
    realtime(wk, "its event loop (not the engine's steps)")
    wk.set_defaults(func=cmd_worker)

    au = add("audit-export", help="print the audit trail as JSON lines, oldest first")
    au.add_argument("--count", type=int, help="at most this many records")
    au.set_defaults(func=cmd_audit_export)

    gk = add("gen-key", help="print a new AES-256 key entry for encryption_keys")
    gk.add_argument("--id", default="k1", help="the key's id in the ring")
    gk.set_defaults(func=cmd_gen_key)

    hk = add("hash-key", help="print the sha256 of an API key for the api_keys config")
    hk.add_argument("secret", nargs="?", help="the key (default: read one line from stdin)")
    hk.set_defaults(func=cmd_hash_key)

    tm = add("tiny-model", help="build the small local test model (no download)")
    tm.add_argument("dir")
    tm.add_argument("--size", choices=["tiny", "100m"], default="tiny")
    tm.add_argument("--seed", type=int, default=0)
    tm.set_defaults(func=cmd_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    overrides = {k: getattr(args, k, None) for k in ("port", "host", "model")}
    try:
        cfg = load_config(args.config, overrides=overrides)
        logs.setup(cfg.log_level, cfg.log_format)
        for name in unknown_variables():
            logging.getLogger("slogate").warning("%s is not a setting slogate knows; ignored", name)
        args.func(args, cfg)
    except ConfigError as exc:
        print(f"slogate: configuration error: {exc}", file=sys.stderr)
        sys.exit(CANNOT_START)
    except RedisError as exc:  # Redis may come back: a supervisor should restart, not give up
        print(f"slogate: Redis is unreachable: {exc}", file=sys.stderr)
        sys.exit(1)
    except (ValueError, RuntimeError, OSError) as exc:  # a port in use, a file that cannot be read
        print(f"slogate: {exc}", file=sys.stderr)
        sys.exit(CANNOT_START)


if __name__ == "__main__":
    main()
