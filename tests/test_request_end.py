"""How a request ends in the gateway: what it teaches admission, what a stream answers (pure logic)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from gateway.completions import _Job, _observe
from gateway.metrics import GatewayMetrics
from gateway.schema import ParsedRequest
from gateway.state import REQUEST_ID
from policies.admission import AdmissionController
from policies.config import load
from slogate.protocol import Final, GenerateRequest, SamplingParams


def test_the_gateways_time_before_queueing_is_not_learned_as_prefill() -> None:
    """20 ms from arrival to the queue (reading, parsing, admission), 1 ms queued, a first token
    10 ms later: the 200-token prompt took the last 9 ms, not 29 ms."""
    now = time.time()
    arrived, enqueued = now - 0.040, now - 0.020
    admission = AdmissionController(load({}))
    state = SimpleNamespace(metrics=GatewayMetrics(), admission=admission)
    gen = GenerateRequest(id="r", model="m", pool="interactive", cls="interactive", sampling=SamplingParams(),
                          deadline=now + 30, enqueued_at=enqueued, reply="x", stream=True)
    parsed = ParsedRequest(kind="chat", model="m", stream=True, include_usage=False, sampling=SamplingParams(),
                           max_tokens_given=True)
    job = _Job(state, parsed, gen, None, arrived, {}, first_token_at=now - 0.010, outcome="length",
               final=Final("length", 200, 1, queue_wait_s=0.001, ttft_s=0.010))
    decode = admission.estimate("interactive").decode_s_per_token
    _observe(job)
    learned = admission.estimate("interactive").prefill_s_per_token
    assert decode < 0.009 and learned * 200 == pytest.approx(0.009 - decode, abs=1e-6)


def test_only_the_probes_own_answer_closes_its_pools_half_open_breaker() -> None:
    """An answer to a request let through before the breaker opened says nothing of the pool
    now: the probe's ticket goes with its request to its answer."""
    now = time.time()
    admission = AdmissionController(load({"circuit": {"half_open_probes": 1, "close_after": 1}}))
    breaker = admission.breaker("interactive")
    for _ in range(admission.cfg.circuit.consecutive_failures):
        breaker.record_failure(now - admission.cfg.circuit.open_s - 1)
    probe = breaker.acquire(now)
    state = SimpleNamespace(metrics=GatewayMetrics(), admission=admission)
    for ticket, after in ((None, "half_open"), (probe, "closed")):
        job = _stream_job()
        job.state, job.breaker_probe, job.outcome = state, ticket, "length"
        job.final = Final("length", 3, 1, attempt=1)
        _observe(job)
        assert breaker.state(time.time()) == after


@pytest.mark.filterwarnings("ignore:It is recommended to use web.RequestKey")  # the gateway's own keys are strings
async def test_a_keep_alive_before_the_headers_does_not_turn_a_refusal_into_a_200() -> None:
    """A keep-alive queued ahead of a worker's immediate refusal: the refusal is still the
    answer, with its own status, not a 200 and an error event."""

    from gateway.completions import _stream
    from gateway.errors import APIError
    from gateway.results import QUIET, Subscription
    from slogate.protocol import Error

    sub = Subscription("r", keep_alive=True)
    sub.records.put_nowait(QUIET)
    sub.records.put_nowait(Error("prompt beyond the model's context", "context_length_exceeded", 400, attempt=1))
    sub.arrived.set()
    with pytest.raises(APIError) as refused:
        await _stream(_http_request(), [_stream_job(sub)], sub)
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"



@pytest.mark.filterwarnings("ignore:It is recommended to use web.RequestKey")  # the gateway's own keys are strings
async def test_a_stream_whose_deadline_passes_while_held_is_a_504_not_a_200() -> None:
    """Nothing came before the deadline, which passed within the hold: no byte was sent, so the
    answer is the 504 itself, as when not streamed."""

    from gateway.completions import _stream
    from gateway.errors import APIError
    from gateway.results import Subscription

    writes = _Writes()
    job = _stream_job(Subscription("r", keep_alive=True))
    job.gen.deadline = time.time() + 0.05
    with pytest.raises(APIError) as late:
        await _stream(_http_request(writes), [job], job.sub)
    assert (late.value.status, late.value.code) == (504, "deadline_exceeded")
    assert writes.calls == []

