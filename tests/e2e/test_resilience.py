"""Redis going away, a gateway or a worker told to stop, unreadable messages and clients that stop reading."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
import redis

from slogate import keys
from slogate.local_redis import LocalRedis
from slogate.processes import Stack, http_get
from tests.e2e.conftest import FAST_FLEET, MODEL
from tests.e2e.test_failures import running, wait_for

SCORE = {"model": MODEL, "messages": [{"role": "user", "content": "score txn 3"}], "max_tokens": 4}


def stack_on(server: LocalRedis, decode_base_s: float = 0.001, **env: str) -> Stack:
    stack = Stack(server.url, {**FAST_FLEET, "SLOGATE_ADMISSION_CONTROL": "0", **env})
    stack.gateway()
    for pool in ("interactive", "batch"):
        stack.worker(pool, "sim", f"decode_base_s={decode_base_s}", "decode_s_per_seq=0")
    stack.wait_models(MODEL, pools=2)
    return stack


async def post(stack: Stack, body: dict, timeout: float = 10) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
            await r.read()
            return r.status


async def until_in_flight(stack: Stack, n: int = 1, timeout: float = 10) -> None:
    """Until the gateway handles ``n`` requests: a fixed sleep let a loaded host send the
    signal before the request arrived, and the gateway, idle, exited at once."""
    want = f"slogate_gateway_requests_in_flight {float(n)}".encode()
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while want not in await (await s.get(stack.url + "/metrics")).read():
            assert time.monotonic() < deadline, f"{n} request(s) never reached the gateway"
            await asyncio.sleep(0.02)


async def test_redis_outage_gives_503_then_recovers(own_redis: LocalRedis) -> None:
    stack = stack_on(own_redis, decode_base_s=0.02, SLOGATE_REDIS_GRACE_S="1")  # requests fail 1 s into an outage
    try:
        assert await post(stack, SCORE) == 200
        in_flight = asyncio.create_task(post(stack, {**SCORE, "max_tokens": 100}))
        await asyncio.sleep(0.3)
        own_redis.stop()
        assert await in_flight == 503, "a request caught by the outage must fail, not hang or vanish"
        statuses = [await post(stack, SCORE, timeout=5) for _ in range(5)]
        assert set(statuses) == {503}
        stack.wait_http("/readyz", status=503, timeout=5)
        metrics = http_get(stack.url + "/metrics")[1].decode()
        refused = counter(metrics, "slogate_rejected_requests_total", 'status="503"')
        queued = counter(metrics, "slogate_requests_total", 'outcome="redis_unavailable"')
        assert refused + queued == 6, "each 503 is counted once: refused before queueing, or queued and failed"
        assert queued >= 1, "the request caught in flight was queued"
        own_redis.start()
        stack.wait_http("/readyz", status=200, timeout=20)
        assert await post(stack, SCORE) == 200, "the gateway and workers recover without a restart"
    finally:
        stack.stop()


def counter(metrics: str, name: str, label: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{") and label in line)


async def test_sigterm_drains_in_flight_requests(redis_server: LocalRedis) -> None:
    redis.Redis.from_url(redis_server.url).flushdb()
    stack = stack_on(redis_server, decode_base_s=0.02)
    gateway = stack.procs[0]
    try:
        slow = asyncio.create_task(post(stack, {**SCORE, "max_tokens": 50}))
        await until_in_flight(stack)
        gateway.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        assert await post(stack, SCORE) == 503, "a draining gateway takes no new work"
        assert http_get(stack.url + "/readyz")[0] == 503
        assert await slow == 200, "work in flight finishes within the grace period"
        assert gateway.wait(timeout=10) == 0
    finally:
        stack.stop()


async def test_a_request_whose_body_is_still_arriving_when_the_drain_starts_is_served(
        redis_server: LocalRedis) -> None:
    """It passed the draining check already: the drain waits for it as for any in flight."""
    redis.Redis.from_url(redis_server.url).flushdb()
    stack = stack_on(redis_server)
    gateway = stack.procs[0]
    try:
        body = json.dumps(SCORE).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
        await writer.drain()
        await asyncio.sleep(0.3)
        gateway.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.0)  # a slow link: the rest of the body comes a second later
        writer.write(body[10:])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert gateway.wait(timeout=10) == 0
    finally:
        stack.stop()


async def test_requests_still_open_when_the_grace_ends_get_a_503_and_stop(redis_server: LocalRedis) -> None:
    """Cut off without a word, a stream looked like a network fault, and its work went on."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    stack = Stack(redis_server.url, {**FAST_FLEET, "SLOGATE_ADMISSION_CONTROL": "0"})
    gateway = stack.gateway("--grace", "0.3")
    stack.worker("interactive", "sim", "decode_base_s=0.02", "decode_s_per_seq=0")
    stack.wait_models(MODEL)
    try:
        long = asyncio.create_task(post(stack, {**SCORE, "max_tokens": 1000}, timeout=30))  # 20 s of decode
        async with aiohttp.ClientSession() as s:
            async with s.post(stack.url + "/v1/chat/completions",
                              json={**SCORE, "max_tokens": 1000, "stream": True}) as r:
                assert r.status == 200
                await r.content.readline()
                gateway.send_signal(signal.SIGTERM)
                events = [line for line in (await r.read()).decode().splitlines() if line.startswith("data: ")]
        assert await long == 503
        assert '"code":"shutting_down"' in events[-2] and events[-1] == "data: [DONE]"
        assert gateway.wait(timeout=10) == 0, "the gateway exits once the grace is over"
        await worker_stops(client)
    finally:
        stack.stop()
        client.close()


