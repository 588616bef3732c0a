"""The worker: the Redis side of an engine.

It reads its pool's request stream through a consumer group, feeds the engine between steps,
writes each step's output to the request's result stream, and acknowledges a request only
once its final record is written. A worker that dies therefore leaves its requests pending,
and a live one claims them once the dead one's heartbeat expires (or, whatever heartbeats say,
after ``claim_idle_s``); live workers keep their own entries fresh so that a long generation is
never mistaken for an orphan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import redis.asyncio as aioredis
from prometheus_client import start_http_server
from redis.exceptions import (
    ClusterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from engines.base import LONG_PROMPT_CHARS, Engine, EngineRequest, StepOutput
from engines.engine_process import EngineDied, EngineProcess
from engines.engine_thread import EngineThread
from engines.metrics import WorkerMetrics
from engines.stepping import Step
from slogate import keys, logs, protocol, tracing
from slogate.config import DEFAULT_REDIS_URL, Config, redacted, redis_keepalive
from slogate.crypto import Sealer, SealError
from slogate.heap import freeze_startup_heap
from slogate.protocol import Delta, Error, Final, GenerateRequest, Heartbeat, ModelInfo, TokenLogprob
from slogate.tasks import cancel_and_wait, despite_cancels

log = logging.getLogger("slogate.worker")

SEND_ON_DEATH_S = 5.0
"""How long a worker whose engine died keeps trying to send what it reported (Redis may be
slow or away); what is not sent by then stays pending, for another worker to run again."""

CLEANUP_S = 10.0
"""How long a worker whose grace is over gives its cancelled run to end (close the engine,
remove its heartbeat: a Redis read timeout at most) before it cancels it once more, in case
redis-py swallowed the cancel (see :func:`slogate.tasks.cancel_and_wait`)."""

INTAKE_BLOCK_MS = 500
"""How long the intake's XREADGROUP waits in Redis for a request."""
READ_RETRY_S = 0.5
"""How long the intake waits after a failed read before it tries again."""
CUT_OFF_IDLE_MS = 250
"""How long an entry pending for this worker, and not held here, has been idle at least when
the intake takes it back after a failed read: one whose delivery was cut off was handed over
before the read failed, ``READ_RETRY_S`` before at least, where one that another worker (or
another loop of this one) claims meanwhile has been idle a round trip."""
READ_TIMEOUT_S = 5.0
"""How long the worker waits for a reply from Redis: past ``INTAKE_BLOCK_MS``, so an idle
intake never times out."""


class LoopFailed(Exception):
    """A loop of a running worker failed (a bug): the worker ends, for its supervisor to
    restart it. Not the loop's own error, which may be a ValueError or RuntimeError, what the
    CLI takes for a worker that cannot start as configured (exit code 2, for which ``slogate
    up`` stops the stack instead)."""


class QueueUnusable(LoopFailed):
    """Redis refuses the pool's queue for a reason that retrying cannot fix (the key holds
    another type, the ACL forbids it). The worker ends as for a failed loop, naming the key and
    the reason, where it retried for good and served nothing; restarted, it tries again, once
    someone has fixed the key."""


@dataclass
class WorkerSettings:
    pool: str
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 3.0
    claim_idle_s: float = 15.0
    engine_stall_s: float = 60.0
    stall_pause_s: float = 5.0
    max_attempts: int = 3
    result_ttl_s: float = 60.0
    intake_factor: int = 2
    """Requests held (running + waiting in the engine) as a multiple of the engine's batch:
    enough to keep batches full, few enough that the rest stays in Redis for other workers."""


