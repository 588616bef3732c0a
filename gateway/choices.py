"""A request's ``n`` choices: fanned out as ``n`` engine requests, their answers merged.

Workers know nothing of ``n``. Each choice is a request of its own on the pool's queue, with
its own id, subscription, relay and cancel, so retries, lost records, deadlines and cancels
work for each exactly as they do for a request with one choice, and the worker protocol is
unchanged. The gateway
merges only what the client sees (one response whose choices carry their index, or one stream
whose chunks do) and what is counted (the prompt once, the completions summed, as ``usage``
says). The choices' records are read in the handler's own task, as one choice's are, so one
deadline covers them all and the first failure ends the request (its caller then cancels the
rest, as it cancels a request whose client left): here only a task per choice hands its
records to one queue, tagged with their choice. A request of one choice takes none of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from gateway.results import QUIET, Quiet
from slogate.protocol import GenerateRequest, Result
from slogate.tasks import cancel_and_wait

if TYPE_CHECKING:
    from gateway.completions import _Job

_INT64 = 2**64


def fan_out(gen: GenerateRequest, n: int) -> list[GenerateRequest]:
    """The engine requests of ``gen``'s ``n`` choices: the first is ``gen`` itself (its id is the
    request's), choice ``i``'s id is the request's behind ``i-``. The index leads: a heartbeat
    names what its worker holds by each id's first ``HELD_ID_CHARS``, which must tell the choices
    apart, or one lost with Redis's queues is taken for held while another runs and waits for its
    deadline (:meth:`gateway.state.GatewayState.fail_lost`). A seeded request's choice ``i``
    is seeded ``seed + i`` (wrapped within 64 bits): with one seed every choice would draw the
    same sample, and the seed still makes the whole answer reproducible. Greedy choices are
    alike whatever their seeds, as at OpenAI."""
    out = [gen]
    for i in range(1, n):
        sampling = gen.sampling
        if sampling.seed is not None:
            seed = (sampling.seed + i + _INT64 // 2) % _INT64 - _INT64 // 2
            sampling = msgspec.structs.replace(sampling, seed=seed)
        out.append(msgspec.structs.replace(gen, id=f"{i}-{gen.id}", sampling=sampling))
    return out


class Merged(NamedTuple):
    records: asyncio.Queue[tuple[_Job, Result | Quiet]]
    """(choice, record), each choice's in the order they arrived."""
    arrived: asyncio.Event
    """Set once any choice has heard a record: a stream answers then, as one of one choice does."""


@contextlib.asynccontextmanager
async def merged(jobs: Sequence[_Job]) -> AsyncIterator[Merged]:
    """The records of all the choices on one queue, until the block ends."""
    out = Merged(asyncio.Queue(), asyncio.Event())

    async def hand_on(job: _Job) -> None:
        records = job.sub.records
        while True:
            rec = await records.get()
            out.records.put_nowait((job, rec))
            if rec is not QUIET:
                out.arrived.set()

    tasks = [asyncio.create_task(hand_on(job)) for job in jobs]
    try:
        yield out
    finally:
        await cancel_and_wait(tasks)


def usage(jobs: Sequence[_Job]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of the choices so far: the prompt once, as each choice
    counts the same prompt (0 before it has heard a record), the completions summed."""
    return max(j.prompt_tokens for j in jobs), sum(j.completion_tokens for j in jobs)


def as_one(jobs: Sequence[_Job]) -> _Job:
    """The request as metrics, the audit trail and admission count it: once, with the tokens
    its ``usage`` has. It ended as a failed choice did (the rest were cancelled for it), else as
    a choice without an answer did (its client left), else as its last choice to end did: that
    one spans the request's time, so admission learns the request's cost from its final record,
    with the first token any choice sent and that choice's queue wait."""
    lead = (next((j for j in jobs if j.status), None) or next((j for j in jobs if j.final is None), None)
            or max(jobs, key=lambda j: j.ended_at))
    first = min((j for j in jobs if j.first_token_at), key=lambda j: j.first_token_at, default=None)
    final = lead.final
    if final is not None and first is not None and first.final is not None:
        final = msgspec.structs.replace(final, queue_wait_s=first.final.queue_wait_s)
    prompt_tokens, completion_tokens = usage(jobs)
    return dataclasses.replace(lead, final=final, first_token_at=first.first_token_at if first else 0.0,
                               prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