async def test_a_second_signal_ends_the_grace_at_once(redis_server: LocalRedis, tmp_path: Path) -> None:
    """A second SIGTERM or Ctrl-C means now, as it does to ``slogate up``: the gateway waited out
    its whole grace (30 s here) all the same. What is open ends as at the grace's end, and the
    shutdown after it runs as ever: the request's audit record is written, its worker stops it."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    stack = Stack(redis_server.url, {**FAST_FLEET, "SLOGATE_ADMISSION_CONTROL": "0", "SLOGATE_LOG_LEVEL": "INFO"},
                  log_dir=tmp_path / "logs")
    gateway = stack.gateway()
    stack.worker("interactive", "sim", "decode_base_s=0.05", "decode_s_per_seq=0")
    stack.wait_models(MODEL)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(stack.url + "/v1/chat/completions", headers={"x-request-id": "second-signal"},
                              json={**SCORE, "max_tokens": 1000, "stream": True}) as r:  # 50 s of decode
                assert r.status == 200
                await r.content.readline()
                gateway.send_signal(signal.SIGTERM)
                await asyncio.sleep(1.0)
                assert gateway.poll() is None, "one signal leaves open requests their grace"
                gateway.send_signal(signal.SIGTERM)
                try:
                    rest = await asyncio.wait_for(r.read(), 10)
                except TimeoutError:
                    raise AssertionError("the stream ran on into the grace after a second SIGTERM") from None
        events = [line for line in rest.decode().splitlines() if line.startswith("data: ")]
        assert '"code":"shutting_down"' in events[-2] and events[-1] == "data: [DONE]"
        assert gateway.wait(timeout=10) == 0
        audited = [json.loads(fields[b"e"]) for _, fields in client.xrange("slogate:audit")]
        assert [r["outcome"] for r in audited if r.get("request_id") == "second-signal"] == ["shutting_down"]
        await worker_stops(client)
    finally:
        stack.stop()
        client.close()
    log = (tmp_path / "logs" / "gateway-0.log").read_text()
    assert log.count("a second signal cut the grace short") == 1, log


def holding_worker(server: LocalRedis, tmp_path: Path, *args: str) -> tuple[Stack, subprocess.Popen[bytes]]:
    """A gateway and the pool's one worker, at 20 s a hundred tokens; heartbeats that outlive a
    worker by seconds, unless it removes its own."""
    stack = Stack(server.url, {**FAST_FLEET, "SLOGATE_HEARTBEAT_TTL_S": "2", "SLOGATE_CLAIM_IDLE_S": "60",
                               "SLOGATE_ADMISSION_CONTROL": "0", "SLOGATE_LOG_LEVEL": "INFO"},
                  log_dir=tmp_path / "logs")
    stack.gateway()
    worker = stack._spawn("worker", "--pool", "interactive", "--engine", "sim", "-o", "decode_base_s=0.2",
                          "-o", "decode_s_per_seq=0", *args)
    stack.wait_models(MODEL)
    return stack, worker


async def left_to_another_worker(stack: Stack, client: redis.Redis, answer: asyncio.Task) -> None:
    """The stopped worker's request is still pending, its heartbeat gone; a new worker finishes it."""
    assert not list(client.scan_iter("slogate:hb:*")) and not client.smembers(keys.WORKERS), \
        "a worker removes its heartbeat as it exits"
    assert client.xpending(keys.queue("interactive"), keys.GROUP)["pending"] == 1
    stack.worker("interactive", "sim", "decode_base_s=0.001", "decode_s_per_seq=0")
    resp = await asyncio.wait_for(answer, 20)
    assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 100