@dataclass
class _InFlight:
    req: GenerateRequest
    entry_id: bytes
    attempt: int
    received_at: float
    offset: int = 0
    first_token_at: float = 0.0
    held: str = ""
    """Text not yet written: a non-streamed request gets its answer in one record."""
    tokens: int = 0
    """Tokens generated so far (counted in the metrics as they come, so a cancel loses none)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """Log-probabilities not yet written, as ``held`` (and with it: of tokens whose text is held)."""
    logprobs_sent: int = 0


class Worker:
    def __init__(self, engine: Engine | EngineProcess, redis: aioredis.Redis, settings: WorkerSettings,
                 sealer: Sealer | None = None) -> None:
        self.engine = engine if isinstance(engine, EngineProcess) else EngineThread(engine)
        self.sealer = sealer or Sealer()
        self.redis = redis
        self.s = settings
        self.queue = keys.queue(settings.pool)
        self.inflight: dict[str, _InFlight] = {}
        self._preparing = 0
        self._preparer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")
        self._last_expiry_check = 0.0
        self._checks: set[asyncio.Task[None]] = set()
        self._orphans_waiting = True
        """A departed worker may have left requests that had no room here (at start: unknown
        yet); the intake looks for them before it reads new ones."""
        self._unread_own = False
        """A read from the queue failed: Redis may have handed this worker requests whose reply
        never came; the intake looks for them before it reads new ones."""
        self._stopping = asyncio.Event()
        self._replies: dict[str, list[tuple[bytes, bytes]]] = {}
        """Records queued for the next send, per reply stream: (request id, sealed message)."""
        self._acks: list[bytes] = []
        """Queue entries to acknowledge once the records before them are written."""
        self._unacked: set[bytes] = set()
        """Queue entries settled here whose ack Redis has not taken yet: still this worker's, kept
        from idling into another's claim (Redis out of memory refuses the records and the ack,
        not a claim), and never started again here."""
        self._send_wake = asyncio.Event()
        self._send_failing = False
        self._quiet_step_s = 0.0
        self._quiet_prefill_s = 0.0
        self._engine_heard_at = time.monotonic()
        """When the engine last reported a step, or was given work while it held none."""
        self.metrics = WorkerMetrics(settings.pool, settings.worker_id, engine.name)

    async def run(self) -> None:
        try:
            await self._ensure_group()
        except BaseException:
            # The engine loop, which closes the engine however it ends, has not started: an
            # engine process would live on for as long as the worker's own (a queue Redis
            # refuses, or a stop while Redis is away).
            await despite_cancels(self.engine.aclose(1.0))
            raise
        log.info("worker %s serving pool %s with %s engine (model %s)", self.s.worker_id,
                 self.s.pool, self.engine.name, self.engine.model_id)
        tasks = [asyncio.create_task(coro) for coro in (
            self._intake_loop(), self._heartbeat_loop(), self._claim_loop(), self._departed_loop(),
            self._cancel_loop(), self._abandoned_loop(), self._watchdog_loop())]
        engine = asyncio.create_task(self._engine_loop())
        try:
            # A loop that fails (a bug) would leave a worker that looks alive and serves
            # nothing (no heartbeat, or no intake). The worker ends with the loop's error
            # instead, for its supervisor to restart it; what it held stays pending for others.
            running = {engine, *tasks}
            while engine in running:
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for failed in [t for t in done if t is not engine and not t.cancelled() and t.exception()]:
                    name, exc = failed.get_coro().__name__, failed.exception()
                    log.error("the worker's %s failed; the worker stops", name, exc_info=exc)
                    raise LoopFailed(f"the worker's {name} failed: {exc}") from exc
            engine.result()
        finally:
            await cancel_and_wait([engine, *tasks])
            key = keys.heartbeat(self.s.pool, self.s.worker_id)
            try:
                async with self.redis.pipeline(transaction=True) as p:
                    await p.delete(key).srem(keys.WORKERS, key).execute()
            except RedisError:
                pass
            self._preparer.shutdown(wait=False)

    def stop(self) -> None:
        """Take no new work; finish what is held (unfinished entries stay pending for others)."""
        self._stopping.set()

    async def _ensure_group(self) -> None:
        """Create the pool's consumer group, until Redis takes it: error replies that pass
        included (a failover's READONLY, a full disk's MISCONF), which ended the worker's start,
        or its intake after a Redis that restarted empty."""
        while True:
            try:
                await self.redis.xgroup_create(self.queue, keys.GROUP, id="0", mkstream=True)
                return
            except (RedisError, OSError) as exc:
                if "BUSYGROUP" in str(exc):
                    return
                if not _passes(exc):
                    raise QueueUnusable(f"cannot use {self.queue} as pool {self.s.pool}'s queue: {exc}") from exc
                log.warning("cannot join %s (%s); retrying", self.queue, exc)
                await asyncio.sleep(0.5)

    # -- intake ---------------------------------------------------------------------------

    def _room(self) -> int:
        """None while the engine is in a step over ``stall_pause_s``: new requests are better
        off with other workers meanwhile."""
        if self._paused():
            return 0
        load = self.engine.load()
        return max(0, load.capacity * self.s.intake_factor - len(self.inflight))

    def _stalled_s(self) -> float:
        """How long the engine has held work without finishing a step."""
        return 0.0 if self._engine_holds_nothing() else time.monotonic() - self._engine_heard_at

    def _paused(self) -> bool:
        return self._stalled_s() > self.s.stall_pause_s

    def _engine_holds_nothing(self) -> bool:
        """Requests still being tokenized here are not the engine's yet."""
        return len(self.inflight) <= self._preparing

    async def _intake_loop(self) -> None:
        while not self._stopping.is_set():
            room = self._room()
            if room == 0:
                await asyncio.sleep(0.002)
                continue
            if self._orphans_waiting:  # older, and maybe half streamed to their clients: first
                self._orphans_waiting = False
                await self._take_over_departed()
                continue
            if self._unread_own:
                await self._take_back_unread(room)
                continue
            try:
                resp = await self.redis.xreadgroup(keys.GROUP, self.s.worker_id, {self.queue: ">"},
                                                   count=room, block=INTAKE_BLOCK_MS)
            except (RedisError, OSError) as exc:  # error replies included: a failover's READONLY, a full disk's MISCONF
                if "NOGROUP" in str(exc):
                    log.warning("%s lost its consumer group (Redis restarted empty?); recreating it", self.queue)
                    await self._ensure_group()
                    continue
                log.warning("reading %s failed (%s); retrying", self.queue, exc)
                self._unread_own = True
                await asyncio.sleep(READ_RETRY_S)
                continue
            if resp:
                await self._accept(resp[0][1], attempts=None)

    async def _take_back_unread(self, room: int) -> None:
        """Serve the requests Redis handed this worker in a reply that never arrived (a read
        timed out on a slow Redis, a connection cut). They are this worker's pending entries,
        which nobody else claims until they have been idle ``claim_idle_s``: a 15 s stall at
        least, where taking them back now costs one XPENDING after a failed read.

        At most ``room`` of them, the oldest: what this worker holds may come after them in the
        look. Entries too young to take (another loop of this one claimed them, and holds them
        in a moment) that fill the look are waited for, not looked at again at once."""
        held = self._unacked | {job.entry_id for job in self.inflight.values()}
        count = room + len(held)
        try:
            pending = await self.redis.xpending_range(self.queue, keys.GROUP, "-", "+", count,
                                                      consumername=self.s.worker_id)
            others = [p for p in pending if p["message_id"] not in held]
            cut_off = [p for p in others if p["time_since_delivered"] >= CUT_OFF_IDLE_MS]
            young_ms = [p["time_since_delivered"] for p in others if p["time_since_delivered"] < CUT_OFF_IDLE_MS]
            unread = {p["message_id"]: p["times_delivered"] for p in cut_off[:room]}
            entries = []
            # Claimed with their delivery counts as they are: a plain claim counts one delivery
            # more, and a worker that takes one over after this one died would take its second
            # run for a third, ``max_attempts`` stopping the request a run too early. Claimed
            # only if still idle: one that another worker took over since the look stays its,
            # where taken back it ran on both.
            for times in set(unread.values()):
                entries += await self.redis.xclaim(self.queue, keys.GROUP, self.s.worker_id, CUT_OFF_IDLE_MS,
                                                   [eid for eid, n in unread.items() if n == times], retrycount=times)
        except (RedisError, OSError) as exc:
            if _queue_gone(exc):  # a Redis that restarted empty: nothing is pending, and the read makes the group
                self._unread_own = False
                return
            log.warning("looking for requests whose delivery to this worker was cut off failed (%s); retrying", exc)
            await asyncio.sleep(READ_RETRY_S)  # a claim whose reply was lost too: idle long enough again
            return
        self._unread_own = len(pending) == count or len(cut_off) > room  # more may follow
        entries = [(entry_id, fields) for entry_id, fields in entries if fields]
        if entries:
            log.warning("took back %d request(s) whose delivery to this worker was cut off", len(entries))
            await self._accept(entries, attempts=unread)
        elif self._unread_own and young_ms:
            await asyncio.sleep((CUT_OFF_IDLE_MS - max(young_ms)) / 1000)

    async def _accept(self, entries: Iterable[tuple[bytes, dict[bytes, bytes]]],
                      attempts: dict[bytes, int] | None) -> None:
        now = time.time()
        fresh: list[tuple[GenerateRequest, bytes, int]] = []
        drop: list[bytes] = []
        for entry_id, fields in entries:
            try:
                request_id = fields.get(protocol.ID_FIELD, b"")
                req = protocol.decode_request(self.sealer.open(fields[protocol.FIELD], request_id))
            except (protocol.ProtocolError, SealError, KeyError) as exc:
                log.error("dropping unreadable entry %s on %s: %s", entry_id, self.queue, exc)
                self.metrics.dropped.inc()
                drop.append(entry_id)
                reply = fields.get(protocol.REPLY_FIELD, b"").decode("utf-8", "replace")
                if request_id and reply.startswith(keys.replies("")):  # a gateway's reply stream, nothing else
                    self._queue_record(reply, request_id, Error(
                        "a worker could not read this request: the gateway and the workers do not share an "
                        "encryption key, or run releases that cannot talk to each other (the worker's log says "
                        "which)", "protocol_mismatch", 502, attempt=attempts.get(entry_id, 1) if attempts else 1))
                continue
            attempt = attempts.get(entry_id, 1) if attempts else 1
            if req.id in self.inflight or entry_id in self._unacked:
                continue
            if attempt > self.s.max_attempts:
                self._fail(req, entry_id, attempt, Error(
                    f"request failed on {attempt - 1} workers in a row; not retried again",
                    "worker_failed", 502, attempt))
            elif now > req.deadline:
                self._fail(req, entry_id, attempt, Error(
                    "deadline passed before a worker could start the request",
                    "deadline_exceeded", 504, attempt))
            else:
                fresh.append((req, entry_id, attempt))
        self._ack(drop)
        if not fresh:
            return
        if self._engine_holds_nothing():  # its clock starts with its first work
            self._engine_heard_at = time.monotonic()
        for req, entry_id, attempt in fresh:
            self.inflight[req.id] = _InFlight(req, entry_id, attempt, now)
        requests = [EngineRequest(id=r.id, sampling=r.sampling, deadline=r.deadline, prompt=r.prompt,
                                  messages=r.messages, tools=r.tools) for r, _, _ in fresh]
        long: list[EngineRequest] = []
        for r in requests:
            if _prompt_chars(r) > LONG_PROMPT_CHARS:
                long.append(r)
            else:
                self.engine.send(("add", self._prepared(r)))
        self._preparing += len(long)
        for coro in (self._prepare(long), self._abort_cancelled([r.id for r in requests])):
            task = asyncio.create_task(coro)
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

    def _prepared(self, request: EngineRequest) -> EngineRequest:
        try:
            return self.engine.prepare(request)
        except Exception:  # an engine whose prepare breaks its promise: add_request will tokenize
            log.exception("preparing request %s failed; the engine tokenizes it itself", request.id,
                          extra=self._about(request.id))
            return request

    def _about(self, request_id: str) -> dict[str, str | None]:
        """``extra`` for a line about a request held here: its gateway's request id."""
        job = self.inflight.get(request_id)
        return logs.about(job.req.request_id if job is not None else None)

    async def _prepare(self, requests: list[EngineRequest]) -> None:
        """Tokenize long prompts on a thread of its own (the tokenizer releases the GIL),
        beside the running step, then hand them to the engine; one cancelled meanwhile
        is dropped. ``_preparing`` already counts them."""
        if not requests:
            return
        prepared = requests
        try:
            prepared = await asyncio.get_running_loop().run_in_executor(
                self._preparer, lambda: [self._prepared(r) for r in requests])
        finally:
            if self._engine_holds_nothing():
                self._engine_heard_at = time.monotonic()
            # queued before the count drops, so a stopping worker never sees neither
            for r in prepared:
                if r.id in self.inflight:
                    self.engine.send(("add", r))
            self._preparing -= len(requests)

    async def _abort_cancelled(self, request_ids: list[str]) -> None:
        """Requests cancelled before this worker took them (their cancel message went to
        nobody) are dropped at the next step. Checked beside their start, not before it, so
        the check's round trip never delays a first token."""
        try:
            flags = await self.redis.mget([keys.cancel(rid) for rid in request_ids])
        except (RedisError, OSError) as exc:
            log.warning("checking %d request(s) for cancels failed: %s", len(request_ids), exc)
            return
        cancelled = [job for rid, flag in zip(request_ids, flags) if flag is not None and (job := self._abort(rid))]
        self._drop(cancelled)

    def _fail(self, req: GenerateRequest, entry_id: bytes, attempt: int, err: Error) -> None:
        self.metrics.finished(err.code)
        job = _InFlight(req, entry_id, attempt, time.time())
        self._trace(job, job.received_at, 0, err.code)
        self._write(job, err)
        self._ack([entry_id])

    def _ack(self, entry_ids: list[bytes]) -> None:
        """Acknowledge and delete queue entries with the next send, after the records queued
        before them."""
        if entry_ids:
            self._acks.extend(entry_ids)
            self._unacked.update(entry_ids)
            self._send_wake.set()

    # -- engine ---------------------------------------------------------------------------

    async def _engine_loop(self) -> None:
        """Drive the engine until the worker stops with nothing held, handing each step's
        outputs to the same bookkeeping wherever the engine runs.

        The engine steps back to back and this loop writes each step's outputs while the next
        step computes. Stepping from this loop instead (a step per executor call) left the
        engine idle between steps while the loop woke, wrote and handed over the next step:
        about a quarter of a small model's step time under load. The engine's end (a dead
        engine process: :class:`engines.engine_process.EngineDied`) ends the worker, whose
        unfinished requests stay pending for other workers.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        sender = asyncio.create_task(self._sender(done))
        started = [sender]
        try:
            # Inside the try: an attach that raises leaves neither the sender nor the engine
            # running. The finisher sends the engine its stop, so it starts once attached.
            await self.engine.attach()
            started.append(asyncio.create_task(self._finish_engine()))
            while (report := await self.engine.next()) is not None:
                self._engine_heard_at = time.monotonic()
                if isinstance(report, Step):
                    self._on_step(report.outputs, report.seconds)
                else:
                    log.error("engine step failed; failing the %d request(s) it held: %s",
                              len(report.request_ids), report.error)
                    self._on_engine_failure(report.request_ids)
            done.set_result(None)
            self._send_wake.set()
            await sender
        except EngineDied:
            # What the engine reported before it died goes out first: cut off, its finished
            # requests would run again elsewhere, and a sampled stream could not resume.
            done.set_result(None)
            self._send_wake.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(sender), SEND_ON_DEATH_S)
            raise
        finally:
            try:
                await cancel_and_wait(started)
            finally:  # cancelled again meanwhile (the worker's run is): the engine still ends before the run does
                await despite_cancels(self.engine.aclose(1.0))

    async def _finish_engine(self) -> None:
        await self._stopping.wait()
        while self.inflight or self._preparing:
            await asyncio.sleep(0.01)
        self.engine.send(("stop",))

    def _abort(self, request_id: str) -> _InFlight | None:
        """Forget a held request here and have the engine free it before its next step."""
        job = self.inflight.pop(request_id, None)
        if job is not None:
            self.engine.send(("abort", request_id))
        return job

    def _on_step(self, outputs: list[StepOutput], seconds: float | None) -> None:
        if seconds is not None:
            self.metrics.step.observe(seconds)
        if outputs:
            self._records(outputs)
        expired = self._expire()
        if expired:
            self._drop(expired, Error("the request did not finish before its deadline", "deadline_exceeded", 504))

    def _on_engine_failure(self, request_ids: set[str]) -> None:
        jobs = [job for rid in request_ids if (job := self.inflight.pop(rid, None)) is not None]
        self._drop(jobs, Error("the engine failed while serving this request", "engine_error", 500))

    def _expire(self) -> list[_InFlight]:
        """Stop requests whose deadline passed, whatever the engine does about deadlines."""
        now = time.time()
        if now - self._last_expiry_check < 0.01:
            return []
        self._last_expiry_check = now
        expired = [job for job in self.inflight.values() if now > job.req.deadline]
        return [job for job in expired if self._abort(job.req.id) is not None]

    def _drop(self, jobs: list[_InFlight], error: Error | None = None) -> None:
        """Settle requests stopped early: acknowledged, and told ``error`` when their gateway
        still waits or may (a deadline, an engine failure, a gateway taken for gone); a cancel
        needs no answer. Written with
        the step records, after those already queued for the same requests."""
        now = time.time()
        for job in jobs:
            self.metrics.finished(error.code if error else "cancelled")
            self._trace(job, now, job.tokens, error.code if error else "cancelled")
            if error is not None:
                self._write(job, msgspec.structs.replace(error, attempt=job.attempt))
        self._ack([j.entry_id for j in jobs])

    async def _sender(self, engine_done: asyncio.Future[None]) -> None:
        """Send what the steps queued, one pipeline at a time, so every request's records stay
        in order; what piles up while one is in flight goes out together in the next. A send
        that fails is retried, backing off up to a second, until Redis takes it: a record
        lost would leave a hole in a stream or a request unanswered. Ends once the engine has
        and everything is sent."""
        backoff = 0.0
        while True:
            await self._send_wake.wait()
            self._send_wake.clear()
            try:
                sent = await self._flush()
            except Exception:  # a bug in a write must not stop every later one
                log.exception("sending records failed")
                sent = True
            if sent:
                backoff = 0.0
            else:
                backoff = min(max(2 * backoff, 0.05), 1.0)
                await asyncio.sleep(backoff)
                self._send_wake.set()
            if engine_done.done() and not self._replies and not self._acks:
                return

    async def _flush(self) -> bool:
        """One entry per reply stream holding everything queued for it, then the acks, in one
        transaction; False when Redis did not take it, and all of it is queued again, ahead of
        what came meanwhile (one that Redis applied but whose reply was lost is sent twice: the
        gateway drops repeated text by its offset, and acks repeat harmlessly). Each write renews its
        stream's TTL, so a stream whose gateway died and that nobody writes to any more goes away
        ``result_ttl_s`` later: renewed only now and then, a stream its gateway deleted on the
        way out came back from the next write with no TTL at all, for ever."""
        if not self._replies and not self._acks:
            return True
        replies, self._replies = self._replies, {}
        acks, self._acks = self._acks, []
        try:
            # One transaction: a command Redis refuses (out of memory) aborts it all, so acks never
            # land without the records before them, nor do the records that did get in repeat.
            async with self.redis.pipeline(transaction=True) as p:
                for key, records in replies.items():
                    p.xadd(key, {protocol.BATCH_FIELD: protocol.encode_batch(records)})
                    p.pexpire(key, int(self.s.result_ttl_s * 1000))
                if acks:
                    p.xack(self.queue, keys.GROUP, *acks)
                    p.xdel(self.queue, *acks)
                try:
                    await p.execute()
                    self._unacked.difference_update(acks)
                    if self._send_failing:
                        self._send_failing = False
                        log.info("records are reaching Redis again")
                    return True
                except (RedisError, OSError) as exc:
                    if not self._send_failing:
                        self._send_failing = True
                        log.error("publishing %d records and %d acks failed; retrying until Redis takes them: %s",
                                  sum(len(r) for r in replies.values()), len(acks), exc)
        except Exception:  # a bug, not Redis: they are lost, and others' claims must rerun them
            self._unacked.difference_update(acks)
            raise
        for key, records in self._replies.items():
            replies.setdefault(key, []).extend(records)
        self._replies, self._acks = replies, acks + self._acks
        return False

    def _records(self, outputs: list[StepOutput]) -> None:
        """Queue a step's records and acknowledgements for the sender. The bookkeeping (what
        is finished, what was written) happens here, at once, so the deadline sweep and the
        intake already see it while the records are on their way."""
        now = time.time()
        done: list[bytes] = []
        generated = 0
        for out in outputs:
            job = self.inflight.get(out.request_id)
            if job is None:
                continue
            if out.error is not None:
                code = out.error_code or ("invalid_request_error" if out.error_status < 500 else "engine_error")
                self._write(job, Error(out.error, code, out.error_status, job.attempt, out.error_param))
                self.metrics.finished(code)
                self._trace(job, now, job.tokens, code)
            else:
                generated += out.completion_tokens - job.tokens
                job.tokens = out.completion_tokens
                if out.text:
                    if not job.first_token_at:
                        job.first_token_at = now
                        self.metrics.ttft.observe(now - job.received_at)
                    job.held += out.text
                job.logprobs += out.logprobs
                if (job.held or job.logprobs) and (job.req.stream or out.finish_reason is not None):
                    self._write(job, Delta(job.held, job.offset, job.attempt, out.prompt_tokens, out.completion_tokens,
                                           job.logprobs, job.logprobs_sent))
                    job.offset += len(job.held)
                    job.held = ""
                    job.logprobs_sent += len(job.logprobs)
                    job.logprobs = []
                if out.finish_reason is None:
                    continue
                outcome = _OUTCOMES.get(out.finish_reason, out.finish_reason)
                self.metrics.finished(outcome)
                self._trace(job, now, out.completion_tokens, outcome, out.prompt_tokens)
                self._write(job, Final(
                    out.finish_reason, out.prompt_tokens, out.completion_tokens, job.attempt,
                    queue_wait_s=max(0.0, job.received_at - job.req.enqueued_at),
                    ttft_s=max(0.0, (job.first_token_at or now) - job.req.enqueued_at),
                    offset=job.offset, token_offset=job.logprobs_sent))
            done.append(job.entry_id)
            del self.inflight[out.request_id]
        if generated > 0:
            self.metrics.tokens.inc(generated)
        self._ack(done)

    def _trace(self, job: _InFlight, now: float, completion_tokens: int, outcome: str,
               prompt_tokens: int = 0) -> None:
        """Queue wait, prefill and decode as spans of the gateway's trace, for a request that
        ended here however it ended (``slogate.outcome``): a cancelled or late one shows where
        its time went too. Decode only once there was a first token."""
        if not tracing.enabled() or not job.req.trace:
            return
        first = job.first_token_at or now
        attrs = {"slogate.worker": self.s.worker_id, "slogate.pool": self.s.pool, "slogate.outcome": outcome}
        tracing.record("queue_wait", job.req.trace, job.req.enqueued_at, job.received_at, **attrs)
        tracing.record("prefill", job.req.trace, job.received_at, first,
                       **attrs, **({"slogate.prompt_tokens": prompt_tokens} if prompt_tokens else {}))
        if job.first_token_at:
            tracing.record("decode", job.req.trace, first, now,
                           **attrs, **{"slogate.completion_tokens": completion_tokens})

    def _write(self, job: _InFlight, msg: Delta | Final | Error) -> None:
        """Queue a record for the request's gateway (sent by :meth:`_flush`)."""
        self._queue_record(job.req.reply, job.req.id.encode(), msg)

    def _queue_record(self, reply: str, rid: bytes, msg: Delta | Final | Error) -> None:
        self._replies.setdefault(reply, []).append((rid, self.sealer.seal(protocol.encode(msg), rid)))
        self._send_wake.set()

    # -- cancels, heartbeats, orphans -----------------------------------------------------

    async def _cancel_loop(self) -> None:
        """Stop the held requests cancelled on the channel. Messages sent while unsubscribed
        are lost, so after each (re)subscription the held requests' cancel flags are read."""
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(keys.CANCEL_CHANNEL)
                if self.inflight:
                    await self._abort_cancelled(list(self.inflight))
                async for msg in pubsub.listen():
                    # any client may publish here: what is no request id in UTF-8 matches none
                    job = self._abort(msg["data"].decode(errors="replace"))
                    if job is not None:
                        self._drop([job])
            except (RedisError, OSError) as exc:
                log.warning("cancel subscription lost (%s); resubscribing", exc)
                await asyncio.sleep(0.5)
            finally:
                await pubsub.aclose()

    async def _abandoned_loop(self) -> None:
        """Stop the requests of gateways that are gone. A gateway that crashed sends no cancels,
        and its requests would run to their end for nobody. Its ``alive`` key (renewed every
        second) must be missing at checks ``GATEWAY_GONE_AFTER_S`` apart, so a Redis that
        restarted empty a moment ago stops nothing, however often this worker beats: checks
        ``heartbeat_interval_s`` apart (0.2 s) both fell before the gateway's next renewal."""
        missing_since: dict[str, float] = {}
        while True:
            await asyncio.sleep(self.s.heartbeat_interval_s)
            watched = sorted({job.req.alive for job in self.inflight.values() if job.req.alive})
            try:
                flags = await self.redis.mget(watched) if watched else []
            except (RedisError, OSError):
                continue
            now = time.monotonic()
            missing_since = {key: missing_since.get(key, now) for key, flag in zip(watched, flags) if flag is None}
            gone = {key for key, since in missing_since.items() if now - since >= GATEWAY_GONE_AFTER_S}
            if gone:
                jobs = [job for rid, held in list(self.inflight.items())
                        if held.req.alive in gone and (job := self._abort(rid)) is not None]
                log.warning("stopped %d request(s) whose gateway is gone", len(jobs))
                self._drop(jobs, GATEWAY_GONE)

    def heartbeat(self) -> Heartbeat:
        load = self.engine.load()
        self.metrics.load(load)
        if load.decode_step_s and load.running <= 1:
            self._quiet_step_s = min(self._quiet_step_s or load.decode_step_s, load.decode_step_s)
        if load.prefill_s_per_token:
            self._quiet_prefill_s = min(self._quiet_prefill_s or load.prefill_s_per_token, load.prefill_s_per_token)
        return Heartbeat(
            worker_id=self.s.worker_id, pool=self.s.pool, engine=self.engine.name,
            models=[ModelInfo(self.engine.model_id, self.engine.max_context)],
            running=load.running, waiting=load.waiting + self._preparing,
            capacity=0 if self._stopping.is_set() or self._paused() else load.capacity,
            kv_usage=load.kv_usage, prefill_s_per_token=load.prefill_s_per_token,
            decode_step_s=load.decode_step_s, decode_s_per_seq=load.decode_s_per_seq,
            quiet_step_s=self._quiet_step_s, quiet_prefill_s_per_token=self._quiet_prefill_s, ts=time.time(),
            held=[rid[:protocol.HELD_ID_CHARS] for rid in self.inflight], ttl_s=self.s.heartbeat_ttl_s,
            features=list(protocol.FEATURES))

    async def _watchdog_loop(self) -> None:
        """Give up an engine that holds requests and has not finished a step in
        ``engine_stall_s``: the worker ends (see :class:`engines.engine_process.EngineDied`),
        and other workers take its requests over."""
        while True:
            await asyncio.sleep(min(1.0, self.s.engine_stall_s / 4))
            stalled = self._stalled_s()
            if stalled > self.s.engine_stall_s:
                self.engine.abandon(f"the engine has not finished a step in {stalled:.0f} s while holding "
                                    f"{len(self.inflight)} request(s)")
                return

    async def _heartbeat_loop(self) -> None:
        """Until the worker ends: a draining worker still holds requests, and a heartbeat that
        expired would have another worker take them over (and run them again) while this one
        finishes them. Draining, it reports no capacity, so gateways count on it for nothing."""
        key = keys.heartbeat(self.s.pool, self.s.worker_id)
        while True:
            try:
                async with self.redis.pipeline(transaction=True) as p:
                    p.set(key, protocol.encode(self.heartbeat()), px=int(self.s.heartbeat_ttl_s * 1000))
                    p.sadd(keys.WORKERS, key)
                    await p.execute()
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.s.heartbeat_interval_s)

    async def _claim_loop(self) -> None:
        """Keep what this worker holds its own (until it ends, draining included), and take
        what has been idle too long while there is room."""
        idle_ms = int(self.s.claim_idle_s * 1000)
        while True:
            await asyncio.sleep(self.s.claim_idle_s / 3)
            try:
                await self._refresh_own()
                if not self._stopping.is_set() and self._room():
                    await self._claim_orphans(idle_ms)
            except (RedisError, OSError) as exc:
                if not _queue_gone(exc):
                    log.warning("claim pass failed: %s", exc)

    async def _refresh_own(self) -> None:
        """Reset the idle time of what this worker holds, so nobody claims a live request.

        What another worker has taken over meanwhile (this one's heartbeat lapsed: a partition
        from Redis, a stalled loop) is dropped here instead: claimed back, it ran on both, and
        a stream that cannot resume failed its client though no worker had."""
        held = dict.fromkeys(self._unacked) | {job.entry_id: rid for rid, job in self.inflight.items()}
        if not held:
            return
        async with self.redis.pipeline(transaction=False) as p:
            for entry_id in held:
                p.xpending_range(self.queue, keys.GROUP, entry_id, entry_id, 1)
            pending = await p.execute()
        taken = [entry_id for entry_id, info in zip(held, pending)
                 if info and _text(info[0]["consumer"]) != self.s.worker_id]
        if taken:
            log.warning("%d request(s) held here were taken over by other workers while this one's heartbeat "
                        "lapsed; dropping them here", len(taken))
            for entry_id in taken:
                if held[entry_id] is not None and self._abort(held[entry_id]) is not None:
                    self.metrics.finished("taken_over")
            self._unacked.difference_update(taken)
        ids = [entry_id for entry_id in held if entry_id not in taken]
        if ids:
            await self.redis.xclaim(self.queue, keys.GROUP, self.s.worker_id, 0, ids, justid=True)

    async def _claim_orphans(self, idle_ms: int) -> None:
        _, entries, deleted = await self.redis.xautoclaim(
            self.queue, keys.GROUP, self.s.worker_id, idle_ms, "0-0", count=self._room())
        if deleted:
            await self.redis.xack(self.queue, keys.GROUP, *deleted)
        await self._take_over(entries)

    async def _departed_loop(self) -> None:
        """Take over what a worker whose heartbeat has expired held, as soon as it expires.

        ``claim_idle_s`` must outlast the pauses of a live worker, so waiting for it left a
        stream silent for 15-30 s when its worker died. A heartbeat is renewed every
        ``heartbeat_interval_s``; one gone past its TTL means the worker is gone, and what it
        held has been idle at least that long, which the claim requires (so of two workers
        that see it, one wins). Departed consumers that hold nothing leave the group."""
        while not self._stopping.is_set():
            await asyncio.sleep(self.s.heartbeat_interval_s)
            await self._take_over_departed()

    async def _take_over_departed(self) -> None:
        try:
            await self._claim_departed(int(self.s.heartbeat_ttl_s * 1000))
        except (RedisError, OSError) as exc:
            if not _queue_gone(exc):
                log.warning("takeover pass failed: %s", exc)

    async def _claim_departed(self, ttl_ms: int) -> None:
        consumers = [c for c in await self.redis.xinfo_consumers(self.queue, keys.GROUP)
                     if _text(c["name"]) != self.s.worker_id]
        if not consumers:
            return
        beats = await self.redis.mget([keys.heartbeat(self.s.pool, _text(c["name"])) for c in consumers])
        for consumer, beat in zip(consumers, beats):
            name = _text(consumer["name"])
            if beat is not None:
                continue
            if not consumer["pending"]:
                if consumer["idle"] > 10 * ttl_ms:  # not one that has yet to send its first heartbeat
                    await self.redis.xgroup_delconsumer(self.queue, keys.GROUP, name)
                continue
            room = self._room()
            if not room:  # the intake takes them as room frees, before anything new
                self._orphans_waiting = True
                return
            held = await self.redis.xpending_range(self.queue, keys.GROUP, "-", "+", room, consumername=name)
            if held:
                entries = await self.redis.xclaim(self.queue, keys.GROUP, self.s.worker_id, ttl_ms,
                                                  [h["message_id"] for h in held])
                await self._take_over(entries)
                if entries and consumer["pending"] > len(held):  # more than there was room for
                    self._orphans_waiting = True

    async def _take_over(self, entries: list[tuple[bytes, dict[bytes, bytes] | None]]) -> None:
        entries = [(eid, fields) for eid, fields in entries if fields]
        if not entries:
            return
        attempts = {}
        for eid, _ in entries:
            info = await self.redis.xpending_range(self.queue, keys.GROUP, eid, eid, 1)
            attempts[eid] = info[0]["times_delivered"] if info else 2
        log.warning("claimed %d request(s) left by a dead worker", len(entries))
        self.metrics.claimed.inc(len(entries))
        await self._accept(entries, attempts)



