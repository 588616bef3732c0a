"""``/v1/chat/completions`` and ``/v1/completions``: HTTP in, a queued request, HTTP out."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError, ResponseError

from gateway import choices, schema, tool_output
from gateway import openai_shapes as shapes
from gateway.admit import admit, retry_headers
from gateway.auth import Caller
from gateway.errors import (
    DECODED_CODINGS,
    APIError,
    bad_request,
    redis_unavailable,
    unsupported_encoding,
)
from gateway.relay import Relay, SplicedOutput
from gateway.results import QUIET, Subscription
from gateway.state import AUDIT, COUNTED, REQUEST_ID, STATE, STREAM_ERROR, GatewayState
from policies.admission import Decision, deadline_for
from policies.classify import UnknownClass, classify
from policies.prompt_tokens import prior_estimate
from slogate import keys, protocol, tracing
from slogate.config import Config
from slogate.protocol import Delta, Error, Final, GenerateRequest

TIMEOUT_HEADER = "x-slogate-timeout"
CLASS_HEADER = "x-slogate-class"


@dataclass
class _Job:
    """One admitted request on its way through the gateway: one of its choices (``n``), each an
    engine request of its own (:mod:`gateway.choices`)."""

    state: GatewayState
    parsed: schema.ParsedRequest
    gen: GenerateRequest
    sub: Subscription
    arrived: float
    headers: dict[str, str]
    epoch: int = 0
    """The feedback loop's verdicts when it was admitted (``Decision.epoch``)."""
    breaker_probe: int | None = None
    """``Decision.breaker_probe``: its answer is the probe's its pool's half-open breaker awaits."""
    key: str = "anonymous"
    """The caller's API key id."""
    first_token_at: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    """As the last record said: what a request that ends without a final record used."""
    outcome: str = "cancelled"
    worker_done: bool = False
    """A final or error record came, or Redis refused to queue it: nothing is left to cancel."""
    final: Final | None = None
    ended_at: float = 0.0
    """When the final or error record came: the request's end, which its latencies are measured
    to, not when its client took it (a stream's last write may wait ``client_timeout_s`` for a
    client that stopped reading)."""
    status: int = 0
    """The HTTP status of a failed request: 5xx other than 504 count against the pool's
    breaker. A missed deadline is a latency signal (the feedback loop's business), and counting
    it would let a client trip a pool for everyone by asking for impossible deadlines."""
    index: int = 0
    """Which of the request's choices it is."""
    slot: int | None = None
    """Its handle in the gateway's own in-flight count (:class:`policies.inflight.InFlight`), until
    it is freed."""
    relay: Relay = field(init=False)

    def __post_init__(self) -> None:
        self.relay = Relay(streamed=self.parsed.stream, deterministic=self.gen.sampling.deterministic)

    @property
    def labels(self) -> tuple[str, str, str]:
        return self.gen.cls, self.gen.pool, self.gen.model

    def free_slot(self) -> None:
        """Free its slot in the in-flight count once it is over: a choice that ended while another
        runs would otherwise count as busy, its slot's predicted end with it, and admission would
        predict waits for a slot no one holds. Freed once, whichever comes first: its last record
        or the request's end."""
        if self.slot is not None:
            self.state.directory.own.end(self.gen.pool, self.slot)
            self.slot = None

    def queue_wait_s(self, final: Final) -> float:
        """From its arrival here, as its first token is timed: the gateway's own time before
        queueing is a wait, not prefill."""
        return final.queue_wait_s + self.gen.enqueued_at - self.arrived


async def chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


