"""Load generation shared by the benchmarks: closed-loop (N clients back to back) and
open-loop (Poisson arrivals at a fixed rate, which is what exposes queueing: a closed loop
slows down with the server and hides it).

Each request records its status, latency and (for streams) time to first token, measured at
the client, so figures include everything a user would see.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORKLOAD = ROOT.parent / "shared" / "workloads" / "risk-mix.jsonl"


@dataclass
class Sample:
    cls: str
    status: int
    latency: float
    ttft: float | None = None
    started: float = 0.0
    retry_after: float | None = None
    streamed: bool = False
    reason: str | None = None
    """``x-slogate-reason`` of an answer that was not a 200 (why it was shed)."""


@dataclass
class Workload:
    rows: list[dict[str, Any]]
    model: str
    _next: int = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            row = self.rows[self._next % len(self.rows)]
            self._next += 1
            yield row

    def only(self, predicate) -> "Workload":
        return Workload([r for r in self.rows if predicate(r)], self.model)


def load_workload(path: Path | str = DEFAULT_WORKLOAD, model: str = "slogate-sim") -> Workload:
    path = Path(path)
    if not path.exists():
        raise SystemExit(f"workload {path} not found; pass --workload PATH/risk-mix.jsonl")
    rows = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        row["body"] = {**row["body"], "model": model}
        rows.append(row)
    return Workload(rows, model)


async def one_request(session: aiohttp.ClientSession, url: str, row: dict[str, Any],
                      headers: dict[str, str] | None = None) -> Sample:
    start = time.perf_counter()
    body = row["body"]
    ttft = None
    retry_after = reason = None
    try:
        async with session.post(url + row.get("endpoint", "/v1/chat/completions"), json=body,
                                headers=headers) as resp:
            status = resp.status
            if status == 429 and "Retry-After" in resp.headers:
                retry_after = float(resp.headers["Retry-After"])
            if status != 200:
                reason = resp.headers.get("x-slogate-reason")
            if body.get("stream") and status == 200:
                async for line in resp.content:
                    if ttft is None and b'"content":"' in line and b'"content":""' not in line:
                        ttft = time.perf_counter() - start
                    if b"error" in line and line.startswith(b'data: {"error"'):
                        status = 599
            else:
                await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        status = 0
    latency = time.perf_counter() - start
    return Sample(row.get("class_hint", "interactive"), status, latency, ttft, start, retry_after,
                  bool(body.get("stream")), reason)


async def closed_loop(url: str, workload: Workload, concurrency: int, duration: float,
                      think: Callable[[], float] | None = None) -> list[Sample]:
    """``concurrency`` clients, each sending its next request ``think()`` seconds (default 0)
    after its last answer, whatever the answer was."""
    samples: list[Sample] = []
    rows = iter(workload)
    end = time.perf_counter() + duration
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def client() -> None:
            while time.perf_counter() < end:
                samples.append(await one_request(s, url, next(rows)))
                if think is not None:
                    await asyncio.sleep(think())

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples


async def poisson_arrivals(rate: float, duration: float, seed: int,
                           fire: Callable[[], Awaitable[None]]) -> None:
    """Start ``fire()`` at Poisson arrival times for ``duration`` s, whatever the server does,
    then wait for every started request to end."""
    rng = random.Random(seed)
    tasks: set[asyncio.Task[None]] = set()
    start = time.perf_counter()
    next_at = start
    while next_at < start + duration:
        next_at += rng.expovariate(rate)
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(fire())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


async def open_loop(url: str, workload: Workload, rate: float, duration: float, seed: int = 0,
                    max_open: int = 4096, headers: dict[str, str] | None = None) -> list[Sample]:
    rows = iter(workload)
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=max_open)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def fire() -> None:
            samples.append(await one_request(s, url, next(rows), headers))

        await poisson_arrivals(rate, duration, seed, fire)
    return samples


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[k]


def quantile_interval(values: list[float], q: float, confidence: float = 0.95) -> tuple[float, float]:
    """Where the true ``q``-th percentile lies with at least ``confidence``, from the order
    statistics alone: of n independent requests, how many fall below it is binomial (n,
    q/100), whatever the latency distribution. A P99 of 200 requests has no upper bound at
    95% (the largest of 200 lies above the true P99 only 87% of the time): ``inf``. Requests
    of one closed loop share the host's slow moments, so the real interval is wider."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    ordered = sorted(values)
    cdf = _binomial_cdf(n, q / 100)
    alpha = (1 - confidence) / 2
    # the rank-l value lies at or below the quantile when at least l requests do
    low_rank = max((rank for rank in range(1, n + 1) if cdf[rank - 1] <= alpha), default=0)
    high_rank = next((rank for rank in range(1, n + 1) if cdf[rank - 1] >= 1 - alpha), n + 1)
    return (ordered[low_rank - 1] if low_rank else float("-inf"),
            ordered[high_rank - 1] if high_rank <= n else float("inf"))


def ratio_interval(top: list[float], q_top: float, bottom: list[float], q_bottom: float,
                   confidence: float = 0.95) -> tuple[float, float]:
    """Where the ratio of two groups' true percentiles lies with at least ``confidence``
    (each percentile's interval at half the risk)."""
    half = 1 - (1 - confidence) / 2
    top_low, top_high = quantile_interval(top, q_top, half)
    bottom_low, bottom_high = quantile_interval(bottom, q_bottom, half)
    return top_low / bottom_high, (top_high / bottom_low if bottom_low > 0 else float("inf"))


def _binomial_cdf(n: int, p: float) -> list[float]:
    """P(X <= k) for k = 0..n, X binomial (n, p), through logs so that n in the thousands
    does not overflow."""
    if p <= 0 or p >= 1:
        return [float(p <= 0 or k == n) for k in range(n + 1)]
    log_p, log_q, log_n = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    total, out = 0.0, []
    for k in range(n + 1):
        total += math.exp(log_n - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p + (n - k) * log_q)
        out.append(min(total, 1.0))
    return out


@dataclass
class Summary:
    sent: int
    ok: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: dict[int, int] = field(default_factory=dict)


def summarize(samples: list[Sample], duration: float) -> Summary:
    ok = [s.latency for s in samples if s.status == 200]
    errors: dict[int, int] = {}
    for s in samples:
        if s.status != 200:
            errors[s.status] = errors.get(s.status, 0) + 1
    return Summary(len(samples), len(ok), len(ok) / duration, percentile(ok, 50) * 1000,
                   percentile(ok, 99) * 1000, errors)


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row) + " |")
    return "\n".join(lines)
