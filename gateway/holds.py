"""The line of batch requests a gateway holds back before queueing them (``gateway.admit``).

They all wait for the same thing, the interactive load on the pools they would share to fall,
so they go in the order they came: only the oldest asks the admission controller again, and
when it goes the next one asks at once; a batch request that comes while the line is not empty,
for a pool the line waits for, joins its end (``behind-held``) rather than going. Asking each on
its own timer, or letting newcomers go, let a request that came later go first whenever the load
dipped between the older ones' looks.
"""

from __future__ import annotations

import asyncio
from collections import deque


class HoldLine:
    def __init__(self) -> None:
        self._line: deque[asyncio.Event] = deque()

    def __len__(self) -> int:
        return len(self._line)

    def join(self) -> asyncio.Event:
        """A place at the end of the line: its event is set when it is a held request's turn to
        ask again, or when the gateway starts draining."""
        turn = asyncio.Event()
        self._line.append(turn)
        return turn

    def first(self, turn: asyncio.Event) -> bool:
        return bool(self._line) and self._line[0] is turn

    def leave(self, turn: asyncio.Event) -> None:
        was_first = self.first(turn)
        self._line.remove(turn)
        if was_first and self._line:
            self._line[0].set()

    def wake_first(self) -> None:
        """Have the first ask again now: one that came later joined behind it."""
        if self._line:
            self._line[0].set()

    def wake_all(self) -> None:
        for turn in self._line:
            turn.set()
