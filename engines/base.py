"""The small interface between the worker loop and an engine.

The worker owns all I/O; an engine only turns requests into token deltas. ``add_request``,
``abort_request``, ``has_unfinished`` and ``step`` are called from one thread only (the loop
of the engine's own process, or the worker's engine thread), so engines need no locks; ``step``
may block (a forward pass) while the worker's event loop goes on. ``prepare`` runs on other
threads, beside a step, so it must not touch the engine's state; ``load`` is read from the
event loop and only reads counters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, Protocol, TypeVar

import msgspec

from slogate.protocol import FinishReason, SamplingParams, TokenLogprob

LONG_PROMPT_CHARS = 2048
"""Where a prompt stops being short for tokenizing. The worker tokenizes prompts up to this
many characters (about 500 tokens, 0.4 ms) on its event loop as they arrive, and longer ones on
its prepare thread: the hop to that thread and back waits for the GIL on both sides (1.4 ms at
the median and up to 9 ms for a short prompt at 16 streams, tiny model), far more than
tokenizing it, while a 2,000-token prompt tokenized between two steps adds its 2-3 ms to every
stream's gap. Above it the loader encodes through the tokenizer's batch call, which lets go
of the GIL, so the side thread does not stall the loop either."""


COUNT = Annotated[int, msgspec.Meta(ge=1)]
"""An engine option that counts something the engine cannot do without (a slot, a chunk, a
block): zero started cleanly and then served nothing (:func:`checked_options`)."""
AT_LEAST_0 = Annotated[int, msgspec.Meta(ge=0)]
NOT_NEGATIVE = Annotated[float, msgspec.Meta(ge=0)]

OptionsT = TypeVar("OptionsT")


def checked_options(engine: str, options_type: type[OptionsT], options: dict[str, Any]) -> OptionsT:
    """``options`` as the engine's options dataclass, each checked for its type and range
    before anything loads: a typo names the valid options, a wrong value its option, where
    they used to fail deep inside once the model had loaded (``kv_cache_bytes=2e8``: "'float'
    object cannot be interpreted as an integer"), or not at all (a worker with no slot)."""
    known = {f.name for f in fields(options_type)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown {engine} engine options: {', '.join(unknown)}; expected {', '.join(sorted(known))}")
    try:
        return msgspec.convert(options, options_type)
    except msgspec.ValidationError as exc:
        what, _, where = str(exc).rpartition(" - at `$.")
        raise ValueError(f"{engine} engine option {where.rstrip('`')}: {what}") from None


@dataclass
class EngineRequest:
    id: str
    sampling: SamplingParams
    deadline: float
    """Absolute unix time; an engine may order work by it (earliest deadline first)."""
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt_ids: list[int] | None = None
    """The prompt's token ids, when :meth:`Engine.prepare` computed them ahead."""


@dataclass
class StepOutput:
    """What one step produced for one request.

    ``text`` is safe to show: complete UTF-8, and never the start of a stop string that may
    still complete. ``finish_reason`` is set on the last output of a request.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    error_status: int = 500
    error_code: str | None = None
    """OpenAI's error code, where a more precise one than the status's applies."""
    error_param: str | None = None
    """The request field at fault, where one is."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One for each of ``token_ids``, when the request asked for log-probabilities."""


@dataclass
class EngineLoad:
    running: int
    waiting: int
    capacity: int
    kv_usage: float = 0.0
    prefill_s_per_token: float = 0.0
    decode_step_s: float = 0.0
    decode_s_per_seq: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


Send = Callable[[list[StepOutput]], None]
"""Hands outputs on while a step still runs."""


class Engine(Protocol):
    name: str
    model_id: str
    max_context: int

    def prepare(self, request: EngineRequest) -> EngineRequest:
        """The request with what needs no engine state done ahead (tokenizing the prompt). The
        worker calls it on another thread, beside a step rather than between two, so a long
        prompt's tokenizing does not stretch the running streams' gap. Never raises: a request
        it cannot prepare comes back as it was, and ``add_request`` reports the problem."""

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. A request that can never be served must come back from the next
        ``step`` as an output with ``error`` set (status 400 for the client's fault)."""

    def abort_request(self, request_id: str) -> None:
        """Forget a request and free what it holds; it produces no further output."""

    def has_unfinished(self) -> bool: ...

    def step(self, arrivals: Callable[[], bool] | None = None,
             send: Send | None = None) -> list[StepOutput]:
        """Advance every scheduled request by one step. ``arrivals``, which the engine may
        call while it steps, adds the requests that came since (through ``add_request``) and
        says whether there were any; ``send`` hands outputs on before the step ends. An
        engine that can serve newcomers within the step in progress does, sending their
        outputs at once, instead of leaving them for the next step."""

    def load(self) -> EngineLoad: ...
