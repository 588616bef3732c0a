"""Does admission control keep interactive traffic inside its objective under overload?

Open-loop Poisson arrivals of the financial-risk mix against gateway + sim workers (or real
engines with ``--engine real``). First the mix's capacity C is calibrated (a closed loop with
admission off); then each offered load (fractions of C) runs against a fresh stack, with
admission on and off. For each class it reports offered, admitted and shed rates, P50/P99 of
admitted requests (time to first token for streamed interactive ones, end to end otherwise)
and goodput: requests per second that met their objective.

    python -m benchmarks.slo_overload [--duration 20] [--loads 0.5,1,1.2,2,4]

Saves benchmarks/results/slo_overload.md, .json and .png.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import redis
import uvloop

from benchmarks.loadgen import (DEFAULT_WORKLOAD, Sample, Workload, closed_loop, load_workload,
                                markdown_table, open_loop, percentile)
from slogate.local_redis import LocalRedis
from slogate.processes import Stack

RESULTS = Path(__file__).resolve().parent / "results"
OBJECTIVE_S = 0.150
# One interactive worker of 16 slots and one batch worker of 32, with GPU-like step times.
SIM = {
    "interactive": ["prefill_s_per_token=0.00002", "decode_base_s=0.004", "decode_s_per_seq=0.0002", "max_batch=16"],
    "batch": ["prefill_s_per_token=0.00002", "decode_base_s=0.010", "decode_s_per_seq=0.0003", "max_batch=32"],
}


@dataclass
class ClassResult:
    load: float
    admission: bool
    cls: str
    offered_rps: float
    admitted_rps: float
    shed_rps: float
    error_rps: float
    p50_ms: float
    p99_ms: float
    goodput_rps: float


def start(server: LocalRedis, admission: bool, engine: str, model: str | None) -> Stack:
    redis.Redis.from_url(server.url).flushdb()
    stack = Stack(server.url, {"SLOGATE_ADMISSION_CONTROL": "1" if admission else "0",
                               "SLOGATE_LOG_LEVEL": "WARNING", "SLOGATE_WORKER_POLL_S": "0.1",
                               **({"SLOGATE_MODEL": model} if model else {})})
    stack.gateway()
    for pool, options in SIM.items():
        if engine == "sim":
            stack.worker(pool, "sim", *options)
        else:
            stack.worker(pool, "stream" if pool == "interactive" else "paged")
    stack.wait_models(model_name(engine, model), pools=2, timeout=300)
    return stack


def model_name(engine: str, model: str | None) -> str:
    return "slogate-sim" if engine == "sim" else Path(model or "tiny").name


def latency(s: Sample) -> float:
    return s.ttft if s.ttft is not None else s.latency


def met_objective(s: Sample) -> bool:
    if s.status != 200:
        return False
    if s.cls == "batch":
        return True
    if s.streamed and s.ttft is None:
        return False
    return latency(s) <= OBJECTIVE_S


def settled(samples: list[Sample], settle_s: float) -> list[Sample]:
    """The samples sent after the first ``settle_s`` seconds of a point."""
    if not samples or settle_s <= 0:
        return samples
    first = min(s.started for s in samples)
    return [s for s in samples if s.started - first >= settle_s]


def summarize(samples: list[Sample], load: float, admission: bool, duration: float) -> list[ClassResult]:
    out = []
    for cls in ("interactive", "batch"):
        mine = [s for s in samples if s.cls == cls]
        ok = [s for s in mine if s.status == 200]
        shed = [s for s in mine if s.status == 429]
        lat = [latency(s) for s in ok]
        good = [s for s in mine if met_objective(s)]
        out.append(ClassResult(load, admission, cls, len(mine) / duration, len(ok) / duration,
                               len(shed) / duration, (len(mine) - len(ok) - len(shed)) / duration,
                               percentile(lat, 50) * 1000, percentile(lat, 99) * 1000, len(good) / duration))
    return out


async def run_point(url: str, workload: Workload, rate: float, duration: float) -> list[Sample]:
    return await open_loop(url, workload, rate, duration)


def calibrate(server: LocalRedis, workload: Workload, engine: str, model: str | None, duration: float) -> float:
    """C: completed requests/s of the mix with every client kept busy and nothing shed."""
    stack = start(server, admission=False, engine=engine, model=model)
    try:
        samples = uvloop.run(closed_loop(stack.url, workload, 64, duration))
    finally:
        stack.stop()
    return sum(1 for s in samples if s.status == 200) / duration


def plot(results: list[ClassResult], capacity: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for admission, style in ((True, "-o"), (False, "--s")):
        rows = [r for r in results if r.cls == "interactive" and r.admission == admission]
        label = "admission on" if admission else "admission off"
        ax1.plot([r.load for r in rows], [r.p99_ms for r in rows], style, label=label)
        ax2.plot([r.load for r in rows], [r.goodput_rps for r in rows], style, label=label)
    ax1.axhline(OBJECTIVE_S * 1000, color="red", lw=1, label="150 ms objective")
    ax1.set(xlabel="offered load (x C)", ylabel="interactive P99 (ms)", yscale="log",
            title="Interactive P99 of admitted requests")
    ax2.axhline(0.9 * capacity, color="grey", lw=1, label="90% of C")
    ax2.set(xlabel="offered load (x C)", ylabel="requests/s meeting the objective",
            title=f"Interactive goodput (C = {capacity:.0f} req/s)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--loads", default="0.5,1,1.2,2,4")
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    parser.add_argument("--engine", choices=["sim", "real"], default="sim")
    parser.add_argument("--model", help="model directory for --engine real")
    parser.add_argument("--capacity", type=float, help="skip calibration and use this C (req/s)")
    parser.add_argument("--name", default="slo_overload", help="results file stem")
    parser.add_argument("--admission", choices=["both", "on", "off"], default="both")
    parser.add_argument("--settle", type=float, default=0.0,
                        help="leave the first seconds of each point out of the statistics (a cold start)")
    args = parser.parse_args()

    loads = [float(x) for x in args.loads.split(",")]
    workload = load_workload(args.workload, model_name(args.engine, args.model))
    results: list[ClassResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalRedis(Path(tmp)).start()
        try:
            capacity = args.capacity or calibrate(server, workload, args.engine, args.model, args.duration / 2)
            print(f"calibrated capacity C = {capacity:.1f} req/s")
            modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.admission]
            for admission in modes:
                for load in loads:
                    stack = start(server, admission, args.engine, args.model)
                    try:
                        samples = uvloop.run(run_point(stack.url, workload, load * capacity, args.duration))
                    finally:
                        stack.stop()
                    rows = summarize(settled(samples, args.settle), load, admission, args.duration - args.settle)
                    results += rows
                    i = rows[0]
                    print(f"load {load:>4}C admission {'on ' if admission else 'off'}: interactive "
                          f"admitted {i.admitted_rps:.0f}/s shed {i.shed_rps:.0f}/s P99 {i.p99_ms:.0f} ms "
                          f"goodput {i.goodput_rps:.0f}/s", flush=True)
        finally:
            server.stop()

    table = markdown_table(
        ["load (xC)", "admission", "class", "offered/s", "admitted/s", "shed/s", "errors/s", "P50 ms",
         "P99 ms", "goodput/s"],
        [[f"{r.load:g}", "on" if r.admission else "off", r.cls, r.offered_rps, r.admitted_rps, r.shed_rps,
          r.error_rps, r.p50_ms, r.p99_ms, r.goodput_rps] for r in results])
    header = (f"# SLO under overload ({args.engine} engines)\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
              f"C = {capacity:.1f} req/s of the risk mix; open-loop Poisson arrivals, {args.duration:.0f} s "
              f"per point; objective {OBJECTIVE_S * 1000:.0f} ms P99 (TTFT when streamed); batch goodput = "
              f"completed reports."
              + (f" Statistics leave out the first {args.settle:g} s of each point (a cold start: the "
                 f"gateway has learned nothing about the pools yet)." if args.settle > 0 else "")
              + "\n\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(header + table + "\n")
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"capacity_rps": capacity, "results": [asdict(r) for r in results]}, indent=1))
    plot(results, capacity, RESULTS / f"{args.name}.png")
    print(header + table)


if __name__ == "__main__":
    main()
