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
has room for it. Costs are learned from requests that ran while prompts kept arriving, so the
learned decode cost already includes a slowdown: the share of the workers' time it gives to
prompts, beyond the decode step the workers measure. Prompts up to that share are priced in;
only those beyond it (a burst, or a rate the costs have not caught up with) use up slack.
Without that credit every prompt would be counted twice, and steady load would be shed for a
slowdown already priced in. The credit never runs ahead of the prompts actually booked.

Each gateway books the prompts it admits; other gateways' reach it only through learned costs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class PromptBook:
    done_at: float = 0.0
    """When the prompts booked so far should all be prefilled."""
    booked_s: float = 0.0
    """Prefill seconds booked since the book opened; never decreases."""
    expected_s: float = 0.0
    """Prefill seconds the learned costs already allow for since the book opened: the priced
    share of the workers' time, integrated over time."""
    _last: float = 0.0
    _prune_at: int = 64
    _promises: list[tuple[float, float]] = field(default_factory=list)
    """Min-heap of promises as ``(slack + excess then, until - excess then)``, where excess is
    ``booked_s - expected_s``: a promise has room for ``slack - excess since``, and holds until
    ``until + excess since``, since every prompt it made room for delays its request's end."""

    def _advance(self, now: float, priced_share: float) -> None:
        if now > self._last:
            self.expected_s = min(self.expected_s + priced_share * (now - self._last), self.booked_s)
            self._last = now

    def ahead(self, now: float) -> float:
        """How long a prompt admitted now waits for the prompts booked before it."""
        return max(self.done_at - now, 0.0)

    def book(self, share_s: float, now: float, priced_share: float = 0.0) -> None:
        self._advance(now, priced_share)
        self.done_at = max(self.done_at, now) + share_s
        self.booked_s += share_s

    def _excess(self) -> float:
        return self.booked_s - self.expected_s

    def promise(self, slack_s: float, until: float, now: float) -> None:
        """An admitted request can bear ``slack_s`` more seconds of other prompts; it should be
        done at ``until``, later by whatever other prompts it bears."""
        excess = self._excess()
        heap = self._promises
        heapq.heappush(heap, (max(slack_s, 0.0) + excess, until - excess))
        if len(heap) >= self._prune_at:
            # Ended promises leave only from the top; a roomy one under a stream of tight ones
            # would stay for ever.
            heap[:] = [p for p in heap if p[1] + excess > now]
            heapq.heapify(heap)
            self._prune_at = max(64, 2 * len(heap))

    def room(self, now: float, priced_share: float = 0.0) -> tuple[float, float]:
        """``(seconds of prefill that may still be booked, when the tightest promise ends)``;
        ``(inf, now)`` when no promise is live. ``priced_share``: the share of the workers' time
        that the costs behind predictions already give to prompts (``Prediction.priced_share``)."""
        self._advance(now, priced_share)
        excess = self._excess()
        heap = self._promises
        while heap and heap[0][1] + excess <= now:
            heapq.heappop(heap)
        if not heap:
            return float("inf"), now
        key, until = heap[0]
        return key - excess, until + excess
