"""A lean HTTP/1.1 load client, for benchmarks only.

At thousands of requests (or streamed chunks) a second on two cores, a general client
(aiohttp's costs a few hundred microseconds a request, tens a chunk) becomes the bottleneck
and measures itself. This one sends pre-encoded requests over keep-alive connections. For
plain POSTs it reads only the status line and the Content-Length body, which is all the gateway
benchmark needs; a streamed response is kept as it arrives, each read with its arrival time,
and parsed once it has ended (:class:`StreamConn`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.loadgen import Sample, poisson_arrivals


def encode_post(host: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    return head + data


def encode_requests(host: str, rows: list[dict[str, Any]]) -> list[bytes]:
    return [encode_post(host, row.get("endpoint", "/v1/chat/completions"), row["body"]) for row in rows]


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


class StreamConn(asyncio.Protocol):
    """One keep-alive connection for streamed responses, one at a time. While a response
    streams, each read is only stored with the moment it arrived (and its ``data:`` events
    counted, for a caller that waits for a stream to get going): no parsing and no task to wake
    per chunk, so at 16 streams the client leaves the cores it shares with the gateway alone and
    times each chunk as it lands rather than when a reader task next runs."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.reads: list[tuple[float, int]] = []
        """(arrival time, the buffer's length after the read)."""
        self.events = 0
        self.closed = False
        self._done: asyncio.Future[None] | None = None
        self._head_end = 0
        self._length: int | None = None
        """The body's Content-Length; None for a chunked body, which ends with a zero chunk."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.buf += data
        self.reads.append((now, len(self.buf)))
        self.events += data.count(b"data: {")
        if not self._head_end:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self._head_end = end + 4
            head = bytes(self.buf[:end]).lower()
            i = head.find(b"content-length:")
            if i >= 0 and b"transfer-encoding: chunked" not in head:
                j = head.find(b"\r\n", i)
                self._length = int(head[i + 15:j if j >= 0 else len(head)])
        ended = (len(self.buf) >= self._head_end + self._length if self._length is not None
                 else self.buf.endswith(b"\r\n0\r\n\r\n"))
        if ended and self._done is not None and not self._done.done():
            self._done.set_result(None)

    async def post(self, payload: bytes) -> tuple[float, int, list[tuple[float, bytes]]]:
        """Send one request; when its response has ended: when it was sent, its status, and
        each ``data:`` event's payload with the arrival of the read that completed it."""
        assert self.transport is not None and not self.closed
        self.buf, self.reads, self.events, self._head_end, self._length = bytearray(), [], 0, 0, None
        self._done = asyncio.get_running_loop().create_future()
        sent = time.perf_counter()
        self.transport.write(payload)
        await self._done
        if not self._head_end:
            raise ConnectionError("the connection closed before a response")
        return sent, int(self.buf[9:12]), self._events()

    def _events(self) -> list[tuple[float, bytes]]:
        """The body's ``data:`` lines. The gateway writes whole events, so chunked framing
        never falls inside one (an event cut by it would fail to decode, not pass unseen)."""
        out, reads, r = [], self.reads, 0
        at = self.buf.find(b"data: ", self._head_end)
        while at >= 0:
            end = self.buf.find(b"\n", at)
            if end < 0:
                break
            while reads[r][1] <= end:
                r += 1
            out.append((reads[r][0], bytes(self.buf[at + 6:end])))
            at = self.buf.find(b"data: ", end)
        if not out and self._length is not None:  # an error answer, not a stream
            out.append((self.reads[-1][0], bytes(self.buf[self._head_end:])))
        return out


async def connect(host: str, port: int) -> StreamConn:
    _, conn = await asyncio.get_running_loop().create_connection(StreamConn, host, port)
    return conn


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
