"""The stream engine's scheduler: the paged engine's blocks, queues and preemption, with a
latency-first choice of what each step runs.

Every step runs one decode for each running stream. What is left of the step goes to prompts,
earliest deadline first across prompts being prefilled and requests still waiting, so an
urgent newcomer overtakes a long prompt halfway through its prefill. While streams decode,
prompt work may add at most ``max_stall_ratio`` times a decode-only step, and never more than
``step_budget_s``: a long prompt enters in chunks sized by :class:`StepCost` and the gap
between a stream's tokens stays bounded. With no stream decoding there is no gap to protect,
so the step takes every waiting prompt it can.

A request that arrives while a step runs may join it between two layers
(:mod:`engines.paged.layered`) with its whole prompt. A join makes the step longer by the
newcomer's prompt, which the streams decoding would have paid in their next step anyway, and
by its pass alone through the layers behind; both delay the first token of every prompt in
the step, while the newcomer saves the whole next step. So a newcomer joins when what it saves
is more than what the prompts in the step lose together, and while joins add at most
``max_stall_ratio`` times what the step was planned to take, so that it cannot keep growing
for as long as requests keep arriving. A burst of prompts is then served step by
step as before, and among decoding streams a newcomer gets its first token a step sooner.
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


class LatencyScheduler(Scheduler):
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_step_tokens: int,
                 max_model_len: int, cost: StepCost, policy: LatencyPolicy) -> None:
        super().__init__(block_manager, max_num_seqs, max_step_tokens, max_model_len)
        self.cost = cost
        self.policy = policy
        self.last_plan: tuple[int, list[tuple[int, int]]] | None = (0, [])
        """Decode rows and prompt chunks ``(start, tokens)`` of the last schedule, which the
        engine's measured step time is set against; None once requests joined it."""
        self._join_s = 0.0
        """What joins may still add to the step in progress."""
        self._tokens_left = 0
        self._decodes = 0
        self._prompts = 0
        """Prompt chunks in the step in progress, joiners included: whom a join delays."""

    def schedule(self) -> Schedule:
        sched = Schedule()
        self.running.sort(key=lambda s: s.priority)
        for seq in [s for s in self.running if not s.is_prefilling]:
            if seq.status is not Status.RUNNING or not self._make_room(seq, sched):
                continue
            self.block_manager.may_append(seq)
            sched.add(seq, 1)
        decodes = len(sched.seqs)
        self._tokens_left = self._fill_with_prompts(sched, decodes)
        chunks = [(s.num_computed_tokens, n) for s, n in zip(sched.seqs[decodes:], sched.num_new_tokens[decodes:])]
        self.last_plan = (decodes, chunks)
        self._join_s = self.policy.max_stall_ratio * self.cost.predict(decodes, chunks)
        self._decodes, self._prompts = decodes, len(chunks)
        return sched

    def join(self, sched: Schedule, passed: float) -> Schedule:
        """Waiting requests that join ``sched`` now, with ``passed`` of its layers behind it:
        whole prompts of two tokens or more (so the model runner lays their rows out after
        the step's own), most urgent first, where joining is worth it (see above)."""
        extra = Schedule()
        if sched.preempted:
            return extra
        catch_up = passed * self.cost.decode_step_s(0)  # the newcomers' pass alone, paid once
        for seq in sorted(self.waiting, key=lambda s: s.priority):
            remaining = len(seq) - seq.num_computed_tokens
            alone = 0.0 if extra.seqs else catch_up
            work = self.cost.prefill_s([(seq.num_computed_tokens, remaining)]) + alone
            saved = self.cost.decode_step_s(self._decodes + self._prompts) - alone
            if (remaining < 2 or remaining > self._tokens_left or work > self._join_s
                    or saved <= self._prompts * work or not self._start(seq)):
                continue
            n = len(seq) - seq.num_computed_tokens
            if n < 2:  # the prefix cache left one token: it runs as a decode next step
                continue
            extra.add(seq, n)
            self._join_s -= work
            self._tokens_left -= n
            self._prompts += 1
        if extra.seqs:
            self.last_plan = None  # a joined step is not a shape the cost model can learn from
        return extra

    def allowance_s(self, decodes: int) -> float:
        """Seconds of prompt work a step with ``decodes`` decode rows may take."""
        if decodes == 0:
            return float("inf")
        return min(self.policy.step_budget_s, self.policy.max_stall_ratio * self.cost.decode_step_s(decodes))

    def _fill_with_prompts(self, sched: Schedule, decodes: int) -> int:
        """Add prompt chunks to ``sched``; returns how many more tokens the step may take."""
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
        return tokens_left

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
