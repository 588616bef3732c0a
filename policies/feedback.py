"""Closing the loop: measured interactive latency moves a factor applied to every prediction.

The predictor is a model, and models drift (a slower GPU, longer prompts than the priors, a
Redis hop nobody counted). Rather than trust it, the gateway reports what admitted interactive
requests actually took, as a fraction of their objective. Each full window gives one verdict:
its quantile over 1 tightens (the factor grows, so fewer requests look admissible), under the
headroom relaxes; the factor stays within bounds. The window restarts after each verdict, so
a verdict judges only requests admitted under the current factor and one bad burst cannot
tighten again and again while it ages out. It relaxes by more the further the quantile is under
the headroom (up to the step it tightens by), so after a burst an idle pool opens up again
within a few windows.
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
    _ratios: list[float] = field(default_factory=list)

    def record(self, ratio: float) -> None:
        """``ratio`` is measured latency / objective for one admitted interactive request."""
        self._ratios.append(ratio)
        if len(self._ratios) < self.cfg.samples:
            return
        ordered = sorted(self._ratios)
        self._ratios.clear()
        q = ordered[min(math.ceil(self.cfg.quantile * len(ordered)) - 1, len(ordered) - 1)]
        self.last_quantile = q
        if q > 1.0:
            self.factor = min(self.factor * self.cfg.tighten, self.cfg.max_factor)
        elif q < self.cfg.headroom:
            # The further under, the faster: a factor a burst left high would otherwise hold an
            # idle pool shut for minutes. Never faster than it tightens.
            step = min(max(self.cfg.headroom / q if q > 0 else self.cfg.tighten, self.cfg.relax), self.cfg.tighten)
            self.factor = max(self.factor / step, self.cfg.min_factor)