async def test_a_worker_whose_grace_runs_out_removes_its_heartbeat(redis_server: LocalRedis, tmp_path: Path) -> None:
    """It was left to expire: the gateway counted a gone worker, and other workers took its
    requests over only once it had."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    stack, worker = holding_worker(redis_server, tmp_path, "--grace", "1")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=40)) as s:
            answer = asyncio.create_task(s.post(stack.url + "/v1/chat/completions", json={**SCORE, "max_tokens": 100}))
            await asyncio.to_thread(wait_for, lambda: running(client) == 1, 5, "the request to start")
            worker.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(worker.wait, 10) == 0
            await left_to_another_worker(stack, client, answer)
    finally:
        stack.stop()
        client.close()
    log = (tmp_path / "logs" / "worker-1.log").read_text()
    assert "grace period over; 1 request(s) left pending for other workers" in log, log


async def test_a_second_signal_ends_a_workers_grace_at_once(redis_server: LocalRedis, tmp_path: Path) -> None:
    """As it does the gateway's and ``slogate up``'s: the worker waited out its whole grace (30 s
    here) all the same. What it holds is left as at the grace's end, for other workers."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    stack, worker = holding_worker(redis_server, tmp_path)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=40)) as s:
            answer = asyncio.create_task(s.post(stack.url + "/v1/chat/completions", json={**SCORE, "max_tokens": 100}))
            await asyncio.to_thread(wait_for, lambda: running(client) == 1, 5, "the request to start")
            worker.send_signal(signal.SIGTERM)
            await asyncio.sleep(1.0)
            assert worker.poll() is None, "one signal leaves held requests their grace"
            worker.send_signal(signal.SIGTERM)
            try:
                assert await asyncio.to_thread(worker.wait, 10) == 0
            except subprocess.TimeoutExpired:
                raise AssertionError("the worker ran on into its grace after a second SIGTERM") from None
            await left_to_another_worker(stack, client, answer)
    finally:
        stack.stop()
        client.close()
    log = (tmp_path / "logs" / "worker-1.log").read_text()
    assert log.count("a second signal cut the grace short; 1 request(s) left pending for other workers") == 1, log
    assert "grace period over" not in log, log


async def stuck_stream(server: LocalRedis, tmp_path: Path, request_id: str) -> tuple[Stack, subprocess.Popen[bytes],
                                                                                   socket.socket]:
    """A gateway (grace 1 s) whose stream to a client that reads nothing has filled the socket's
    buffers: its handler's write never completes."""
    redis.Redis.from_url(server.url).flushdb()
    stack = Stack(server.url, {**FAST_FLEET, "SLOGATE_ADMISSION_CONTROL": "0", "SLOGATE_LOG_LEVEL": "INFO"},
                  log_dir=tmp_path / "logs")
    gateway = stack.gateway("--grace", "1")
    stack.worker("interactive", "sim", "decode_base_s=0.001", "decode_s_per_seq=0")
    stack.wait_models(MODEL)
    # Some 20 MB of events (top logprobs make each some 3 kB), far more than the socket buffers hold.
    body = json.dumps({**SCORE, "max_tokens": 7000, "stream": True, "logprobs": True, "top_logprobs": 20}).encode()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        client.connect(("127.0.0.1", stack.port))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"x-request-id: %s\r\nContent-Length: %d\r\n\r\n" % (request_id.encode(), len(body)) + body)
        await stuck(stack.port, client.getsockname()[1])
    except BaseException:
        client.close()
        stack.stop()
        raise
    return stack, gateway, client


