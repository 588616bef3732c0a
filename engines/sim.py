"""A simulated engine with a real engine's timing and no model.

Load tests need queueing that looks like a GPU's (prefill linear in prompt length, a decode
step that slows as the batch grows, a batch limit, continuous batching) without paying for
one. Output is deterministic in the prompt (and the ``seed``, when one is given), so a request
retried on another worker yields the same tokens, as greedy or seeded decoding on a real engine
would.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engines.base import COUNT, NOT_NEGATIVE, EngineLoad, EngineRequest, Send, StepOutput, checked_options
from slogate.config import served_model_id
from slogate.protocol import TokenLogprob, fit_to_context

WORDS = (
    "risk low medium high review score clear flag hold approve decline pattern velocity "
    "merchant amount country device payee history limit exposure counterparty margin "
    "collateral rating outlook stable negative positive watch liquidity"
).split()


@dataclass
class SimTiming:
    prefill_s_per_token: NOT_NEGATIVE = 0.00005
    decode_base_s: NOT_NEGATIVE = 0.004
    decode_s_per_seq: NOT_NEGATIVE = 0.0002
    max_batch: COUNT = 64
    max_context: COUNT = 8192
    chars_per_token: COUNT = 4


@dataclass
class _Seq:
    req: EngineRequest
    prompt_tokens: int
    seed: int
    text: str = ""
    emitted: int = 0
    generated: int = 0


def count_prompt_tokens(prompt: str | None, messages: list[dict[str, Any]] | None,
                        chars_per_token: int) -> int:
    """What a tokenizer would roughly say: the sim charges prefill by it."""
    if messages is not None:
        chars = sum(len(str(m.get("content") or "")) + 4 for m in messages)
    else:
        chars = len(prompt or "")
    return max(1, -(-chars // chars_per_token))


def _text_seed(basis: str, seed: int | None) -> int:
    """Where the made-up text starts: the prompt's, moved by the request's ``seed`` when it has
    one, so that a request retried with its seed says the same again. Moved by the seed itself,
    not a hash of it: the text is picked by its start modulo the word list, and choices seeded
    one apart (``n``, :func:`gateway.choices.fan_out`) then always say different things, up to
    as many choices as there are words."""
    start = zlib.crc32(basis.encode())
    return start if seed is None else start + seed


def sim_logprob(token: str, top: int) -> TokenLogprob:
    """Made-up but coherent figures: the word it says at nine chances in ten, the next words of
    its list at half the chance each of the one before."""
    chosen = math.log(0.9)
    start = WORDS.index(token[1:])
    alternatives = [f" {WORDS[(start + k) % len(WORDS)]}" for k in range(1, top)]
    listed = [(token, chosen), *((alt, math.log(0.1 / 2**k)) for k, alt in enumerate(alternatives, 1))]
    return TokenLogprob(token, token.encode(), chosen, [(t, t.encode(), lp) for t, lp in listed[:top]])


def stop_cut(text: str, start: int, stops: list[str]) -> tuple[int, bool]:
    """How much of ``text`` may be shown: up to a completed stop string (then True), else all
    but a tail that could still grow into one (a partial stop is never shown)."""
    best = None
    for stop in stops:
        pos = text.find(stop, max(0, start - len(stop) + 1))
        if pos != -1 and (best is None or pos < best):
            best = pos
    if best is not None:
        return best, True
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return len(text) - hold, False


@dataclass
class SimEngine:
    model_id: str = "slogate-sim"
    timing: SimTiming = field(default_factory=SimTiming)
    name: str = "sim"
    _waiting: deque[_Seq] = field(default_factory=deque)
    _running: list[_Seq] = field(default_factory=list)
    _errors: list[StepOutput] = field(default_factory=list)

    @property
    def max_context(self) -> int:
        return self.timing.max_context

    def prepare(self, request: EngineRequest) -> EngineRequest:
        return request

    def add_request(self, request: EngineRequest) -> None:
        n = count_prompt_tokens(request.prompt, request.messages, self.timing.chars_per_token)
        request = dataclasses.replace(request, sampling=fit_to_context(request.sampling, n, self.max_context))
        total = n + request.sampling.max_tokens
        if total > self.timing.max_context:
            self._errors.append(StepOutput(
                request.id, prompt_tokens=n, error_status=400, error_code="context_length_exceeded",
                error=f"prompt ({n} tokens) plus max_tokens ({request.sampling.max_tokens}) is "
                      f"{total}, beyond the model's context of {self.timing.max_context} tokens"))
            return
        if request.sampling.json_schema is not None:
            held_to = request.sampling.schema_param or "response_format"
            self._errors.append(StepOutput(
                request.id, prompt_tokens=n, error_status=400, error_param=held_to,
                error=f"the simulated engine writes made-up text and cannot hold it to '{held_to}'; "
                      "serve this model with a real engine (stream or paged)"))
            return
        basis = request.prompt if request.prompt is not None else repr(request.messages)
        self._waiting.append(_Seq(request, n, _text_seed(basis, request.sampling.seed)))

    def abort_request(self, request_id: str) -> None:
        self._waiting = deque(s for s in self._waiting if s.req.id != request_id)
        self._running = [s for s in self._running if s.req.id != request_id]

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._errors)

    def step(self, arrivals: Callable[[], bool] | None = None,
             send: Send | None = None) -> list[StepOutput]:
        """One simulated step; arrivals wait for the next (the simulated step has no layers)."""
        outputs, self._errors = self._errors, []
        t = self.timing
        prefill_tokens = 0
        while self._waiting and len(self._running) < t.max_batch:
            seq = self._waiting.popleft()
            prefill_tokens += seq.prompt_tokens
            self._running.append(seq)
        if not self._running:
            return outputs
        cost = prefill_tokens * t.prefill_s_per_token
        cost += t.decode_base_s + t.decode_s_per_seq * len(self._running)
        if cost > 0:
            time.sleep(cost)
        now = time.time()
        still = []
        for seq in self._running:
            out = self._advance(seq, now)
            if out.text or out.finish_reason or out.logprobs:
                outputs.append(out)
            if out.finish_reason is None:
                still.append(seq)
        self._running = still
        return outputs

    def _advance(self, seq: _Seq, now: float) -> StepOutput:
        out = StepOutput(seq.req.id, prompt_tokens=seq.prompt_tokens)
        if now > seq.req.deadline:
            out.finish_reason = "deadline"
            out.completion_tokens = seq.generated
            return out
        word = WORDS[(seq.seed + seq.generated * 7919) % len(WORDS)]
        start = len(seq.text)
        seq.text += f" {word}"
        seq.generated += 1
        out.token_ids = [(seq.seed + seq.generated) % 32000]
        if seq.req.sampling.logprobs is not None:
            out.logprobs = [sim_logprob(f" {word}", seq.req.sampling.logprobs)]
        cut, stopped = stop_cut(seq.text, start, seq.req.sampling.stop)
        if stopped:
            out.finish_reason = "stop"
        elif seq.generated >= seq.req.sampling.max_tokens:
            out.finish_reason = "length"
            cut = len(seq.text)
        out.text = seq.text[seq.emitted:cut]
        seq.emitted = max(seq.emitted, cut)
        out.completion_tokens = seq.generated
        return out

    def load(self) -> EngineLoad:
        t = self.timing
        return EngineLoad(
            running=len(self._running), waiting=len(self._waiting), capacity=t.max_batch,
            prefill_s_per_token=t.prefill_s_per_token,
            decode_step_s=t.decode_base_s + t.decode_s_per_seq * max(len(self._running), 1),
            decode_s_per_seq=t.decode_s_per_seq)


OPTIONS = SimTiming


def create(model: str | None = None, **options: Any) -> SimEngine:
    """Options are checked here (:func:`engines.base.checked_options`): one of the wrong type
    (``-o decode_base_s=4ms``) would fail only in ``load()``, in the worker's heartbeat,
    leaving a worker nobody sees. ``model`` is served under the id a real engine gives it
    (:func:`slogate.config.served_model_id`), so that a sim pool beside a real one serves the
    same model."""
    return SimEngine(model_id=served_model_id(model) if model else "slogate-sim",
                     timing=checked_options("sim", SimTiming, options))
