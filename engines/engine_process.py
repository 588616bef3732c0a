"""Run an engine in a process of its own, fed by the worker over a socket.

A step of a small model is mostly Python. With the engine on a thread of the worker, the
step and the worker's event loop (reading requests, tokenizing, writing every stream's tokens
to Redis) took turns at one GIL: at 16 streams the tiny model's worker used 0.92 of a core
although two threads were busy, a step took 4.1 ms against 2.6 ms alone, and a new request
or a finished token waited for the step's Python. Here the engine steps back to back in an
interpreter of its own, as vLLM's engine core does. The worker sends a command when a request
arrives or is cancelled and reads one message of outputs per step; its loop never waits on a
write (the transport buffers it), so neither side can block the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import pickle
import select
import signal
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from engines.base import Engine, EngineLoad, EngineRequest
from engines.stepping import Command, Failure, Idle, Report, Step, step_until_stopped
from slogate.heap import freeze_startup_heap
from slogate.tether import tie_to_parent

log = logging.getLogger("slogate.engine_process")

_HEADER = struct.Struct("!I")

Encoder = Callable[[str | None, list[dict[str, Any]] | None, list[dict[str, Any]] | None], list[int]]
"""A prompt, or chat messages and tools, to token ids (see :func:`engines.runtime.loader.encode_prompt`)."""


class EngineDied(RuntimeError):
    """The engine process is gone. The worker stops and leaves what it held pending in Redis,
    where other workers claim it."""


class EngineProcess:
    """The worker's side of an engine process. ``name``, ``model_id`` and ``max_context`` are
    the engine's, ``load`` what it reported with its latest step."""

    def __init__(self, factory: Callable[[], Engine], encoder: Callable[[], Encoder] | None = None,
                 start_timeout_s: float = 900.0) -> None:
        """Start the process and wait until ``factory`` (a picklable callable, run there)
        has built the engine: a model that cannot load fails here, with the engine's reason.
        Only from the main thread: the kernel ends the process when the thread that started it
        ends (``tie_to_parent``), so one started from a passing thread would die with it.
        ``encoder``, run here meanwhile, gives what tokenizes requests in this process, beside
        the engine's steps; without it the engine tokenizes between two of them."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("start an EngineProcess from the main thread: it would die with the thread "
                               f"{threading.current_thread().name!r} that started it")
        ctx = multiprocessing.get_context("spawn")  # torch does not survive a fork after threads
        self._sock, child = socket.socketpair()
        self._proc = ctx.Process(target=_serve, args=(child, factory), name="engine", daemon=True)
        self._proc.start()
        child.close()
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None
        self.encode: Encoder | None = None
        encoder_error: Exception | None = None
        try:
            self.encode = encoder() if encoder is not None else None
        except Exception as exc:  # noqa: BLE001 - the engine's own reason, when it has one, says more
            encoder_error = exc
        self._sock.settimeout(start_timeout_s)
        try:
            kind, *body = _read(self._sock)
        except (OSError, EOFError) as exc:
            self.close(0)
            raise RuntimeError(f"the engine process did not start (exit code {self._proc.exitcode}): {exc}") from exc
        if kind != "ready":
            self.close(5)
            raise RuntimeError(f"the engine process could not build its engine: {body[0]}")
        if encoder_error is not None:
            self.close(5)
            raise RuntimeError(f"cannot load the tokenizer: {encoder_error}") from encoder_error
        self.name, self.model_id, self.max_context, self._load = body

    def prepare(self, request: EngineRequest) -> EngineRequest:
        if self.encode is None or request.prompt_ids is not None:
            return request
        try:
            return dataclasses.replace(request, prompt_ids=self.encode(request.prompt, request.messages,
                                                                            request.tools))
        except Exception:  # noqa: BLE001 - the engine tokenizes again and reports why
            return request

    def load(self) -> EngineLoad:
        return self._load

    async def attach(self) -> None:
        """Move the socket onto the running event loop."""
        self._sock.settimeout(None)
        self._reader, self._writer = await asyncio.open_connection(sock=self._sock)

    async def next(self) -> Step | Failure | None:
        """The engine's next step or failure; None once it finished after a stop command."""
        assert self._reader is not None, "attach() first"
        while True:
            try:
                size = _HEADER.unpack(await self._reader.readexactly(_HEADER.size))[0]
                report: Report = pickle.loads(await self._reader.readexactly(size))
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                await asyncio.to_thread(self._proc.join, 5)
                if self._proc.exitcode == 0:
                    return None
                raise EngineDied(f"the engine process exited with code {self._proc.exitcode}") from exc
            if not isinstance(report, Failure):
                self._load = report.load
            if not isinstance(report, Idle):
                return report

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop a process whose socket no loop runs yet (it failed to start), by force once
        ``timeout_s`` has passed; once attached, :meth:`aclose`."""
        assert self._writer is None, "aclose() once attached"
        self._sock.close()
        self._end(timeout_s)

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Stop the process, by force once ``timeout_s`` has passed.

        The loop closes the socket only once it runs again: a close that then waited for the
        process on the loop kept the engine from seeing the end of its socket, stepping on what
        it held until it was killed. Here the socket is gone before the wait, which runs off
        the loop; what was still buffered for the engine is of no use to it now. An attach that
        failed left the socket unattached: closed as it is, the process ends the same way.
        """
        if self._writer is None:
            self._sock.close()
        else:
            self._writer.transport.abort()
            with contextlib.suppress(OSError):  # the connection broke first: closed all the same
                await self._writer.wait_closed()
        await asyncio.to_thread(self._end, timeout_s)

    def _end(self, timeout_s: float) -> None:
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def abandon(self, reason: str) -> None:
        """Kill a hung engine: :meth:`next` then raises :class:`EngineDied`."""
        log.error("%s; killing the engine process", reason)
        self._proc.kill()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def send(self, command: Command) -> None:
        """Queue a command for the engine (see :data:`engines.stepping.Command`)."""
        assert self._writer is not None, "attach() first"
        self._writer.write(_frame(command))


def _frame(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _read(sock: socket.socket) -> tuple[Any, ...]:
    size = _HEADER.unpack(_read_exactly(sock, _HEADER.size))[0]
    return pickle.loads(_read_exactly(sock, size))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the other side closed the socket")
        data += chunk
    return bytes(data)


def _serve(sock: socket.socket, factory: Callable[[], Engine]) -> None:
    """The engine process: build the engine, then apply commands and step until told to
    stop with nothing held, or until the worker is gone (its end of the socket closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the worker, which says when to stop
    # A worker killed (or stopped before it could close the engine) leaves no engine building a
    # model for nobody; it spawns this process from its main thread.
    tie_to_parent(multiprocessing.parent_process().pid)
    try:
        try:
            engine = factory()
        except Exception as exc:  # noqa: BLE001 - whatever stops the engine from building, the worker reports it
            sock.sendall(_frame(("error", f"{type(exc).__name__}: {exc}")))
            return
        freeze_startup_heap()
        sock.sendall(_frame(("ready", engine.name, engine.model_id, engine.max_context, engine.load())))
    except ConnectionError:  # the worker ended while the engine was building (it could not start)
        return

    def next_command(wait: bool) -> Command | None:
        return _read(sock) if select.select([sock], [], [], None if wait else 0)[0] else None

    try:
        step_until_stopped(engine, next_command, lambda report: sock.sendall(_frame(report)))
    except (EOFError, ConnectionError):
        log.warning("the worker is gone; the engine process exits")
