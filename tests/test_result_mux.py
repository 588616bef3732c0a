"""The gateway's reply stream: records reach their requests in order, whatever entry they
came in, and an entry it cannot read is dropped without stopping the rest."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.app import commands_redis
from gateway.batcher import CommandBatcher
from gateway.results import QUIET, ResultMux
from slogate import protocol
from slogate.config import Config, redis_keepalive
from slogate.crypto import Sealer
from slogate.protocol import Delta, Error, Final
from slogate.tasks import cancel_and_wait


async def test_records_are_routed_in_order_and_unreadable_entries_skipped(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    batcher = CommandBatcher(client)
    mux = ResultMux(client, batcher, Sealer(), block_ms=50)
    a, b = mux.subscribe("a"), mux.subscribe("b")
    reader = asyncio.create_task(mux.run())
    try:
        await client.xadd(mux.key, {protocol.BATCH_FIELD: protocol.encode_batch(
            [(b"a", protocol.encode(Delta("he", 0))), (b"gone", protocol.encode(Delta("?", 0))),
             (b"b", protocol.encode(Delta("x", 0)))])})
        await client.xadd(mux.key, {protocol.BATCH_FIELD: b"\xc1"})
        await client.xadd(mux.key, {b"other": b"field"})
        await client.xadd(mux.key, {protocol.BATCH_FIELD: protocol.encode_batch(
            [(b"a", protocol.encode(Delta("llo", 2))), (b"a", protocol.encode(Final("stop", 1, 2))),
             (b"b", b"\x93garbage")])})
        got_a = [await asyncio.wait_for(a.records.get(), 5) for _ in range(3)]
        got_b = [await asyncio.wait_for(b.records.get(), 5) for _ in range(2)]
        assert got_a == [Delta("he", 0), Delta("llo", 2), Final("stop", 1, 2)]
        assert got_b[0] == Delta("x", 0)
        assert isinstance(got_b[1], Error) and got_b[1].code == "protocol_mismatch"
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await client.aclose()


async def test_only_quiet_streams_hear_keep_alives(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    reader_client = aioredis.Redis.from_url(redis_url, single_connection_client=True)
    mux = ResultMux(reader_client, CommandBatcher(client), Sealer(), block_ms=50, keep_alive_s=0.2)
    stream, plain = mux.subscribe("s", keep_alive=True), mux.subscribe("p")
    reader = asyncio.create_task(mux.run())
    try:
        assert await asyncio.wait_for(stream.records.get(), 5) is QUIET
        await client.xadd(mux.key, {protocol.BATCH_FIELD: protocol.encode_batch(
            [(b"s", protocol.encode(Delta("a", 0))), (b"p", protocol.encode(Delta("b", 0)))])})
        assert await asyncio.wait_for(stream.records.get(), 5) == Delta("a", 0)
        assert await asyncio.wait_for(stream.records.get(), 5) is QUIET
        assert plain.records.get_nowait() == Delta("b", 0) and plain.records.empty()
    finally:
        await cancel_and_wait([reader])
        await reader_client.aclose()
        await client.aclose()


async def test_the_reader_stops_when_cancelled_as_it_starts_a_read(redis_url: str) -> None:
    """Right after a tick the reader is starting its next XREAD, where redis-py can swallow
    a cancel: the reader must end all the same."""
    client = aioredis.Redis.from_url(redis_url)
    mux = ResultMux(client, CommandBatcher(client), Sealer(), block_ms=50, keep_alive_s=0.2)
    stream = mux.subscribe("s", keep_alive=True)
    reader = asyncio.create_task(mux.run())
    try:
        assert await asyncio.wait_for(stream.records.get(), 5) is QUIET
        await asyncio.wait_for(cancel_and_wait([reader]), 5)
        assert reader.cancelled()
    finally:
        await client.aclose()


async def test_a_redis_that_comes_back_within_the_grace_loses_no_request(own_redis) -> None:
    """A dropped connection or a restart: the reader picks up where it was, and the waiting
    requests go on; only an outage longer than the grace fails them (503)."""
    # Over TCP a closed connection shows only when used.
    client = commands_redis(own_redis.tcp_url, Config().redis_timeout_s)
    writer = aioredis.Redis.from_url(own_redis.url)
    reader_client = aioredis.Redis.from_url(own_redis.url, single_connection_client=True)
    batcher = CommandBatcher(client)
    mux = ResultMux(reader_client, batcher, Sealer(), block_ms=50, redis_grace_s=3.0)
    sub = mux.subscribe("s")
    reader = asyncio.create_task(mux.run())
    try:
        await send(writer, mux.key, Delta("a", 0))
        assert await asyncio.wait_for(sub.records.get(), 5) == Delta("a", 0)
        assert all(await asyncio.gather(*(client.ping() for _ in range(4))))  # pooled connections, idle from now on
        own_redis.stop()
        await asyncio.sleep(0.5)
        assert mux._ticked_at == 0.0, "alive is renewed at the first pass once Redis is back"
        own_redis.start()
        await send(writer, mux.key, Delta("b", 1))
        assert await asyncio.wait_for(sub.records.get(), 5) == Delta("b", 1), "no 503 within the grace"
        pings = []
        for _ in range(4):  # one pipeline each, at once: as many connections
            pings.append(batcher.call("PING"))
            await asyncio.sleep(0)
        assert await asyncio.gather(*pings, return_exceptions=True) == [True] * 4, \
            "no pooled connection the restart closed is drawn"
        own_redis.stop()
        failed = await asyncio.wait_for(sub.records.get(), 10)
        assert isinstance(failed, Error) and failed.status == 503 and failed.attempt == 0
    finally:
        await cancel_and_wait([reader])
        for c in (reader_client, writer, client):
            await c.aclose()


async def test_the_reader_goes_on_when_closing_stale_connections_fails(own_redis, monkeypatch) -> None:
    """The close after an outage raised out of the reader's loop: every stream of the gateway
    then waited for records nobody read, to its deadline."""
    client = aioredis.Redis.from_url(own_redis.url)
    reader_client = aioredis.Redis.from_url(own_redis.url, single_connection_client=True)

    async def fails(**_) -> None:
        raise RedisConnectionError("closing failed")

    monkeypatch.setattr(client.connection_pool, "disconnect", fails)
    mux = ResultMux(reader_client, CommandBatcher(client), Sealer(), block_ms=50, redis_grace_s=3.0)
    sub = mux.subscribe("s")
    reader = asyncio.create_task(mux.run())
    try:
        own_redis.stop()
        await asyncio.sleep(0.3)
        own_redis.start()
        writer = aioredis.Redis.from_url(own_redis.url)
        await send(writer, mux.key, Delta("a", 0))
        assert await asyncio.wait_for(sub.records.get(), 5) == Delta("a", 0)
        assert not reader.done()
        await writer.aclose()
    finally:
        await cancel_and_wait([reader])
        await reader_client.aclose()


async def send(client: aioredis.Redis, key: str, record: Delta) -> None:
    await client.xadd(key, {protocol.BATCH_FIELD: protocol.encode_batch([(b"s", protocol.encode(record))])})


async def test_the_reader_connection_probes_a_silent_redis_over_tcp(redis_server) -> None:
    """A blocking XREAD with no read timeout hangs for good on a Redis a network fault cut off
    silently: over TCP, the kernel's keepalive probes break such a connection."""
    import socket

    assert redis_keepalive("unix:///run/redis.sock?db=0") == {}, "a local socket has no network to fail"
    url = redis_server.tcp_url
    reader = aioredis.Redis.from_url(url, single_connection_client=True, **redis_keepalive(url))
    try:
        await reader.ping()
        sock = reader.connection._writer.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 8000
    finally:
        await reader.aclose()


