"""What encryption at rest costs per message: seal and open of 200 B, 2 KB and 16 KB.

    python -m benchmarks.sealing [--n 20000] [--name sealing]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.loadgen import markdown_table
from slogate.crypto import Sealer, generate_key, parse_key_ring

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20000, help="messages of each size")
    parser.add_argument("--name", default="sealing", help="results file stem")
    args = parser.parse_args()
    n = args.n
    sealer = Sealer(parse_key_ring(f"k1:{generate_key()}"))
    rows = []
    for size in (200, 2048, 16384):
        data = b"x" * size
        t0 = time.perf_counter()
        for _ in range(n):
            sealed = sealer.seal(data, b"request-id")
        t1 = time.perf_counter()
        for _ in range(n):
            sealer.open(sealed, b"request-id")
        t2 = time.perf_counter()
        rows.append([f"{size} B", (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6])
    table = markdown_table(["message", "seal us", "open us"], rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(f"# AES-256-GCM sealing cost\n\n{n} messages each, one core.\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
