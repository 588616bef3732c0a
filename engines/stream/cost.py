"""What one engine step costs, so the scheduler can fill a step up to a time budget.

A step is one forward pass over decode rows and prompt chunks. Its time is a fixed part (the
pass itself), a part per decode row, and for each prompt token a part for the layers plus a
part that grows with how far into the context the token sits (attention reads every earlier
position). Without the position part, a chunk sized at the start of a long prompt would
overrun the budget deep inside it.

The shape comes from a few timed passes at start-up; two scales then follow measured steps, so
a busier host or a warmer cache moves the predictions with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Ewma:
    """A running average that follows drift.

    ``rise``, when set, is the weight of a sample above the average: a cost estimate that is
    slow to believe bad news overruns the step budget while it catches up.
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
class StepCost:
    fixed_s: float
    per_decode_s: float
    per_token_s: float
    per_token_per_position_s: float
    decode_scale: Ewma = field(default_factory=lambda: Ewma(1.0, alpha=0.2, rise=0.5))
    """Measured over predicted decode-only steps."""
    prefill_scale: Ewma = field(default_factory=lambda: Ewma(1.0, alpha=0.1, rise=0.5))
    """Measured over predicted prompt work, once the step's decodes are taken off. Kept apart
    from ``decode_scale``: decode steps are mostly fixed cost, and a decode-only step that runs
    fast must not make prompt chunks larger."""

    @classmethod
    def fit(cls, fixed_s: float, decodes: int, decode_s: float, tokens: int, near_s: float,
            far_start: int, far_s: float) -> StepCost:
        """From timed passes: one token; ``decodes`` decode rows; ``tokens`` prompt tokens at
        position 0 and again at ``far_start``."""
        per_decode = max(decode_s - fixed_s, 0.0) / decodes
        near = max(near_s - fixed_s, 0.0) / tokens
        far = max(far_s - fixed_s, 0.0) / tokens
        per_position = max(far - near, 0.0) / far_start if far_start else 0.0
        per_token = max(near - per_position * tokens / 2, near / 2, 1e-9)
        return cls(fixed_s, max(per_decode, 1e-9), per_token, per_position)

    def chunk_work(self, start: int, tokens: int) -> float:
        """Seconds (before scaling) that ``tokens`` prompt tokens from ``start`` add to a step."""
        return tokens * (self.per_token_s + self.per_token_per_position_s * (start + tokens / 2))

    def decode_step_s(self, decodes: int) -> float:
        """A step of ``decodes`` decode rows and no prompt work."""
        return self.decode_scale.value * (self.fixed_s + self.per_decode_s * decodes)

    def prefill_s(self, chunks: Iterable[tuple[int, int]]) -> float:
        """What prompt chunks, each ``(start, tokens)``, add to a step."""
        return self.prefill_scale.value * sum(self.chunk_work(start, n) for start, n in chunks)

    def predict(self, decodes: int, chunks: Iterable[tuple[int, int]] = ()) -> float:
        return self.decode_step_s(decodes) + self.prefill_s(chunks)

    def observe(self, decodes: int, chunks: list[tuple[int, int]], seconds: float) -> None:
        """Learn from a step that ran ``decodes`` decode rows and ``chunks`` in ``seconds``."""
        work = sum(self.chunk_work(start, n) for start, n in chunks)
        if work <= 0:
            self.decode_scale.add(seconds / (self.fixed_s + self.per_decode_s * decodes))
        else:
            self.prefill_scale.add(max(seconds - self.decode_step_s(decodes), 0.0) / work)

    def tokens_within(self, seconds: float, start: int) -> int:
        """Prompt tokens from position ``start`` that add at most ``seconds`` to a step."""
        if seconds <= 0:
            return 0
        quadratic = self.prefill_scale.value * self.per_token_per_position_s / 2
        linear = self.prefill_scale.value * (self.per_token_s + self.per_token_per_position_s * start)
        if quadratic > 0:
            fit = (-linear + math.sqrt(linear * linear + 4 * quadratic * seconds)) / (2 * quadratic)
        else:
            fit = seconds / linear
        return int(fit)
