"""A worker's records reach their gateway whole and in order, even when Redis drops a send."""

from __future__ import annotations

from types import SimpleNamespace

import redis.asyncio as aioredis

from engines.sim import create
from engines.worker import Worker, WorkerSettings
from slogate import keys, protocol
from slogate.local_redis import LocalRedis
from slogate.protocol import Delta, Final

REPLIES = keys.replies("test-gateway")


async def test_a_send_redis_refused_is_sent_again_ahead_of_later_records(own_redis: LocalRedis) -> None:
    """Dropped, the first records would leave a hole in the middle of the stream (the gateway
    joined the text on either side of it) and the acks would leave finished requests to be
    claimed and run again."""
    client = aioredis.Redis.from_url(own_redis.url, socket_connect_timeout=1)
    worker = Worker(create(decode_base_s=0), client, WorkerSettings(pool="p"))
    job = SimpleNamespace(req=SimpleNamespace(id="r1", reply=REPLIES))
    worker._write(job, Delta("a", 0))
    worker._ack([b"1-1"])
    own_redis.stop()
    assert await worker._flush() is False
    worker._write(job, Delta("b", 1))
    worker._write(job, Final("length", 1, 2))
    worker._ack([b"1-2"])
    assert worker._acks == [b"1-1", b"1-2"]
    own_redis.start()
    assert await worker._flush() is True
    assert not worker._replies and not worker._acks
    entries = await client.xrange(REPLIES)
    records = [protocol.decode_result(payload) for _, f in entries
               for _, payload in protocol.decode_batch(f[protocol.BATCH_FIELD])]
    assert [r.text for r in records if isinstance(r, Delta)] == ["a", "b"]
    assert isinstance(records[-1], Final)
    assert await client.pttl(REPLIES) > 0, "the stream's TTL is set again with the retry"
    await client.aclose()
