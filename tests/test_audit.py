"""The audit trail keeps the records Redis could not take, and writes them once it can."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import time

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer
from redis.exceptions import RedisError

from gateway.app import make_app
from gateway.audit import KEEP_UNWRITTEN, RETRY_S, STREAM, AuditLog, export
from gateway.batcher import CommandBatcher
from gateway.state import STATE
from slogate import keys, logs, protocol
from slogate.config import Config
from slogate.local_redis import LocalRedis
from slogate.protocol import Heartbeat, ModelInfo


def written(lines: list) -> list[str]:
    return [json.loads(line)["request_id"] for _, f in lines for line in f[b"e"].decode().splitlines()]


async def failed_write(own_redis: LocalRedis, flush_s: float) -> tuple[aioredis.Redis, AuditLog]:
    """An audit log whose first record ("a") Redis, stopped, did not take."""
    client = aioredis.Redis.from_url(own_redis.url, socket_connect_timeout=1)
    audit = AuditLog(CommandBatcher(client), keep=100, flush_s=flush_s)
    audit.write("a", time.time(), 200, {"key": "k", "model": "m"})
    own_redis.stop()
    with pytest.raises((RedisError, OSError)):
        await audit.flush()
    return client, audit


async def test_records_redis_did_not_take_are_sent_again_once_it_is_back(own_redis: LocalRedis, caplog) -> None:
    client, audit = await failed_write(own_redis, flush_s=10)
    assert caplog.text.count("audit records could not be written") == 1
    audit.write("b", time.time(), 200, {"key": "k", "model": "m"})
    own_redis.start()
    deadline = time.monotonic() + RETRY_S + 10  # no request comes meanwhile: the retry is its own
    while not await client.exists(STREAM):
        assert time.monotonic() < deadline, "the kept records are sent again"
        await asyncio.sleep(0.05)
    assert written(await client.xrange(STREAM)) == ["a", "b"]
    await client.aclose()


async def test_what_is_kept_through_an_outage_is_bounded(own_redis: LocalRedis, caplog) -> None:
    client = aioredis.Redis.from_url(own_redis.url, socket_connect_timeout=1)
    audit = AuditLog(CommandBatcher(client), keep=100, flush_s=10, max_records=2)
    own_redis.stop()
    for i in range(KEEP_UNWRITTEN * 2 + 10):
        audit.write(f"r{i}", time.time(), 200, {"key": "k", "model": "m"})
        await asyncio.sleep(0.01)
    pending = audit.flush()
    if pending is not None:
        with pytest.raises((RedisError, OSError)):
            await pending
    kept = [r for _, records in audit._unwritten for r in records] + audit._records
    assert len(kept) == KEEP_UNWRITTEN * 2, "the oldest beyond the bound are dropped"
    assert kept[-1].find('"r41"') > 0 and kept[0].find('"r10"') > 0 and "dropped" in caplog.text
    await client.aclose()


async def test_the_trail_keeps_about_as_many_records_however_they_were_batched(redis_url: str) -> None:
    """Records are trimmed one by one: a busy flush after a quiet spell must not take the quiet
    spell's records with it, nor a quiet spell keep a busy one's many times over."""
    client = aioredis.Redis.from_url(redis_url)
    await client.delete(STREAM)
    audit = AuditLog(CommandBatcher(client), keep=1000, flush_s=10, max_records=500)
    for i in range(2000):
        audit.write(f"quiet{i}", time.time(), 200, {"key": "k", "model": "m"})
        await audit.flush()
    kept = written(await client.xrange(STREAM))
    assert 1000 <= len(kept) <= 1100, "Redis trims whole nodes of up to 100 entries"
    assert kept[-1] == "quiet1999"
    for i in range(400):
        audit.write(f"busy{i}", time.time(), 200, {"key": "k", "model": "m"})
    await audit.flush()
    kept = written(await client.xrange(STREAM))
    assert 1000 <= len(kept) <= 1100
    assert kept[-1] == "busy399" and sum(r.startswith("quiet") for r in kept) >= 600
    await client.delete(STREAM)
    await client.aclose()


async def test_records_come_back_whole_whatever_line_separators_their_text_holds(redis_url: str) -> None:
    """JSON leaves U+2028, U+2029 and NEL unescaped; only "\\n" separates records."""
    from gateway.audit import export

    client = aioredis.Redis.from_url(redis_url)
    await client.delete(STREAM)
    audit = AuditLog(CommandBatcher(client), keep=100, flush_s=10)
    audit.write("odd", time.time(), 404, {"key": "k", "model": "a\u2028b\u2029c\x85d"})
    await audit.flush()
    await client.xadd(STREAM, {"e": '{"request_id":"old1"}\n{"request_id":"old2"}'})  # as earlier releases wrote
    lines = await asyncio.to_thread(lambda: list(export(redis_url)))
    assert [json.loads(line)["request_id"] for line in lines] == ["odd", "old1", "old2"]
    assert json.loads(lines[0])["model"] == "a\u2028b\u2029c\x85d"
    await client.delete(STREAM)
    await client.aclose()


async def test_records_gathered_while_a_retry_was_due_are_written_after_it(own_redis: LocalRedis) -> None:
    client, audit = await failed_write(own_redis, flush_s=0.05)
    own_redis.start()
    await asyncio.sleep(0.1)
    audit.write("b", time.time(), 200, {"key": "k", "model": "m"})  # kept for the retry, no timer of its own
    deadline = time.monotonic() + RETRY_S + 10
    while not await client.exists(STREAM):  # the retry writes a and b
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    audit.write("c", time.time(), 200, {"key": "k", "model": "m"})
    while len(written(await client.xrange(STREAM))) < 3:  # and c goes on its own timer again
        assert time.monotonic() < deadline, "c was left waiting for the next request"
        await asyncio.sleep(0.05)
    assert written(await client.xrange(STREAM)) == ["a", "b", "c"]
    await client.aclose()


class LostReplies(CommandBatcher):
    """Redis runs the first ``lose`` commands, then the connection drops before their replies."""

    def __init__(self, client: aioredis.Redis, lose: int) -> None:
        super().__init__(client)
        self.lose = lose

    def call(self, *args):
        reply = super().call(*args)
        if self.lose <= 0:
            return reply
        self.lose -= 1
        lost = asyncio.get_running_loop().create_future()
        reply.add_done_callback(lambda _: lost.set_exception(ConnectionError("Connection closed by server.")))
        return lost


async def test_a_flush_whose_reply_was_lost_is_not_written_twice(redis_url: str, caplog) -> None:
    client = aioredis.Redis.from_url(redis_url)
    await client.delete(STREAM)
    audit = AuditLog(LostReplies(client, lose=1), keep=100, flush_s=10)
    audit.write("a", time.time(), 200, {"key": "k", "model": "m"})
    with pytest.raises(ConnectionError):
        await audit.flush()
    assert written(await client.xrange(STREAM)) == ["a"], "Redis ran it"
    assert "could not be written" in caplog.text
    audit.write("b", time.time(), 200, {"key": "k", "model": "m"})
    await audit.flush()  # a again (Redis knows its number: skipped), then b
    assert written(await client.xrange(STREAM)) == ["a", "b"]
    assert not audit._unwritten and not audit._failing
    await client.delete(STREAM, audit._flushes_key)
    await client.aclose()


async def test_export_loses_no_record_when_the_trail_is_trimmed_under_it(redis_url: str) -> None:
    """The trail is trimmed at its oldest end, where an export starts: when the last entry of
    a page is trimmed before the next page is read, the next page's first record must still
    be exported."""
    client = aioredis.Redis.from_url(redis_url)
    audit = AuditLog(CommandBatcher(client), keep=10_000, flush_s=10, max_records=10_000)
    for i in range(1500):
        audit.write(f"r{i}", time.time(), 200, {"key": "k", "model": "m"})
    await audit.flush()

    def run() -> list[str]:
        import redis as sync_redis
        trim = sync_redis.Redis.from_url(redis_url)
        out = []
        for n, line in enumerate(export(redis_url)):
            out.append(json.loads(line)["request_id"])
            if n == 999:  # the first page is out; the gateway's MAXLEN trims the oldest 1000 meanwhile
                trim.xtrim(STREAM, maxlen=500, approximate=False)
        trim.close()
        return out

    got = await asyncio.to_thread(run)
    assert got[1000:] == [f"r{i}" for i in range(1000, 1500)]
    await client.aclose()


async def test_an_admission_refusal_is_audited_with_what_admission_decided(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    hb = Heartbeat(worker_id="w1", pool="interactive", engine="sim", models=[ModelInfo("m", 8192)], running=0,
                   waiting=0, capacity=8, prefill_s_per_token=0.01, decode_step_s=0.005)
    name = keys.heartbeat("interactive", "w1")
    await r.set(name, protocol.encode(hb), px=60_000)
    await r.sadd(keys.WORKERS, name)
    async with TestClient(TestServer(make_app(Config(redis_url=redis_url)))) as client:
        resp = await client.post("/v1/completions", headers={"x-slogate-class": "interactive",
                                                             "x-request-id": "shed-me"},
                                 json={"model": "m", "prompt": "x" * 8000, "max_tokens": 4})
        assert resp.status == 429
        reason = resp.headers["x-slogate-reason"]
        await client.server.app[STATE].audit.flush()
    [record] = [json.loads(f[b"e"]) for _, f in await r.xrange(STREAM)]
    assert record["request_id"] == "shed-me" and record["status"] == 429
    assert record.get("decision") == reason, record
    await r.aclose()


class JsonLines(logging.Handler):
    """The lines a JSON log would hold, as they are emitted."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logs.JsonFormatter())
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