def audited(server: LocalRedis, request_id: str) -> dict:
    audit = redis.Redis.from_url(server.url)
    [record] = [r for _, fields in audit.xrange("slogate:audit")
                if (r := json.loads(fields[b"e"])).get("request_id") == request_id]
    audit.close()
    return record


async def test_a_stream_whose_client_stopped_reading_is_ended_by_the_gateway_at_the_grace_end(
        redis_server: LocalRedis, tmp_path: Path) -> None:
    """Its write never completes, so aiohttp cancels its handler at shutdown: that was logged
    and audited as a client that left (499 ``cancelled``), though the gateway ended it."""
    stack, gateway, client = await stuck_stream(redis_server, tmp_path, "stopped-reading")
    try:
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=20) == 0
        record = audited(redis_server, "stopped-reading")
    finally:
        client.close()
        stack.stop()
    assert (record["status"], record["outcome"]) == (503, "shutting_down"), record
    log = (tmp_path / "logs" / "gateway-0.log").read_text()
    assert "the client closed the connection" not in log, log
    assert "the grace was over before POST /v1/chat/completions finished" in log, log


@pytest.mark.parametrize("leaves", ["grace_over", "not_listening"])
async def test_a_client_that_leaves_after_the_grace_is_counted_as_leaving(
        redis_server: LocalRedis, tmp_path: Path, leaves: str) -> None:
    """Once the grace is over the gateway gives what is still open a second to take its 503, then
    aiohttp's shutdown stops listening and waits half a second more for the handlers before it
    cancels them: a client that closed its connection in either was logged and audited as ended
    by the gateway (503 ``shutting_down``), though it left as one does before the grace."""
    stack, gateway, client = await stuck_stream(redis_server, tmp_path, "left-late")
    log = tmp_path / "logs" / "gateway-0.log"
    try:
        gateway.send_signal(signal.SIGTERM)
        while ("grace over: ending 1 request(s)" not in log.read_text() if leaves == "grace_over"
               else listening(stack.port)):
            assert gateway.poll() is None, "the gateway exited before the client left"
            await asyncio.sleep(0.01)
        client.close()
        assert gateway.wait(timeout=20) == 0
        record = audited(redis_server, "left-late")
    finally:
        client.close()
        stack.stop()
    assert record["status"] == 499, record
    text = log.read_text()
    assert "the client closed the connection during POST /v1/chat/completions" in text, text
    assert "the grace was over before" not in text, text


async def stuck(port: int, peer_port: int, timeout: float = 30.0) -> None:
    """Until the gateway's socket to the client holds as much unsent as it takes: its handler's
    writes wait for a client that reads nothing (Linux's ``/proc/net/tcp``)."""
    end, last = time.monotonic() + timeout, -1
    while (now := unsent(port, peer_port)) == 0 or now != last:
        assert time.monotonic() < end, "the stream never filled the socket's buffers"
        last = now
        await asyncio.sleep(0.5)


def listening(port: int) -> bool:
    """Whether a socket listens on ``port`` (``/proc/net/tcp``'s state 0A)."""
    return any(int(fields[1].split(":")[1], 16) == port and fields[3] == "0A"
               for fields in map(str.split, Path("/proc/net/tcp").read_text().splitlines()[1:]))


def unsent(port: int, peer_port: int) -> int:
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and int(fields[2].split(":")[1], 16) == peer_port:
            return int(fields[4].split(":")[0], 16)
    return 0


