"""The aiohttp application: middlewares for what every request shares, thin handlers, and
the background tasks (result reader, fleet view) tied to the app's lifetime."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong
from opentelemetry.trace import Span, SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway import completions, prompt_ratios
from gateway.audit import AuditLog
from gateway.auth import KeyStore
from gateway.batcher import CommandBatcher
from gateway.errors import APIError, unsupported_encoding
from gateway.metrics import GatewayMetrics
from gateway.openapi import openapi_document
from gateway.ratelimit import RateLimiter
from gateway.results import ResultMux
from gateway.state import AUDIT, COUNTED, REQUEST_ID, STATE, STREAM_ERROR, GatewayState
from gateway.workers import WorkerDirectory
from policies.admission import AdmissionController
from slogate import logs, tracing
from slogate.config import DEFAULT_REDIS_URL, Config, redacted, redis_keepalive
from slogate.crypto import Sealer
from slogate.heap import freeze_startup_heap
from slogate.tasks import cancel_and_wait

log = logging.getLogger("slogate.gateway")
_AUDITED = frozenset({"/v1/chat/completions", "/v1/completions"})
_CLIENT_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
_json = msgspec.json.Encoder()


@web.middleware
async def edge(request: web.Request, handler) -> web.StreamResponse:
    """Request id on every response; every failure in OpenAI's error shape. A completion
    request's span starts here, so that its status and the lines logged about it (a client
    that left, a failure) carry its trace."""
    given = request.headers.get("x-request-id")
    request_id = given if given and _CLIENT_ID.match(given) else os.urandom(16).hex()
    request[REQUEST_ID] = request_id
    request[AUDIT] = {}
    logs.request_id.set(request_id)
    started = time.time()
    traced = request.path in _AUDITED
    with (tracing.span(f"{request.method} {request.path}", SpanKind.SERVER, **{"slogate.request_id": request_id})
          if traced else tracing.OFF) as span:
        try:
            resp = await handler(request)
        except APIError as err:
            resp = err.response()
            _count_unqueued(request, err.status, err.code)
        except web.HTTPException as exc:
            err = _http_error(request, exc)
            resp = err.response()
            if traced:  # a scanner's 404s are no refused completions
                _count_unqueued(request, err.status, err.code)
        except asyncio.CancelledError:
            if request.app[STATE].cut_off(request):
                _cut_off(request, started, span)
            else:
                _client_left(request, started, span)
            raise
        except Exception as exc:
            if isinstance(exc, ConnectionResetError) and _client_gone(request):
                _client_left(request, started, span)
                return web.Response(status=CLIENT_CLOSED)
            log.exception("unhandled error serving %s %s", request.method, request.path)
            resp = APIError(500, "internal error in the gateway; the request id is in x-request-id",
                            None, "internal_error").response()
            _count_unqueued(request, 500, "internal_error")
        if not resp.prepared:
            resp.headers["x-request-id"] = request_id
        tracing.set_http_status(span, resp.status)
        if (failed := request.get(STREAM_ERROR)) is not None:
            tracing.set_stream_error(span, failed.status, failed.code)
    _audit(request, started, resp.status)
    return resp


def _client_left(request: web.Request, started: float, span: Span | None) -> None:
    log.info("the client closed the connection during %s %s", request.method, request.path)
    _ended(request, started, span, CLIENT_CLOSED, "cancelled")


def _cut_off(request: web.Request, started: float, span: Span | None) -> None:
    """A handler cancelled by the shutdown: the gateway ended it (``GatewayState.cut_off``)."""
    log.info("the grace was over before %s %s finished: ended with 503 shutting_down", request.method,
             request.path)
    _ended(request, started, span, 503, "shutting_down")


def _ended(request: web.Request, started: float, span: Span | None, status: int, code: str) -> None:
    """The span, count and audit record of a request whose handler was cancelled: it has no
    response to take them from."""
    tracing.set_http_status(span, status)
    if request.path in _AUDITED:  # a scrape of /metrics that timed out is no refused completion
        _count_unqueued(request, status, code)
    request[AUDIT].setdefault("outcome", code)
    _audit(request, started, status)


def _count_unqueued(request: web.Request, status: int, code: str | None) -> None:
    """A request that ended before it was queued, whatever ended it (a refusal, a client that
    left, a failure of the gateway's), in ``slogate_rejected_requests_total``: one queued is in
    ``slogate_requests_total`` by its outcome, so that every request is in one of the two."""
    if not request.get(COUNTED):
        request.app[STATE].metrics.rejected.labels(str(status), code or "").inc()


CLIENT_CLOSED = 499
"""The status the audit trail gives a request whose client left before its answer ended
(nginx's "client closed request"); it is never sent."""


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _audit(request: web.Request, started: float, status: int) -> None:
    """Every completion request goes into the audit trail, whatever became of it: a client that
    leaves mid-answer is recorded with what it was sent (``outcome`` says how it ended)."""
    if request.path in _AUDITED:
        request.app[STATE].audit.write(request[REQUEST_ID], started, status, request[AUDIT])


def _http_error(request: web.Request, exc: web.HTTPException) -> APIError:
    if exc.status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        return APIError(405, f"method {request.method} is not allowed on {request.path}"
                             + (f" (allowed: {allowed})" if allowed else ""), None, "method_not_allowed",
                        {"Allow": allowed} if allowed else None)
    if exc.status == 404:
        return APIError(404, f"no such endpoint: {request.method} {request.path}", None, "unknown_url")
    if exc.status == 413:
        return APIError(413, "request body too large", None, "request_too_large")
    if exc.status == 417:
        return APIError(417, f"unsupported Expect header {request.headers.get('Expect', '')!r}: only "
                             "'100-continue' is", None, "expectation_failed")
    return APIError(exc.status, exc.reason or "request failed", None, None)


def _models(request: web.Request) -> list[dict[str, object]]:
    """Behind the same key check as completions, and only the models the key may use: which
    models a deployment serves is not for anyone who reaches the port."""
    state = request.app[STATE]
    caller = state.keys.for_request(request.headers)
    view = state.directory.view
    created = int(state.started_at)
    return [{"id": m.id, "object": "model", "created": created, "owned_by": "slogate",
             "max_model_len": m.max_context, "pools": view.pools_serving(m.id)}
            for m in sorted(view.models.values(), key=lambda m: m.id)
            if not caller.models or m.id in caller.models]


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _models(request)}, dumps=lambda o: _json.encode(o).decode())