_OUTCOMES = {"deadline": "deadline_exceeded"}
"""Finish reasons named as the worker's own errors for the same end (its deadline sweep, a
request late when taken), and as the gateway names them: one outcome, counted and searched
for as one."""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _prompt_chars(request: EngineRequest) -> int:
    return (len(request.prompt or "") + sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or ""))
                                            for m in request.messages or ()) + len(str(request.tools or "")))


GIL_SWITCH_INTERVAL_S = 0.001
"""An engine on a thread of the worker (:class:`engines.engine_thread.EngineThread`) steps
while this loop reads requests and writes tokens. A step of a small model is mostly Python
holding the GIL, and by default the loop waits up to 5 ms for
it each time; at 1 ms a new request or a finished token waits less (stream benchmark, tiny
model, 16 streams through the gateway, two runs each: TTFT P99 32 and 52 ms against 73 and
61 ms at 5 ms)."""


GATEWAY_GONE_AFTER_S = 1.0
"""How long a gateway's ``alive`` key must stay missing before its requests are stopped: a
live gateway renews it about once a second, and at once when Redis is back after an outage."""
GATEWAY_GONE = Error("the workers took this gateway for gone and stopped the request: its liveness key in Redis "
                     "lapsed (Redis refused writes for seconds, or the gateway stalled); retry it", "gateway_gone", 503)