class _Writes:
    """A response's payload writer that keeps what each call sent."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.buffer_size = 0
        self.output_size = 0

    async def write_headers(self, status_line: str, headers) -> None:
        self.calls.append(("headers", status_line.encode()))

    def send_headers(self) -> None:
        pass

    async def write(self, data: bytes) -> None:
        self.calls.append(("write", bytes(data)))

    async def write_eof(self, data: bytes = b"") -> None:
        self.calls.append(("eof", bytes(data)))

    def enable_chunking(self) -> None:
        pass

    def enable_compression(self, *args) -> None:
        pass


@pytest.mark.filterwarnings("ignore:It is recommended to use web.RequestKey")  # the gateway's own keys are strings
async def test_records_that_arrive_together_go_out_in_one_write() -> None:
    """A record alone is sent at once; records queued together (a backlog, the last ones) are
    sent in one write, each still a chunk of its own."""
    from gateway.completions import _stream
    from gateway.results import Subscription
    from slogate.protocol import Delta

    sub = Subscription("r", keep_alive=True)
    sub.records.put_nowait(Delta("a", 0))
    sub.arrived.set()
    writes = _Writes()
    streaming = asyncio.create_task(_stream(_http_request(writes), [_stream_job(sub, include_usage=True)], sub))
    while not any(kind == "write" for kind, _ in writes.calls):
        await asyncio.sleep(0.001)
    [(_, first)] = [c for c in writes.calls if c[0] == "write"]
    assert first.count(b"data: ") == 2 and b'"role":"assistant"' in first and b'"content":"a"' in first

    for text, offset in (("b", 1), ("c", 2)):
        sub.records.put_nowait(Delta(text, offset))
    sub.records.put_nowait(Final("stop", 3, 3))
    await streaming
    kinds = [kind for kind, _ in writes.calls]
    assert kinds == ["headers", "write", "eof"], kinds
    last = writes.calls[-1][1]
    events = [e for e in last.split(b"\n\n") if e]
    assert [e.split(b'"content":')[1][:3] for e in events[:2]] == [b'"b"', b'"c"']
    assert b'"finish_reason":"stop"' in events[2] and b'"usage"' in events[3] and events[4] == b"data: [DONE]"


@pytest.mark.filterwarnings("ignore:It is recommended to use web.RequestKey")  # the gateway's own keys are strings
async def test_a_quiet_stream_of_several_choices_sends_one_keep_alive_at_a_time() -> None:
    """Each choice hears the reader's keep-alive tick (its subscription is a stream's): a quiet
    stream of three sent three comments in each write, where one keeps its connection open."""
    from gateway.choices import merged
    from gateway.completions import _stream
    from gateway.results import QUIET, Subscription
    from slogate.protocol import Delta

    jobs = [_stream_job(Subscription(f"{i}-r", keep_alive=True)) for i in range(3)]
    for i, job in enumerate(jobs):
        job.index = i
    jobs[0].sub.records.put_nowait(Delta("a", 0))
    writes = _Writes()
    async with merged(jobs) as source:
        streaming = asyncio.create_task(_stream(_http_request(writes), jobs, source))
        await _written(writes, 1)
        for job in jobs:  # as the reader's tick tells every quiet stream at once
            job.sub.records.put_nowait(QUIET)
        await _written(writes, 2)
        for job in jobs:
            job.sub.records.put_nowait(Final("stop", 3, 1))
        await streaming
    [_, (_, quiet)] = [c for c in writes.calls if c[0] == "write"]
    assert quiet == b": keep-alive\n\n"
    assert writes.calls[-1][1].count(b'"finish_reason":"stop"') == 3


async def _written(writes: _Writes, count: int) -> None:
    while sum(kind == "write" for kind, _ in writes.calls) < count:
        await asyncio.sleep(0.001)


@pytest.mark.filterwarnings("ignore:It is recommended to use web.RequestKey")  # the gateway's own keys are strings
async def test_a_write_the_deadline_cuts_short_is_not_sent_again() -> None:
    """The deadline may fire while a write waits for a slow client to drain: what that write
    put on the wire must not go out again with the stream's end."""
    from gateway.completions import _stream
    from gateway.results import Subscription
    from slogate.protocol import Delta

    class SlowClient(_Writes):
        async def write(self, data: bytes) -> None:
            await super().write(data)
            await asyncio.sleep(5)  # the transport has it; the drain never comes

    sub = Subscription("r", keep_alive=True)
    sub.records.put_nowait(Delta("slow", 0))
    sub.arrived.set()
    job = _stream_job(sub)
    job.gen.deadline = time.time() + 0.3
    writes = SlowClient()
    await _stream(_http_request(writes), [job], job.sub)
    sent = b"".join(data for _, data in writes.calls)
    assert sent.count(b'"content":"slow"') == 1 and b"deadline_exceeded" in sent


