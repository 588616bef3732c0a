"""Step an engine on a thread of the worker, with the same face as an engine process.

For engines with nothing to gain from a process of their own (the sim engine) and for
``slogate worker --in-process``. The engine is touched from this thread only; the worker's
loop hands it commands through a queue and awaits its reports.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from engines.base import Engine, EngineLoad, EngineRequest
from engines.engine_process import EngineDied
from engines.stepping import Command, Failure, Idle, Report, Step, step_until_stopped


class _Closed(Exception):
    """The worker closed the engine: end the thread at once."""


class EngineThread:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name, self.model_id, self.max_context = engine.name, engine.model_id, engine.max_context
        self._commands: deque[Command] = deque()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._reports: asyncio.Queue[Report | BaseException | None] = asyncio.Queue()

    def prepare(self, request: EngineRequest) -> EngineRequest:
        return self.engine.prepare(request)

    def load(self) -> EngineLoad:
        return self.engine.load()

    async def attach(self) -> None:
        """Start the thread; its reports come back through this loop."""
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._run, args=(loop,), name="engine", daemon=True).start()

    async def next(self) -> Step | Failure | None:
        """The engine's next step or failure; None once it finished after a stop command."""
        while True:
            report = await self._reports.get()
            if isinstance(report, BaseException):
                raise report
            if not isinstance(report, Idle):
                return report

    async def aclose(self, timeout_s: float = 0.0) -> None:
        """End the thread before its next step (``timeout_s``: as for an engine process)."""
        self._closed.set()
        self._wake.set()

    def abandon(self, reason: str) -> None:
        """Leave a hung engine's thread behind (a thread cannot be killed): :meth:`next` raises
        :class:`engines.engine_process.EngineDied`, and the worker ends."""
        self._closed.set()
        self._reports.put_nowait(EngineDied(f"{reason}; the engine is abandoned"))

    def send(self, command: Command) -> None:
        """Queue a command for the engine (see :data:`engines.stepping.Command`)."""
        self._commands.append(command)
        self._wake.set()

    def _next_command(self, wait: bool) -> Command | None:
        while not self._closed.is_set():
            if self._commands:
                return self._commands.popleft()
            if not wait:
                return None
            self._wake.wait(0.5)
            self._wake.clear()
        raise _Closed

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        def report(item: Report | BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(self._reports.put_nowait, item)
            except RuntimeError:  # the loop closed first (the grace period ran out)
                pass

        try:
            step_until_stopped(self.engine, self._next_command, report)
            report(None)
        except _Closed:
            pass
        except BaseException as exc:  # noqa: BLE001 - whatever killed the thread must reach the worker
            report(exc)
