"""The stream engine's decisions, kept apart from tensors: who waits in what order, and how
many prompt tokens one step may prefill without stalling the streams already running."""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field


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
    """A running average that follows drift (a growing context slows every step).

    ``rise``, when set, is the weight of a sample above the average: a cost estimate that
    is slow to believe bad news overruns the step budget while it catches up.
    """

    value: float = 0.0
    alpha: float = 0.2
    rise: float | None = None

    def add(self, sample: float) -> None:
        if self.value == 0.0:
            self.value = sample
            return
        weight = self.rise if self.rise is not None and sample > self.value else self.alpha
        self.value += weight * (sample - self.value)


@dataclass
class PrefillCost:
    """What a prefill forward pass costs: a fixed part, plus for each prompt token a part for
    the layers and a part that grows with how far into the context the token sits
    (attention reads every earlier position).

    Without the context part, a chunk sized at the start of a long prompt would overrun the
    budget deep inside it. ``scale`` follows measured passes, so a busier host or a warmer
    cache moves every prediction together.
    """

    fixed_s: float
    per_token_s: float
    per_token_per_position_s: float
    scale: Ewma = field(default_factory=lambda: Ewma(1.0, alpha=0.1, rise=0.5))
    observed_per_token_s: Ewma = field(default_factory=Ewma)

    @classmethod
    def fit(cls, fixed_s: float, tokens: int, near_s: float, far_start: int, far_s: float) -> PrefillCost:
        """From a one-token pass, and passes of ``tokens`` tokens at position 0 and at
        ``far_start``."""
        near = max(near_s - fixed_s, 0.0) / tokens
        far = max(far_s - fixed_s, 0.0) / tokens
        per_position = max(far - near, 0.0) / far_start if far_start else 0.0
        per_token = max(near - per_position * tokens / 2, near / 2, 1e-9)
        cost = cls(fixed_s, per_token, per_position)
        cost.observed_per_token_s.add(near)
        return cost

    def _work(self, rows: int, width: int, start: int) -> float:
        return rows * width * (self.per_token_s + self.per_token_per_position_s * (start + width / 2))

    def predict(self, rows: int, width: int, start: int = 0) -> float:
        """Seconds for ``rows`` prompts of ``width`` tokens each, starting at ``start``."""
        return self.fixed_s + self.scale.value * self._work(rows, width, start)

    def add(self, rows: int, width: int, start: int, seconds: float) -> None:
        work = self._work(rows, width, start)
        if work > 0:
            self.scale.add(max(seconds - self.fixed_s, 0.0) / work)
        self.observed_per_token_s.add(max(seconds - self.fixed_s, 0.0) / (rows * width))

    def tokens_within(self, seconds: float, start: int, min_tokens: int, max_tokens: int) -> int:
        """Prompt tokens one pass can take from position ``start`` in ``seconds``, never
        below ``min_tokens``: a prompt must make progress even when decoding alone fills the
        budget, or a full batch would starve the newcomer."""
        quadratic = self.scale.value * self.per_token_per_position_s / 2
        linear = self.scale.value * (self.per_token_s + self.per_token_per_position_s * start)
        room = seconds - self.fixed_s
        if room <= 0:
            return min_tokens
        if quadratic > 0:
            fit = (-linear + math.sqrt(linear * linear + 4 * quadratic * room)) / (2 * quadratic)
        else:
            fit = room / linear if linear > 0 else max_tokens
        return max(min_tokens, min(max_tokens, int(fit)))
