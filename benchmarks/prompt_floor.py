"""The time to first token an engine would give if it ran nothing but the prompts.

Why: the stream engine's TTFT target compares 16 streams with one, and on CPU a prompt token
costs about what a decode row does, so at 16 streams the newcomers' prompts are a large share
of all the work and queue behind one another whatever the scheduler does with the streams.
Serving the same arrivals with prompts alone (no decode, no serving path, each pass taking
every prompt waiting, in arrival order) at this host's timed pass lengths shows how much of a
measured TTFT tail is that queue, which no choice of what to decode when removes.

A client's first token is the first that shows text, and a request whose first sampled token
is a byte of a character needs another pass of the whole model for each token until it shows
(on the ~100M model about one request in twelve, and those made the P99), so the floor runs
those passes too, one token each right after the request's prompt pass, as the stream engine
does. Left out, the ~100M model's floor at 16 streams on an AMX host was 1.5-1.7x the
one-stream median; with them it was 2.04x, and the stream engine's P99 sat on it (94.8
against 94.6 ms).

The passes are timed, not taken from the engine's cost model: its straight line (a fixed cost
from a one-token pass plus a cost per token) overprices short passes, since on CPU a pass of up
to 8-16 tokens costs little more than reading the weights once.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class PassTimes:
    """Seconds a pass of a prompt of ``tokens[i]`` tokens took (the fastest of a few), and
    between and beyond them the straight line through the nearest two."""

    tokens: list[int]
    seconds: list[float]

    def __call__(self, n: int) -> float:
        i = min(max(bisect.bisect_left(self.tokens, n), 1), len(self.tokens) - 1)
        (a, b), (sa, sb) = self.tokens[i - 1:i + 1], self.seconds[i - 1:i + 1]
        return max(sa + (sb - sa) * (n - a) / (b - a), 0.0)


def time_passes(time_pass: Callable[[int], float], sizes: list[int], sweeps: int = 7,
                before: PassTimes | None = None) -> PassTimes:
    """Time a pass of each size once a sweep and keep each size's fastest, of these sweeps and
    of ``before`` (the same sizes timed earlier): a floor must not carry a busy host's stalls,
    and sweeps spread each size's tries over the whole timing, so a stretch of noise cannot hold
    all of one size's. Timed again after a run, the floor no longer rests on one minute of a
    host whose speed drifts: once, on passes timed during a slow one, it came out over the
    engine's own TTFT."""
    if before is not None and before.tokens != sizes:
        raise ValueError(f"earlier timings are of sizes {before.tokens}, not {sizes}")
    best = list(before.seconds) if before is not None else [float("inf")] * len(sizes)
    for _ in range(sweeps):
        best = [min(b, time_pass(n)) for b, n in zip(best, sizes)]
    return PassTimes(sizes, best)


def prompts_alone(arrivals: list[tuple[float, int, int]], pass_s: Callable[[int], float],
                  pass_tokens: int = 512) -> list[float]:
    """Seconds from each arrival ``(time, prompt tokens, tokens to text)`` to the end of the pass
    that gave it its first text, in the order given. A pass takes every prompt that arrived
    before it began, in arrival order, up to ``pass_tokens`` tokens (always at least one
    prompt), and lasts ``pass_s`` of its tokens; then those of its requests that need more
    than one token to show text go on in passes of one token each (``pass_s`` of their number)
    until each has its text."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    ttft = [0.0] * len(arrivals)
    free_at = float("-inf")
    k = 0
    while k < len(order):
        begin = max(free_at, arrivals[order[k]][0])
        taken, tokens = [], 0
        while k < len(order) and arrivals[order[k]][0] <= begin:
            n = arrivals[order[k]][1]
            if taken and tokens + n > pass_tokens:
                break
            taken.append(order[k])
            tokens += n
            k += 1
        free_at = begin + pass_s(tokens)
        sampled = 1
        while taken:
            for i in taken:
                ttft[i] = free_at - arrivals[i][0]
            sampled += 1
            taken = [i for i in taken if arrivals[i][2] >= sampled]
            if taken:
                free_at += pass_s(len(taken))
    return ttft
