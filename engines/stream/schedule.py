"""The stream engine's decisions, kept apart from tensors: who waits in what order, and how
many prompt tokens one step may prefill without stalling the streams already running."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass


class EdfQueue:
    """Waiting request ids, earliest deadline first; ties go to whoever came first.

    Removal is lazy (the id is forgotten and skipped when it reaches the top), so aborting a
    waiting request costs nothing.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._live: set[str] = set()
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def push(self, request_id: str, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), request_id))
        self._live.add(request_id)

    def remove(self, request_id: str) -> None:
        self._live.discard(request_id)

    def pop(self) -> str | None:
        while self._heap:
            _, _, request_id = heapq.heappop(self._heap)
            if request_id in self._live:
                self._live.remove(request_id)
                return request_id
        return None


@dataclass
class Ewma:
    """A running average that follows drift (a growing context slows every step)."""

    value: float = 0.0
    alpha: float = 0.2

    def add(self, sample: float) -> None:
        self.value = sample if self.value == 0.0 else self.value + self.alpha * (sample - self.value)


def prefill_chunk(
    budget_s: float, decode_s: float, prefill_s_per_token: float, min_tokens: int, max_tokens: int
) -> int:
    """Prompt tokens that fit in what the step budget leaves after the decode pass.

    Never below ``min_tokens``: a prompt must make progress even when decoding alone fills
    the budget, or a full batch would starve the newcomer forever.
    """
    if prefill_s_per_token <= 0.0:
        return max_tokens
    fit = int((budget_s - decode_s) / prefill_s_per_token)
    return max(min_tokens, min(max_tokens, fit))