"""What a request stopped for its gateway's lapsed key is told: nobody reads it if the gateway is
gone, but one that lives (its renewals refused by a Redis out of memory) would otherwise wait for
the request's deadline, an hour for batch."""


_PASSING = (OSError, RedisConnectionError, RedisTimeoutError, ReadOnlyError, OutOfMemoryError, TryAgainError,
            ClusterDownError)
"""Errors that go away without anyone's doing: a lost connection, a Redis loading its data
(``BusyLoadingError`` is a ``ConnectionError``), a failover, memory or a cluster slot that
frees."""
_PASSING_CODES = frozenset({"BUSY", "MISCONF", "NOREPLICAS"})
"""The same among the error replies redis-py leaves as ``ResponseError``: a long script, a
disk that refuses the snapshot, replicas that are not there yet."""


def _passes(exc: Exception) -> bool:
    return isinstance(exc, _PASSING) or str(exc).split(" ", 1)[0] in _PASSING_CODES


def _queue_gone(exc: Exception) -> bool:
    """A Redis that restarted empty has lost the pool's stream and group: the intake loop
    creates them again, and the passes over them have nothing to do meanwhile."""
    return "NOGROUP" in str(exc) or "no such key" in str(exc)


def worker_redis(url: str) -> aioredis.Redis:
    """The worker's client, with reads that time out: a Redis cut off without a word (a network
    partition, a failover to another host) would hold the intake, the heartbeat and the sends
    on their replies for good. redis-py 8 times reads out after 5 s by default; set here, the
    timeout stays past the intake's block whatever a release defaults to. Its cancel
    subscription reads without one (pub/sub blocks; keepalive probes break it over TCP)."""
    return aioredis.Redis.from_url(url, max_connections=16, socket_connect_timeout=2, socket_timeout=READ_TIMEOUT_S,
                                   health_check_interval=10, **redis_keepalive(url))


