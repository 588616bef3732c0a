"""The loop that drives an engine, wherever it runs: apply the worker's commands, step, report.

The same loop runs in an engine process (:mod:`engines.engine_process`) and on a thread of the
worker (:mod:`engines.engine_thread`); only where commands come from and where reports go
differ. Every command queued is applied before the next step, so a request cancelled before
the engine saw it is added and dropped in the same pass, never stepped. While a step runs, the
engine may look for arrivals (``step(arrivals, send)``): requests that came meanwhile are added
then, so a stream engine can serve them within the step and send their outputs before it ends;
cancels and the stop wait for the step's end, since the step still holds what they would free.
An add of a request whose cancel waits waits behind it: ahead of it, the engine would take it
for a redelivery of the request it still holds, and the cancel would then drop both.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.base import Engine, EngineLoad, StepOutput

log = logging.getLogger("slogate.engine")

Command = tuple[Any, ...]
"""``("add", EngineRequest)``, ``("abort", request_id)`` or ``("stop",)``: finish what is
held, then end."""


@dataclass
class Step:
    outputs: list[StepOutput]
    seconds: float | None
    """The step's whole duration, on the report that ends it; None on what the engine sends
    during the step, which goes on (timed as steps of their own, those hand-overs split one
    step into several short ones in the worker's step-time histogram)."""
    load: EngineLoad


@dataclass
class Failure:
    """A step raised: the engine dropped ``request_ids`` and goes on serving."""

    request_ids: set[str]
    error: str


@dataclass
class Idle:
    """The engine holds nothing now; what the last aborts freed shows in ``load``."""

    load: EngineLoad


Report = Step | Failure | Idle


def step_until_stopped(engine: Engine, next_command: Callable[[bool], Command | None],
                       report: Callable[[Report], None]) -> None:
    """Step ``engine`` back to back until a stop command arrives and nothing is held.

    ``next_command(wait)`` gives the next queued command or None; with ``wait`` (nothing to
    step) it blocks until one arrives. It raises to end the loop at once (the worker is gone).
    """
    held: set[str] = set()  # what the engine holds, so a failed step can drop it all
    stopping = False
    idle_reported = True
    deferred: deque[Command] = deque()  # what arrived during a step and waits for its end
    ended: list[BaseException] = []  # how next_command ended the loop during a step

    def arrivals() -> bool:
        added = False
        try:
            while not ended and (command := next_command(False)) is not None:
                if command[0] == "add" and ("abort", command[1].id) not in deferred:
                    held.add(command[1].id)
                    engine.add_request(command[1])
                    added = True
                else:
                    deferred.append(command)
        except BaseException as exc:  # noqa: BLE001 - raised again once the step is over, not as its failure
            ended.append(exc)
        return added

    def send(outputs: list[StepOutput], seconds: float | None = None) -> None:
        """Report outputs; ``seconds`` only when they end a step (see :class:`Step`)."""
        held.difference_update(o.request_id for o in outputs if o.finish_reason is not None or o.error)
        report(Step(outputs, seconds, engine.load()))

    while True:
        busy = engine.has_unfinished()
        if stopping and not busy:
            return
        if not busy and not idle_reported:
            report(Idle(engine.load()))
            idle_reported = True
        command = deferred.popleft() if deferred else next_command(not busy)
        if command is not None:
            kind, *body = command
            if kind == "add":
                held.add(body[0].id)
                engine.add_request(body[0])
            elif kind == "abort":
                held.discard(body[0])
                engine.abort_request(body[0])
            else:
                stopping = True
            continue
        started = time.perf_counter()
        try:
            outputs = engine.step(arrivals, send)
        except (ConnectionError, EOFError):  # reporting during the step: the worker is gone, not the engine
            raise
        except Exception:  # an engine bug or out of memory: fail what it held, keep serving
            log.exception("engine step failed; failing the %d request(s) it held", len(held))
            for request_id in held:
                engine.abort_request(request_id)
            report(Failure(held, traceback.format_exc(limit=1)))
            held = set()
            idle_reported = False  # a failure carries no load: what it dropped shows in the next report
            continue
        idle_reported = False
        send(outputs, time.perf_counter() - started)
        if ended:
            raise ended[0]