async def test_unreadable_messages_are_dropped_and_work_goes_on(redis_server: LocalRedis) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    stack = stack_on(redis_server)
    try:
        queue = keys.queue("interactive")
        client.xadd(queue, {b"m": b"\x93garbage"})
        client.xadd(queue, {b"m": b"\x82\xa1v\x63\xa2id\xa1x"})
        client.xadd(queue, {b"other": b"field"})
        assert await post(stack, SCORE) == 200
        deadline = time.monotonic() + 5
        while client.xpending(queue, keys.GROUP)["pending"] or client.xlen(queue):
            assert time.monotonic() < deadline, "unreadable entries must be acknowledged and removed"
            await asyncio.sleep(0.05)
    finally:
        stack.stop()
        client.close()


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_stalled_stream_reader_does_not_hurt_others(redis_server: LocalRedis) -> None:
    redis.Redis.from_url(redis_server.url).flushdb()
    stack = stack_on(redis_server)
    gateway_pid = stack.procs[0].pid
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
        body = (b'{"model": "%s", "prompt": "go", "max_tokens": 1500, "stream": true}' % MODEL.encode())
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        before = rss_kb(gateway_pid)
        results = await asyncio.gather(*(post(stack, SCORE) for _ in range(30)))
        assert results == [200] * 30
        await asyncio.sleep(1.0)
        assert rss_kb(gateway_pid) - before < 50_000, "a client that stops reading must not grow memory"
        writer.close()
    finally:
        stack.stop()


async def test_a_request_ended_during_an_outage_is_stopped_once_redis_is_back(tmp_path: Path) -> None:
    """Its cancel could not reach Redis, and the worker would have run it to its end for
    nobody (its gateway is alive, so the gone-gateway check does not fire)."""
    own_redis = LocalRedis(tmp_path / "redis", persist=True).start()
    stack = stack_on(own_redis, decode_base_s=0.02, SLOGATE_REDIS_GRACE_S="1")  # requests fail 1 s into an outage
    client = redis.Redis.from_url(own_redis.url)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(stack.url + "/v1/chat/completions",
                              json={**SCORE, "max_tokens": 1500, "stream": True}) as r:  # 30 s of decode
                await r.content.readline()
                own_redis.stop()
                events = [line for line in (await r.read()).decode().splitlines() if line.startswith("data: ")]
        assert '"code":"redis_unavailable"' in events[-2], "after the grace, the stream ends with a 503 event"
        request_id = json.loads(events[0][len("data: "):])["id"].removeprefix("chatcmpl-")
        own_redis.start()
        deadline = time.monotonic() + 10  # 20 s before the request would end on its own
        while not client.exists(keys.cancel(request_id)):
            assert time.monotonic() < deadline, "the cancel is sent again once Redis is back"
            await asyncio.sleep(0.05)
        while not list(client.scan_iter("slogate:hb:interactive:*")) or running(client):
            assert time.monotonic() < deadline, "the worker stops the request"
            await asyncio.sleep(0.05)
    finally:
        stack.stop()
        client.close()
        own_redis.stop()


