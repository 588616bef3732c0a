"""The gateway's count of requests in flight per pool, against a real Redis: its own requests
exactly as they start and end, other gateways' from the stream's length."""

from __future__ import annotations

import asyncio
import signal

import pytest
import redis.asyncio as aioredis

from gateway import workers
from gateway.workers import WorkerDirectory
from slogate import keys, protocol
from slogate.local_redis import LocalRedis
from slogate.protocol import Heartbeat, ModelInfo
from slogate.tasks import cancel_and_wait


async def beat(client: aioredis.Redis, hb: Heartbeat, ttl_ms: int | None = None) -> None:
    """What a worker's heartbeat writes."""
    key = keys.heartbeat(hb.pool, hb.worker_id)
    await client.set(key, protocol.encode(hb), px=ttl_ms)
    await client.sadd(keys.WORKERS, key)


async def test_in_flight_counts_own_requests_at_once_and_others_from_the_stream(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    hb = Heartbeat(worker_id="w1", pool="interactive", engine="sim", models=[ModelInfo("m", 4096)],
                   running=0, waiting=0, capacity=16)
    await beat(client, hb)
    directory = WorkerDirectory(client, ["interactive", "batch"])
    mine = [directory.own.start("interactive", 100.0 + i) for i in range(3)]
    for _ in range(3):  # this gateway's requests, queued
        await client.xadd(keys.queue("interactive"), {"m": b"x"})
    for _ in range(5):  # another gateway's
        await client.xadd(keys.queue("interactive"), {"m": b"x"})
    await directory.refresh()
    sig = directory.signals()
    assert (sig["interactive"].in_flight, sig["batch"].in_flight) == (8, 0)
    assert [w.worker_id for w in sig["interactive"].workers] == ["w1"]
    assert sorted(sig["interactive"].own_ends) == [100.0, 101.0, 102.0]

    directory.own.end("interactive", mine[0])
    directory.own.end("interactive", mine[2])
    directory.own.start("batch", 200.0)
    sig = directory.signals()  # no read in between: own changes count at once
    assert (sig["interactive"].in_flight, sig["batch"].in_flight) == (6, 1)
    assert list(sig["interactive"].own_ends) == [101.0]
    await client.aclose()


async def test_a_frozen_redis_makes_the_gateway_unready_before_its_reads_time_out(
        own_redis: LocalRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of a stopped Redis fails only at the socket timeout (5 s); until then /readyz said ok."""
    monkeypatch.setattr(workers, "STALE_AFTER_S", 0.3)
    client = aioredis.Redis.from_url(own_redis.url, socket_timeout=5)
    hb = Heartbeat(worker_id="w1", pool="interactive", engine="sim", models=[ModelInfo("m", 4096)],
                   running=0, waiting=0, capacity=16)
    await beat(client, hb)
    directory = workers.WorkerDirectory(client, ["interactive"], poll_s=0.05)
    reading = asyncio.create_task(directory.run())
    try:
        await asyncio.sleep(0.2)
        assert directory.ready() == (True, "ok")
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(1.0)
            assert directory.ready() == (False, "Redis is unreachable")
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if directory.ready()[0]:
                break
        assert directory.ready() == (True, "ok")
    finally:
        await cancel_and_wait([reading])
        await client.aclose()


async def test_the_fleet_is_read_from_the_workers_set_and_a_lost_pool_stays_watched(redis_url: str) -> None:
    """Expired heartbeats leave the set; a pool no config names, once its last worker is gone,
    is still counted as without workers (its requests are ended after the grace)."""
    client = aioredis.Redis.from_url(redis_url)
    extra = Heartbeat(worker_id="w2", pool="extra", engine="sim", models=[ModelInfo("m", 4096)],
                      running=0, waiting=0, capacity=16)
    await beat(client, extra, ttl_ms=200)
    directory = WorkerDirectory(client, ["interactive"])
    assert await directory.refresh()
    assert [hb.worker_id for hb in directory.view.by_pool["extra"]] == ["w2"]
    assert set(directory.unserved_since) == {"interactive"}
    await asyncio.sleep(0.3)
    assert await directory.refresh()
    assert not directory.view.heartbeats and set(directory.unserved_since) == {"interactive", "extra"}
    assert await client.smembers(keys.WORKERS) == set(), "the expired heartbeat's name is dropped"
    await client.aclose()


async def test_an_idle_directory_reads_the_fleet_without_scripts_until_a_probe_is_due(own_redis: LocalRedis) -> None:
    """Each read ran EVAL, SCRIPT LOAD and EVALSHA, with no expired heartbeat to drop: half of
    an idle gateway's commands to Redis. They probe the ACL, at the first read and when one is due."""
    admin = aioredis.Redis.from_url(own_redis.url)
    client = aioredis.Redis.from_url(own_redis.url)
    await beat(admin, Heartbeat(worker_id="w1", pool="interactive", engine="sim", models=[ModelInfo("m", 4096)],
                                running=0, waiting=0, capacity=16))
    directory = WorkerDirectory(client, ["interactive", "batch"])
    assert await directory.refresh()
    await admin.config_resetstat()
    for _ in range(5):
        assert await directory.refresh()
    idle = await admin.info("commandstats")
    assert idle["cmdstat_smembers"]["calls"] == 5 and idle["cmdstat_xlen"]["calls"] == 10, idle
    assert not {"cmdstat_eval", "cmdstat_evalsha", "cmdstat_script|load"} & set(idle), idle
    await admin.config_resetstat()
    await admin.delete(keys.heartbeat("interactive", "w1"))
    assert await directory.refresh() and not directory.view.heartbeats
    expired = await admin.info("commandstats")
    assert expired["cmdstat_eval"]["calls"] == 1 and "cmdstat_evalsha" not in expired, expired
    assert await admin.smembers(keys.WORKERS) == set()
    for c in (client, admin):
        await c.aclose()


async def test_an_acl_tightened_at_run_time_shows_when_the_probe_is_due(own_redis: LocalRedis,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads between probes run no script, so a refusal shows at the next probe, and its
    lifting at the next read after it."""
    admin = aioredis.Redis.from_url(own_redis.url)
    await admin.execute_command("ACL", "SETUSER", "gw", "on", ">pw", "~*", "&*", "+@all")
    client = aioredis.Redis.from_url(f"redis://gw:pw@127.0.0.1:{own_redis.port}/0")
    directory = WorkerDirectory(client, ["interactive"])
    assert await directory.refresh()
    await admin.execute_command("ACL", "SETUSER", "gw", "-evalsha")
    assert await directory.refresh() and directory.refused is None, "no probe is due yet"
    monkeypatch.setattr(workers, "PROBE_EVERY_S", 0.0)
    assert not await directory.refresh()
    assert "'evalsha' command" in (directory.refused or ""), directory.refused
    monkeypatch.setattr(workers, "PROBE_EVERY_S", 30.0)
    await admin.execute_command("ACL", "SETUSER", "gw", "+evalsha")
    assert await directory.refresh() and directory.refused is None
    for c in (client, admin):
        await c.aclose()
