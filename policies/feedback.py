"""Closing the loop: measured interactive latency moves a factor applied to every prediction.

The predictor is a model, and models drift (a slower GPU, longer prompts than the priors, a
Redis hop nobody counted, a host whose cores a burst of arrivals takes). Rather than trust it,
the gateway reports what admitted interactive requests actually took, as a fraction of their
objective. Each window gives one verdict: its quantile over 1 tightens (the factor grows, so
fewer requests look admissible), under the headroom relaxes; the factor stays within bounds.

A window that tightens does not wait to be full: once more requests in it were late than its
quantile allows (3 of 200 for a P99), no later sample can bring its quantile back under 1, so
the verdict is given at once. A burst that makes the requests it admitted late is answered
within a few of them instead of after 200, which at the dozen a burst admits was never. Relaxing
still takes a full window: only all of it shows the headroom.

A verdict judges only requests admitted under the current factor: each admitted request
carries the number of verdicts given when it was admitted (``epoch``), and answers from an
earlier epoch are left out, so one bad burst tightens once, not again and again while its
requests finish. A count, not a time: a clock stepped back would leave every answer looking
admitted before the last verdict. It relaxes by more the further the quantile is under the headroom (up to the
step it tightens by), so after a burst an idle pool opens up again within a few windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from policies.config import Feedback


@dataclass
class LatencyFeedback:
    cfg: Feedback
    factor: float = 1.0
    last_quantile: float | None = None
    """The last verdict's window quantile; for a window cut short, the least it can be."""
    epoch: int = 0
    """Verdicts given so far."""
    _ratios: list[float] = field(default_factory=list)
    _late: list[float] = field(default_factory=list)

    def record(self, ratio: float, epoch: int) -> None:
        """``ratio`` is measured latency / objective for one interactive request admitted when
        :attr:`epoch` was ``epoch``."""
        if epoch != self.epoch:
            return
        self._ratios.append(ratio)
        if ratio > 1.0:
            self._late.append(ratio)
            if len(self._late) > self._may_be_late():
                self._verdict(min(self._late))
                return
        if len(self._ratios) < self.cfg.samples:
            return
        ordered = sorted(self._ratios)
        self._verdict(ordered[self._quantile_index()])

    def _quantile_index(self) -> int:
        return min(math.ceil(self.cfg.quantile * self.cfg.samples) - 1, self.cfg.samples - 1)

    def _may_be_late(self) -> int:
        """How many of a full window may be over the objective with its quantile still within."""
        return self.cfg.samples - 1 - self._quantile_index()

    def _verdict(self, q: float) -> None:
        self._ratios.clear()
        self._late.clear()
        self.epoch += 1
        self.last_quantile = q
        if q > 1.0:
            self.factor = min(self.factor * self.cfg.tighten, self.cfg.max_factor)
        elif q < self.cfg.headroom:
            # The further under, the faster: a factor a burst left high would otherwise hold an
            # idle pool shut for minutes. Never faster than it tightens.
            step = min(max(self.cfg.headroom / q if q > 0 else self.cfg.tighten, self.cfg.relax), self.cfg.tighten)
            self.factor = max(self.factor / step, self.cfg.min_factor)
