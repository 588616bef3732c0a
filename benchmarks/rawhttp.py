"""A lean HTTP/1.1 load client for non-streamed POSTs, for the throughput benchmark only.

At thousands of requests a second on two cores, a general client (aiohttp's costs a few
hundred microseconds a request) becomes the bottleneck and measures itself. This one sends
pre-encoded requests over keep-alive connections and reads only the status line and the
Content-Length body, which is all the gateway benchmark needs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.loadgen import Sample, poisson_arrivals


def encode_requests(host: str, rows: list[dict[str, Any]]) -> list[bytes]:
    out = []
    for row in rows:
        body = json.dumps(row["body"]).encode()
        head = (f"POST {row.get('endpoint', '/v1/chat/completions')} HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        out.append(head + body)
    return out


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[int] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(0)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        head = bytes(self.buf[:end]).lower()
        length = 0
        i = head.find(b"content-length:")
        if i >= 0:
            j = head.find(b"\r\n", i)
            length = int(head[i + 15:j if j >= 0 else len(head)])
        if len(self.buf) >= end + 4 + length:
            status = int(self.buf[9:12])
            del self.buf[:end + 4 + length]
            if not self.waiter.done():
                self.waiter.set_result(status)

    async def request(self, payload: bytes) -> int:
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(payload)
        return await self.waiter


class Pool:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[_Conn] = []

    async def send(self, payload: bytes, cls: str) -> Sample:
        start = time.perf_counter()
        conn = self.idle.pop() if self.idle else None
        if conn is None or conn.closed:
            _, conn = await asyncio.get_running_loop().create_connection(_Conn, self.host, self.port)
        status = await conn.request(payload)
        if not conn.closed:
            self.idle.append(conn)
        return Sample(cls, status, time.perf_counter() - start, started=start)

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()


def _cycle(payloads: list[bytes]) -> Iterator[bytes]:
    while True:
        yield from payloads


async def closed_loop(host: str, port: int, payloads: list[bytes], clients: int, duration: float) -> list[Sample]:
    pool, samples, rows = Pool(host, port), [], _cycle(payloads)
    end = time.perf_counter() + duration

    async def client() -> None:
        while time.perf_counter() < end:
            samples.append(await pool.send(next(rows), "interactive"))

    await asyncio.gather(*(client() for _ in range(clients)))
    pool.close()
    return samples


async def open_loop(host: str, port: int, payloads: list[bytes], rate: float, duration: float,
                    seed: int = 0) -> list[Sample]:
    """Poisson arrivals at ``rate``; each arrival takes an idle connection or opens one."""
    pool, samples, rows = Pool(host, port), [], _cycle(payloads)

    async def fire() -> None:
        samples.append(await pool.send(next(rows), "interactive"))

    await poisson_arrivals(rate, duration, seed, fire)
    pool.close()
    return samples
