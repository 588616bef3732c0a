"""Clients that retry at once: do the requests admitted under a retry flood keep their objective?

Each client sends a risk-score request of the risk mix (interactive, not streamed) and sends the
next 0-50 ms after the answer, a 429 included: it ignores Retry-After, as locust's ``RiskScorer``
does. Past a few dozen clients nearly every request is a shed that comes straight back, and
bursts of them find the pool's slots free. The stack is what ``slogate up --engine sim`` runs: a gateway and one
sim worker with the sim's default timing (64 slots, 0.05 ms a prompt token, so a 184-token score
prompt adds 9 ms to the step it joins); with ``--engine stream``, the stream engine on the tiny
model, as ``slogate up`` serves the interactive pool. Each client count runs against a fresh
stack, cold.

With ``--after N``, once the flood is over the same stack gets N requests one at a time, 0.5 s
apart: does an idle stack serve again? The flood leaves an engine's costs as the contention
made them (on a 2-core host the clients and the 429s take the cores the engine needs), and
admission judges by them until requests it lets through teach it otherwise.

    python -m benchmarks.retry_flood [--clients 10,25,50] [--duration 30] [--window 5] [--engine stream --after 40]

Reports, for the admitted requests, P50/P99 and the share answered within the 150 ms objective,
over the whole run and per window (the first window holds the cold start: nothing learned yet),
and the paced requests after it. Saves benchmarks/results/retry_flood.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import redis
import uvloop

from benchmarks.loadgen import (
    DEFAULT_WORKLOAD,
    Sample,
    Workload,
    closed_loop,
    load_workload,
    markdown_table,
    one_request,
    percentile,
)
from engines.runtime.tiny_model import build_tiny_model
from slogate.local_redis import LocalRedis
from slogate.processes import Stack

RESULTS = Path(__file__).resolve().parent / "results"
OBJECTIVE_S = 0.150
MAX_GAP_S = 0.050
PACED_GAP_S = 0.5


@dataclass
class FloodResult:
    clients: int
    sent_rps: float
    admitted_rps: float
    shed_rps: float
    errors: int
    p50_ms: float
    p99_ms: float
    within_objective: float
    """Of the admitted requests, the share answered within the objective."""
    goodput_rps: float
    windows: list[float]
    """``within_objective`` per window of ``--window`` seconds, by when the request was sent."""
    shed_reasons: dict[str, int]
    """Sheds by ``x-slogate-reason``."""
    after: list[str]
    """The paced requests after the flood, in order: "admitted", or why it was not (its
    ``x-slogate-reason``, else its status)."""


def run_clients(redis_url: str, workload_path: str, clients: int, duration: float, seed: int,
                model_dir: Path | None, after: int) -> tuple[list[Sample], list[Sample]]:
    """The flood's samples, then the paced ones'."""
    redis.Redis.from_url(redis_url).flushdb()
    env = {"SLOGATE_LOG_LEVEL": "WARNING"} | ({"SLOGATE_MODEL": str(model_dir)} if model_dir else {})
    stack = Stack(redis_url, env)
    try:
        stack.gateway()
        stack.worker("interactive", "stream" if model_dir else "sim")
        model = model_dir.name if model_dir else "slogate-sim"
        stack.wait_models(model, timeout=300)
        workload = load_workload(workload_path, model).only(
            lambda r: r.get("class_hint") == "interactive" and not r["body"].get("stream"))
        rng = random.Random(seed)
        flood = uvloop.run(closed_loop(stack.url, workload, clients, duration, lambda: rng.uniform(0, MAX_GAP_S)))
        return flood, uvloop.run(paced(stack.url, workload, after))
    finally:
        stack.stop()


async def paced(url: str, workload: Workload, count: int) -> list[Sample]:
    rows = iter(workload)
    samples = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for _ in range(count):
            samples.append(await one_request(s, url, next(rows)))
            await asyncio.sleep(PACED_GAP_S)
    return samples


def within(samples: list[Sample]) -> float:
    return sum(s.latency <= OBJECTIVE_S for s in samples) / len(samples) if samples else float("nan")


def summarize(clients: int, samples: list[Sample], duration: float, window: float, after: list[Sample]) -> FloodResult:
    admitted = [s for s in samples if s.status == 200]
    shed = sum(s.status == 429 for s in samples)
    first = min((s.started for s in samples), default=0.0)
    windows = [within([s for s in admitted if k * window <= s.started - first < (k + 1) * window])
               for k in range(int(duration // window))]
    lat = [s.latency for s in admitted]
    reasons: dict[str, int] = {}
    for s in samples:
        if s.status == 429:
            reasons[s.reason or "?"] = reasons.get(s.reason or "?", 0) + 1
    return FloodResult(clients, len(samples) / duration, len(admitted) / duration, shed / duration,
                       len(samples) - len(admitted) - shed, percentile(lat, 50) * 1000, percentile(lat, 99) * 1000,
                       within(admitted), sum(s.latency <= OBJECTIVE_S for s in admitted) / duration, windows,
                       reasons, ["admitted" if s.status == 200 else s.reason or str(s.status) for s in after])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="10,25,50")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=["sim", "stream"], default="sim",
                        help="the interactive pool's engine: stream runs the tiny model, built here")
    parser.add_argument("--after", type=int, default=0, help="paced requests once the flood is over")
    parser.add_argument("--name", default="retry_flood", help="results file stem")
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny") if args.engine == "stream" else None
        server = LocalRedis(Path(tmp)).start()
        try:
            for clients in (int(c) for c in args.clients.split(",")):
                flood, after = run_clients(server.url, args.workload, clients, args.duration, args.seed, model_dir,
                                           args.after)
                r = summarize(clients, flood, args.duration, args.window, after)
                results.append(r)
                print(f"{clients} clients: admitted {r.admitted_rps:.0f}/s, {r.within_objective:.1%} within "
                      f"{OBJECTIVE_S * 1000:.0f} ms, P99 {r.p99_ms:.0f} ms; after: "
                      f"{r.after.count('admitted')} of {len(r.after)} admitted", flush=True)
        finally:
            server.stop()

    table = markdown_table(
        ["clients", "sent/s", "admitted/s", "shed/s", "errors", "P50 ms", "P99 ms", "within 150 ms", "goodput/s",
         "shed by reason"],
        [[r.clients, r.sent_rps, r.admitted_rps, r.shed_rps, r.errors, r.p50_ms, r.p99_ms,
          f"{r.within_objective:.1%}", r.goodput_rps,
          ", ".join(f"{k} {v / sum(r.shed_reasons.values()):.0%}" for k, v in sorted(r.shed_reasons.items()))]
         for r in results])
    windows = markdown_table(
        ["clients"] + [f"{k * args.window:g}-{(k + 1) * args.window:g} s" for k in range(len(results[0].windows))],
        [[r.clients] + [f"{w:.1%}" for w in r.windows] for r in results])
    engine = ("stream engine, tiny model, as `slogate up` serves interactive work" if args.engine == "stream"
              else "sim engine, `slogate up --engine sim` timing")
    header = (f"# Retry flood ({engine})\n\n"
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; risk-score requests of the risk mix "
              f"(interactive, not streamed); each client sends its next request 0-{MAX_GAP_S * 1000:.0f} ms "
              f"after an answer, 429s included; "
              f"{args.duration:.0f} s per client count, each on a fresh stack. Latency is of admitted requests, "
              f"end to end at the client; objective {OBJECTIVE_S * 1000:.0f} ms.\n\n")
    text = f"{header}{table}\n\nAdmitted requests within the objective, by when they were sent:\n\n{windows}\n"
    if args.after:
        paced_rows = [[r.clients, f"{r.after.count('admitted')} of {len(r.after)}",
                       ", ".join(f"{k} {r.after.count(k)}" for k in sorted(set(r.after)) if k != "admitted"),
                       "".join("A" if a == "admitted" else "x" for a in r.after)] for r in results]
        text += (f"\nThen, on the same stack, {args.after} requests one at a time, {PACED_GAP_S:g} s apart "
                 f"(A admitted, x not):\n\n"
                 + markdown_table(["clients", "admitted", "not admitted, by reason", "in order"], paced_rows) + "\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(text)
    (RESULTS / f"{args.name}.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(text)


if __name__ == "__main__":
    main()
