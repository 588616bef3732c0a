"""The batch engine: continuous batching over a paged KV cache, behind the worker's
:class:`engines.base.Engine` interface.

Each ``step`` retires what expired, asks the scheduler for a batch, runs it once, samples one
token per sequence that reached its end, and turns those tokens into text. Requests join and
leave between steps; blocks go back to the pool the moment a request finishes, is aborted or
runs past its deadline.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

import torch

from engines.base import COUNT, EngineLoad, EngineRequest, Send, StepOutput
from engines.paged.block_manager import BlockManager
from engines.paged.fused import fuse_projections
from engines.paged.model_runner import KVShape, ModelRunner
from engines.paged.scheduler import Schedule, Scheduler
from engines.paged.sequence import Sequence, Status
from engines.runtime.detokenizer import OutputTracker
from engines.runtime.grammar import Grammars, TokenizerUnsupported, matcher_error
from engines.runtime.loader import LoadedModel
from engines.runtime.packed_linear import pack_linears
from engines.runtime.sampling import make_generator, sample, token_logprobs
from engines.runtime.token_pieces import TokenPieces
from slogate import json_output
from slogate.protocol import TokenLogprob, fit_to_context

_SMOOTHING = 0.2
"""Weight of the newest step in the moving averages that ``load`` reports."""
_SCHEMA_PARAM = "response_format.json_schema.schema"
_COMPILE_WAIT_S = 0.005
"""Longest a step with nothing to run waits for a schema to compile, so commands still flow."""


@dataclass
class _Live:
    seq: Sequence
    tracker: OutputTracker
    generator: torch.Generator | None
    matcher: Any = None
    """The llguidance matcher holding the output to its JSON schema, if it has one."""
    compiled: Future[Any] | None = None
    """The compile its matcher was copied from."""
    renewed: bool = False
    """Whether its matcher was renewed once already (:meth:`PagedEngine._renew`)."""


@dataclass
class PagedOptions:
    block_size: COUNT = 16
    num_blocks: COUNT | None = None
    kv_cache_bytes: COUNT = 512 * 2**20
    """Used when ``num_blocks`` is not given: the pool takes as many blocks as fit."""
    max_num_seqs: COUNT = 64
    max_batched_tokens: COUNT = 1024
    enable_prefix_caching: bool = True
    decode_kernel: str | None = None
    """Decode attention: ``native`` (fused C++ kernel), ``torch`` or ``auto``; None reads
    ``SLOGATE_PAGED_KERNEL`` (default auto: native when it builds)."""
    pack_weights: bool = True
    """On CPU, run the model's linear layers on weights packed once for oneDNN
    (:mod:`engines.runtime.packed_linear`); off, they run as transformers ships them."""
    cuda_graphs: bool = True
    """On a GPU, run steps as CUDA graphs where they fit (:mod:`engines.paged.step_graphs`),
    all captured at start-up."""


class PagedEngine:
    name = "paged"

    def __init__(self, loaded: LoadedModel, options: PagedOptions | None = None) -> None:
        opts = options or PagedOptions()
        self.loaded = loaded
        self.model_id = loaded.model_id
        self.max_context = loaded.max_context
        num_blocks = opts.num_blocks or max(
            1, opts.kv_cache_bytes // KVShape.of(loaded.model).bytes_per_block(opts.block_size, loaded.dtype)
        )
        self.block_manager = BlockManager(num_blocks, opts.block_size, opts.enable_prefix_caching)
        self.longest_sequence = min(loaded.max_context, num_blocks * opts.block_size)
        """What one request may reach: the context, or the KV pool where that holds less (a large
        model's, in a small budget). A default ``max_tokens`` is lowered to fit it."""
        self.scheduler = Scheduler(
            self.block_manager, opts.max_num_seqs, opts.max_batched_tokens, loaded.max_context
        )
        if loaded.device.type == "cpu":
            fuse_projections(loaded.model)
        if opts.pack_weights:
            pack_linears(loaded.model, opts.max_num_seqs, warm_rows=opts.max_batched_tokens)
        self.runner = ModelRunner(loaded.model, num_blocks, opts.block_size, opts.decode_kernel, opts.cuda_graphs,
                                  loaded.max_context)
        self.capacity = opts.max_num_seqs
        self.pieces = TokenPieces(loaded.tokenizer)
        self.grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
        self._compiling: dict[str, tuple[_Live, Future[Any]]] = {}
        """Requests whose JSON schema is compiling; they join the batch once it has."""
        self._live: dict[str, _Live] = {}
        self._pending: list[StepOutput] = []
        self._decode_step_s = 0.0
        self._prefill_s_per_token = 0.0
        self.clock = time.time
        """Wall clock that deadlines are compared against (replaceable in tests)."""

    def prepare(self, request: EngineRequest) -> EngineRequest:
        if request.prompt_ids is not None:
            return request
        try:
            return dataclasses.replace(request, prompt_ids=self.loaded.encode(request.prompt, request.messages,
                                                                              request.tools))
        except Exception:  # noqa: BLE001 - add_request tokenizes again and reports why
            return request

    def add_request(self, request: EngineRequest) -> None:
        if request.id in self._live or request.id in self._compiling:
            return  # a redelivery of a request already served here: its outputs are on their way
        try:
            prompt_ids = (request.prompt_ids if request.prompt_ids is not None
                          else self.loaded.encode(request.prompt, request.messages, request.tools))
        except Exception as exc:  # noqa: BLE001 - a bad prompt is the client's fault, whatever raised
            self._pending.append(_error(request.id, f"cannot tokenize the request: {exc}"))
            return
        vocab = self.loaded.vocab_size
        for name, ids in (("stop_token_ids", request.sampling.stop_token_ids),
                          ("logit_bias", request.sampling.logit_bias)):
            beyond = [t for t in ids if not 0 <= t < vocab]
            if beyond:
                self._pending.append(_error(request.id, f"'{name}' holds {beyond[0]}, beyond this model's "
                                                        f"vocabulary (token ids 0 to {vocab - 1})", param=name))
                return
        request = dataclasses.replace(request, sampling=fit_to_context(request.sampling, len(prompt_ids),
                                                                         self.longest_sequence))
        seq = Sequence(request.id, list(prompt_ids), request.sampling, request.deadline)
        reason = "empty prompt" if not prompt_ids else self.scheduler.rejection(seq)
        if reason:
            self._pending.append(_error(request.id, reason, len(prompt_ids),
                                        "context_length_exceeded" if prompt_ids else None))
            return
        tracker = OutputTracker(self.loaded.tokenizer, request.sampling, self.loaded.eos_token_ids, prompt_ids)
        live = _Live(seq, tracker, make_generator(request.sampling, self.loaded.device))
        if request.sampling.json_schema is None:
            self._start(request.id, live)
            return
        compiled = self.grammars.compile(request.sampling.json_schema)
        if not compiled.done():
            self._compiling[request.id] = (live, compiled)
        elif (failed := self._start(request.id, live, compiled)) is not None:  # kept: it may cut in now
            self._pending.append(failed)

    def _start(self, rid: str, live: _Live, compiled: Future[Any] | None = None) -> StepOutput | None:
        """Hand a request to the scheduler, with a matcher of its own from its schema's finished
        compile if it has one; the error output instead if that schema cannot compile."""
        if compiled is not None:
            try:
                live.matcher, live.compiled = self.grammars.start(compiled), compiled
            except Exception as exc:  # noqa: BLE001 - that request's schema, not the engine, is at fault
                param = _schema_field(live) if isinstance(exc, TokenizerUnsupported) else _schema_param(live)
                return _error(rid, f"cannot hold the output to '{_schema_field(live)}': {exc}",
                              live.seq.num_prompt_tokens, param=param)
        self._live[rid] = live
        self.scheduler.add(live.seq)
        return None

    def _start_compiled(self) -> list[StepOutput]:
        """Start the requests whose JSON schema has compiled; fail those whose schema cannot."""
        failed = []
        for rid, (live, compiled) in list(self._compiling.items()):
            if compiled.done():
                del self._compiling[rid]
                if (error := self._start(rid, live, compiled)) is not None:
                    failed.append(error)
        return failed

    def abort_request(self, request_id: str) -> None:
        self._abandon(request_id)
        live = self._live.pop(request_id, None)
        if live is not None:
            self.scheduler.finish(live.seq)

    def _abandon(self, request_id: str) -> _Live | None:
        """Drop a request whose schema is compiling, and the compile if it has not begun and no
        other request waits for it: a client that gave up must not hold others' schemas up."""
        entry = self._compiling.pop(request_id, None)
        if entry is None:
            return None
        live, compiled = entry
        if all(other is not compiled for _, other in self._compiling.values()):
            compiled.cancel()
        return live

    def has_unfinished(self) -> bool:
        return bool(self._pending or self._live or self._compiling)

    def step(self, arrivals: Callable[[], bool] | None = None,
             send: Send | None = None) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        outputs.extend(self._expire(self.clock()))
        outputs.extend(self._start_compiled())
        if outputs and send is not None:  # out before the pass, which may fail: a 400 stays a 400
            send(outputs)
            outputs = []
        sched = self.scheduler.schedule()
        if not sched.seqs:
            if self._compiling and not outputs:  # nothing to run until a schema compiles: no spinning
                wait([compiled for _, compiled in self._compiling.values()], _COMPILE_WAIT_S, FIRST_COMPLETED)
            return outputs
        started = time.perf_counter()
        sampled, logits = self._forward(sched, arrivals, send)
        tokens = self._sample(sched, sampled, logits)
        self._record_timing(time.perf_counter() - started, sched.num_tokens, len(sched.seqs))
        outputs.extend(self._emit(*sampled_token) for sampled_token in tokens)
        return outputs

    def _forward(self, sched: Schedule, arrivals: Callable[[], bool] | None,
                 send: Send | None) -> tuple[list[int], torch.Tensor]:
        """The step's pass. A batch step takes newcomers at the next one: its steps are long
        anyway, and throughput, not the first token, is what it serves."""
        return self.runner.run(sched)

    def _sample(self, sched: Schedule, sampled: list[int],
                logits: torch.Tensor) -> list[tuple[_Live, int, TokenLogprob | None]]:
        """Sample the next token of the sequences at ``sampled`` in ``sched`` and advance them
        all; their outputs (with the token's log-probability, where asked for) are for ``_emit``."""
        lives = [self._live[sched.seqs[i].request_id] for i in sampled]
        held = [i for i, lv in enumerate(lives) if lv.matcher is not None]
        tokens = sample(
            logits,
            [lv.seq.sampling for lv in lives],
            [lv.generator for lv in lives],
            [lv.tracker.token_ids for lv in lives],
            self.loaded.eos_token_ids,
            (held, self._blocked([lives[i] for i in held])) if held else None,
        )
        if held:
            self.grammars.advance([lives[i].matcher for i in held], [tokens[i] for i in held])
            for i in held:
                if lives[i].matcher.is_error():  # the token was allowed: its mask was computed without error
                    self._renew(lives[i], [*lives[i].tracker.token_ids, tokens[i]])
        self.scheduler.postprocess(sched, dict(zip(sampled, tokens)))
        wanted = [i for i, lv in enumerate(lives) if lv.seq.sampling.logprobs is not None]
        logprobs: list[TokenLogprob | None] = [None] * len(lives)
        if wanted:
            found = token_logprobs(logits, wanted, [tokens[i] for i in wanted],
                                   [lives[i].seq.sampling.logprobs or 0 for i in wanted])
            for i, (lp, top) in zip(wanted, found):
                start = lives[i].tracker.at_start
                logprobs[i] = TokenLogprob(*self.pieces(tokens[i], start), lp,
                                           [(*self.pieces(t, start), v) for t, v in top])
        return list(zip(lives, tokens, logprobs))

    def _blocked(self, lives: list[_Live]) -> torch.Tensor:
        """The tokens each of ``lives`` may not take next; a matcher that failed computing its
        mask is renewed, and its mask computed again, where :meth:`_renew` can."""
        blocked = self.grammars.blocked([lv.matcher for lv in lives])
        renewed = [i for i, lv in enumerate(lives) if lv.matcher.is_error() and self._renew(lv, lv.tracker.token_ids)]
        if renewed:
            blocked[renewed] = self.grammars.blocked([lives[i].matcher for i in renewed])
        return blocked

    def _renew(self, live: _Live, tokens: list[int]) -> bool:
        """Give a request whose matcher failed one from a fresh compile of its schema, at
        ``tokens``, once, where its compile gave other matchers too. They share its lexer, and
        with it llguidance's limit on lexer states, which the requests it serves fill up one
        after another: a 4,000-value enum failed its 24,312th request (and every one beside
        it) at our limits. A request that met the limit by others' work goes on; one whose
        compile served it alone met the limit by its own, and ends with the error. Waits for
        the compile: this happens once in thousands of requests, and failing them costs more."""
        if live.renewed or live.compiled is None or not self.grammars.shared(live.compiled):
            return False
        live.renewed = True
        schema = live.seq.sampling.json_schema or ""
        compiled = self.grammars.compile(schema)
        if compiled is live.compiled:  # not yet renewed by a request that shared it
            self.grammars.forget(schema)
            compiled = self.grammars.compile(schema)
        try:
            matcher = self.grammars.start(compiled)
        except Exception:  # noqa: BLE001 - the request ends with its matcher's error, as without renewal
            return False
        matcher.consume_tokens(tokens)
        if matcher.is_error():
            return False
        live.matcher, live.compiled = matcher, compiled
        return True

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self._compiling),
            capacity=self.capacity,
            kv_usage=self.block_manager.usage,
            prefill_s_per_token=self._prefill_s_per_token,
            decode_step_s=self._decode_step_s,
            extra={
                "prefix_cache_hit_rate": self.block_manager.hit_rate,
                "kv_blocks_total": float(self.block_manager.num_blocks),
                "kv_blocks_free": float(self.block_manager.num_free_blocks),
                "preemptions_total": float(self.scheduler.num_preemptions),
            },
        )

    def _emit(self, live: _Live, token: int, logprob: TokenLogprob | None = None) -> StepOutput:
        seq = live.seq
        if live.matcher is not None and live.matcher.is_error():  # past llguidance's limits, or a bug
            self._live.pop(seq.request_id, None)
            self.scheduler.finish(seq)
            self.grammars.forget(seq.sampling.json_schema or "")
            return _error(seq.request_id, f"cannot hold the output to '{_schema_field(live)}': "
                                          f"{matcher_error(live.matcher)}",
                          seq.num_prompt_tokens, param=_schema_param(live))
        text, finish = live.tracker.append(token)
        if finish in (None, "length") and live.matcher is not None and live.matcher.is_stopped():
            text += live.tracker.end()  # complete JSON, even on the last token max_tokens allows
            finish = "stop"
        if finish is not None:
            self._live.pop(seq.request_id, None)
            self.scheduler.finish(seq)
        return StepOutput(
            request_id=seq.request_id,
            text=text,
            token_ids=[token],
            finish_reason=finish,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=len(live.tracker.token_ids),
            logprobs=[logprob] if logprob is not None else [],
        )

    def _expire(self, now: float, waiting_only: bool = False) -> list[StepOutput]:
        """Finish every request whose deadline passed, freeing its blocks before scheduling;
        ``waiting_only``: those no step runs (waiting, or compiling), while one is paused."""
        outputs = []
        for rid in [rid for rid, (lv, _) in self._compiling.items() if lv.seq.deadline < now]:
            live = self._abandon(rid)
            outputs.append(StepOutput(request_id=rid, finish_reason="deadline",
                                      prompt_tokens=live.seq.num_prompt_tokens))
        for rid in [rid for rid, lv in self._live.items()
                    if lv.seq.deadline < now and (not waiting_only or lv.seq.status is Status.WAITING)]:
            live = self._live.pop(rid)
            self.scheduler.finish(live.seq)
            outputs.append(
                StepOutput(
                    request_id=rid,
                    text=live.tracker.flush(),
                    finish_reason="deadline",
                    prompt_tokens=live.seq.num_prompt_tokens,
                    completion_tokens=len(live.tracker.token_ids),
                )
            )
        return outputs

    def _record_timing(self, seconds: float, num_tokens: int, num_seqs: int) -> None:
        """Moving averages of the decode step and of prefill cost per token, the two figures
        the admission controller predicts latency from."""
        prefill_tokens = num_tokens - num_seqs
        if prefill_tokens <= 0:
            self._decode_step_s = _blend(self._decode_step_s, seconds)
        else:
            self._prefill_s_per_token = _blend(self._prefill_s_per_token, seconds / num_tokens)


def _blend(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - _SMOOTHING) * old + _SMOOTHING * new


def _schema_param(live: _Live) -> str:
    """The field a client sent its schema in: only ``json_schema`` formats carry one, and a tool
    call's is its function's (``schema_param``)."""
    sampling = live.seq.sampling
    if sampling.schema_param is not None:
        return sampling.schema_param
    return "response_format" if sampling.json_schema == json_output.ANY_OBJECT else _SCHEMA_PARAM


def _schema_field(live: _Live) -> str:
    """What the output is held to, as an error about it names it."""
    return live.seq.sampling.schema_param or "response_format"


def _error(request_id: str, message: str, prompt_tokens: int = 0, code: str | None = None,
           param: str | None = None) -> StepOutput:
    return StepOutput(
        request_id=request_id,
        finish_reason="error",
        prompt_tokens=prompt_tokens,
        error=message,
        error_status=400,
        error_code=code,
        error_param=param,
    )
