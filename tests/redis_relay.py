"""A TCP relay between a client and Redis, to break its connections the ways a network does."""

from __future__ import annotations

import asyncio


class Relay:
    """A TCP relay to Redis. :meth:`cut` silences the connections open at the time, as a
    partition does (nothing passes either way, nothing closes); connections opened later pass.
    With ``drop_reply_to``, the first request that holds those bytes reaches Redis but its reply
    does not: the connection closes instead, as one lost between Redis running a command and the
    client hearing of it. Later requests pass."""

    def __init__(self, port: int, drop_reply_to: bytes | None = None) -> None:
        self.port = port
        self.url = ""
        self.drop_reply_to = drop_reply_to
        self._live: list[list[bool]] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> Relay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"
        return self

    def cut(self) -> None:
        for live in self._live:
            live[0] = False

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        live, dropping = [True], [False]
        self._live.append(live)
        self._writers += [writer, up_writer]
        await asyncio.gather(self._requests(reader, up_writer, live, dropping),
                             _pipe(up_reader, writer, live, dropping), return_exceptions=True)

    async def _requests(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, live: list[bool],
                        dropping: list[bool]) -> None:
        try:
            while data := await src.read(65536):
                if self.drop_reply_to is not None and self.drop_reply_to in data:
                    self.drop_reply_to = None
                    dropping[0] = True
                if live[0]:
                    dst.write(data)
                    await dst.drain()
        finally:
            dst.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, live: list[bool],
                dropping: list[bool]) -> None:
    """Pass what ``src`` sends while ``live``; once ``dropping``, close instead of passing."""
    try:
        while data := await src.read(65536):
            if dropping[0]:
                live[0] = False
                break
            if live[0]:
                dst.write(data)
                await dst.drain()
    finally:
        dst.close()