@pytest.mark.filterwarnings("ignore:It is recommended to use web.RequestKey")  # the gateway's own keys are strings
async def test_a_client_that_takes_none_of_the_answers_end_is_cut_off() -> None:
    """The last write's drain never comes (a client that stopped reading, its connection
    open): the handler, and the subscription, slots and counts it holds, waited for it for
    good, long past the request's deadline."""
    from gateway.completions import _stream
    from gateway.results import Subscription
    from slogate.protocol import Delta

    class StuckClient(_Writes):
        async def write_eof(self, data: bytes = b"") -> None:
            await super().write_eof(data)
            await asyncio.Event().wait()

    sub = Subscription("r", keep_alive=True)
    for rec in (Delta("done", 0), Final("stop", 3, 1)):
        sub.records.put_nowait(rec)
    sub.arrived.set()
    job = _stream_job(sub)
    job.state.cfg.client_timeout_s = 0.2
    request = _http_request(StuckClient())
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(_stream(request, [job], sub), 10)
    request.transport.abort.assert_called_once()


@pytest.mark.filterwarnings("ignore:It is recommended to use web.RequestKey")  # the gateway's own keys are strings
async def test_the_time_a_client_takes_to_read_the_end_is_not_learned_as_the_pools() -> None:
    """A stream answered in full whose client then read nothing for its client_timeout_s (1 s):
    the wait for the client was measured as the request's own end to end, and admission
    learned it as the pool's decode cost, 1/8 s more per token of its 9, for every request
    after (the pool's 10 ms steps looked like 135 ms)."""
    from gateway.completions import _stream
    from gateway.results import Subscription
    from slogate.protocol import Delta

    class StuckClient(_Writes):
        async def write_eof(self, data: bytes = b"") -> None:
            await super().write_eof(data)
            await asyncio.Event().wait()

    sub = Subscription("r", keep_alive=True)
    for rec in (Delta("a b c d e f g h i", 0, prompt_tokens=3, completion_tokens=9), Final("stop", 3, 9)):
        sub.records.put_nowait(rec)
    sub.arrived.set()
    job = _stream_job(sub)
    job.state = SimpleNamespace(cfg=SimpleNamespace(client_timeout_s=1.0), metrics=GatewayMetrics(),
                                admission=AdmissionController(load({})))
    with pytest.raises(ConnectionResetError):
        await _stream(_http_request(StuckClient()), [job], sub)
    _observe(job)
    assert job.state.admission.estimate("interactive").decode_s_per_token * 8 < 1.0


def test_the_gateways_own_error_leaves_the_request_to_be_cancelled_on_the_worker() -> None:
    """A record the gateway could not read, or its own lost reader, ends the answer, but the
    worker is still generating it: only a worker's own last record spares the cancel."""
    from gateway.completions import _final_error
    from slogate.protocol import Error

    for record, worker_done in ((Error("lost the connection to Redis", "redis_unavailable", 503, attempt=0), False),
                                (Error("unreadable", "protocol_mismatch", 502, attempt=0), False),
                                (Error("engine failed", "engine_error", 500, attempt=1), True),
                                (Final("length", 3, 4, attempt=1), True)):
        job = _stream_job()
        _final_error(job, record)
        assert job.worker_done is worker_done, record


