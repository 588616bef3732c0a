"""The stream engine's scheduler: the paged engine's blocks, queues and preemption, with a
latency-first choice of what each step runs.

Every step runs one decode for each running stream. What is left of the step goes to prompts,
earliest deadline first across prompts being prefilled and requests still waiting, so an
urgent newcomer overtakes a long prompt halfway through its prefill. While streams decode,
prompt work may add at most ``max_stall_ratio`` times a decode-only step, and never more than
``step_budget_s``: a long prompt enters in chunks sized by :class:`StepCost` and the gap
between a stream's tokens stays bounded. With no stream decoding there is no gap to protect,
so the step takes every waiting prompt it can.

While streams decode, new prompts go first. Those waiting when a step begins run in a pass of
their own, before the streams' step and never twice in a row. One that arrives while the
streams' step runs may cut in: the step pauses between two layers
(:mod:`engines.paged.layered`) while its whole prompt runs alone, and its first token is out
after its own pass, not after the rest of this step and all of the next. The streams pay for
those passes: the model's weights read once more for each, besides the prompts they would
have carried in their steps anyway. A latency-first engine makes that trade. On the ~100M
model on 2 CPU cores, with 16 streams, the TTFT median fell by two fifths and its P99 by a
fifth to two fifths against prompts riding in the streams' steps.

A newcomer never cuts in ahead of a more urgent prompt in the step (with equal objectives:
one that came first), which it would delay by its own pass: in a ramp, where steps carry the
prompts of the requests before, letting everyone cut in served them last come first and took
the ramp's TTFT P99 from 400 to 700-970 ms. Only short prompts go first (up to
``short_prompt_tokens`` a pass; a long prompt is chunked into the streams' steps as ever), and
at most ``cut_ins_per_step`` passes pause one step, so a stream's gap stays bounded however
fast requests arrive.
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
    cut_ins_per_step: int = 2
    """Most passes of newcomers' prompts that may pause one step; 0: new prompts run in the
    streams' steps beside them, none first."""
    max_tokens_with_decodes: int | None = None
    """Most tokens a step runs while streams decode: on a GPU, the most a CUDA graph runs, so
    a prompt chunk never drops the streams' step onto the eager path (~6x slower there)."""


