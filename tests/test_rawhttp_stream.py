"""The benchmarks' lean streaming client reads what a real aiohttp server streams."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestServer

from benchmarks import rawhttp


async def _sse(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body.get("fail"):
        return web.json_response({"error": {"message": "no", "status": 429}}, status=429)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b": keep-alive\n\n")
    for i in range(body["n"]):
        await resp.write(f"data: {json.dumps({'i': i, 'class': request.headers['x-class']})}\n\n".encode())
        await asyncio.sleep(0.01)
    await resp.write_eof(b"data: [DONE]\n\n")
    return resp


async def test_a_stream_then_an_error_on_one_connection() -> None:
    app = web.Application()
    app.router.add_post("/s", _sse)
    async with TestServer(app) as server:
        conn = await rawhttp.connect("127.0.0.1", server.port)
        sent, status, events = await conn.post(rawhttp.encode_post("127.0.0.1", "/s", {"n": 5}, {"x-class": "a"}))
        assert status == 200
        assert [json.loads(e) for _, e in events[:-1]] == [{"i": i, "class": "a"} for i in range(5)]
        assert events[-1][1] == b"[DONE]"
        times = [t for t, _ in events]
        assert sent < times[0] and times == sorted(times) and times[-2] - times[0] >= 0.03  # read as they came
        _, status, events = await conn.post(rawhttp.encode_post("127.0.0.1", "/s", {"fail": True}))
        assert status == 429 and json.loads(events[0][1])["error"]["status"] == 429
        assert not conn.closed  # both on the one keep-alive connection
        conn.transport.close()
