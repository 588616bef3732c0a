"""Bursts: does admission keep the requests it admits inside the objective when many arrive at once?

Every ``--every`` seconds, ``--size`` risk-score requests of the risk mix (interactive, not
streamed) are sent at the same instant, ``--bursts`` times, against a fresh stack: the gateway,
the stream engine on the interactive pool and the paged engine on the batch pool, the tiny model
(what ``slogate up`` runs), or sim workers with ``--engine sim``. First ``--warmup`` requests go one
at a time, as a service in use would have seen, so the gateway has learned the pool's costs.

A burst is the hard case for a predictor: every decision in it is made within milliseconds, before
any heartbeat or finished request can show what the burst itself costs (here: the gateway
answering the rest with 429s, and the load generator, on the cores the engine needs). Only the
latency feedback loop sees that, from the admitted requests that came back late.

Reports, per burst: admitted, shed, how many admitted ones were within the objective at the client
and by the gateway's own count (``slogate_objective_requests_total``: from when the gateway read
the request to its answer, so without the load generator's own queueing), their P50 and worst
latency at the client, and the feedback factor after the burst. Run::

    python -m benchmarks.slo_burst [--size 200] [--bursts 8] [--every 3]

Saves benchmarks/results/<name>.md and .json (default ``slo_burst_<engine>``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import redis
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.loadgen import (
    DEFAULT_WORKLOAD,
    Sample,
    Workload,
    load_workload,
    markdown_table,
    one_request,
    percentile,
)
from slogate.local_redis import LocalRedis
from slogate.processes import Stack, http_get

RESULTS = Path(__file__).resolve().parent / "results"
OBJECTIVE_S = 0.150


@dataclass
class BurstResult:
    burst: int
    sent: int
    admitted: int
    shed: int
    errors: int
    within_client: int
    """Admitted requests answered within the objective, timed at the client."""
    within_gateway: int
    """The same by the gateway's own count."""
    p50_ms: float
    max_ms: float
    factor: float
    """The feedback factor after the burst."""


def gateway_counts(url: str) -> tuple[dict[bool, float], float]:
    """``({met: count}, feedback factor)`` from the gateway's metrics."""
    counts = {True: 0.0, False: 0.0}
    factor = float("nan")
    for family in text_string_to_metric_families(http_get(url + "/metrics")[1].decode()):
        for s in family.samples:
            if s.name == "slogate_objective_requests_total" and s.labels.get("class") == "interactive":
                counts[s.labels["met"] == "true"] += s.value
            elif s.name == "slogate_admission_feedback_factor":
                factor = s.value
    return counts, factor


async def bursts(url: str, workload: Workload, size: int, count: int, every: float,
                 warmup: int) -> list[BurstResult]:
    rows = iter(workload)
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(warmup):
            await one_request(session, url, next(rows))
        for k in range(count):
            before, _ = gateway_counts(url)
            batch = [next(rows) for _ in range(size)]
            samples: list[Sample] = await asyncio.gather(*(one_request(session, url, r) for r in batch))
            after, factor = gateway_counts(url)
            ok = [s.latency for s in samples if s.status == 200]
            shed = sum(s.status == 429 for s in samples)
            out.append(BurstResult(k + 1, size, len(ok), shed, size - len(ok) - shed,
                                   sum(t <= OBJECTIVE_S for t in ok), round(after[True] - before[True]),
                                   percentile(ok, 50) * 1000, max(ok, default=float("nan")) * 1000, factor))
            r = out[-1]
            print(f"burst {r.burst}: admitted {r.admitted}, within {OBJECTIVE_S * 1000:.0f} ms: "
                  f"{r.within_client} at the client, {r.within_gateway} by the gateway; factor {r.factor:.2f}",
                  flush=True)
            await asyncio.sleep(every)
    return out


def run(redis_url: str, workload_path: str, engine: str, model: str | None,
        args: argparse.Namespace) -> list[BurstResult]:
    redis.Redis.from_url(redis_url).flushdb()
    stack = Stack(redis_url, {"SLOGATE_LOG_LEVEL": "WARNING", **({"SLOGATE_MODEL": model} if model else {})})
    try:
        stack.gateway()
        if engine == "sim":
            stack.worker("interactive", "sim")
        else:
            stack.worker("interactive", "stream")
            stack.worker("batch", "paged")
        name = "slogate-sim" if engine == "sim" else Path(model or "tiny").name
        stack.wait_models(name, timeout=300)
        workload = load_workload(workload_path, name).only(
            lambda r: r.get("class_hint") == "interactive" and not r["body"].get("stream"))
        return uvloop.run(bursts(stack.url, workload, args.size, args.bursts, args.every, args.warmup))
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=200, help="requests per burst")
    parser.add_argument("--bursts", type=int, default=8)
    parser.add_argument("--every", type=float, default=3.0, help="seconds between the end of one burst and the next")
    parser.add_argument("--warmup", type=int, default=20, help="requests sent one at a time first")
    parser.add_argument("--engine", choices=["real", "sim"], default="real")
    parser.add_argument("--model", help="model directory (default: build the tiny model)")
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    parser.add_argument("--name", help="results file stem (default slo_burst_<engine>)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.engine == "real" and model is None:
            model = subprocess.run([sys.executable, "-m", "slogate.cli", "tiny-model", f"{tmp}/tiny"],
                                   check=True, capture_output=True, text=True).stdout.strip()
        server = LocalRedis(Path(tmp)).start()
        try:
            results = run(server.url, args.workload, args.engine, model, args)
        finally:
            server.stop()

    table = markdown_table(
        ["burst", "sent", "admitted", "shed", "errors", "within 150 ms at the client", "within 150 ms by the gateway",
         "admitted P50 ms", "admitted max ms", "feedback factor after"],
        [[r.burst, r.sent, r.admitted, r.shed, r.errors, r.within_client, r.within_gateway, r.p50_ms, r.max_ms,
          f"{r.factor:.2f}"] for r in results])
    admitted = sum(r.admitted for r in results)
    header = (f"# Bursts ({args.engine} engines)\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
              f"{args.bursts} bursts of {args.size} risk-score requests of the risk mix (interactive, not "
              f"streamed) sent at once, {args.every:g} s apart, after {args.warmup} sent one at a time; a fresh "
              f"stack; the load generator on the same host. Objective {OBJECTIVE_S * 1000:.0f} ms end to end. "
              f"In all, {sum(r.within_gateway for r in results)} of {admitted} admitted requests were within it "
              f"by the gateway's count, {sum(r.within_client for r in results)} at the client.\n\n")
    RESULTS.mkdir(exist_ok=True)
    name = args.name or f"slo_burst_{args.engine}"
    (RESULTS / f"{name}.md").write_text(header + table + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(header + table)


if __name__ == "__main__":
    main()
