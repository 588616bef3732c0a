"""The line of batch requests a gateway holds back before queueing them (``gateway.admit``).

They all wait for the same thing, the interactive load on the pools they would share to fall,
so they go in the order they came: only the oldest asks the admission controller again, and
when it goes the next one asks at once; a batch request that comes while the line is not empty,
for a pool the line waits for, joins its end (``behind-held``) rather than going. Asking each on
its own timer, or letting newcomers go, let a request that came later go first whenever the load
dipped between the older ones' looks. Those behind the first look again on their own timer all
the same, as ones behind it: only to go to a pool the line does not wait for, once their route
leads there (where batch has such a pool).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

PACE_OVER = 8
"""Departures the line's pace is measured over."""


class HoldLine:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._line: deque[asyncio.Event] = deque()
        self._clock = clock
        self._left: deque[float] = deque(maxlen=PACE_OVER)
        """When the last few held requests left the line, however they left."""
        self._moved_at = 0.0
        """When a place last freed, or the line last started from empty."""

    def __len__(self) -> int:
        return len(self._line)

    def join(self) -> asyncio.Event:
        """A place at the end of the line: its event is set when it is a held request's turn to
        ask again, or when the gateway starts draining."""
        turn = asyncio.Event()
        if not self._line:  # a new spell of holding: how the last one moved says nothing of it
            self._moved_at = self._clock()
            self._left.clear()
        self._line.append(turn)
        return turn

    def first(self, turn: asyncio.Event) -> bool:
        return bool(self._line) and self._line[0] is turn

    def leave(self, turn: asyncio.Event) -> None:
        was_first = self.first(turn)
        self._line.remove(turn)
        self._moved_at = self._clock()
        self._left.append(self._moved_at)
        if was_first and self._line:
            self._line[0].set()

    def wake_first(self) -> None:
        """Have the first ask again now: one that came later joined behind it."""
        if self._line:
            self._line[0].set()

    def wake_all(self) -> None:
        for turn in self._line:
            turn.set()

    def place_frees_in(self, floor: float) -> float:
        """About how long until a full line has a place: it moves at the pace its last few
        places freed, and has not moved for as long as it has not; never less than ``floor``.
        A full line told every refused request to come back in ``floor`` (a second), and a line
        held for a minute by interactive load refused each of them again sixty times."""
        now = self._clock()
        left = self._left
        pace = (left[-1] - left[0]) / (len(left) - 1) if len(left) >= 2 else 0.0
        return max(floor, pace, now - self._moved_at)
