"""A trivial OpenAI-shaped server: the floor against which the gateway's overhead is measured,
and the server behind the upstream engine when that is measured (streamed, as it asks)."""

from __future__ import annotations

import json
import sys
import time

import uvloop
from aiohttp import web

BODY = (b'{"id":"chatcmpl-echo","object":"chat.completion","created":%d,"model":"echo",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":" 42"},"finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":100,"completion_tokens":4,"total_tokens":104}}')


CHUNKS = (b'data: {"id":"chatcmpl-echo","object":"chat.completion.chunk","created":%d,"model":"echo",'
          b'"choices":[{"index":0,"delta":{"content":" 42"},"finish_reason":"length"}]}\n\n'
          b'data: {"id":"chatcmpl-echo","object":"chat.completion.chunk","created":%d,"model":"echo","choices":[],'
          b'"usage":{"prompt_tokens":100,"completion_tokens":4,"total_tokens":104}}\n\ndata: [DONE]\n\n')


async def chat(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    if b'"stream"' not in raw or not json.loads(raw).get("stream"):  # the direct path parses nothing, as before
        return web.Response(body=BODY % int(time.time()), content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    now = int(time.time())
    await response.write(CHUNKS % (now, now))
    await response.write_eof()
    return response


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)


if __name__ == "__main__":
    main()
