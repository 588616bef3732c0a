"""What one Redis command costs over TCP loopback and over a Unix socket, in the CPU time
of the client (redis-py's asyncio client on uvloop, as the gateway and workers use it) and
of redis-server: the embedded Redis of ``slogate up`` is reached through its socket.

    python -m benchmarks.redis_transport [--n 20000] [--rounds 3]

Each round measures both transports, alternating, on XADD of a 300-byte record (what a
worker's flush sends) and XREAD of one entry (what the gateway's reader does per flush).
Prints a table and saves it to benchmarks/results/redis_transport.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis
import uvloop

from benchmarks.loadgen import markdown_table
from slogate.local_redis import LocalRedis

RESULTS = Path(__file__).resolve().parent / "results"


def _server_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(url: str, pid: int, n: int) -> list[float]:
    """Client and server CPU microseconds per XADD, then per XREAD."""
    client = aioredis.Redis.from_url(url)
    await client.delete("bench")
    out = []
    for command in ("XADD", "XREAD"):
        c0, s0 = time.process_time(), _server_cpu_s(pid)
        last = b"0-0"
        for _ in range(n):
            if command == "XADD":
                await client.xadd("bench", {"b": b"x" * 300})
            else:
                last = (await client.xread({"bench": last}, count=1))[0][1][-1][0]
        out += [(time.process_time() - c0) / n * 1e6, (_server_cpu_s(pid) - s0) / n * 1e6]
    await client.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20000, help="commands of each kind per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="redis_transport", help="results file stem")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalRedis(Path(tmp)).start()
        try:
            assert server.proc is not None
            for r in range(1, args.rounds + 1):
                for name, url in (("TCP loopback", server.tcp_url), ("Unix socket", server.url)):
                    rows.append([r, name, *uvloop.run(_measure(url, server.proc.pid, args.n))])
        finally:
            server.stop()
    table = markdown_table(["round", "transport", "XADD client us", "XADD redis us", "XREAD client us",
                            "XREAD redis us"], rows)
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (RESULTS / f"{args.name}.md").write_text(
        f"# Redis command cost by transport\n\n{stamp}, {os.cpu_count()} cores; {args.n} commands of each kind "
        f"per row, CPU time per command (client: redis-py asyncio on uvloop; redis: redis-server).\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
