"""Configuration: one YAML file plus ``SLOGATE_*`` environment overrides, validated at start.

A bad value stops the process with a message naming the key, because a gateway that starts
with a silently ignored setting is worse than one that does not start.
"""

from __future__ import annotations

import math
import os
import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
import yaml

from policies.config import PolicyConfig


class ConfigError(ValueError):
    pass


class ApiKeyConfig(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    """A name for logs, metrics, audit and rate limits: never the secret."""
    sha256: str
    """Hex SHA-256 of the secret (``slogate hash-key``); the secret itself is never stored."""
    models: list[str] = []
    """Models this key may use; empty means all."""

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256.lower()):
            raise ValueError(f"api key {self.id!r}: sha256 must be 64 hex digits")


ENGINES = ("sim", "stream", "paged", "upstream")


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True):
    engine: str = "sim"
    """One of ``ENGINES``."""
    workers: int = 1
    options: dict[str, Any] = {}
    """Passed to the engine factory (sim timings, block budget, dtype...)."""


def _default_pools() -> dict[str, PoolConfig]:
    return {"interactive": PoolConfig(engine="stream"), "batch": PoolConfig(engine="paged")}


class Config(msgspec.Struct, forbid_unknown_fields=True):
    redis_url: str | None = None
    """Unset: ``slogate up`` starts a private redis-server under ``state_dir``."""
    redis_timeout_s: float = 5.0
    """How long the gateway waits for Redis to answer a command (its result reader's blocking
    read has no timeout: ``redis_keepalive``). A Redis that hangs fails each command after this
    long (a request being queued: a 503), and holds a stopping gateway's exit as long on its last
    clean-ups."""
    redis_grace_s: float = 3.0
    """How long the gateway's result reader retries a Redis it cannot read before it fails every
    waiting request with a 503: a dropped connection or a restart is over by then, and the
    requests go on where they were (records carry their offsets, so one lost on the way is a
    502, never a hole in the text)."""
    alive_ttl_s: float = 5.0
    """How long the gateway's alive key outlives its last renewal (about once a second): the
    workers stop the requests of a gateway whose key is gone, so a gateway that died holds the
    engines this long at most, plus the workers' checks a second apart. Shorter frees them
    sooner; a gateway whose loop stalls longer (or whose renewals Redis refuses that long) has
    its running requests stopped as a dead one's. At least 2 s, or a live gateway's key would
    lapse between two renewals."""
    host: str = "0.0.0.0"
    port: int = 8000
    state_dir: str = ".slogate"
    model: str | None = None
    """Local directory or hub id served by the real engines; unset builds the tiny model."""
    pools: dict[str, PoolConfig] = msgspec.field(default_factory=_default_pools)
    encryption_keys: str | None = None
    """``id:base64key,...``: prompts and completions in Redis are sealed with AES-256-GCM under
    the first key; every key opens (rotation: see README). ``slogate gen-key`` makes one."""
    api_keys: list[ApiKeyConfig] = []
    """Empty: no authentication (local use; the gateway warns at start)."""
    policies: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    admission_control: bool = True
    """Off: every request is queued (for measuring what admission control buys)."""
    max_body_bytes: int = 1 << 20
    client_timeout_s: float = 30.0
    """A connection with no complete request for this long (idle between requests, or headers
    that never end) is closed, and a body that does not arrive in this long is a 408."""
    default_max_tokens: int = 256
    """max_tokens of a request that sets none (OpenAI's own default is the whole context)."""
    max_messages: int = 256
    """Messages one chat request may carry."""
    max_n: int = 8
    """Choices (``n``) one request may ask for: each is an engine request of its own."""
    max_streams_per_key: int = 64
    """Streams one API key may hold open at once, across all gateways (enforced when keys are on)."""
    max_timeout_s: float = 3600.0
    """Largest deadline a client may ask for with ``x-slogate-timeout``; without the header a
    request gets its class's deadline from the policies."""
    sse_keep_alive_s: float = 15.0
    """A stream that has sent nothing for this long sends an SSE comment (clients skip it), so
    that proxies and load balancers that close idle connections keep a queued stream open."""
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 3.0
    claim_idle_s: float = 15.0
    """A request left pending this long by a dead worker is claimed by another."""
    engine_stall_s: float = 60.0
    """A worker whose engine holds requests and has not finished a step for this long stops
    (and is restarted by ``slogate up``), leaving its requests to other workers: a hung engine
    would otherwise hold them until their deadlines while its heartbeat says all is well."""
    stall_pause_s: float = 5.0
    """A worker whose engine has been in one step this long (a hang, or a prefill of many
    thousand tokens on a CPU) takes no new requests and shows no capacity until the step ends."""
    workerless_grace_s: float = 60.0
    """A request whose pool has had no live worker for this long (since the later of the last
    worker's loss and the request's start) is ended with a 503 and cancelled. Shorter losses
    are ridden out: a restarted worker takes the requests over."""
    max_attempts: int = 3
    """Deliveries before a request that keeps killing workers is failed instead of retried."""
    result_ttl_s: float = 60.0
    """How long a reply stream outlives its last write (so it goes when its gateway dies), and
    a cancel flag its request's deadline."""
    worker_poll_s: float = 0.5
    """How often the gateway refreshes its view of worker heartbeats."""
    audit_max_entries: int = 1_000_000
    """Audit records kept in Redis, about (older ones are trimmed; a record is about 400 bytes
    of Redis memory); export them with audit-export."""
    log_level: str = "INFO"
    log_format: str = "json"
    """json (one object a line, with request and trace ids) or text."""


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


