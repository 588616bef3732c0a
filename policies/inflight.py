"""This gateway's own requests in flight, per pool, each with the time its slot should free.

A pool's slots free when the requests holding them end, and how soon that is depends on which
requests those are: sixteen slots held by 100-token streams free about one every 50 ms, sixteen
held by 8-token scores one every few ms. A mean service time cannot tell the two apart and
mispredicts the wait by that factor whenever the mix in flight differs from the mix on average
(under overload it always does: what got in is what had the most patience). So the gateway
keeps, for each request it sent, when admission predicted its slot would free, and the
predictor reads the earliest of those.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass
class InFlight:
    _ends: dict[str, dict[int, float]] = field(default_factory=dict)
    _handles: itertools.count = field(default_factory=itertools.count)

    def start(self, pool: str, busy_until: float) -> int:
        """Count a request sent to ``pool``; ``busy_until`` is when its slot should free. The
        handle goes back to :meth:`end` when the request is over, however it ended."""
        handle = next(self._handles)
        self._ends.setdefault(pool, {})[handle] = busy_until
        return handle

    def end(self, pool: str, handle: int) -> None:
        del self._ends[pool][handle]

    def count(self, pool: str) -> int:
        return len(self._ends.get(pool, ()))

    def ends(self, pool: str) -> Collection[float]:
        return self._ends.get(pool, {}).values()
