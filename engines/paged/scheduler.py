"""Which sequences run in the next step, and with how many tokens each.

Every step mixes one-token decodes of running sequences with (chunked) prefills, under a
token budget, so a long prompt never stalls the streams already running. Order is earliest
deadline first. When the pool runs out of blocks the least urgent running sequence is
preempted by recompute: its blocks are released (its full blocks stay in the prefix cache, so
the recompute is mostly cache hits) and it goes back to the waiting queue with its generated
tokens, to be prefilled again later. A request admitted must leave one free block per running
sequence, so the pool never runs dry again before each of them has filled a block: that is
what keeps preemption from thrashing.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engines.paged.block_manager import BlockManager
from engines.paged.sequence import Sequence, Status


@dataclass
class Schedule:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether the i-th sequence reaches its end this step, so its last logits give a token."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == len(seq)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        if max_batched_tokens < max_num_seqs:
            raise ValueError("max_batched_tokens must be at least max_num_seqs (one token per decode)")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def rejection(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never be served, checked up front so it fails fast with a 400."""
        total = seq.max_total_tokens
        if total > self.max_model_len:
            return (
                f"prompt ({seq.num_prompt_tokens} tokens) plus max_tokens ({seq.sampling.max_tokens}) "
                f"exceeds the model context of {self.max_model_len} tokens"
            )
        needed = self.block_manager.blocks_for(total)
        if needed > self.block_manager.num_blocks:
            return (
                f"prompt plus max_tokens needs {needed} KV blocks but the cache holds only "
                f"{self.block_manager.num_blocks}"
            )
        return None

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.priority)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Schedule:
        sched = Schedule()
        budget = self.max_batched_tokens
        self.running.sort(key=lambda s: s.priority)
        decoding = [s for s in self.running if not s.is_prefilling]
        prefilling = [s for s in self.running if s.is_prefilling]
        for seq in decoding:
            if seq.status is not Status.RUNNING:
                continue
            if not self._make_room(seq, sched):
                continue
            self.block_manager.may_append(seq)
            sched.add(seq, 1)
            budget -= 1
        for seq in prefilling:
            if seq.status is not Status.RUNNING or budget <= 0:
                continue
            n = min(len(seq) - seq.num_computed_tokens, budget)
            sched.add(seq, n)
            budget -= n
        if not sched.preempted or not sched.seqs:
            self._admit(sched, budget)
        return sched

    def postprocess(self, sched: Schedule, sampled: dict[int, int]) -> None:
        """Account for the step that ran ``sched``; ``sampled`` maps a position in it to the
        token sampled there."""
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens)):
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
            if i in sampled:
                seq.append_token(sampled[i])

    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its blocks now (finished, aborted, expired)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = Status.FINISHED

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _make_room(self, seq: Sequence, sched: Schedule) -> bool:
        """Free blocks until ``seq`` can take its next token, preempting the least urgent
        running sequence not yet scheduled; False when ``seq`` itself had to go."""
        scheduled = set(map(id, sched.seqs))
        while not self.block_manager.can_append(seq):
            victims = [s for s in self.running if id(s) not in scheduled]
            victim = victims[-1]
            self.preempt(victim)
            sched.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, sched: Schedule, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            reserve = len(self.running) + 1 if self.running else 0
            if not self.block_manager.can_allocate(seq, reserve):
                break
            self.waiting.pop(0)
            self.block_manager.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(len(seq) - seq.num_computed_tokens, budget)
            sched.add(seq, n)
            budget -= n