async def test_a_redis_outage_does_not_show_clients_where_redis_is(own_redis: LocalRedis) -> None:
    """redis-py's errors name the host and port or socket path: the operator's to know."""
    stack = stack_on(own_redis, decode_base_s=0.02, SLOGATE_REDIS_GRACE_S="1")  # requests fail 1 s into an outage
    where = own_redis.url.split("://", 1)[1].split("?")[0]

    async def ask(body: dict) -> tuple[int, str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
                return r.status, await r.text()

    try:
        in_flight = asyncio.create_task(ask({**SCORE, "max_tokens": 100}))
        await asyncio.sleep(0.3)
        own_redis.stop()
        answers = [await in_flight] + [await ask(SCORE) for _ in range(3)]
        own_redis.start()  # a worker holding unsent results waits for Redis to stop, past Stack.stop's 10 s
    finally:
        stack.stop()
    for status, text in answers:
        assert status == 503 and "Redis" in text, text
        assert where not in text and "connecting to" not in text, text


async def test_a_request_stopped_while_redis_refused_the_gateways_renewals_is_answered(own_redis: LocalRedis) -> None:
    """Redis out of memory for 4 s refuses every write, the gateway's alive key's renewals
    included: the key (2 s here) lapses and the workers stop the gateway's requests, as a dead
    gateway's. But the gateway lives, and its client waited for the request's deadline."""
    stack = stack_on(own_redis, decode_base_s=0.02, SLOGATE_ALIVE_TTL_S="2")
    client = redis.Redis.from_url(own_redis.url)

    async def ask() -> tuple[int, str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(stack.url + "/v1/chat/completions", json={**SCORE, "max_tokens": 1500},
                              headers={"x-slogate-timeout": "40"}) as r:  # 30 s of decode
                return r.status, await r.text()

    try:
        in_flight = asyncio.create_task(ask())
        await asyncio.sleep(0.5)
        client.config_set("maxmemory", 1)
        try:
            await asyncio.sleep(4.0)
        finally:
            client.config_set("maxmemory", 0)
        status, text = await in_flight
        assert status == 503 and "deadline" not in text, (status, text)
    finally:
        stack.stop()
        client.close()


async def worker_stops(client) -> None:
    deadline = time.monotonic() + 5
    while running(client):
        assert time.monotonic() < deadline, "the worker stops what nobody waits for"
        await asyncio.sleep(0.05)


def stops_on_sigterm(proc: subprocess.Popen, within_s: float) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the process did not exit within {within_s:g} s of SIGTERM") from None


def test_a_gateway_told_to_stop_while_redis_hangs_exits(own_redis: LocalRedis) -> None:
    """Redis frozen (SIGSTOP: a hung host, a stalled VM), nothing in flight: the last clean-up
    went through the result reader's connection, which has no read timeout, and over the Unix
    socket nothing ever broke it: the gateway never exited. Its commands wait a second for
    Redis (``redis_timeout_s``), the time its last clean-ups take here."""
    stack = stack_on(own_redis, SLOGATE_REDIS_TIMEOUT_S="1")
    gateway = stack.procs[0]
    try:
        own_redis.proc.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        stops_on_sigterm(gateway, 30)
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
        stack.stop()


async def test_a_gateway_told_to_stop_while_redis_hangs_exits_though_cancels_were_due_again(
        own_redis: LocalRedis, tmp_path: Path) -> None:
    """Two clients left while Redis hung: each cancel was sent again every second until its
    request's deadline (ten minutes here), and those retries, one always on its way, held the
    gateway's exit as long. Each is sent once more, and what Redis did not take is said once.
    Each try waits 2 s for Redis (``redis_timeout_s``), then 1 s for the next: a cancel is on
    its way 2 s of each 3, and the second's, 1.5 s behind the first's, covers the first's pauses."""
    stack = Stack(own_redis.url, {**FAST_FLEET, "SLOGATE_ADMISSION_CONTROL": "0", "SLOGATE_REDIS_TIMEOUT_S": "2"},
                  log_dir=tmp_path / "logs")
    gateway = stack.gateway()
    stack.worker("interactive", "sim", "decode_base_s=0.02", "decode_s_per_seq=0")
    stack.wait_models(MODEL)
    body = {**SCORE, "max_tokens": 1500, "stream": True}  # 30 s of decode
    try:
        async with aiohttp.ClientSession() as s:
            streams = [await s.post(stack.url + "/v1/chat/completions", json=body,
                                    headers={"x-slogate-timeout": "600"}) for _ in range(2)]
            for r in streams:
                await r.content.readline()
            own_redis.proc.send_signal(signal.SIGSTOP)
            for r in streams:  # a retry of one is always on its way when the other's is due
                r.close()
                await asyncio.sleep(1.5)
        await asyncio.sleep(1.0)  # both failed once: the first's second try is on its way, the second waits for one
        stops_on_sigterm(gateway, 40)
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
        stack.stop()
    log = (tmp_path / "logs" / "gateway-0.log").read_text()
    assert log.count("2 cancel(s) could not be sent to Redis") == 1, log