class LatencyScheduler(Scheduler):
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_step_tokens: int,
                 max_model_len: int, cost: StepCost, policy: LatencyPolicy) -> None:
        super().__init__(block_manager, max_num_seqs, max_step_tokens, max_model_len)
        self.cost = cost
        self.policy = policy
        self.last_plan: tuple[int, list[tuple[int, int]]] = (0, [])
        """Decode rows and prompt chunks ``(start, tokens)`` of the last schedule, which the
        engine's measured step time is set against."""
        self._cut_ins_left = 0
        """Passes that may still pause the step in progress."""
        self._first_due: tuple[float, int] | None = None
        """The most urgent prompt that gets its first token from the step in progress."""
        self.prompt_pass = False
        """Whether the last schedule is a pass of new prompts that went first."""

    def schedule(self) -> Schedule:
        self.running.sort(key=lambda s: s.priority)
        self.prompt_pass = False
        if self.policy.cut_ins_per_step > 0 and self.last_plan[0] > 0 and self._decoding():
            sched = self._whole_prompts()
            if sched.seqs:  # prompts first: a pass of their own, then the streams' step
                self.last_plan = (0, plan_chunks(sched))
                self._cut_ins_left = 0  # every prompt in the pass is more urgent than a newcomer
                self.prompt_pass = True
                return sched
        sched = Schedule()
        for seq in [s for s in self.running if not s.is_prefilling]:
            if seq.status is not Status.RUNNING or not self._make_room(seq, sched):
                continue
            self.block_manager.may_append(seq)
            sched.add(seq, 1)
        decodes = len(sched.seqs)
        self._fill_with_prompts(sched, decodes)
        self.last_plan = (decodes, plan_chunks(sched, decodes))
        self._cut_ins_left = 0 if sched.preempted else self.policy.cut_ins_per_step
        due = [s.priority for i, s in enumerate(sched.seqs) if i >= decodes and sched.samples(i)]
        self._first_due = min(due, default=None)
        return sched

    def cut_in(self) -> Schedule:
        """Waiting requests to run alone now, while the step in progress is paused: whole
        prompts, most urgent first, up to ``short_prompt_tokens`` in all, more urgent than
        every prompt the step gives a first token. Empty once the step's passes are spent, or
        when it had to preempt a stream for memory. The engine ends those whose deadline passed
        first: the streams would pause for an answer nobody waits for, and the most urgent one
        waiting holds the blocks and the place it needs (:meth:`_start`) from later ones."""
        if self._cut_ins_left <= 0:
            return Schedule()
        extra = self._whole_prompts(self._first_due)
        if extra.seqs:
            self._cut_ins_left -= 1
        return extra

    def next_tokens(self, seqs: list[Sequence]) -> Schedule:
        """A decode-only pass of ``seqs`` alone, leaving out any whose next token needs a block
        that only preempting a stream would free (it waits for the streams' step)."""
        sched = Schedule()
        for seq in seqs:
            if seq.status is Status.RUNNING and not seq.is_prefilling and self.block_manager.can_append(seq):
                self.block_manager.may_append(seq)
                sched.add(seq, 1)
        return sched

    def _whole_prompts(self, before: tuple[float, int] | None = None) -> Schedule:
        """Waiting requests started with their whole prompts, most urgent first (and more
        urgent than ``before``), up to ``short_prompt_tokens`` in all."""
        sched = Schedule()
        tokens_left = min(self.policy.short_prompt_tokens, self.max_batched_tokens)
        for seq in sorted(self.waiting, key=lambda s: s.priority):
            if before is not None and seq.priority >= before:
                break
            if len(seq) - seq.num_computed_tokens > tokens_left or not self._start(seq):
                continue
            n = len(seq) - seq.num_computed_tokens  # less once the prefix cache served a part
            sched.add(seq, n)
            tokens_left -= n
        return sched

    def _decoding(self) -> bool:
        return any(s.status is Status.RUNNING and not s.is_prefilling for s in self.running)

    def allowance_s(self, decodes: int) -> float:
        """Seconds of prompt work a step with ``decodes`` decode rows may take."""
        if decodes == 0:
            return float("inf")
        return min(self.policy.step_budget_s, self.policy.max_stall_ratio * self.cost.decode_step_s(decodes))

    def _fill_with_prompts(self, sched: Schedule, decodes: int) -> None:
        """Add prompt chunks to ``sched``, most urgent first, within the step's allowance."""
        p = self.policy
        time_left = self.allowance_s(decodes)
        tokens_left = (p.fixed_chunk_tokens if p.fixed_chunk_tokens is not None
                       else self.max_batched_tokens - decodes)
        if decodes and p.max_tokens_with_decodes is not None:
            tokens_left = min(tokens_left, p.max_tokens_with_decodes - decodes)
        short_left = p.short_prompt_tokens
        prefilling = [s for s in self.running if s.is_prefilling and s.status is Status.RUNNING]
        waiting = self.waiting if not sched.preempted else []
        for seq in sorted(prefilling + waiting, key=lambda s: s.priority):
            if tokens_left <= 0:
                break
            start = seq.num_computed_tokens
            remaining = len(seq) - start
            if p.fixed_chunk_tokens is not None:
                n = remaining
            elif self.cost.prefill_s([(start, remaining)]) <= time_left:
                n = remaining
            elif start == 0 and remaining <= short_left:
                n = remaining
                short_left -= remaining
            else:
                n = self.cost.tokens_within(time_left, start)
                if not sched.num_new_tokens[decodes:]:
                    n = max(n, p.min_chunk_tokens)
            n = min(n, remaining, tokens_left)
            if n <= 0:
                continue
            if seq.status is Status.WAITING and not self._start(seq):
                continue
            n = min(n, len(seq) - seq.num_computed_tokens)
            sched.add(seq, n)
            tokens_left -= n
            time_left -= self.cost.prefill_s([(seq.num_computed_tokens, n)])

    def _start(self, seq: Sequence) -> bool:
        """Move a waiting request into the batch if a slot and its blocks are free, and the
        most urgent waiting request could still start after it: requests with later deadlines
        that fit would take each slot and block freed (in the passes of short prompts that go
        first, which a long one never joins), and a large urgent one never started before its
        deadline (the paged scheduler's queue holds them back the same way)."""
        if not self._fits(seq, len(self.running)):
            return False
        first = self.waiting[0]
        if first is not seq and not self._fits(first, len(self.running) + 1, self.block_manager.free_blocks_taken(seq)):
            return False
        self.waiting.remove(seq)
        self.block_manager.allocate(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def _fits(self, seq: Sequence, running: int, taken: int = 0) -> bool:
        """Whether ``seq`` could start beside ``running`` requests with ``taken`` free blocks
        gone, leaving a free block for each running one."""
        reserve = running + 1 if running else 0
        return running < self.max_num_seqs and self.block_manager.can_allocate(seq, reserve + taken)


def plan_chunks(sched: Schedule, first: int = 0) -> list[tuple[int, int]]:
    """The prompt chunks ``(start, tokens)`` of ``sched`` from row ``first`` on, as the cost
    model prices them."""
    return [(s.num_computed_tokens, n) for s, n in zip(sched.seqs[first:], sched.num_new_tokens[first:])]
