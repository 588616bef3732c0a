"""The prompts admitted to a pool, and what they cost the requests around them.

On one engine, prompt passes and decode steps share the same device time. So a prompt admitted
now delays two kinds of request by its prefill time (spread over the pool's workers): those
admitted after it, whose own prompts wait behind it, and those already running, whose
remaining steps wait while it is prefilled (whole, or in chunks: the total is the same). The
slot count sees neither, and under a burst of arrivals that find free slots it admits them all;
their prompts then go through together and every request in the burst is late.

The book answers both. ``done_at`` is when the prompts booked so far should be prefilled,
drained in real time: the wait of the next prompt. Each admitted interactive request leaves a
promise: the slack its prediction had within the budget, until the request should be done (its
first token when streamed, its last otherwise). A prompt is booked only if every live promise
has room for it. Costs are learned from requests that ran while prompts kept arriving, so they
already include the slowdown of prompts arriving at the recent rate; only prompts beyond that
rate (a burst) use up slack. Without that credit every prompt would be counted twice, and
steady load would be shed for a slowdown already priced in.

Each gateway books the prompts it admits; other gateways' reach it only through learned costs.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

RATE_WINDOW_S = 1.0
"""The recent booking rate is an exponential average over about this long: near the time a
request's slowdown takes to show in the learned costs (its own run plus a few dozen samples)."""


@dataclass
class PromptBook:
    done_at: float = 0.0
    """When the prompts booked so far should all be prefilled."""
    booked_s: float = 0.0
    """Prefill seconds booked since the book opened; never decreases."""
    expected_s: float = 0.0
    """Prefill seconds the learned costs already allow for since the book opened: the recent
    booking rate, integrated. Costs learned while prompts kept arriving at a rate include the
    slowdown that rate causes; only prompts beyond it use up a promise's slack."""
    _rate_acc: float = 0.0
    _last: float = 0.0
    _promises: list[tuple[float, float]] = field(default_factory=list)
    """Min-heap of ``(slack at admission + booked_s - expected_s then, until)``: a promise
    has room left for ``key - (booked_s - expected_s)`` seconds of prefill."""

    def _advance(self, now: float) -> None:
        dt = now - self._last
        if dt <= 0:
            return
        rate = self._rate_acc / RATE_WINDOW_S
        self.expected_s += rate * dt
        self._rate_acc *= math.exp(-dt / RATE_WINDOW_S)
        self._last = now

    def ahead(self, now: float) -> float:
        """How long a prompt admitted now waits for the prompts booked before it."""
        return max(self.done_at - now, 0.0)

    def book(self, share_s: float, now: float) -> None:
        self._advance(now)
        self.done_at = max(self.done_at, now) + share_s
        self.booked_s += share_s
        self._rate_acc += share_s

    def promise(self, slack_s: float, until: float) -> None:
        """An admitted request can bear ``slack_s`` more seconds of other prompts until ``until``."""
        heapq.heappush(self._promises, (max(slack_s, 0.0) + self.booked_s - self.expected_s, until))

    def room(self, now: float) -> tuple[float, float]:
        """``(seconds of prefill that may still be booked, when the tightest promise ends)``;
        ``(inf, now)`` when no promise is live."""
        self._advance(now)
        heap = self._promises
        while heap and heap[0][1] <= now:
            heapq.heappop(heap)
        if not heap:
            return float("inf"), now
        key, until = heap[0]
        return key - (self.booked_s - self.expected_s), until
