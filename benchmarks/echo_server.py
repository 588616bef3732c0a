"""A trivial OpenAI-shaped server: the floor against which the gateway's overhead is measured."""

from __future__ import annotations

import sys
import time

import uvloop
from aiohttp import web

BODY = (b'{"id":"chatcmpl-echo","object":"chat.completion","created":%d,"model":"echo",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":" 42"},"finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":100,"completion_tokens":4,"total_tokens":104}}')


async def chat(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=BODY % int(time.time()), content_type="application/json")


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)


if __name__ == "__main__":
    main()