_COERCE = {int: int, float: float, str: str, bool: _bool}


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
"""Where every process looks for Redis when none is configured (``slogate up`` starts its own)."""


def served_model_id(model: str) -> str:
    """The id a worker serving ``model`` advertises (``/v1/models``, its heartbeat): a local
    directory's name, a hub id as given. Every engine uses it, the sim one too, so that the pools
    of one ``slogate up --model DIR`` advertise one model, not a name and a path. A name written as
    a path is one whether or not this host has it (a sim worker of a compose stack need not), and
    is made absolute first (symlinks kept as named): ``.`` or ``..`` has no name of its own."""
    return Path(os.path.abspath(model)).name if _written_as_path(model) or Path(model).is_dir() else model


def _written_as_path(model: str) -> bool:
    return model.startswith(("/", "./", "../")) or model in (".", "..")


def missing_model_dir(model: str) -> str | None:
    """Why a model named as a path (``/``, ``./``, ``../``) cannot load: it does not exist, and is
    no hub id to look up either. None for any other name. Torch-free, so that a worker says it
    before it starts an engine process, which spends seconds importing torch to find it out."""
    if _written_as_path(model) and not Path(model).exists():
        return f"model directory '{model}' does not exist"
    return None


def redacted(url: str) -> str:
    """``url`` fit for a log line: a password in it (``user:pass@`` or redis-py's
    ``?password=``) becomes ``***``."""
    parts = urlsplit(url)
    if parts.password:
        host = parts.netloc.rpartition("@")[2]
        url = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
    base, mark, query = url.partition("?")
    return base + mark + re.sub(r"(^|&)(password=)[^&#]*", r"\1\2***", query, flags=re.IGNORECASE)


def redis_keepalive(url: str) -> dict[str, object]:
    """TCP keepalive probes for connections that block in a read without a timeout: the
    gateway's result reader in XREAD (a read timeout would cost a task per read under Python
    3.11) and a worker's cancel subscription (redis-py's pub/sub reads without one). A Redis
    that a network fault cut off silently would otherwise hang them for good: the gateway's
    every stream and its ``alive`` key, the worker's cancels. Probes start after 5 s of silence;
    3 unanswered ones, 1 s apart, break the connection, and its reader reconnects. A command
    sent and not acknowledged for 8 s (when no probes go) breaks it too (``TCP_USER_TIMEOUT``,
    where there is one)."""
    if not url.startswith(("redis://", "rediss://")):
        return {}
    options = {getattr(socket, name): value for name, value in
               (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 8000))
               if hasattr(socket, name)}
    return {"socket_keepalive": True, "socket_keepalive_options": options}


def load_config(path: str | Path | None = None, env: dict[str, str] | None = None,
                overrides: dict[str, Any] | None = None) -> Config:
    """Read the YAML file (or defaults), apply ``SLOGATE_<KEY>`` env vars, then CLI overrides."""
    env = os.environ if env is None else env
    raw: dict[str, Any] = {}
    path = path or env.get("SLOGATE_CONFIG")
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"config file {path} is not valid YAML: {problem}{where}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        raw.update(loaded)
    for name, field_type in _scalar_fields().items():
        value = env.get(f"SLOGATE_{name.upper()}")
        if value:  # set but empty (compose's ${VAR:-}) is unset, not an empty setting
            raw[name] = _parse_env(name, value, field_type)
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    pools = raw.pop("pools", None)
    cfg = _convert(raw, Config, "")
    if pools is not None:
        if not isinstance(pools, dict) or not pools:
            raise ConfigError("pools: must map pool names to their settings")
        cfg.pools = {str(name): _convert(p or {}, PoolConfig, f"pools.{name}.") for name, p in pools.items()}
    _check_ranges(cfg)
    return cfg


OTHER_VARIABLES = frozenset({"SLOGATE_CONFIG", "SLOGATE_PAGED_KERNEL", "SLOGATE_TRACE_FILE", "SLOGATE_TEST_DEVICE",
                             "SLOGATE_WORKLOAD", "SLOGATE_MODEL_NAME"})
