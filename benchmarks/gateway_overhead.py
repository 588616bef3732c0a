"""What the gateway costs: the same risk-score load sent straight to a trivial OpenAI-shaped
server, through gateway + Redis + a sim worker with zero engine time, and through gateway +
Redis + an upstream worker in front of that trivial server (what fronting a server you run costs).

    python -m benchmarks.gateway_overhead [--duration 10] [--rates 1500,2000]

Prints a table and saves it to benchmarks/results/gateway_overhead.md. Everything, the load
generator included, runs on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
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


WRK_SCRIPT = """wrk.method = "POST"
wrk.body = [==[%s]==]
wrk.headers["Content-Type"] = "application/json"
"""


def wrk(url: str, body: dict, duration: float, connections: int = 64) -> Summary | None:
    """The same load from wrk, a load generator in C, when it is installed (apt install wrk):
    it costs the shared cores far less than a Python client, so the gateway's own ceiling shows."""
    if shutil.which("wrk") is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_SCRIPT % json.dumps(body))
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{duration:.0f}s", "--latency", "-s", f.name,
                          url + "/v1/chat/completions"], capture_output=True, text=True).stdout
    os.unlink(f.name)
    ms = {m.group(1): float(m.group(2)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(3)]
          for m in re.finditer(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)$", out, re.M)}
    total = int(re.search(r"(\d+) requests in", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    failed = int(bad.group(1)) if bad else 0
    return Summary(total, total - failed, (total - failed) / duration, ms.get("50", 0.0), ms.get("99", 0.0),
                   {429: failed} if failed else {})


def gateway_run(redis_url: str, admission: bool, payloads: list[bytes], duration: float,
                rates: list[float], body: dict, upstream: str | None = None) -> dict[str, Summary]:
    """Sim workers with zero engine time, or with ``upstream`` (a server's base URL) upstream
    workers in front of it."""
    stack = Stack(redis_url, {"SLOGATE_LOG_LEVEL": "WARNING", "SLOGATE_ADMISSION_CONTROL": "1" if admission else "0",
                              **({"SLOGATE_MODEL": "slogate-sim"} if upstream else {})})
    engine, options = ("upstream", [f"url={upstream}/v1", "max_context=8192"]) if upstream else ("sim", ZERO)
    try:
        stack.gateway()
        stack.worker("interactive", engine, *options)
        stack.worker("batch", engine, *options)
        stack.wait_models("slogate-sim", pools=2)
        out = uvloop.run(measure(stack.url, payloads, duration, rates))
        by_wrk = wrk(stack.url, body, duration)
        if by_wrk is not None:
            out["64 clients (closed, wrk)"] = by_wrk
        return out
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--rates", default="1500,2000", help="open-loop arrival rates, requests/s")
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    parser.add_argument("--name", default="gateway_overhead", help="results file stem")
    args = parser.parse_args()

    rates = [float(r) for r in args.rates.split(",")]
    workload = load_workload(args.workload).only(
        lambda r: r["class_hint"] == "interactive" and not r["body"].get("stream"))
    payloads = rawhttp.encode_requests("127.0.0.1", workload.rows)
    with tempfile.TemporaryDirectory() as tmp:
        redis = LocalRedis(Path(tmp)).start()
        echo, echo_url = start_echo()
        try:
            body = workload.rows[0]["body"]
            direct = uvloop.run(measure(echo_url, payloads, args.duration, rates))
            by_wrk = wrk(echo_url, body, args.duration)
            if by_wrk is not None:
                direct["64 clients (closed, wrk)"] = by_wrk
            runs = {"direct to a trivial server": direct}
            runs["gateway + upstream worker, admission on"] = gateway_run(
                redis.url, True, payloads, args.duration, rates, body, upstream=echo_url)
            echo.terminate()
            runs["gateway, admission on"] = gateway_run(redis.url, True, payloads, args.duration, rates, body)
            runs["gateway, admission off"] = gateway_run(redis.url, False, payloads, args.duration, rates, body)
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
              f"Redis + sim workers with zero engine time; upstream path = the same with upstream workers "
              f"streaming from the trivial server, which runs beside them. Latency is end to end at the "
              f"client.\n\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(header + table + "\n")
    print(header + table)


if __name__ == "__main__":
    main()
