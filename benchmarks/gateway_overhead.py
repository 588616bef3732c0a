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


async def measure(url: str, payloads: list[bytes], duration: float, rate: float) -> dict[str, Summary]:
    host, port = url.removeprefix("http://").split(":")
    out = {}
    out["1 client (closed)"] = summarize(
        await rawhttp.closed_loop(host, int(port), payloads, 1, duration / 2), duration / 2)
    out["64 clients (closed)"] = summarize(
        await rawhttp.closed_loop(host, int(port), payloads, 64, duration), duration)
    out[f"open loop {rate:.0f}/s"] = summarize(
        await rawhttp.open_loop(host, int(port), payloads, rate, duration), duration)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    args = parser.parse_args()

    workload = load_workload(args.workload).only(
        lambda r: r["class_hint"] == "interactive" and not r["body"].get("stream"))
    payloads = rawhttp.encode_requests("127.0.0.1", workload.rows)
    with tempfile.TemporaryDirectory() as tmp:
        redis = LocalRedis(Path(tmp)).start()
        echo, echo_url = start_echo()
        stack = Stack(redis.url, {"SLOGATE_LOG_LEVEL": "WARNING"})
        try:
            stack.gateway()
            stack.worker("interactive", "sim", *ZERO)
            stack.worker("batch", "sim", *ZERO)
            stack.wait_models("slogate-sim", pools=2)
            direct = uvloop.run(measure(echo_url, payloads, args.duration, args.rate))
            gateway = uvloop.run(measure(stack.url, payloads, args.duration, args.rate))
        finally:
            stack.stop()
            echo.terminate()
            redis.stop()

    rows = []
    for name in direct:
        d, g = direct[name], gateway[name]
        rows.append([name, f"{d.rps:.0f}", f"{g.rps:.0f}", d.p50_ms, g.p50_ms, g.p50_ms - d.p50_ms,
                     d.p99_ms, g.p99_ms, g.p99_ms - d.p99_ms, sum(g.errors.values())])
    table = markdown_table(
        ["load", "direct req/s", "gateway req/s", "direct P50 ms", "gateway P50 ms", "added P50 ms",
         "direct P99 ms", "gateway P99 ms", "added P99 ms", "gateway errors"], rows)
    header = (f"# Gateway overhead\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{platform.machine()} with {os.cpu_count()} cores, load generator on the "
              f"same machine; {args.duration:.0f} s per load; risk-score requests (non-streamed, "
              f"max_tokens <= 8) from {Path(args.workload).name}; gateway path = gateway + Redis + "
              f"sim worker with zero engine time.\n\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway_overhead.md").write_text(header + table + "\n")
    print(header + table)


if __name__ == "__main__":
    main()