"""``SLOGATE_*`` variables that are not configuration keys but are read elsewhere."""


def unknown_variables(env: dict[str, str] | None = None) -> list[str]:
    """``SLOGATE_*`` variables that nothing reads: a misspelt one (``SLOGATE_PORTT``) would
    otherwise leave its setting at the default without a word."""
    env = os.environ if env is None else env
    known = {f"SLOGATE_{name.upper()}" for name in _scalar_fields()} | OTHER_VARIABLES
    return sorted(name for name in env if name.startswith("SLOGATE_") and name not in known)


def _scalar_fields() -> dict[str, type]:
    fields = {}
    for f in msgspec.structs.fields(Config):
        base = f.type
        if base in (int, float, str, bool) or base == (str | None):
            fields[f.name] = str if base == (str | None) else base
    return fields


def _parse_env(name: str, value: str, field_type: type) -> Any:
    try:
        return _COERCE[field_type](value)
    except ValueError as exc:
        raise ConfigError(f"SLOGATE_{name.upper()}={value!r}: expected {field_type.__name__}") from exc


def _convert(raw: Any, kind: type, prefix: str) -> Any:
    """msgspec says ``... - at `$.port```; lead with the full key instead."""
    try:
        return msgspec.convert(raw, kind, strict=False)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        if " - at `$." in msg:
            what, where = msg.rsplit(" - at `$.", 1)
            msg = f"{prefix}{where.rstrip('`')}: {what}"
        elif prefix:
            msg = f"{prefix.rstrip('.')}: {msg}"
        raise ConfigError(f"invalid configuration: {msg}") from None


def _check_ranges(cfg: Config) -> None:
    positive = ["port", "audit_max_entries", "max_messages", "max_n", "max_streams_per_key", "max_body_bytes",
                "default_max_tokens", "max_timeout_s", "sse_keep_alive_s", "client_timeout_s",
                "heartbeat_interval_s", "heartbeat_ttl_s", "claim_idle_s", "engine_stall_s", "stall_pause_s",
                "workerless_grace_s", "max_attempts", "result_ttl_s", "worker_poll_s", "redis_timeout_s",
                "redis_grace_s", "alive_ttl_s"]
    for key in positive:
        if not 0 < getattr(cfg, key) < math.inf:  # NaN too, which every comparison lets through
            raise ConfigError(f"{key}: must be a positive finite number, got {getattr(cfg, key)}")
    if cfg.alive_ttl_s < 2:
        raise ConfigError(f"alive_ttl_s: must be at least 2 (it is renewed about once a second), got {cfg.alive_ttl_s}")
    if cfg.port > 65535:
        raise ConfigError(f"port: must be at most 65535, got {cfg.port}")
    if cfg.heartbeat_ttl_s <= cfg.heartbeat_interval_s:
        raise ConfigError("heartbeat_ttl_s: must exceed heartbeat_interval_s, or live workers flicker")
    if cfg.stall_pause_s >= cfg.engine_stall_s:
        raise ConfigError("stall_pause_s: must be below engine_stall_s, or a stalled worker takes requests "
                          "until it ends")
    if cfg.log_format not in ("json", "text"):
        raise ConfigError(f"log_format: must be json or text, got {cfg.log_format!r}")
    if cfg.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"log_level: must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {cfg.log_level!r}")
    for name, pool in cfg.pools.items():
        if pool.workers < 0:
            raise ConfigError(f"pools.{name}.workers: must be >= 0")
        if pool.engine not in ENGINES:
            raise ConfigError(f"pools.{name}.engine: unknown engine {pool.engine!r}; choose one of "
                              f"{', '.join(ENGINES)}")
    known = {k.id for k in cfg.api_keys} or {"anonymous"}
    for where, named in (("rate_limits.per_key", cfg.policies.rate_limits.per_key),
                         ("classification.key_classes", cfg.policies.classification.key_classes)):
        unknown = sorted(set(named) - known)
        if unknown:  # a misspelt id would never apply
            raise ConfigError(f"policies.{where}: {unknown[0]!r} is not the id of any configured API key "
                              f"({', '.join(sorted(known))})")
    routing = cfg.policies.routing
    for where, named in (("pools.interactive", routing.pools.interactive), ("pools.batch", routing.pools.batch),
                         ("interactive_spill", routing.interactive_spill)):
        unknown = [p for p in named if p not in cfg.pools]
        if unknown:  # nobody would read its queue, nor would the gateway watch its depth
            raise ConfigError(f"policies.routing.{where}: pool {unknown[0]!r} is not one of the configured pools "
                              f"({', '.join(cfg.pools)})")