async def _read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The body, within ``timeout_s``: a client that sends it a byte at a time would otherwise
    hold a handler and a connection for as long as it likes."""
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"request body of {request.content_length} bytes exceeds the limit of "
                            f"{limit} bytes", None, "request_too_large")
    coding = request.headers.get("Content-Encoding", "")
    if coding and not (coding.isascii() and coding.lower() in (*DECODED_CODINGS, "identity")):
        raise unsupported_encoding(coding)  # as aiohttp tells one it decodes
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", None,
                       "request_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"request body exceeds the limit of {limit} bytes", None,
                       "request_too_large") from None
    except web.RequestPayloadError as exc:  # a body that is not the Content-Encoding it claims
        raise APIError(400, f"the request body could not be read: {' '.join(str(exc).split())}", None,
                       "invalid_body") from None


def _deadline(request: web.Request, now: float, cls: str, state: GatewayState) -> float:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return deadline_for(cls, now, state.cfg.policies)
    limit = state.cfg.max_timeout_s
    try:
        timeout = float(raw)
    except ValueError:
        timeout = -1.0
    if not 0 < timeout <= limit:
        raise bad_request(f"header {TIMEOUT_HEADER} must be a number of seconds in (0, {limit:g}]",
                          TIMEOUT_HEADER)
    return now + timeout


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    if state.draining:
        raise APIError(503, "gateway is shutting down; retry on another replica", None, "shutting_down")
    state.handling += 1
    try:
        return await _handle(request, state, kind)
    finally:
        state.handling -= 1


async def _handle(request: web.Request, state: GatewayState, kind: str) -> web.StreamResponse:
    arrived = time.time()
    with tracing.span("validate"):
        caller = state.keys.for_request(request.headers)
        request[AUDIT]["key"] = caller.key_id
        body = await _read_body(request, state.cfg.max_body_bytes, state.cfg.client_timeout_s)
        parsed = schema.parse(kind, body, state.cfg.default_max_tokens, state.cfg.max_messages, state.cfg.max_n)
        request[AUDIT]["model"] = parsed.model
        state.keys.check_model(caller, parsed.model)
        _check_model(state, parsed, caller)
        cls, reason = _classify(state, parsed, caller, request.headers.get(CLASS_HEADER))
        deadline = _deadline(request, arrived, cls, state)
    request[AUDIT]["cls"] = cls
    async with contextlib.AsyncExitStack() as held:
        with tracing.span("admit", **{"slogate.class": cls}) as span:
            try:
                if state.keys.enabled:
                    await _rate_limit(state, caller, parsed)
                await schema.check_json_schema(parsed)  # after the rate limit: a compile may take a thread for 0.5 s
                if parsed.stream:  # before admission, which books the prompt's time for a request it lets go
                    await held.enter_async_context(_stream_slot(state, caller.key_id, deadline))
                decision = await admit(state, parsed, cls, deadline, caller.key_id)
            except APIError as err:  # a refusal's trail says why, as an admitted request's does
                if err.headers and "x-slogate-reason" in err.headers:
                    request[AUDIT]["decision"] = err.headers["x-slogate-reason"]
                raise
            if span is not None:
                span.set_attributes({"slogate.pool": decision.pool, "slogate.decision": decision.reason})
        request[AUDIT].update(pool=decision.pool, decision=decision.reason)
        return await _run(request, state, parsed, cls, reason, decision, arrived, deadline)


async def _run(request: web.Request, state: GatewayState, parsed: schema.ParsedRequest, cls: str,
               reason: str, decision: Decision, arrived: float, deadline: float) -> web.StreamResponse:
    request_id = os.urandom(16).hex()
    pool = decision.pool
    gen = GenerateRequest(
        id=request_id, model=parsed.model, pool=pool, cls=cls, sampling=parsed.sampling,
        deadline=deadline, enqueued_at=time.time(), reply=state.mux.key, prompt=parsed.prompt,
        messages=parsed.messages, tools=parsed.tools, stream=parsed.stream, trace=tracing.inject(),
        alive=state.mux.alive, request_id=request[REQUEST_ID])
    headers = {"x-slogate-class": cls, "x-slogate-reason": reason, "x-slogate-pool": pool,
               "x-slogate-admission": decision.reason}
    jobs = [_Job(state, parsed, choice, state.mux.subscribe(choice.id, parsed.stream, pool), arrived, headers,
                 decision.epoch, decision.breaker_probe, request[AUDIT]["key"], index=i)
            for i, choice in enumerate(choices.fan_out(gen, parsed.n))]
    for job, busy_until in zip(jobs, decision.slot_ends or [time.time()] * len(jobs)):
        job.slot = state.directory.own.start(pool, busy_until)
    request[COUNTED] = True  # in slogate_requests_total by its outcome, not as refused before queueing
    request[AUDIT]["id"] = shapes.response_id(parsed.kind, request_id)
    state.in_flight += 1
    state.metrics.in_flight.inc()
    try:
        with tracing.span("enqueue", **{"slogate.pool": pool}):
            await _enqueue(state, jobs)
        if len(jobs) == 1:
            return await _answer(request, jobs, jobs[0].sub)
        async with choices.merged(jobs) as merged:
            return await _answer(request, jobs, merged)
    except APIError as err:  # which class, pool and decision it failed in, as a success says
        err.headers = {**headers, **(err.headers or {})}
        raise
    except asyncio.CancelledError:
        if state.cut_off(request):  # the gateway's end, not its client's
            for job in jobs:
                if not job.ended_at:
                    job.outcome, job.status = "shutting_down", 503
        raise
    except Exception as exc:
        if not isinstance(exc, ConnectionResetError):  # a client that left is cancelled; this, the gateway's bug
            for job in jobs:
                job.outcome, job.status = "internal_error", 500
        raise
    finally:
        for job in jobs:
            job.free_slot()
            if not job.worker_done:
                state.cancel(job.gen.id, deadline)
            state.mux.unsubscribe(job.sub)
        state.in_flight -= 1
        state.metrics.in_flight.dec()
        whole = jobs[0] if len(jobs) == 1 else choices.as_one(jobs)
        _observe(whole, () if len(jobs) == 1 else jobs)
        request[AUDIT].update(outcome=whole.outcome, prompt_tokens=whole.prompt_tokens,
                              completion_tokens=whole.completion_tokens, **_timings(whole))


async def _enqueue(state: GatewayState, jobs: list[_Job]) -> None:
    """Queue every choice (in one pipeline: they are sent before any reply is awaited)."""
    sent = [state.batcher.call("XADD", keys.queue(job.gen.pool), "*", protocol.ID_FIELD, job.gen.id,
                               protocol.REPLY_FIELD, state.mux.key, protocol.FIELD,
                               state.sealer.seal(protocol.encode(job.gen), job.gen.id.encode()))
            for job in jobs]
    failed = None
    for job, queued in zip(jobs, sent):
        try:
            await queued
        except (RedisError, OSError) as exc:
            job.outcome, job.status = "redis_unavailable", 503
            # Refused (out of memory, read-only): never queued, so nothing to cancel. A reply
            # lost on the way (a timeout, a cut connection) may hide a queued request.
            job.worker_done = isinstance(exc, ResponseError)
            failed = failed or exc
    if failed is not None:
        raise redis_unavailable("cannot queue the request", failed) from None


async def _answer(request: web.Request, jobs: list[_Job], source: Subscription | choices.Merged) -> web.StreamResponse:
    """``source``: a lone choice's subscription, or the choices' records merged."""
    if jobs[0].parsed.stream:
        return await _stream(request, jobs, source)
    return await _collect(jobs, source)


@contextlib.asynccontextmanager
async def _stream_slot(state: GatewayState, key_id: str, deadline: float) -> AsyncIterator[None]:
    """Hold one of the key's concurrent-stream slots. They live in Redis, so the limit holds
    across gateways: one entry per open stream, in a sorted set by when it ends at the latest
    (its deadline). A gateway that dies cannot leak them: each is dropped once past its end,
    whoever asks next. (A counter with a TTL leaked the open streams of a gateway killed, for
    as long as retries kept renewing it: two crashes could lock a key out of streams.)"""
    if not state.keys.enabled:
        yield
        return
    slots = keys.stream_slots(key_id)
    slot = os.urandom(8).hex()
    limit = state.cfg.max_streams_per_key
    taking = state.batcher.call("EVAL", _TAKE_SLOT, 1, slots, limit, slot,
                                round(deadline - time.time() + STREAM_SLOT_SLACK_S, 3),
                                _longest_stream_s(state.cfg) + STREAM_SLOT_SLACK_S)

    def give_back(done: asyncio.Future[Any]) -> None:
        if not done.cancelled():
            done.exception()  # retrieved: taken or not, the slot is given back
        state.batcher.fire("ZREM", slots, slot)

    try:
        taken = await asyncio.shield(taking)
    except asyncio.CancelledError:  # the client left, but Redis may still take the slot: once it answers
        taking.add_done_callback(give_back)
        raise
    except (RedisError, OSError) as exc:
        state.batcher.fire("ZREM", slots, slot)  # it may have run, its reply lost
        raise redis_unavailable("cannot count open streams", exc) from None
    if not taken:
        raise APIError(429, f"key '{key_id}' already has {limit} streams open; close one first",
                       None, "too_many_streams", {"x-slogate-reason": "stream-limit", **retry_headers(1.0)})
    try:
        yield
    finally:
        state.batcher.fire("ZREM", slots, slot)


STREAM_SLOT_SLACK_S = 60
"""How long a slot outlives its stream's deadline: the moment the stream takes to end after it,
and clocks that disagree."""

_TAKE_SLOT = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""
"""Drop the slots past their end; take one if the limit allows (ARGV: limit, slot, seconds it
may last, the longest any may). Redis's clock, so that gateways' clocks need not agree."""


def _longest_stream_s(cfg: Config) -> int:
    objectives = cfg.policies.objectives
    return int(max(cfg.max_timeout_s, objectives.interactive.deadline_s, objectives.batch.deadline_s))


def _check_model(state: GatewayState, parsed: schema.ParsedRequest, caller: Caller) -> None:
    if (why := state.redis_trouble()) is not None:
        raise APIError(503, f"{why}; the request cannot be queued", None, "redis_unavailable",
                       retry_headers(state.cfg.policies.admission.unavailable_retry_after_s))
    view = state.directory.view
    if not view.heartbeats:
        raise APIError(503, "no live worker is serving any model; start a worker "
                            "(slogate worker --pool NAME)", None, "no_live_worker",
                       retry_headers(state.cfg.policies.admission.unavailable_retry_after_s))
    model = view.models.get(parsed.model)
    if model is None:
        served = ", ".join(sorted(m for m in view.models if not caller.models or m in caller.models)) or "none"
        raise APIError(404, f"model '{parsed.model}' is not served here (served: {served})",
                       "model", "model_not_found")
    if parsed.max_tokens_given and parsed.sampling.max_tokens >= model.max_context:
        raise bad_request(f"{parsed.max_tokens_param} ({parsed.sampling.max_tokens}) must be below the model's "
                          f"context length ({model.max_context})", parsed.max_tokens_param, "context_length_exceeded")
    _check_features(state, parsed)


def _check_features(state: GatewayState, parsed: schema.ParsedRequest) -> None:
    """A 503 for a request that needs a parameter some worker serving its model would ignore
    (an older release, mid-upgrade): its answer would look right and not be. Any pool's worker
    counts, since the pool is not picked yet; the refusal lasts until the last one is upgraded."""
    needed = protocol.features_needed(parsed.sampling, bool(parsed.tools))
    if not needed:
        return
    older = [hb for hb in state.directory.view.heartbeats
             if any(m.id == parsed.model for m in hb.models) and not set(needed) <= set(hb.features or ())]
    if older:
        missing = [f for f in needed if any(f not in (hb.features or ()) for hb in older)]
        names = ", ".join(f"{hb.pool}/{hb.worker_id}" for hb in older[:3]) + (", ..." if len(older) > 3 else "")
        raise APIError(503, f"{' and '.join(missing)} cannot be served now: {len(older)} worker(s) serving model "
                            f"'{parsed.model}' ({names}) run an older release that would ignore it; retry once "
                            f"they are upgraded, or send the request without it", missing[0], "worker_outdated",
                       retry_headers(state.cfg.policies.admission.unavailable_retry_after_s))


def _classify(state: GatewayState, parsed: schema.ParsedRequest, caller: Caller,
              header_class: str | None) -> tuple[str, str]:
    rules = state.cfg.policies.classification
    try:
        return classify(header_class, rules.key_classes.get(caller.key_id), rules.model_routes.get(parsed.model),
                        parsed.stream, parsed.sampling.max_tokens if parsed.max_tokens_given else None,
                        parsed.prompt_chars, state.cfg.policies)
    except UnknownClass as exc:
        raise bad_request(str(exc), CLASS_HEADER) from None


async def _rate_limit(state: GatewayState, caller: Caller, parsed: schema.ParsedRequest) -> None:
    rpm, tpm = state.cfg.policies.rate_limits.for_key(caller.key_id)
    # Each choice may take max_tokens; the prompt is one for all of them, as their usage counts it.
    tokens = prior_estimate(parsed.prompt_chars, len(parsed.messages or ())) + parsed.sampling.max_tokens * parsed.n
    try:
        verdict = await state.limiter.check(caller.key_id, rpm, tpm, tokens)
    except (RedisError, OSError) as exc:
        raise redis_unavailable("cannot check rate limits", exc) from None
    if verdict.allowed:
        return
    what = {"rpm": f"{rpm} requests per minute", "tpm": f"{tpm} tokens per minute",
            "tokens-over-tpm": f"{tpm} tokens per minute (this request alone needs {tokens})"}
    raise APIError(429, f"rate limit of {what.get(verdict.reason, verdict.reason)} exceeded for key "
                        f"'{caller.key_id}'", None, "rate_limit_exceeded",
                   {"x-slogate-reason": f"rate-limit:{verdict.reason}", **retry_headers(verdict.retry_after_s)})


async def _records(jobs: list[_Job], records: asyncio.Queue[Any],
                   before_wait: Callable[[], Awaitable[None]] | None = None):
    """Yield (choice, new text, record) for each record that moves a choice's answer on, until
    every choice's last, and (choice, None, QUIET) when a stream has heard nothing for a while.
    ``records`` holds a lone choice's records, or the choices' (choice, record) pairs
    (:func:`gateway.choices.merged`). ``before_wait`` is awaited whenever no record is queued,
    before waiting for one. Iterate it in ``contextlib.aclosing``: it holds the request's
    deadline, which, left to the loop's finalizer to close some turns after the caller stopped
    (on a final error record), could still cancel the handler writing the answer."""
    lone = jobs[0] if len(jobs) == 1 else None
    left = len(jobs)
    try:
        async with asyncio.timeout(jobs[0].gen.deadline - time.time() + LATE_S):
            while True:
                if before_wait is not None and records.empty():
                    await before_wait()
                if lone is not None:
                    job, rec = lone, await records.get()
                else:
                    job, rec = await records.get()
                    if job.ended_at:  # its answer is whole: what comes after its last record is none of it
                        continue
                if rec is QUIET:
                    yield job, None, rec
                    continue
                relay = job.relay
                try:
                    text = relay.accept(rec)
                except SplicedOutput as exc:
                    job.outcome, job.status = exc.code, 502
                    raise APIError(502, str(exc), None, exc.code) from None
                if isinstance(rec, Delta):
                    if text is None:  # stale or repeated: its counts are not the answer's
                        continue
                    job.prompt_tokens, job.completion_tokens = rec.prompt_tokens, rec.completion_tokens
                    if text and not job.first_token_at and job.parsed.stream:  # one not streamed holds it to the end
                        job.first_token_at = time.time()
                elif rec.attempt and rec.attempt < relay.attempt:
                    continue
                yield job, text, rec
                if not isinstance(rec, Delta):
                    left -= 1
                    if not left:
                        return
    except TimeoutError:
        for job in jobs:
            if not job.ended_at:
                job.outcome, job.status = "deadline_exceeded", 504
        raise APIError(504, "the request did not finish before its deadline", None,
                       "deadline_exceeded") from None


def _final_error(job: _Job, rec: Final | Error) -> APIError | None:
    job.ended_at = time.time()
    job.free_slot()
    job.worker_done = rec.attempt != 0  # attempt 0: the gateway's own error; the worker goes on until cancelled
    if isinstance(rec, Error):
        job.outcome, job.status = rec.code, rec.status
        param = rec.param
        if rec.code == "context_length_exceeded":
            param = "messages" if job.parsed.messages is not None else "prompt"
        return APIError(rec.status, rec.message, param, rec.code)
    if rec.finish_reason == "deadline":
        job.outcome, job.status = "deadline_exceeded", 504
        return APIError(504, "the request did not finish before its deadline", None, "deadline_exceeded")
    if rec.finish_reason in ("cancelled", "error"):
        job.outcome, job.status = rec.finish_reason, 502
        return APIError(502, f"the worker ended the request ({rec.finish_reason})", None, "worker_failed")
    job.outcome = rec.finish_reason
    job.final = rec
    job.prompt_tokens, job.completion_tokens = rec.prompt_tokens, rec.completion_tokens
    if not job.parsed.stream:
        job.first_token_at = job.gen.enqueued_at + rec.ttft_s
    return None


async def _collect(jobs: list[_Job], source: Subscription | choices.Merged) -> web.Response:
    async with contextlib.aclosing(_records(jobs, source.records)) as records:
        async for job, _, rec in records:
            if isinstance(rec, Delta):
                continue
            err = _final_error(job, rec)
            if err is not None:
                raise err
    job = jobs[0]  # what the choices share
    kind, logprobs, use = job.parsed.kind, job.gen.sampling.logprobs is not None, job.parsed.tool_use
    answers = []
    for j in jobs:  # each one's outcome is its finish reason
        text, finish, calls = j.relay.text, j.outcome, None
        if use is not None:
            text, calls = tool_output.message(use, text)
            finish = tool_output.finish_reason(finish, len(calls), use)
        answers.append(shapes.choice(kind, j.index, text, finish, j.relay.logprobs if logprobs else None, calls))
    body = shapes.full_response(kind, shapes.response_id(kind, job.gen.id), int(job.arrived), job.gen.model,
                                answers, _usage(jobs))
    return web.Response(body=body, content_type="application/json", headers=job.headers)


def _usage(jobs: list[_Job]) -> dict[str, int]:
    """The request's usage so far (a stream may send it with every chunk): a lone choice's own
    counts, with nothing summed for it."""
    if len(jobs) == 1:
        return shapes.usage(jobs[0].prompt_tokens, jobs[0].completion_tokens)
    return shapes.usage(*choices.usage(jobs))


STREAM_HOLD_S = 0.5
"""How long a stream waits for its first record before it answers: a request the worker
refuses at once (a prompt beyond the context) gets its own status, 400, as when not streamed,
instead of a 200 and an error event; one still queued gets its headers soon all the same."""
LATE_S = 0.25
"""How long after its deadline the gateway still waits for a request: time for the worker's own
answer to the deadline to arrive first."""


async def _stream(request: web.Request, jobs: list[_Job], source: Subscription | choices.Merged) -> web.StreamResponse:
    """Frames are sent once no other record is queued: records that arrived together (a
    backlog, the last ones) go out in one write, one syscall and one wakeup of the client.
    Each choice has its own frames (its index, its log-probabilities' offsets); the usage, if
    asked for, comes once all have finished."""
    job = jobs[0]  # what the choices share
    parsed, logprobs = job.parsed, job.gen.sampling.logprobs is not None
    rid = shapes.response_id(parsed.kind, job.gen.id)
    chunks = [shapes.ChunkWriter(parsed.kind, rid, int(job.arrived), job.gen.model, j.index) for j in jobs]
    calls = [tool_output.StreamedCalls(parsed.tool_use, c) for c in chunks] if parsed.tool_use else None
    out: list[bytes] = []

    async def start() -> web.StreamResponse:
        resp = web.StreamResponse(headers={
            **job.headers, "content-type": "text/event-stream", "cache-control": "no-cache",
            "x-request-id": request[REQUEST_ID], "x-accel-buffering": "no"})
        await resp.prepare(request)
        if parsed.kind == "chat":
            out.extend(c.role() for c in chunks)
        return resp

    async def send() -> None:
        if out and resp is not None:
            data = b"".join(out)
            out.clear()  # before the write: a deadline during its drain must not send it again
            await resp.write(data)

    resp = None
    late_at = job.gen.deadline + LATE_S
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(source.arrived.wait(), max(0.0, min(STREAM_HOLD_S, late_at - time.time())))
    if not source.arrived.is_set() and time.time() < late_at:  # past it, the answer is the 504 itself
        resp = await start()
        await send()
    try:
        async with contextlib.aclosing(_records(jobs, source.records, send)) as records:
            async for choice, text, rec in records:
                if rec is QUIET:  # before the headers, nothing needs keeping alive yet
                    if resp is not None and not out:  # frames keep it alive; the choices, told at once, need one
                        out.append(shapes.KEEP_ALIVE)
                elif isinstance(rec, Delta):
                    resp = resp or await start()
                    use = _usage(jobs) if parsed.continuous_usage else None
                    fresh = choice.relay.fresh if logprobs else None
                    if calls is not None:
                        out.extend(calls[choice.index].text(text, use, fresh))
                    else:
                        out.append(chunks[choice.index].text(text, use, fresh))
                else:
                    err = _final_error(choice, rec)
                    if err is not None:
                        raise err
                    resp = resp or await start()
                    if calls is not None:
                        out.extend(calls[choice.index].finish(rec.finish_reason))
                    else:
                        out.append(chunks[choice.index].finish(rec.finish_reason))
        if parsed.include_usage:
            out.append(chunks[0].usage(_usage(jobs)))
    except APIError as err:
        if resp is None:  # nothing sent yet: the error is the answer, with its own status
            raise
        request[STREAM_ERROR] = err  # for the request's span, whose status says 200
        out.append(shapes.sse_error(err.body()))
    out.append(shapes.DONE)
    await _end(request, resp, b"".join(out), job.state.cfg.client_timeout_s)
    return resp


async def _end(request: web.Request, resp: web.StreamResponse, data: bytes, timeout_s: float) -> None:
    """Send the stream's last frames, which a client that stopped reading with its connection
    open never takes: past ``timeout_s`` its connection is cut, as a client that left. Its
    deadline no longer bounds this write, and the handler, with its subscription, stream slot
    and place in the in-flight counts, would otherwise wait for it for good."""
    try:
        async with asyncio.timeout(timeout_s):
            await resp.write_eof(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError(f"the client took nothing of the answer's end in {timeout_s:g} s") from None


NOT_THE_POOLS_FAULT = frozenset({"redis_unavailable", "result_lost", "no_live_worker", "shutting_down",
                                 "gateway_gone", "internal_error"})
"""Failures that say nothing of how the pool serves, so its breaker does not count them: a pool
left without workers (its breaker would then refuse the batch that may queue for a restarted
worker, and keep probing for minutes once one is back), Redis (down, records lost on their
way, or this gateway's liveness key lapsing in it), this gateway's drain or its own bug."""


def _timings(job: _Job) -> dict[str, float]:
    """Where one request's time went, for whoever looks it up in the audit trail by its id
    (the metrics have only distributions): ``queue_ms``, from its arrival here until a worker
    took it (known once the worker's last record came), and ``ttft_ms``, until its first token
    (as this gateway streamed it, or as the worker made it for an answer sent whole), beside
    ``latency_ms`` for the whole. A slow request was then either queued or slow to start."""
    out = {}
    if job.final is not None:
        out["queue_ms"] = round(job.queue_wait_s(job.final) * 1000, 1)
    if job.first_token_at:
        out["ttft_ms"] = round((job.first_token_at - job.arrived) * 1000, 1)
    return out


def _observe(job: _Job, parts: Sequence[_Job] = ()) -> None:
    """Metrics for every request; for finished ones, teach the admission controller what
    they cost; for ones the pool failed, count it against the pool's breaker. ``parts``: the
    choices of a request of several (``job`` is them as one), each of which costs the pool
    what its own times say."""
    job.state.metrics.finished(*job.labels, job.outcome)
    end = job.ended_at or time.time()
    e2e = end - job.arrived
    m = job.state.metrics.series(*job.labels)
    m.prompt_tokens.inc(job.prompt_tokens)
    m.generation_tokens.inc(job.completion_tokens)
    if job.first_token_at:  # it reached the client: a real first token, however the rest ended
        m.ttft.observe(job.first_token_at - job.arrived)
    rec = job.final
    if rec is None:
        if job.status >= 500:  # failed or late: counted where the latencies are, and missed
            m.e2e.observe(e2e)
            if job.gen.cls == "interactive":
                m.missed.inc()
        if job.status >= 500 and job.status != 504 and job.outcome not in NOT_THE_POOLS_FAULT:
            job.state.admission.observe_failure(job.gen.pool, end)
        if job.status == 504:
            measured = job.parsed.stream and bool(job.first_token_at)
            job.state.admission.observe_expired(
                cls=job.gen.cls, stream=job.parsed.stream, epoch=job.epoch, measured=measured,
                latency_s=job.first_token_at - job.arrived if measured else e2e)
        return
    m.e2e.observe(e2e)
    m.queue_wait.observe(rec.queue_wait_s)
    if job.gen.cls == "interactive":
        latency = (job.first_token_at or end) - job.arrived if job.parsed.stream else e2e
        (m.met if latency <= job.state.admission.objective(job.parsed.stream) else m.missed).inc()
    for one in parts or (job,):  # a choice's own pace: the whole's span holds the choices' waits for each other
        if one.first_token_at and one.final.completion_tokens > 1:
            m.tpot.observe(((one.ended_at or end) - one.first_token_at) / (one.final.completion_tokens - 1))
    job.state.admission.prompt_tokens.observe(job.parsed.model, job.key, job.parsed.prompt_chars,
                                              len(job.parsed.messages or ()), rec.prompt_tokens)
    answer = dict(pool=job.gen.pool, cls=job.gen.cls, stream=job.parsed.stream,
                  ttft_s=(job.first_token_at or end) - job.arrived, e2e_s=e2e, now=end, epoch=job.epoch,
                  probe=job.breaker_probe)
    if not parts:
        job.state.admission.observe(prompt_tokens=rec.prompt_tokens, completion_tokens=rec.completion_tokens,
                                    queue_wait_s=job.queue_wait_s(rec), **answer)
        return
    for part in parts:  # each has its final record: the whole would have ended as one without
        final = part.final
        job.state.admission.learn(part.gen.pool, final.prompt_tokens, final.completion_tokens,
                                  part.queue_wait_s(final), (part.first_token_at or part.ended_at) - part.arrived,
                                  part.ended_at - part.arrived)
    job.state.admission.answered(**answer, n=len(parts))
