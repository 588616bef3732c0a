"""The stream engine's scheduler: the paged engine's blocks, queues and preemption, with a
latency-first choice of what each step runs.

Every step runs one decode for each running stream. What is left of the step goes to prompts,
earliest deadline first across prompts being prefilled and requests still waiting, so an
urgent newcomer overtakes a long prompt halfway through its prefill. While streams decode,
prompt work may add at most ``max_stall_ratio`` times a decode-only step, and never more than
``step_budget_s``: a long prompt enters in chunks sized by :class:`StepCost` and the gap
between a stream's tokens stays bounded. With no stream decoding there is no gap to protect,
so the step takes every waiting prompt it can.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.paged.block_manager import BlockManager
from engines.paged.scheduler import Schedule, Scheduler
from engines.paged.sequence import Sequence, Status
from engines.stream.cost import StepCost


@dataclass
class LatencyPolicy:
    step_budget_s: float = 0.020
    """The most engine time prompt work may add to a step while streams decode."""
    max_stall_ratio: float = 1.0
    """Prompt work may add at most this multiple of a decode-only step, so a stream's gap
    stays within (1 + ratio) times its usual one even when decode steps are fast."""
    min_chunk_tokens: int = 16
    """The most urgent prompt advances at least this much each step, however full it is."""
    short_prompt_tokens: int = 512
    """Whole prompts up to this many tokens in all enter each step whatever the budget: a
    burst of short requests gets its first tokens together instead of one per step. Holding
    them to the budget too starves them wherever prompt work is a large share of the load: on
    the ~100M model in fp32 on 2 slow cores (1.5 ms per prompt token, a 16-stream decode step
    61 ms), the newcomers queued and the TTFT at 16 streams went from 168 ms to 1.8 s (P50)."""
    fixed_chunk_tokens: int | None = None
    """Prompt tokens per step instead of a time budget (for tests and experiments)."""
    max_tokens_with_decodes: int | None = None
    """Most tokens a step runs while streams decode: on a GPU, the most a CUDA graph runs, so
    a prompt chunk never drops the streams' step onto the eager path (~6x slower there)."""


@dataclass
class _Left:
    """What the step being built may still take."""

    time_s: float
    tokens: int
    short_tokens: int
    """Of :attr:`LatencyPolicy.short_prompt_tokens`."""


class LatencyScheduler(Scheduler):
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_step_tokens: int,
                 max_model_len: int, cost: StepCost, policy: LatencyPolicy) -> None:
        super().__init__(block_manager, max_num_seqs, max_step_tokens, max_model_len)
        self.cost = cost
        self.policy = policy
        self.last_plan: tuple[int, list[tuple[int, int]]] | None = (0, [])
        """Decode rows and prompt chunks ``(start, tokens)`` of the last schedule, which the
        engine's measured step time is set against; None once requests joined it."""
        self._left = _Left(0.0, 0, 0)

    def schedule(self) -> Schedule:
        sched = Schedule()
        self.running.sort(key=lambda s: s.priority)
        for seq in [s for s in self.running if not s.is_prefilling]:
            if seq.status is not Status.RUNNING or not self._make_room(seq, sched):
                continue
            self.block_manager.may_append(seq)
            sched.add(seq, 1)
        decodes = len(sched.seqs)
        p = self.policy
        tokens_left = p.fixed_chunk_tokens if p.fixed_chunk_tokens is not None else self.max_batched_tokens - decodes
        if decodes and p.max_tokens_with_decodes is not None:
            tokens_left = min(tokens_left, p.max_tokens_with_decodes - decodes)
        self._left = _Left(self.allowance_s(decodes), tokens_left, p.short_prompt_tokens)
        prefilling = [s for s in self.running if s.is_prefilling and s.status is Status.RUNNING]
        self._fill_with_prompts(sched, prefilling + (self.waiting if not sched.preempted else []), floor=True)
        chunks = [(s.num_computed_tokens, n) for s, n in zip(sched.seqs[decodes:], sched.num_new_tokens[decodes:])]
        self.last_plan = (decodes, chunks)
        return sched

    def join(self, sched: Schedule, passed: float) -> Schedule:
        """Waiting requests that may join ``sched`` while it runs, with ``passed`` of its
        layers behind it (see :mod:`engines.paged.layered`): what the step had left of its
        allowance, less the newcomers' pass alone through those layers. Their chunks are at
        least two tokens, so that the model runner lays them out after the step's own rows."""
        extra = Schedule()
        if sched.preempted or not self.waiting:
            return extra
        self._left.time_s -= passed * self.cost.decode_step_s(0)
        has_prompts = self.last_plan is None or bool(self.last_plan[1])
        self._fill_with_prompts(extra, list(self.waiting), floor=not has_prompts, min_tokens=2)
        if extra.seqs:
            self.last_plan = None  # a joined step is not a shape the cost model can learn from
        return extra

    def allowance_s(self, decodes: int) -> float:
        """Seconds of prompt work a step with ``decodes`` decode rows may take."""
        if decodes == 0:
            return float("inf")
        return min(self.policy.step_budget_s, self.policy.max_stall_ratio * self.cost.decode_step_s(decodes))

    def _fill_with_prompts(self, sched: Schedule, candidates: list[Sequence], floor: bool, min_tokens: int = 1) -> None:
        """Add chunks of ``candidates`` to ``sched``, most urgent first, within what the step
        has left (``self._left``, which this spends). With ``floor``, the first chunk is at
        least :attr:`LatencyPolicy.min_chunk_tokens` whatever the time left."""
        p, left = self.policy, self._left
        for seq in sorted(candidates, key=lambda s: s.priority):
            if left.tokens <= 0:
                return
            start = seq.num_computed_tokens
            remaining = len(seq) - start
            if p.fixed_chunk_tokens is not None:
                n = remaining
            elif self.cost.prefill_s([(start, remaining)]) <= left.time_s:
                n = remaining
            elif start == 0 and remaining <= left.short_tokens:
                n = remaining
                left.short_tokens -= remaining
            else:
                n = self.cost.tokens_within(left.time_s, start)
                if floor:
                    n = max(n, p.min_chunk_tokens)
            n = min(n, remaining, left.tokens)
            if n < min_tokens:
                continue
            if seq.status is Status.WAITING and not self._start(seq):
                continue
            n = min(n, len(seq) - seq.num_computed_tokens)
            if n < min_tokens:  # the prefix cache left one token: it runs as a decode next step
                continue
            sched.add(seq, n)
            floor = False
            left.tokens -= n
            left.time_s -= self.cost.prefill_s([(seq.num_computed_tokens, n)])

    def _start(self, seq: Sequence) -> bool:
        """Move a waiting request into the batch if a slot and its blocks are free."""
        reserve = len(self.running) + 1 if self.running else 0
        if len(self.running) >= self.max_num_seqs or not self.block_manager.can_allocate(seq, reserve):
            return False
        self.waiting.remove(seq)
        self.block_manager.allocate(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True
