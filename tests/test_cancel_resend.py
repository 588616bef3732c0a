"""A cancel Redis refuses is sent again each second until Redis takes it: one chain of re-sends
per request, however many times its cancel is asked for."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import make_app
from gateway.state import CANCEL_RETRY_S, STATE
from slogate import keys
from slogate.config import Config


async def published(cancels: aioredis.client.PubSub, within_s: float) -> list[bytes]:
    told: list[bytes] = []
    end = asyncio.get_running_loop().time() + within_s
    while (left := end - asyncio.get_running_loop().time()) > 0:
        message = await cancels.get_message(timeout=left)
        if message is not None and message["type"] == "message":
            told.append(message["data"])
    return told


@pytest.mark.parametrize("again", ["while the first is in flight", "while the first waits to be sent again"])
async def test_a_second_cancel_of_a_request_whose_first_is_still_being_sent_sends_nothing(
        redis_url: str, again: str) -> None:
    """Each call sent the cancel and, Redis refusing it, started its own chain of re-sends: two
    cancels of one request were re-sent twice a second until its deadline."""
    r = aioredis.Redis.from_url(redis_url)
    cancels = r.pubsub()
    await cancels.subscribe(keys.CANCEL_CHANNEL)
    try:
        async with TestClient(TestServer(make_app(Config(redis_url=redis_url)))) as client:
            state = client.server.app[STATE]
            await r.config_set("maxmemory", 1)  # the cancel's SET is refused, its PUBLISH goes out
            try:
                deadline = time.time() + 60
                state.cancel("r", deadline)
                if again == "while the first waits to be sent again":
                    while "r" not in state.cancel_retries:
                        await asyncio.sleep(0.01)
                state.cancel("r", deadline)
                told = await published(cancels, CANCEL_RETRY_S / 2)  # before any re-send is due
                again_told = await published(cancels, CANCEL_RETRY_S)  # the first re-send's turn
            finally:
                await r.config_set("maxmemory", 0)
        assert told == [b"r"]
        assert again_told == [b"r"], "sent again, by one chain"
    finally:
        await cancels.aclose()
        await r.aclose()