async def test_requests_in_flight_when_the_acl_refuses_the_reader_are_told_what_it_refused(own_redis) -> None:
    """A user refused XREAD (a rule against blocking commands) failed them as if the connection
    to Redis was lost, and the log said so too."""
    admin = aioredis.Redis.from_url(own_redis.url)
    await admin.execute_command("ACL", "SETUSER", "gw", "on", ">pw", "~*", "&*", "+@all")
    url = f"redis://gw:pw@127.0.0.1:{own_redis.port}/0"
    client = aioredis.Redis.from_url(url)
    reader_client = aioredis.Redis.from_url(url, single_connection_client=True)
    mux = ResultMux(reader_client, CommandBatcher(client), Sealer(), block_ms=50, redis_grace_s=0.2)
    sub = mux.subscribe("s")
    reader = asyncio.create_task(mux.run())
    try:
        await send(admin, mux.key, Delta("a", 0))
        assert await asyncio.wait_for(sub.records.get(), 5) == Delta("a", 0)
        await admin.execute_command("ACL", "SETUSER", "gw", "-@blocking")
        failed = await asyncio.wait_for(sub.records.get(), 5)
        assert isinstance(failed, Error) and failed.status == 503 and failed.code == "redis_unavailable"
        assert "ACL" in failed.message and "'xread' command" in failed.message, failed
        assert "lost the connection" not in failed.message and mux.refused, failed
    finally:
        await cancel_and_wait([reader])
        for c in (reader_client, client, admin):
            await c.aclose()


