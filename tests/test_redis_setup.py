"""What the gateway says of a Redis set up in a way it cannot work well with."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import make_app
from slogate import keys, protocol
from slogate.config import Config, PoolConfig
from slogate.local_redis import LocalRedis
from slogate.protocol import Heartbeat, ModelInfo


@pytest.mark.parametrize(("policy", "warned"), [("allkeys-lru", True), ("volatile-ttl", True), ("noeviction", False)])
async def test_a_redis_that_evicts_keys_when_full_is_named_at_startup(own_redis: LocalRedis, caplog, policy: str,
                                                                      warned: bool) -> None:
    """Under an eviction policy a full Redis drops keys: a queue, a heartbeat, the gateway's alive
    key (its loss fails every request that heard nothing), or the audit trail's flush numbers (a
    flush sent again after its reply was lost is written twice). Nothing said so. One that
    refuses writes when full is what the gateway wants, and is not warned of."""
    client = aioredis.Redis.from_url(own_redis.url)
    await client.config_set("maxmemory", "1gb")
    await client.config_set("maxmemory-policy", policy)
    await client.aclose()
    async with TestClient(TestServer(make_app(Config(redis_url=own_redis.url)))):
        pass
    assert (f"maxmemory-policy {policy}" in caplog.text and "noeviction" in caplog.text) == warned, caplog.text


async def test_a_gateway_whose_redis_user_may_not_run_scripts_says_so_in_its_readiness(own_redis: LocalRedis,
                                                                                      caplog) -> None:
    """The gateway's audit trail, rate limits, stream slots and fleet reads run Lua scripts. A
    user refused them was ready until the first worker's heartbeat expired, then unready for good
    (the expired name is only ever pruned by a script), saying "Redis is unreachable"."""
    admin = aioredis.Redis.from_url(own_redis.url)
    await admin.execute_command("ACL", "SETUSER", "gw", "on", ">pw", "~*", "&*", "+@all", "-@scripting")
    hb = Heartbeat(worker_id="w1", pool="interactive", engine="sim", models=[ModelInfo("m", 8192)], running=0,
                   waiting=0, capacity=8, prefill_s_per_token=0.01, decode_step_s=0.005)
    await admin.set(keys.heartbeat("interactive", "w1"), protocol.encode(hb), px=600_000)
    await admin.sadd(keys.WORKERS, keys.heartbeat("interactive", "w1"))
    url = f"redis://gw:pw@127.0.0.1:{own_redis.port}/0"
    cfg = Config(redis_url=url, pools={"interactive": PoolConfig()}, worker_poll_s=0.05)
    async with TestClient(TestServer(make_app(cfg))) as client:
        resp = await client.get("/readyz")
        body = await resp.json()
        assert resp.status == 503 and "ACL" in body["reason"] and "eval" in body["reason"], body
        assert "Redis is unreachable" not in caplog.text
        [line] = [r.getMessage() for r in caplog.records if "ACL" in r.getMessage()]
        assert "+eval" in line and "evalsha" in line
        await admin.execute_command("ACL", "SETUSER", "gw", "+@scripting")
        deadline = time.monotonic() + 10
        while (resp := await client.get("/readyz")).status != 200:
            assert time.monotonic() < deadline, await resp.text()
            await asyncio.sleep(0.05)
    await admin.aclose()


async def served_to_user(server: LocalRedis, rule: str) -> tuple[aioredis.Redis, Config]:
    """A client of ``server``'s default user, after it made a gateway's user ``gw`` of ``rule``
    and a live worker serving model "m"; the gateway's config as that user."""
    admin = aioredis.Redis.from_url(server.url)
    await admin.execute_command("ACL", "SETUSER", "gw", "on", ">pw", "~*", "&*", "+@all", rule)
    hb = Heartbeat(worker_id="w1", pool="interactive", engine="sim", models=[ModelInfo("m", 8192)], running=0,
                   waiting=0, capacity=8, prefill_s_per_token=0.01, decode_step_s=0.005)
    await admin.set(keys.heartbeat("interactive", "w1"), protocol.encode(hb), px=600_000)
    await admin.sadd(keys.WORKERS, keys.heartbeat("interactive", "w1"))
    return admin, Config(redis_url=f"redis://gw:pw@127.0.0.1:{server.port}/0", pools={"interactive": PoolConfig()},
                         worker_poll_s=0.05)