async def test_the_trails_own_log_lines_carry_no_requests_id(own_redis: LocalRedis) -> None:
    """The flush timer started in the context of the request whose record came first: the
    warning that Redis did not take the records, and the retries' after it, carried that
    request's id (and trace), as if they were about it."""
    client = aioredis.Redis.from_url(own_redis.url, socket_connect_timeout=1)
    audit = AuditLog(CommandBatcher(client), keep=100, flush_s=0.01)
    own_redis.stop()
    handler = JsonLines()
    logger = logging.getLogger("slogate.gateway")
    logger.addHandler(handler)
    token = logs.request_id.set("req-a")
    try:
        audit.write("req-a", time.time(), 200, {"key": "k", "model": "m"})
        logs.request_id.reset(token)
        deadline = time.monotonic() + 10
        while not [line for line in handler.lines if "could not be written" in line["msg"]]:
            assert time.monotonic() < deadline, "the failed flush is logged"
            await asyncio.sleep(0.02)
    finally:
        logger.removeHandler(handler)
        await client.aclose()
    [warning] = [line for line in handler.lines if "could not be written" in line["msg"]]
    assert "request_id" not in warning


async def test_a_retry_of_several_flushes_that_fails_logs_no_asyncio_error(own_redis: LocalRedis, caplog) -> None:
    """A retry sends every flush kept, and those gathered since, together: the timer that sent
    them awaited nothing, and asyncio logged their failure as an error with a traceback, once a
    second for as long as Redis was away."""
    client, audit = await failed_write(own_redis, flush_s=0.01)
    audit.write("b", time.time(), 200, {"key": "k", "model": "m"})  # kept for the retry: a second flush
    deadline = time.monotonic() + RETRY_S + 10
    while audit._failing and not audit._unwritten[1:]:
        assert time.monotonic() < deadline, "the retry sends a and b"
        await asyncio.sleep(0.05)
    gc.collect()  # an unretrieved failure is reported when its future is collected
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text
    await client.aclose()



class Counted(CommandBatcher):
    """Counts the commands sent."""

    calls = 0

    def call(self, *args):
        self.calls += 1
        return super().call(*args)


async def test_closing_waits_for_the_flush_on_its_way_and_sends_nothing_after(own_redis: LocalRedis, caplog) -> None:
    """Redis hung as the gateway stops: the flush on its way was not waited for, its records
    were lost without a word, and its retries went on after close (with two of them at once,
    the gateway never exited)."""
    client = aioredis.Redis.from_url(own_redis.url, socket_timeout=0.5)
    batcher = Counted(client)
    audit = AuditLog(batcher, keep=100, flush_s=10)
    audit.write("a", time.time(), 200, {"key": "k", "model": "m"})
    own_redis.proc.send_signal(signal.SIGSTOP)
    try:
        audit.flush()
        await audit.close()
        assert "the last 1 audit record(s) could not be written" in caplog.text
        sent = batcher.calls
        await asyncio.sleep(RETRY_S + 0.5)
        assert batcher.calls == sent, "nothing is sent after close"
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
    assert caplog.text.count("could not be written") == 1
    await client.aclose()
