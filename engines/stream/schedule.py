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


@dataclass
class PrefillCost:
    """Prefill time as a fixed cost per forward pass plus a cost per prompt token.

    Dividing a chunk's time by its length would fold the fixed cost into the per-token
    figure; small chunks would then look dear, the next chunk would be sized smaller still,
    and chunking would spiral down to its minimum.
    """

    fixed_s: Ewma
    per_token_s: Ewma

    def add(self, tokens: int, seconds: float) -> None:
        self.per_token_s.add(max(seconds - self.fixed_s.value, 0.0) / tokens)

    def tokens_within(self, seconds: float, min_tokens: int, max_tokens: int) -> int:
        """Prompt tokens one forward pass can take in ``seconds``, never below ``min_tokens``:
        a prompt must make progress even when decoding alone fills the budget, or a full
        batch would starve the newcomer."""
        if self.per_token_s.value <= 0.0:
            return max_tokens
        fit = int((seconds - self.fixed_s.value) / self.per_token_s.value)
        return max(min_tokens, min(max_tokens, fit))