@pytest.mark.parametrize(("rule", "refused"), [("-@scripting", "eval"), ("-xadd", "xadd")])
async def test_a_request_that_redis_refuses_the_gateways_user_says_so(own_redis: LocalRedis, rule: str,
                                                                      refused: str) -> None:
    """Refused at the fleet read (scripts) or at the queueing itself (XADD): the client's 503
    said Redis was unreachable or unavailable, pointing its operator at the network."""
    admin, cfg = await served_to_user(own_redis, rule)
    async with TestClient(TestServer(make_app(cfg))) as client:
        resp = await client.post("/v1/chat/completions",
                                 json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        error = (await resp.json())["error"]
    await admin.aclose()
    assert resp.status == 503 and error["code"] == "redis_unavailable", error
    assert "ACL" in error["message"] and "+evalsha" in error["message"], error
    assert f"'{refused}' command" in error["message"] and "unreachable" not in error["message"], error


@pytest.mark.parametrize(("rule", "refused"), [("-evalsha", "evalsha"), ("-script|load", "script|load")])
async def test_a_gateway_whose_redis_user_may_not_run_loaded_scripts_says_so_in_its_readiness(
        own_redis: LocalRedis, rule: str, refused: str) -> None:
    """The rate limiter's script runs by EVALSHA, loaded by SCRIPT LOAD when Redis lacks it. A
    user allowed EVAL but not those was ready, and every request with keys on got a 503 from the
    rate limits."""
    admin = aioredis.Redis.from_url(own_redis.url)
    await admin.execute_command("ACL", "SETUSER", "gw", "on", ">pw", "~*", "&*", "+@all", rule)
    cfg = Config(redis_url=f"redis://gw:pw@127.0.0.1:{own_redis.port}/0", pools={}, worker_poll_s=0.05)
    async with TestClient(TestServer(make_app(cfg))) as client:
        resp = await client.get("/readyz")
        body = await resp.json()
    await admin.aclose()
    assert resp.status == 503 and f"'{refused}' command" in body["reason"], body


async def test_a_gateway_refused_scripts_whose_redis_then_goes_down_says_it_is_unreachable(own_redis: LocalRedis,
                                                                                          caplog) -> None:
    """The ACL's refusal was kept through reads that failed for want of Redis: /readyz went on
    blaming the ACL while Redis was down."""
    admin = aioredis.Redis.from_url(own_redis.url)
    await admin.execute_command("ACL", "SETUSER", "gw", "on", ">pw", "~*", "&*", "+@all", "-@scripting")
    await admin.aclose()
    url = f"redis://gw:pw@127.0.0.1:{own_redis.port}/0"
    cfg = Config(redis_url=url, pools={"interactive": PoolConfig()}, worker_poll_s=0.05)
    async with TestClient(TestServer(make_app(cfg))) as client:
        assert "ACL" in (await (await client.get("/readyz")).json())["reason"]
        own_redis.stop()
        deadline = time.monotonic() + 10
        while "ACL" in (body := await (await client.get("/readyz")).json())["reason"]:
            assert time.monotonic() < deadline, body
            await asyncio.sleep(0.05)
        assert body["reason"] == "Redis is unreachable", body


@pytest.mark.parametrize(("rule", "refused"), [("-@blocking", "xread"), ("-set", "set"), ("-xtrim", "xtrim")])
async def test_a_gateway_whose_redis_user_may_not_read_or_keep_its_reply_stream_says_so(
        own_redis: LocalRedis, caplog, rule: str, refused: str) -> None:
    """The reply reader's own commands (XREAD of the reply stream, the SET that renews ``alive``,
    the XTRIM of what it read) are none of the fleet read's: a user refused one was ready, and
    every request it queued failed three seconds later with "lost the connection to Redis", or
    was stopped by its worker, or filled the stream for as long as the gateway ran."""
    admin, cfg = await served_to_user(own_redis, rule)
    async with TestClient(TestServer(make_app(cfg))) as client:
        deadline = time.monotonic() + 10
        while (resp := await client.get("/readyz")).status == 200:
            assert time.monotonic() < deadline, "ready, though the ACL refuses its reply reader"
            await asyncio.sleep(0.05)
        body = await resp.json()
        assert "ACL" in body["reason"] and f"'{refused}' command" in body["reason"], body
        resp = await client.post("/v1/chat/completions",
                                 json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        error = (await resp.json())["error"]
        assert resp.status == 503 and f"'{refused}' command" in error["message"], error
        assert [r.getMessage() for r in caplog.records if f"'{refused}' command" in r.getMessage()], caplog.text
        await admin.execute_command("ACL", "SETUSER", "gw", "+@all")
        while (resp := await client.get("/readyz")).status != 200:
            assert time.monotonic() < deadline, await resp.text()
            await asyncio.sleep(0.05)
    await admin.aclose()
