"""A circuit breaker per pool, so a broken pool fails fast (503) instead of eating deadlines.

Closed: everything passes; N failures in a row, or a failure rate over a window of outcomes,
opens it. Open: nothing passes until a cool-down ends. Half-open: a few probes pass; enough
successes close it, any failure opens it again. Time is passed in, so tests drive the clock.

Outcomes are reported once per request, but a half-open breaker counts its probes in engine
requests: a request of ``n`` choices sends ``n`` to the pool (:mod:`gateway.choices`), and the
point of probing is to send a pool that may still be failing only ``half_open_probes`` of them.
So it passes only while that many are free, and is refused as while the breaker is open
otherwise, except that a request of more choices than there are probes may probe alone, with
none out: else a pool that hears only such requests (a client that always asks for several
samples) would stay half-open, refusing them all, for as long as it heard no other. One
answered is ``n`` successful probes.

A probe is known by the ticket ``acquire`` gives it, which its answer brings back: requests let
through before the breaker last opened may still answer while probes are out, and taken for
them they closed it with no probe answered. A probe given up (no answer in ``open_s``) keeps
its ticket but not its slot, which went to the next probe: its late answer frees no slot, or
it would free that probe's as well. It is still evidence of the pool since the breaker opened,
and counts as such: a late success is a successful probe toward closing (the breaker judges
whether the pool answers, not how fast: slowness is the feedback loop's business, and a missed
deadline is no failure here), and a late failure opens the breaker again, as any failure while
half-open does. Once the breaker opened again, a ticket from before counts for nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from policies.config import Circuit

State = Literal["closed", "open", "half_open"]


@dataclass
class CircuitBreaker:
    cfg: Circuit
    opened_at: float | None = None
    consecutive: int = 0
    probes_in_flight: int = 0
    spell: int = 0
    """How many times it dropped its probes (it opened, or gave them up): a probe's ticket,
    which holds a slot while it is the latest."""
    opened_spell: int = 0
    """``spell`` when it last opened: a ticket older than that is from before it opened."""
    probe_successes: int = 0
    last_probe_at: float = 0.0
    outcomes: deque[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.outcomes = deque(maxlen=self.cfg.window)

    def state(self, now: float) -> State:
        if self.opened_at is None:
            return "closed"
        return "open" if now < self.opened_at + self.cfg.open_s else "half_open"

    def ready(self, now: float, n: int = 1) -> bool:
        """Whether a request of ``n`` engine requests may go now. Does not take probe slots: call
        ``acquire`` for the request actually sent."""
        state = self.state(now)
        if state == "closed":
            return True
        if state == "open":
            return False
        if self.probes_in_flight and now >= self.last_probe_at + self.cfg.open_s:
            # A probe whose outcome never came back (cancelled, lost) must not wedge the pool.
            self.probes_in_flight = 0
            self.spell += 1
        return self.probes_in_flight + n <= self.cfg.half_open_probes or not self.probes_in_flight

    def acquire(self, now: float, n: int = 1) -> int | None:
        """Take ``n`` probe slots when half-open. Returns the probe's ticket for
        ``record_success``; None when the request is no probe (the breaker is closed)."""
        if self.state(now) != "half_open":
            return None
        self.probes_in_flight += n
        self.last_probe_at = now
        return self.spell

    def retry_after(self, now: float, n: int = 1) -> float:
        """Seconds until the breaker may let something through again: the cool-down's end when
        open; when half-open with its probes out, the moment a probe that never reports is given
        up (the probe may end sooner, but a batch probe can run for minutes)."""
        if self.opened_at is None:
            return 0.0
        if self.state(now) == "half_open" and not self.ready(now, n):
            return max(self.last_probe_at + self.cfg.open_s - now, 0.0)
        return max(self.opened_at + self.cfg.open_s - now, 0.0)

    def record_success(self, now: float, n: int = 1, probe: int | None = None) -> None:
        """A request of ``n`` engine requests answered; ``probe``: the ticket ``acquire`` gave it."""
        state = self.state(now)
        if state == "open":
            return
        if state == "half_open":
            if probe is None or probe < self.opened_spell:  # no probe since it last opened
                return
            if probe == self.spell:  # not given up: its slot is still taken
                self.probes_in_flight -= min(n, self.probes_in_flight)
            self.probe_successes += n
            if self.probe_successes >= self.cfg.close_after:
                self._close()
            return
        self.consecutive = 0
        self.outcomes.append(True)

    def record_failure(self, now: float) -> None:
        state = self.state(now)
        if state == "half_open":
            self._open(now)
            return
        if state == "open":
            return
        self.consecutive += 1
        self.outcomes.append(False)
        failures = len(self.outcomes) - sum(self.outcomes)
        if self.consecutive >= self.cfg.consecutive_failures or (
            len(self.outcomes) >= self.cfg.min_calls
            and failures >= self.cfg.failure_rate * len(self.outcomes)
        ):
            self._open(now)

    def _open(self, now: float) -> None:
        self.opened_at = now
        self.spell += 1
        self.opened_spell = self.spell
        self.probes_in_flight = 0
        self.probe_successes = 0

    def _close(self) -> None:
        self.opened_at = None
        self.consecutive = 0
        self.probes_in_flight = 0
        self.probe_successes = 0
        self.outcomes.clear()
