"""What the gateway costs: the same risk-score load sent straight to a trivial OpenAI-shaped
server, and through gateway + Redis + a sim worker with zero engine time.

    python benchmarks/gateway_overhead.py [--duration 10] [--rate 2000]

Prints a table and saves it to benchmarks/results/gateway_overhead.md. Everything, the load
generator included, runs on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from benchmarks import rawhttp
from benchmarks.loadgen import DEFAULT_WORKLOAD, Summary, load_workload, markdown_table, summarize
from slogate.local_redis import LocalRedis, free_port
from slogate.processes import Stack

RESULTS = Path(__file__).resolve().parent / "results"
ZERO = ["prefill_s_per_token=0", "decode_base_s=0", "decode_s_per_seq=0", "max_batch=512"]


def start_echo() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.echo_server", str(port)])
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, url
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("echo server did not start")


async def measure(url: str, payloads: list[bytes], duration: float, rates: list[float]) -> dict[str, Summary]:
    host, port = url.removeprefix("http://").split(":")
    out = {}
    out["1 client (closed)"] = summarize(
        await rawhttp.closed_loop(host, int(port), payloads, 1, duration / 2), duration / 2)
    out["64 clients (closed)"] = summarize(
        await rawhttp.closed_loop(host, int(port), payloads, 64, duration), duration)
    for rate in rates:
        out[f"open loop {rate:.0f}/s"] = summarize(
            await rawhttp.open_loop(host, int(port), payloads, rate, duration), duration)
    return out


def gateway_run(redis_url: str, admission: bool, payloads: list[bytes], duration: float,
                rates: list[float]) -> dict[str, Summary]:
    stack = Stack(redis_url, {"SLOGATE_LOG_LEVEL": "WARNING", "SLOGATE_ADMISSION_CONTROL": "1" if admission else "0"})
    try:
        stack.gateway()
        stack.worker("interactive", "sim", *ZERO)
        stack.worker("batch", "sim", *ZERO)
        stack.wait_models("slogate-sim", pools=2)
        return uvloop.run(measure(stack.url, payloads, duration, rates))
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--rates", default="1500,2000", help="open-loop arrival rates, requests/s")
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    args = parser.parse_args()

    rates = [float(r) for r in args.rates.split(",")]
    workload = load_workload(args.workload).only(
        lambda r: r["class_hint"] == "interactive" and not r["body"].get("stream"))
    payloads = rawhttp.encode_requests("127.0.0.1", workload.rows)
    with tempfile.TemporaryDirectory() as tmp:
        redis = LocalRedis(Path(tmp)).start()
        echo, echo_url = start_echo()
        try:
            runs = {"direct to a trivial server": uvloop.run(measure(echo_url, payloads, args.duration, rates))}
            echo.terminate()
            runs["gateway, admission on"] = gateway_run(redis.url, True, payloads, args.duration, rates)
            runs["gateway, admission off"] = gateway_run(redis.url, False, payloads, args.duration, rates)
        finally:
            echo.terminate()
            redis.stop()

    direct = runs["direct to a trivial server"]
    rows = []
    for load in direct:
        for path, results in runs.items():
            r = results[load]
            added = "" if results is direct else f"{r.p50_ms - direct[load].p50_ms:.1f} / {r.p99_ms - direct[load].p99_ms:.1f}"
            rows.append([load, path, f"{r.rps:.0f}", r.p50_ms, r.p99_ms, added,
                         r.errors.get(429, 0), sum(n for code, n in r.errors.items() if code != 429)])
    table = markdown_table(["load", "path", "answered 200/s", "P50 ms", "P99 ms", "added P50 / P99 ms",
                            "shed (429)", "errors"], rows)
    header = (f"# Gateway overhead\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{platform.machine()} with {os.cpu_count()} cores, load generator (benchmarks/rawhttp.py) on "
              f"the same machine; {args.duration:.0f} s per load; risk-score requests (non-streamed, "
              f"max_tokens <= 8) from {Path(args.workload).name}; gateway path = one gateway process + "
              f"Redis + sim workers with zero engine time. Latency is end to end at the client.\n\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway_overhead.md").write_text(header + table + "\n")
    print(header + table)


if __name__ == "__main__":
    main()
