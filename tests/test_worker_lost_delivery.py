"""A request Redis handed a worker whose reply never reached it (the read timed out, the
connection was cut) waits in that worker's pending list, where nobody looks for it until it
has been idle ``claim_idle_s``. The worker takes it back as soon as it can read again."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlparse

import redis.asyncio as aioredis

from engines.sim import create
from engines.worker import Worker, WorkerSettings
from slogate import keys, protocol
from slogate.protocol import Error, Final, GenerateRequest, SamplingParams
from slogate.tasks import cancel_and_wait

REPLIES = keys.replies("test-gateway")


class ReplyCutter:
    """A TCP proxy to Redis that, while ``cutting``, drops what Redis sends back, for good on
    each connection it touched: its client waits for replies that never come."""

    def __init__(self, redis_url: str) -> None:
        self.target = urlparse(redis_url)
        self.cutting = False
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.target.scheme == "unix":  # the test Redis's url, where its socket path fits
            server_r, server_w = await asyncio.open_unix_connection(self.target.path)
        else:
            server_r, server_w = await asyncio.open_connection(self.target.hostname, self.target.port)
        cut = False

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, replies: bool) -> None:
            nonlocal cut
            while data := await reader.read(65536):
                cut = cut or (replies and self.cutting)
                if not (replies and cut):
                    writer.write(data)
            writer.close()

        await asyncio.gather(pump(client_r, server_w, False), pump(server_r, client_w, True), return_exceptions=True)

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()


def request(max_tokens: int = 2) -> GenerateRequest:
    return GenerateRequest(id="r", model="m", pool="p", cls="interactive",
                           sampling=SamplingParams(max_tokens=max_tokens), deadline=time.time() + 60,
                           enqueued_at=time.time(), reply=REPLIES, prompt="hi")


async def cut_off_delivery(direct: aioredis.Redis, cutter: ReplyCutter, worker: Worker, req: GenerateRequest) -> None:
    """Have Redis hand ``req`` to ``worker``'s blocked read, and drop the reply until the read
    has timed out."""
    while not await direct.exists(keys.queue("p")):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # the intake blocked on its read
    cutter.cutting = True
    await direct.xadd(keys.queue("p"), {protocol.ID_FIELD: req.id, protocol.FIELD: protocol.encode(req)})
    while not (pending := await direct.xpending(keys.queue("p"), keys.GROUP))["pending"]:
        await asyncio.sleep(0.01)
    assert pending["consumers"][0]["name"].decode() == worker.s.worker_id, "Redis handed it to the worker"
    await asyncio.sleep(1.5)  # past the client's read timeout
    cutter.cutting = False


async def final_record(direct: aioredis.Redis, seconds: float) -> protocol.Result | None:
    """The last record written for the request, once one ends it, within ``seconds``."""
    for _ in range(int(seconds * 10)):
        entries = await direct.xrange(REPLIES)
        records = [protocol.decode_result(payload) for _, f in entries
                   for _, payload in protocol.decode_batch(f[protocol.BATCH_FIELD])]
        if records and isinstance(records[-1], Final | Error):
            return records[-1]
        await asyncio.sleep(0.1)
    return None


async def test_a_request_whose_delivery_was_cut_off_is_taken_back_at_once(redis_url: str) -> None:
    direct = aioredis.Redis.from_url(redis_url)
    cutter = ReplyCutter(redis_url)
    via = aioredis.Redis.from_url(await cutter.start(), socket_timeout=1.0)
    worker = Worker(create(decode_base_s=0), via, WorkerSettings(pool="p", claim_idle_s=120))
    task = asyncio.create_task(worker.run())
    try:
        await cut_off_delivery(direct, cutter, worker, request())
        final = await final_record(direct, 10)  # well inside claim_idle_s
        assert isinstance(final, Final), "the request was served"
        assert final.attempt == 1, "its first delivery never reached a worker: no attempt was spent"
    finally:
        await cancel_and_wait([task])
        await via.aclose()
        await direct.aclose()
        await cutter.close()


async def test_a_request_taken_back_counts_one_attempt_when_another_worker_takes_it_over(redis_url: str) -> None:
    """The worker that took it back dies while serving it: the one that takes it over runs its
    second attempt, which ``max_attempts=2`` allows, not a third."""
    direct = aioredis.Redis.from_url(redis_url)
    cutter = ReplyCutter(redis_url)
    via = aioredis.Redis.from_url(await cutter.start(), socket_timeout=1.0)
    fast = WorkerSettings(pool="p", claim_idle_s=120, heartbeat_interval_s=0.1, heartbeat_ttl_s=0.5, max_attempts=2)
    first = Worker(create(decode_base_s=0.05), via, WorkerSettings(**{**vars(fast), "worker_id": "first"}))
    second = Worker(create(decode_base_s=0), direct, WorkerSettings(**{**vars(fast), "worker_id": "second"}))
    tasks = [asyncio.create_task(first.run())]
    try:
        await cut_off_delivery(direct, cutter, first, request(max_tokens=1000))
        while "r" not in first.inflight:
            await asyncio.sleep(0.05)
        # It dies with the request held; cancelled again while it cleans up, its heartbeat would outlive it.
        await cancel_and_wait(tasks, every_s=5.0)
        tasks.append(asyncio.create_task(second.run()))
        final = await final_record(direct, 10)
        assert isinstance(final, Final), final
        assert final.attempt == 2
    finally:
        await cancel_and_wait(tasks)
        await via.aclose()
        await direct.aclose()
        await cutter.close()


async def test_a_worker_whose_read_failed_while_redis_restarted_empty_reads_again(own_redis) -> None:
    """The failed read has the worker look for deliveries cut off, in a queue and a group that
    Redis lost: the look, refused for good, kept the intake from the read that creates them
    again, and the worker served nothing."""
    client = aioredis.Redis.from_url(own_redis.url, socket_timeout=1.0)
    worker = Worker(create(decode_base_s=0), client, WorkerSettings(pool="p", claim_idle_s=120))
    task = asyncio.create_task(worker.run())
    try:
        while not await client.exists(keys.queue("p")):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the intake blocked on its read
        own_redis.stop()
        await asyncio.sleep(1.0)  # its read fails meanwhile
        own_redis.start()
        req = request()
        await client.xadd(keys.queue("p"), {protocol.ID_FIELD: req.id, protocol.FIELD: protocol.encode(req)})
        final = await final_record(client, 10)
        assert isinstance(final, Final), "the request sent once Redis was back was served"
    finally:
        await cancel_and_wait([task])
        await client.aclose()


async def test_a_request_another_worker_takes_over_meanwhile_is_not_taken_back(redis_url: str, monkeypatch) -> None:
    """Another worker claims the request between this one's look at its pending entries and its
    claim (this one's heartbeat lapsed while Redis was slow): taken back, it ran on both, and
    this one's records, of an attempt older than the other's, were dropped at the gateway."""
    direct = aioredis.Redis.from_url(redis_url)
    cutter = ReplyCutter(redis_url)
    via = aioredis.Redis.from_url(await cutter.start(), socket_timeout=1.0)
    worker = Worker(create(decode_base_s=0), via, WorkerSettings(pool="p", claim_idle_s=120))
    await direct.set(keys.heartbeat("p", "other"), b"alive")
    look = via.xpending_range

    async def look_then_taken_over(*args, **kwargs):
        pending = await look(*args, **kwargs)
        if kwargs.get("consumername") == worker.s.worker_id and pending:
            await direct.xclaim(keys.queue("p"), keys.GROUP, "other", 0, [p["message_id"] for p in pending])
        return pending

    monkeypatch.setattr(via, "xpending_range", look_then_taken_over)
    task = asyncio.create_task(worker.run())
    try:
        await cut_off_delivery(direct, cutter, worker, request())
        await asyncio.sleep(2.0)
        owners = [p["consumer"] for p in await direct.xpending_range(keys.queue("p"), keys.GROUP, "-", "+", 10)]
        assert (owners, await direct.xrange(REPLIES)) == ([b"other"], []), "left to the worker that took it over"
    finally:
        await cancel_and_wait([task])
        await via.aclose()
        await direct.aclose()
        await cutter.close()


async def deliver(direct: aioredis.Redis, worker: Worker, ids: list[str]) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Queue requests ``ids`` and have Redis hand them to ``worker``'s consumer, as a read whose
    reply the worker may never see."""
    for rid in ids:
        req = GenerateRequest(id=rid, model="m", pool="p", cls="interactive", sampling=SamplingParams(max_tokens=2),
                              deadline=time.time() + 60, enqueued_at=time.time(), reply=REPLIES, prompt="hi")
        await direct.xadd(keys.queue("p"), {protocol.ID_FIELD: rid, protocol.FIELD: protocol.encode(req)})
    return (await direct.xreadgroup(keys.GROUP, worker.s.worker_id, {keys.queue("p"): ">"}, count=len(ids)))[0][1]


async def test_a_take_back_takes_no_more_than_there_is_room_for(redis_url: str) -> None:
    """The look at this worker's pending entries asks for ``room`` more than it holds, but what it
    holds may come after what was cut off (taken over from a worker that read later): every entry
    of the look was cut off, and all of them were taken, past the room."""
    direct = aioredis.Redis.from_url(redis_url)
    worker = Worker(create(decode_base_s=0), direct, WorkerSettings(pool="p", claim_idle_s=120))
    try:
        await worker._ensure_group()
        await deliver(direct, worker, [f"cut{i}" for i in range(5)])
        await worker._accept(await deliver(direct, worker, [f"held{i}" for i in range(3)]), attempts=None)
        await asyncio.sleep(0.3)  # past CUT_OFF_IDLE_MS
        worker._unread_own = True
        await worker._take_back_unread(2)
        assert sorted(worker.inflight) == ["cut0", "cut1", "held0", "held1", "held2"]
        assert worker._unread_own, "the rest is taken back as room frees"
        await worker._take_back_unread(3)
        assert len(worker.inflight) == 8
    finally:
        await asyncio.gather(*worker._checks)
        await direct.aclose()


async def test_a_take_back_waits_for_entries_too_young_to_take_rather_than_looking_again_at_once(
        redis_url: str, monkeypatch) -> None:
    """Entries delivered here a moment ago (another loop of this worker claimed them, and has yet
    to hold them) filled the look: the intake looked again at once, over and over, until they
    were old enough."""
    direct = aioredis.Redis.from_url(redis_url)
    worker = Worker(create(decode_base_s=0), direct, WorkerSettings(pool="p", claim_idle_s=120))
    look = direct.xpending_range
    looks = 0

    async def counted(*args, **kwargs):
        nonlocal looks
        looks += 1
        return await look(*args, **kwargs)

    monkeypatch.setattr(direct, "xpending_range", counted)
    try:
        await worker._ensure_group()
        await deliver(direct, worker, ["a", "b"])
        worker._unread_own = True
        while worker._unread_own and looks < 20:
            await worker._take_back_unread(2)
        assert sorted(worker.inflight) == ["a", "b"], "taken back once old enough"
        assert looks <= 4, f"{looks} looks"
    finally:
        await asyncio.gather(*worker._checks)
        await direct.aclose()