async def retrieve_model(request: web.Request) -> web.Response:
    """The SDKs' ``models.retrieve``. A hub id holds a slash, which the SDKs send unescaped."""
    wanted = request.match_info["model"]
    found = next((m for m in _models(request) if m["id"] == wanted), None)
    if found is None:
        raise APIError(404, f"model '{wanted}' is not served here", "model", "model_not_found")
    return web.json_response(found, dumps=lambda o: _json.encode(o).decode())


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    trouble = state.redis_trouble()
    ok, why = (False, trouble) if trouble is not None else state.directory.ready()
    if state.draining:
        ok, why = False, "shutting down"
    return web.json_response({"status": "ok" if ok else "unavailable", "reason": why},
                             status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _export_fleet(state)
    resp = web.Response(body=generate_latest(state.metrics.registry))
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


def _export_fleet(state: GatewayState) -> None:
    m = state.metrics
    view = state.directory.view
    pools = view.by_pool
    for pool, depth in view.queue_depth.items():
        hbs = pools.get(pool, [])
        running = sum(hb.running for hb in hbs)
        m.queue_depth.labels(pool).set(max(depth - running, 0))
        m.live_workers.labels(pool).set(len(hbs))
        m.running.labels(pool).set(running)
        m.kv_usage.labels(pool).set(sum(hb.kv_usage for hb in hbs) / len(hbs) if hbs else 0.0)
        m.own_in_flight.labels(pool).set(state.directory.own.count(pool))
    m.feedback_factor.set(state.admission.feedback.factor)
    for pool, est in state.admission.estimates.items():
        m.learned_cost.labels(pool, "prefill_per_token").set(est.prefill_s_per_token)
        m.learned_cost.labels(pool, "decode_per_token").set(est.decode_s_per_token)
    m.chars_per_token.clear()  # a model no worker serves any more keeps no series
    served = view.models
    for model, chars in state.admission.prompt_tokens.learned().items():
        if model in served:
            m.chars_per_token.labels(model).set(chars)


def make_app(cfg: Config) -> web.Application:
    app = web.Application(middlewares=[edge], client_max_size=cfg.max_body_bytes)
    app.router.add_post("/v1/chat/completions", completions.chat)
    app.router.add_post("/v1/completions", completions.completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_json)
    app.cleanup_ctx.append(_resources(cfg))
    return app


def commands_redis(url: str, timeout_s: float) -> aioredis.Redis:
    """The client for the gateway's commands, which retries none: a pipeline whose reply was
    lost may have run (an XADD queued a request, a stream slot taken), and sent again it would
    run twice, the request for two workers. Its caller gets the error (a 503 to retry). This is
    what ``from_url`` gives in redis-py 8.1, said outright, since ``Redis()`` retries 10 times.
    Its reads time out after ``timeout_s`` (``Config.redis_timeout_s``)."""
    return aioredis.Redis.from_url(url, max_connections=64, socket_connect_timeout=2, socket_timeout=timeout_s,
                                   health_check_interval=10, retry=Retry(NoBackoff(), 0))


def _resources(cfg: Config):
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        url = cfg.redis_url or DEFAULT_REDIS_URL
        commands = commands_redis(url, cfg.redis_timeout_s)
        reader = aioredis.Redis.from_url(url, single_connection_client=True,
                                         socket_connect_timeout=2, socket_timeout=None, **redis_keepalive(url))
        batcher = CommandBatcher(commands)
        sealer = Sealer.from_text(cfg.encryption_keys)
        mux = ResultMux(reader, batcher, sealer, keep_alive_s=cfg.sse_keep_alive_s, redis_grace_s=cfg.redis_grace_s,
                        alive_ttl_s=cfg.alive_ttl_s)
        state = GatewayState(
            cfg, commands, batcher, mux,
            WorkerDirectory(commands, list(cfg.pools), cfg.worker_poll_s, cfg.heartbeat_ttl_s), GatewayMetrics(),
            AdmissionController(cfg.policies), KeyStore(cfg.api_keys), RateLimiter(commands), sealer,
            AuditLog(batcher, cfg.audit_max_entries))
        if sealer.enabled:
            log.info("prompts and completions in Redis are sealed with key %r", sealer.key_ids[0])
        if not state.keys.enabled:
            log.warning("authentication is OFF: anyone who reaches this port can use it; "
                        "configure api_keys for anything but local use")
        app[STATE] = state
        await _warn_if_evicting(commands)
        await state.directory.refresh()
        await prompt_ratios.restore(commands, state.admission.prompt_tokens)
        ratios = prompt_ratios.RatioSaver(commands, state.admission.prompt_tokens)
        tasks = [asyncio.create_task(state.mux.run()), asyncio.create_task(state.directory.run(state.after_refresh)),
                 asyncio.create_task(ratios.run())]
        yield
        await cancel_and_wait(tasks)
        state.send_cancels_now()
        await ratios.save()
        await state.audit.close()
        await state.mux.close()
        await batcher.drain()
        state.log_unsent_cancels()
        await reader.aclose()
        await commands.aclose()

    return ctx


async def _warn_if_evicting(redis: aioredis.Redis) -> None:
    """Say so once at startup when a full Redis would evict keys: the queues, heartbeats, this
    gateway's alive key (its loss fails every request that has heard nothing) and the audit
    trail's flush numbers (a flush sent again after a lost reply is then written twice) are not
    data the gateway can do without. Under ``noeviction`` a full Redis refuses writes, which the
    gateway answers with a 503 to retry. Redis unreachable, or INFO refused, says nothing here."""
    try:
        memory = await redis.info("memory")
    except (RedisError, OSError):
        return
    policy = memory.get("maxmemory_policy", "noeviction")
    if memory.get("maxmemory") and policy != "noeviction":
        log.warning("Redis evicts keys when it is full (maxmemory-policy %s): it may drop queued requests, "
                    "heartbeats and audit records; set maxmemory-policy noeviction", policy)


_RAW_BYTES = re.compile(r"""b'(?:[^'\\]|\\.)*(?:'|$)|b"(?:[^"\\]|\\.)*(?:"|$)""")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CODING = re.compile(r"content-encoding: .*\((\w+)\)", re.IGNORECASE)
"""The coding in aiohttp's ``Can not decode content-encoding: zstandard (zstd). Please install ...``."""


def _hide_raw(message: str) -> str:
    """aiohttp quotes the client's raw bytes (``b'Authorization: Bearer sk-...'``): keep a
    header's name, never its value, which may be a credential."""
    def hide(m: re.Match[str]) -> str:
        name, colon, _ = m[0][2:].partition(":")
        return f"b'{name}: ***'" if colon and _HEADER_NAME.fullmatch(name) else "b'***'"

    return _RAW_BYTES.sub(hide, message.strip())


class MalformedHttpAtInfo(logging.Filter):
    """aiohttp logs a request it cannot parse (a duplicate Content-Type, an oversized header
    line, a body that is not its Content-Encoding: the client's mistake, already answered with a
    400) as an error with a traceback. The
    error log is for the gateway's own failures, so these become one line at info."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, web.RequestPayloadError) and isinstance(exc.__cause__, HttpProcessingError):
            exc = exc.__cause__  # a body that is not its Content-Encoding, met again as aiohttp drains it
        if not isinstance(exc, HttpProcessingError) or not 400 <= exc.code < 500:
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args = "refused a malformed HTTP request (%d): %.200s", (exc.code, _hide_raw(exc.message))
        record.exc_info = record.exc_text = None
        return logging.getLogger().isEnabledFor(logging.INFO)


def malformed_http(exc: HttpProcessingError) -> APIError:
    """A request aiohttp could not parse, as every other client mistake is answered. A request
    line over the limit (a long URL) and a header over it are one error in aiohttp, with one
    limit: one 400 names both (431 would be wrong for the URL, 414 for the header)."""
    if isinstance(exc, LineTooLong):
        return APIError(400, f"a header, or the request line (its URL), is longer than the {exc.args[1]} bytes "
                             "allowed", None, "header_too_large")
    if isinstance(exc, ContentEncodingError):  # a coding aiohttp knows but lacks the package for (zstd)
        named = _CODING.search(exc.message)
        return unsupported_encoding(named[1] if named else None)
    detail = _hide_raw(exc.message).partition("\n")[0].rstrip(":") or "it cannot be parsed"
    return APIError(400, f"malformed HTTP request: {detail}", None, "malformed_http")


class _JsonErrorsHandler(web.RequestHandler):
    """aiohttp answers a request it cannot parse before any middleware runs, in plain text;
    this answers it in OpenAI's shape. aiohttp has no option for it (aio-libs/aiohttp#3287).
    It also notes a connection its client closed (``GatewayState.cut_off``)."""

    __slots__ = ("closed_by_client",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.closed_by_client = False

    def connection_lost(self, exc: BaseException | None) -> None:
        # The gateway's own close (``force_close``) lets go of the transport before this runs.
        self.closed_by_client = self.transport is not None
        super().connection_lost(exc)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs it; refuses once an answer began
        if not isinstance(exc, HttpProcessingError):
            return plain
        resp = malformed_http(exc).response()
        resp.force_close()  # what follows on the connection cannot be trusted to start a request
        return resp


class _JsonErrorsServer(web.Server):
    def __call__(self) -> web.RequestHandler:
        return _JsonErrorsHandler(self, loop=self._loop, **self._kwargs)


def _refused_before_middlewares(handle: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]):
    """aiohttp refuses an Expect header other than ``100-continue`` with a plain-text 417, raised
    before any middleware runs: this hands the refusal to :func:`edge`, which answers it as every
    other (OpenAI's shape, a request id, the audit trail)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await handle(request)
        except web.HTTPException as exc:
            refused = exc

        async def refuse(_: web.Request) -> web.StreamResponse:
            raise refused

        return await edge(request, refuse)

    return handler


class _Runner(web.AppRunner):
    """An AppRunner whose connections answer unparseable requests, and the ones aiohttp refuses
    before the middlewares, in OpenAI's shape."""

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return _JsonErrorsServer(_refused_before_middlewares(plain.request_handler),
                                 request_factory=plain.request_factory,
                                 handler_cancellation=plain.handler_cancellation, **plain._kwargs)


async def _grace(state: GatewayState, grace_s: float, now: asyncio.Event) -> None:
    """Wait up to ``grace_s`` for the open requests to finish, or until ``now`` is set: a
    second SIGTERM or Ctrl-C means stop now, as it does to ``slogate up``, and not after a
    grace of 30 s more."""
    end = time.monotonic() + grace_s
    while state.handling and time.monotonic() < end:
        if now.is_set():
            log.warning("a second signal cut the grace short: ending the %d open request(s) now", state.handling)
            return
        await asyncio.sleep(0.05)


async def serve(cfg: Config, grace_s: float = 30.0, ready: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT, then stop taking requests and let open ones finish; a second
    signal ends them at once."""
    tracing.setup("slogate-gateway")
    logging.getLogger("aiohttp.server").addFilter(MalformedHttpAtInfo())
    # Bound before anything starts: under uvloop, a bind that failed after setup left the
    # background tasks uncancellable, and the process hung instead of saying the port is taken.
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    listening = socket.create_server((cfg.host, cfg.port), family=family, backlog=4096)
    app = make_app(cfg)
    # Open requests get ``grace_s`` below; what is still open after it is cut off (aiohttp's
    # own wait for handlers, 60 s by default, would stretch the grace past what was asked).
    runner = _Runner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5,
                     keepalive_timeout=cfg.client_timeout_s)
    await runner.setup()
    await web.SockSite(runner, listening).start()
    freeze_startup_heap()
    log.info("gateway listening on http://%s:%d (Redis at %s)", cfg.host, cfg.port,
             redacted(cfg.redis_url or DEFAULT_REDIS_URL))
    stop, now = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        """The first starts the drain; a second ends its grace (``_grace``)."""
        (now if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    if ready is not None:
        ready.set()
    await stop.wait()
    state = app[STATE]
    state.drain()
    log.info("draining: %d request(s) in flight, %d held back, grace %.0fs", state.in_flight, len(state.holds),
             grace_s)
    await _grace(state, grace_s, now)
    if state.in_flight:
        # Each gets its answer's end, a 503 (an error event on a stream), not a cut connection
        # a client would take for a network fault; the workers are told to stop them.
        log.warning("grace over: ending %d request(s) still in flight with 503 shutting_down", state.in_flight)
        state.mux.fail_all("the gateway shut down before this request finished; retry on another replica",
                           "shutting_down")
        end = time.monotonic() + 1.0
        while state.in_flight and time.monotonic() < end:
            await asyncio.sleep(0.02)
    state.cutting_off = True
    await runner.cleanup()
    tracing.shutdown()