async def test_a_stale_attempts_record_does_not_set_the_token_counts() -> None:
    """A record of an attempt the relay has moved past is dropped, and so are its counts: the
    request's usage (audit, metrics) is the current attempt's, however it then ends."""
    from gateway.completions import _records
    from gateway.results import Subscription
    from slogate.protocol import Delta, Error

    sub = Subscription("r", keep_alive=True)
    for rec in (Delta("ab", 0, attempt=2, prompt_tokens=5, completion_tokens=2),
                Delta("abcdef", 0, attempt=1, prompt_tokens=5, completion_tokens=6),
                Error("engine failed", "engine_error", 500, attempt=2)):
        sub.records.put_nowait(rec)
    job = _stream_job(sub)
    texts = [text async for _, text, _ in _records([job], sub.records)]
    assert texts == ["ab", None]
    assert (job.prompt_tokens, job.completion_tokens) == (5, 2)


@pytest.mark.filterwarnings("ignore:It is recommended to use web.RequestKey")  # the gateway's own keys are strings
@pytest.mark.parametrize("stream", [True, False])
async def test_a_deadline_that_falls_just_after_the_last_record_does_not_cancel_the_answer(stream: bool) -> None:
    """The request's deadline is armed inside the record reader: left open when the answer
    ended on an error record, it stayed armed until the loop closed the reader some turns
    later, and a deadline that fell meanwhile cancelled the handler writing the error (a
    stream's last frames, the 500 of one not streamed). Here the handler's own time after the
    error record (a blocking moment) runs past the deadline before it next yields."""
    from gateway.completions import LATE_S, _collect, _stream
    from gateway.errors import APIError
    from gateway.results import Subscription
    from slogate.protocol import Delta, Error

    class BusyClient(_Writes):
        async def write_eof(self, data: bytes = b"") -> None:
            await super().write_eof(data)
            await _past_the_deadline()

    async def _past_the_deadline() -> None:
        time.sleep(0.4)
        for _ in range(3):
            await asyncio.sleep(0)

    sub = Subscription("r", keep_alive=stream)
    for rec in (Delta("a", 0), Error("engine failed", "engine_error", 500, attempt=1)):
        sub.records.put_nowait(rec)
    sub.arrived.set()
    job = _stream_job(sub)
    job.parsed.stream = stream
    job.gen.deadline = time.time() + 0.3 - LATE_S
    writes = BusyClient()
    if stream:
        await _stream(_http_request(writes), [job], sub)
        assert b'"code":"engine_error"' in writes.calls[-1][1]
    else:
        with pytest.raises(APIError) as failed:
            await _collect([job], sub)
        assert failed.value.code == "engine_error"
        await _past_the_deadline()


def _stream_job(sub: object = None, include_usage: bool = False) -> _Job:
    """A streamed chat request as ``_run`` hands it on, waiting on ``sub``."""
    now = time.time()
    gen = GenerateRequest(id="r", model="m", pool="interactive", cls="interactive", sampling=SamplingParams(),
                          deadline=now + 30, enqueued_at=now, reply="x", stream=True)
    parsed = ParsedRequest(kind="chat", model="m", stream=True, include_usage=include_usage, sampling=SamplingParams(),
                           max_tokens_given=True, messages=[{"role": "user", "content": "x"}])
    return _Job(SimpleNamespace(cfg=SimpleNamespace(client_timeout_s=30.0)), parsed, gen, sub, now, {})


def _http_request(writer: object = None):
    from aiohttp.test_utils import make_mocked_request

    request = make_mocked_request("POST", "/v1/chat/completions", **({"writer": writer} if writer else {}))
    request[REQUEST_ID] = "r"
    return request