async def _grace(task: asyncio.Task[None], grace_s: float, now: asyncio.Event) -> None:
    """Wait up to ``grace_s`` for the draining worker's run (``task``) to end, or until ``now`` is
    set: a second SIGTERM or Ctrl-C means stop now, as it does to the gateway and ``slogate up``,
    and not after a grace of 30 s more. TimeoutError if it has not ended: its grace is over."""
    cut = asyncio.create_task(now.wait())
    try:
        await asyncio.wait({task, cut}, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        cut.cancel()
    if not task.done():
        raise TimeoutError


async def run_worker(engine: Engine | EngineProcess, cfg: Config, pool: str, grace_s: float = 30.0,
                     metrics_port: int = 0) -> None:
    """Serve ``pool`` until SIGTERM/SIGINT; then finish held requests within ``grace_s``, which a
    second signal ends at once."""
    tracing.setup("slogate-worker")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    freeze_startup_heap()
    url = cfg.redis_url or DEFAULT_REDIS_URL
    log.info("using Redis at %s", redacted(url))
    if pool not in cfg.pools:
        log.warning("pool %r is not in the configuration, whose pools are %s: gateways that read the same "
                    "configuration route to it only a model no configured pool serves, and only with admission "
                    "control off", pool, ", ".join(cfg.pools))
    redis = worker_redis(url)
    worker = Worker(engine, redis, WorkerSettings(
        pool=pool, heartbeat_interval_s=cfg.heartbeat_interval_s, heartbeat_ttl_s=cfg.heartbeat_ttl_s,
        claim_idle_s=cfg.claim_idle_s, engine_stall_s=cfg.engine_stall_s, stall_pause_s=cfg.stall_pause_s,
        max_attempts=cfg.max_attempts, result_ttl_s=cfg.result_ttl_s),
        Sealer.from_text(cfg.encryption_keys))
    if metrics_port:
        start_http_server(metrics_port, registry=worker.metrics.registry)
    loop = asyncio.get_running_loop()
    now = asyncio.Event()

    def on_signal() -> None:
        """The first starts the drain; a second ends its grace (``_grace``)."""
        if worker._stopping.is_set():
            now.set()
        worker.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    task = asyncio.create_task(worker.run())
    stopping = asyncio.create_task(worker._stopping.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            log.info("draining: finishing %d request(s) within %.0f s, taking no new ones",
                     len(worker.inflight), grace_s)
            await _grace(task, grace_s, now)
            log.info("drained; the worker exits")
        task.result()
    except TimeoutError:
        why = "a second signal cut the grace short" if now.is_set() else "grace period over"
        log.warning("%s; %d request(s) left pending for other workers", why, len(worker.inflight))
        # Awaited, not only cancelled: its end closes the engine and removes its heartbeat, which
        # asyncio.run's cancel of what is left as this returns cut short, leaving it to expire.
        await cancel_and_wait([task], every_s=CLEANUP_S)
    finally:
        stopping.cancel()
        await redis.aclose()
        tracing.shutdown()
