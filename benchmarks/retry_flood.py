"""Clients that retry at once: do the requests admitted under a retry flood keep their objective?

Each client sends a risk-score request of the risk mix (interactive, not streamed) and sends the
next 0-50 ms after the answer, a 429 included: it ignores Retry-After, as locust's ``RiskScorer``
does. Past a few dozen clients nearly every request is a shed that comes straight back, and
bursts of them find the pool's slots free. The stack is what ``slogate up --engine sim`` runs: a gateway and one
sim worker with the sim's default timing (64 slots, 0.05 ms a prompt token, so a 184-token score
prompt adds 9 ms to the step it joins). Each client count runs against a fresh stack, cold.

    python -m benchmarks.retry_flood [--clients 10,25,50] [--duration 30] [--window 5]

Reports, for the admitted requests, P50/P99 and the share answered within the 150 ms objective,
over the whole run and per window (the first window holds the cold start: nothing learned yet).
Saves benchmarks/results/retry_flood.md and .json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import redis
import uvloop

from benchmarks.loadgen import DEFAULT_WORKLOAD, Sample, closed_loop, load_workload, markdown_table, percentile
from slogate.local_redis import LocalRedis
from slogate.processes import Stack

RESULTS = Path(__file__).resolve().parent / "results"
OBJECTIVE_S = 0.150
MAX_GAP_S = 0.050


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


def run_clients(redis_url: str, workload_path: str, clients: int, duration: float, seed: int) -> list[Sample]:
    redis.Redis.from_url(redis_url).flushdb()
    stack = Stack(redis_url, {"SLOGATE_LOG_LEVEL": "WARNING"})
    try:
        stack.gateway()
        stack.worker("interactive", "sim")
        stack.wait_models("slogate-sim")
        workload = load_workload(workload_path).only(
            lambda r: r.get("class_hint") == "interactive" and not r["body"].get("stream"))
        rng = random.Random(seed)
        return uvloop.run(closed_loop(stack.url, workload, clients, duration, lambda: rng.uniform(0, MAX_GAP_S)))
    finally:
        stack.stop()


def within(samples: list[Sample]) -> float:
    return sum(s.latency <= OBJECTIVE_S for s in samples) / len(samples) if samples else float("nan")


def summarize(clients: int, samples: list[Sample], duration: float, window: float) -> FloodResult:
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
                       reasons)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="10,25,50")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="retry_flood", help="results file stem")
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalRedis(Path(tmp)).start()
        try:
            for clients in (int(c) for c in args.clients.split(",")):
                samples = run_clients(server.url, args.workload, clients, args.duration, args.seed)
                r = summarize(clients, samples, args.duration, args.window)
                results.append(r)
                print(f"{clients} clients: admitted {r.admitted_rps:.0f}/s, {r.within_objective:.1%} within "
                      f"{OBJECTIVE_S * 1000:.0f} ms, P99 {r.p99_ms:.0f} ms", flush=True)
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
    header = (f"# Retry flood (sim engine, `slogate up --engine sim` timing)\n\n"
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; risk-score requests of the risk mix "
              f"(interactive, not streamed); each client sends its next request 0-{MAX_GAP_S * 1000:.0f} ms "
              f"after an answer, 429s included; "
              f"{args.duration:.0f} s per client count, each on a fresh stack. Latency is of admitted requests, "
              f"end to end at the client; objective {OBJECTIVE_S * 1000:.0f} ms.\n\n")
    text = f"{header}{table}\n\nAdmitted requests within the objective, by when they were sent:\n\n{windows}\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(text)
    (RESULTS / f"{args.name}.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(text)


if __name__ == "__main__":
    main()