async def test_a_reply_stream_replaced_by_one_of_lower_ids_is_read_from_its_start(redis_url: str) -> None:
    """A new primary whose clock is behind writes ids below the last one read: reading after that
    id, the reader skipped them for as long as the clocks' gap lasted, and the requests waited
    for their deadline."""
    client = aioredis.Redis.from_url(redis_url)
    mux = ResultMux(aioredis.Redis.from_url(redis_url, single_connection_client=True), CommandBatcher(client),
                    Sealer(), block_ms=50)
    sub = mux.subscribe("s")
    reader = asyncio.create_task(mux.run())
    try:
        await send(client, mux.key, Delta("a", 0))
        assert await asyncio.wait_for(sub.records.get(), 5) == Delta("a", 0)
        await replace_with_lower_ids(client, mux.key, b"s", Delta("b", 1))
        assert await asyncio.wait_for(sub.records.get(), 5) == Delta("b", 1)
    finally:
        await cancel_and_wait([reader])
        await mux.redis.aclose()
        await client.aclose()


async def replace_with_lower_ids(client: aioredis.Redis, key: str, request_id: bytes, record: Delta) -> None:
    """The stream replaced by one whose entry ids are below any read before."""
    async with client.pipeline(transaction=True) as p:
        await p.delete(key).xadd(key, {protocol.BATCH_FIELD: protocol.encode_batch(
            [(request_id, protocol.encode(record))])}, id="1-1").execute()


async def test_after_a_failover_the_reader_reads_the_new_stream_from_its_start(own_redis) -> None:
    """Entries the new primary wrote before its clock passed the last id read, then after: the
    reader read the later ones only, and the request lost the text between."""
    client = commands_redis(own_redis.url, Config().redis_timeout_s)
    reader_client = aioredis.Redis.from_url(own_redis.url, single_connection_client=True)
    mux = ResultMux(reader_client, CommandBatcher(client), Sealer(), block_ms=50, redis_grace_s=30.0)
    sub = mux.subscribe("s")
    reader = asyncio.create_task(mux.run())
    writer = aioredis.Redis.from_url(own_redis.url)
    try:
        await send(writer, mux.key, Delta("a", 0))
        assert await asyncio.wait_for(sub.records.get(), 5) == Delta("a", 0)
        own_redis.stop()
        while mux._failing_since is None:
            await asyncio.sleep(0.01)
        own_redis.start()  # empty, as a replica that had not the stream yet
        async with writer.pipeline(transaction=True) as p:
            await p.xadd(mux.key, {protocol.BATCH_FIELD: protocol.encode_batch(
                [(b"s", protocol.encode(Delta("b", 1)))])}, id="1-1").xadd(mux.key, {
                    protocol.BATCH_FIELD: protocol.encode_batch([(b"s", protocol.encode(Delta("c", 2)))])}).execute()
        got = [await asyncio.wait_for(sub.records.get(), 5) for _ in range(2)]
        assert got == [Delta("b", 1), Delta("c", 2)]
    finally:
        await cancel_and_wait([reader])
        for c in (reader_client, writer, client):
            await c.aclose()


async def test_an_idle_reader_neither_trims_nor_checks_its_position(own_redis) -> None:
    """With nothing read since its last trim and no request waiting, the reader still sent an
    XTRIM and an XREVRANGE each pass (about one command more a second than its XREAD and the
    renewal of ``alive``). It trims what it read, and a request that comes after the stream was
    replaced by one of lower ids is still read."""
    admin = aioredis.Redis.from_url(own_redis.url)
    client = aioredis.Redis.from_url(own_redis.url)
    reader_client = aioredis.Redis.from_url(own_redis.url, single_connection_client=True)
    mux = ResultMux(reader_client, CommandBatcher(client), Sealer(), block_ms=50, trim_every_s=0.05)
    sub = mux.subscribe("s")
    reader = asyncio.create_task(mux.run())
    try:
        for record in (Delta("a", 0), Delta("b", 1)):
            await send(admin, mux.key, record)
        assert [await asyncio.wait_for(sub.records.get(), 5) for _ in range(2)] == [Delta("a", 0), Delta("b", 1)]
        mux.unsubscribe(sub)
        while await admin.xlen(mux.key) > 1:  # trimmed to the last entry read
            await asyncio.sleep(0.01)
        await admin.config_resetstat()
        await asyncio.sleep(0.5)
        idle = await admin.info("commandstats")
        assert idle.get("cmdstat_xread", {}).get("calls", 0) >= 3, idle
        assert "cmdstat_xtrim" not in idle and "cmdstat_xrevrange" not in idle, idle
        later = mux.subscribe("t")
        await replace_with_lower_ids(admin, mux.key, b"t", Delta("c", 0))
        assert await asyncio.wait_for(later.records.get(), 5) == Delta("c", 0)
    finally:
        await cancel_and_wait([reader])
        for c in (reader_client, client, admin):
            await c.aclose()
