"""The gateway's reply stream: records reach their requests in order, whatever entry they
came in, and an entry it cannot read is dropped without stopping the rest."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gateway.batcher import CommandBatcher
from gateway.results import ResultMux
from slogate import protocol
from slogate.crypto import Sealer
from slogate.protocol import Delta, Error, Final


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
