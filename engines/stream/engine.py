"""The latency-first engine: a few streams at a time, each token out the step it is sampled.

It is the paged engine (the same model runner, paged KV cache, block manager, sampling and
detokenization, so nothing is padded or copied when a request joins or leaves) driven by
:class:`LatencyScheduler`: a small batch, earliest deadline first, and steps kept within a time
budget so a long prompt never freezes the streams already running. While streams decode, new
prompts go first: those waiting run in a pass of their own before the streams' step, and one
that arrives while a step runs cuts in: the step pauses between two layers
(:mod:`engines.paged.layered`) while the newcomer's prompt runs alone, and its first token is
sent before the step goes on. A newcomer whose first token shows no text yet (part of a
character) goes on alone in such a pass until it does: a client sees its first token when it
sees text. Start-up times a few passes to price prompt chunks before the first request arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engines.base import AT_LEAST_0, COUNT, NOT_NEGATIVE, EngineLoad, Send, StepOutput
from engines.paged import step_graphs
from engines.paged.engine import PagedEngine, PagedOptions
from engines.paged.model_runner import KVShape
from engines.paged.scheduler import Schedule
from engines.paged.sequence import Sequence
from engines.runtime.loader import LoadedModel
from engines.stream.cost import Ewma, StepCost
from engines.stream.scheduler import LatencyPolicy, LatencyScheduler, plan_chunks
from slogate.protocol import SamplingParams

_WARMUP_TOKENS = 256
_FIRST_TEXT_TOKENS = 4
"""Most tokens a newcomer's pass samples to show its first text: a UTF-8 character is at
most 4 bytes, so byte-level tokens of one take at most 4."""


@dataclass
class StreamOptions:
    max_batch: COUNT = 16
    step_budget_ms: NOT_NEGATIVE = 20.0
    """Engine time prompt work may add to a step while streams decode."""
    max_stall_ratio: NOT_NEGATIVE = 1.0
    min_chunk_tokens: COUNT = 16
    short_prompt_tokens: AT_LEAST_0 = 512
    prefill_chunk_tokens: COUNT | None = None
    """Fixed prompt tokens per step instead of the time budget."""
    max_step_tokens: COUNT = 2048
    """Most tokens one step runs (a burst with no stream decoding takes up to this)."""
    block_size: COUNT = 16
    kv_cache_bytes: COUNT = 256 * 2**20
    """Upper bound of the KV pool; it holds at most ``max_batch`` full contexts."""
    num_blocks: COUNT | None = None
    enable_prefix_caching: bool = True
    pack_weights: bool = True
    """As for the paged engine (:class:`engines.paged.PagedOptions`)."""
    cuda_graphs: bool = True
    """As for the paged engine; with graphs, while streams decode a step takes no more tokens
    than a graph runs."""
    cut_ins_per_step: AT_LEAST_0 = 2
    """Passes of newcomers' prompts that may pause one step between two layers, where the
    model allows (:mod:`engines.paged.layered`); 0: new prompts wait for the next step and
    run in it beside the streams, none first (:mod:`engines.stream.scheduler`). With CUDA
    graphs it is 0: a step takes a few milliseconds there and runs whole."""
    warmup: bool = True


class StreamEngine(PagedEngine):
    name = "stream"

    def __init__(self, loaded: LoadedModel, options: StreamOptions | None = None) -> None:
        opts = options or StreamOptions()
        block_bytes = KVShape.of(loaded.model).bytes_per_block(opts.block_size, loaded.dtype)
        full = opts.max_batch * -(-loaded.max_context // opts.block_size)
        super().__init__(loaded, PagedOptions(
            block_size=opts.block_size,
            num_blocks=opts.num_blocks or max(1, min(full, opts.kv_cache_bytes // block_bytes)),
            max_num_seqs=opts.max_batch,
            max_batched_tokens=max(opts.max_step_tokens, opts.max_batch),
            enable_prefix_caching=opts.enable_prefix_caching,
            pack_weights=opts.pack_weights,
            cuda_graphs=opts.cuda_graphs,
        ))
        self.policy = LatencyPolicy(opts.step_budget_ms / 1000.0, opts.max_stall_ratio, opts.min_chunk_tokens,
                                    opts.short_prompt_tokens, opts.prefill_chunk_tokens,
                                    opts.cut_ins_per_step if self.runner.graphs is None else 0,
                                    step_graphs.MAX_ROWS if self.runner.graphs is not None else None)
        # Same blocks and queues as the paged engine's scheduler; only the choice of each step differs.
        self.scheduler = LatencyScheduler(
            self.block_manager, opts.max_batch, max(opts.max_step_tokens, opts.max_batch), loaded.max_context,
            StepCost(0.0, 1e-4, 1e-5, 0.0), self.policy,
        )
        self.block_bytes = block_bytes
        self.prefill_step_s = Ewma()
        self._paused_s = 0.0
        """Seconds the step in progress spent paused between layers."""
        if opts.warmup:
            self._warmup()

    @property
    def cost(self) -> StepCost:
        return self.scheduler.cost

    def load(self) -> EngineLoad:
        """Prompt cost per token from the step cost model (what a prompt adds to a step, at a
        typical prompt length), not a whole mixed step over its tokens, which would charge each
        token a share of the step's fixed cost and the decodes that shared it."""
        load = super().load()
        load.prefill_s_per_token = self.cost.prefill_s([(0, _WARMUP_TOKENS)]) / _WARMUP_TOKENS
        load.decode_s_per_seq = self.cost.decode_scale.value * self.cost.per_decode_s
        load.extra.update({
            "prefill_step_s": self.prefill_step_s.value,
            "step_budget_s": self.policy.step_budget_s,
            "step_fixed_s": self.cost.fixed_s,
            "kv_bytes": float(self.kv_bytes()),
        })
        return load

    def kv_tokens(self, request_id: str) -> int:
        """KV positions the request holds now (0 once it finished or was aborted)."""
        live = self._live.get(request_id)
        return live.seq.num_computed_tokens if live is not None and live.seq.block_table else 0

    def kv_bytes(self) -> int:
        """Bytes of the KV pool that requests hold (blocks in use)."""
        return (self.block_manager.num_blocks - self.block_manager.num_free_blocks) * self.block_bytes

    def step(self, arrivals: Callable[[], bool] | None = None, send: Send | None = None) -> list[StepOutput]:
        outputs = super().step(arrivals, send)
        if not self.scheduler.prompt_pass:
            return outputs
        if send is None:
            return outputs + self._until_text(outputs)
        send(outputs)
        return self._until_text(outputs)

    def _forward(self, sched: Schedule, arrivals: Callable[[], bool] | None,
                 send: Send | None) -> tuple[list[int], torch.Tensor]:
        """The step's pass; between its layers ``arrivals`` takes in what the worker sent
        meanwhile (True when it added a request), and the newcomers that may cut in run
        alone, their first tokens sent before the step goes on. One that arrives during such
        a pass may cut in right after it (the step's passes allowing), not after the rest of
        the step: at 16 streams through the gateway on 2 cores, in four A/B runs each, the
        TTFT P99 was 9.0-11.5 ms against 8.4-14.7 ms, and below the paged engine's in all
        four against two."""
        self._paused_s = 0.0
        if arrivals is None or send is None or self.policy.cut_ins_per_step <= 0 or self.runner.decoder is None:
            return self.runner.run(sched)

        def pause(_layer: int) -> None:
            began = time.perf_counter()
            while arrivals():
                self._send_ends(send)
                if not (newcomers := self.scheduler.cut_in()).seqs:
                    break
                outputs = self._pass(newcomers, 0)
                send(outputs)
                if more := self._until_text(outputs):
                    send(more)
            self._paused_s += time.perf_counter() - began

        return self.runner.run(sched, pause)

    def _send_ends(self, send: Send) -> None:
        """Send the refusals of requests that arrived during the step before it goes on (the
        step may yet fail, and a client's mistake must stay a 400, not become its failure),
        and end those that expired waiting before a newcomer is chosen to cut in: the most
        urgent waiting request holds its place in the batch, and one expired held it from a
        newcomer that fits until the next step."""
        ended, self._pending = self._pending + self._expire(self.clock(), waiting_only=True), []
        if ended:
            send(ended)

    def _pass(self, sched: Schedule, decodes: int) -> list[StepOutput]:
        """Run ``sched`` (its first ``decodes`` rows decodes, the rest prompts) outside a step,
        timed as a step of that shape for the cost model, and return its outputs."""
        chunks = plan_chunks(sched, decodes)
        started = time.perf_counter()
        tokens = self._sample(sched, *self.runner.run(sched))
        seconds = time.perf_counter() - started
        self.cost.observe(decodes, chunks, seconds)
        self._record_averages(seconds, sched.num_tokens, len(sched.seqs))
        return [self._emit(*sampled_token) for sampled_token in tokens]

    def _until_text(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """After a pass of new prompts that went first, those whose first token shows no text
        yet (part of a character, or what may start a stop string) go on alone, a token a
        pass, until it shows. A client sees its first token when it sees text: left to the
        streams' step, the rest of the step in progress, the prompts waiting for the next and
        every pass that cuts into it came first. On the ~100M model on 2 cores, one request
        in 12 had such a first token, and those made the 16-stream TTFT P99. The pass's
        other newcomers are sent before these passes run (with ``send``): held for them, they
        made the tiny model's 16-stream P99 instead."""
        more: list[StepOutput] = []
        for _ in range(_FIRST_TEXT_TOKENS - 1):
            hidden = [live.seq for out in outputs
                      if (live := self._live.get(out.request_id)) is not None and not live.tracker.text]
            sched = self.scheduler.next_tokens(hidden)
            if not sched.seqs:
                break
            outputs = self._pass(sched, len(sched.seqs))
            more += outputs
        return more

    def _record_timing(self, seconds: float, num_tokens: int, num_seqs: int) -> None:
        seconds -= self._paused_s  # the step's own work: the pauses (passes, their sends) are timed apart
        self._record_averages(seconds, num_tokens, num_seqs)
        self.cost.observe(*self.scheduler.last_plan, seconds)

    def _record_averages(self, seconds: float, num_tokens: int, num_seqs: int) -> None:
        super()._record_timing(seconds, num_tokens, num_seqs)
        if num_tokens > num_seqs:
            self.prefill_step_s.add(seconds)

    def _warmup(self) -> None:
        """Price the step before the first request, so the first long prompt is already
        chunked to fit the budget: a one-token pass gives the fixed cost, a full batch of
        decodes the cost per stream, and prompt passes at the start and deep in the context
        the cost per token and its growth with position. The fastest of a few runs filters
        out a busy host; the passes also warm the kernels the first request would."""
        slots = self.block_manager.num_blocks * self.block_manager.block_size
        n = max(1, min(_WARMUP_TOKENS, self.max_context // 4, slots // 8))
        far = max(0, min(4 * n, self.max_context - n, slots - n - self.block_manager.block_size))
        rows = max(1, min(self.scheduler.max_num_seqs, slots // (n + self.block_manager.block_size)))
        best = {"fixed": float("inf"), "decode": float("inf"), "near": float("inf"), "far": float("inf")}
        for _ in range(3):
            best["fixed"] = min(best["fixed"], self.time_step([(0, 1)]))
            best["decode"] = min(best["decode"], self.time_step([(n, 1)] * rows))
            best["near"] = min(best["near"], self.time_step([(0, n)]))
            best["far"] = min(best["far"], self.time_step([(far, n)]))
        self.scheduler.cost = StepCost.fit(best["fixed"], rows, best["decode"], n, best["near"], far, best["far"])
        self.block_manager.queried_tokens = self.block_manager.hit_tokens = 0
        PagedEngine._record_timing(self, best["decode"], rows, rows)
        PagedEngine._record_timing(self, best["near"], n, 1)

    def time_step(self, parts: list[tuple[int, int]]) -> float:
        """Seconds to run one step of sequences that have ``start`` tokens cached and run
        ``n`` more, on scratch blocks (what the cache holds does not matter for timing)."""
        vocab = self.loaded.vocab_size
        sched = Schedule()
        for i, (start, n) in enumerate(parts):
            seq = Sequence(f"warmup-{i}", [(7 * j) % vocab for j in range(start + n)], SamplingParams(max_tokens=1))
            self.block_manager.allocate(seq)
            seq.num_computed_tokens = start
            sched.add(seq, n)
        try:
            began = time.perf_counter()
            self.runner.run(sched)
            if self.loaded.device.type == "cuda":
                torch.cuda.synchronize(self.loaded.device)
            return time.perf_counter() - began
        finally:
            for seq in sched.seqs:
                self.block_manager.deallocate(seq)
