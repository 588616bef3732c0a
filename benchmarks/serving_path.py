"""Where a streamed request's time to first token goes on its way through the gateway.

The stream benchmark shows the gateway rows' TTFT above the in-process rows'; this splits it,
request by request, with the spans the gateway and the worker already record (OpenTelemetry,
written to a file) and the client's own clock (all processes on this host, one clock):

- to the gateway: the client sends until the gateway's request span starts (HTTP, parsing);
- gateway: authentication, parsing, validation and admission, until it seals the request;
- to a worker: sealing it, its XADD to the pool's stream, until a worker has read the entry
  (XREADGROUP; the gateway may see the XADD's reply later than that);
- worker to first token: tokenizing, handing the request to the engine, waiting for the step
  in progress, the prompt pass, until the first output with text is back at the worker;
- back to the client: that output's record through Redis, the gateway's reader and SSE.

Writing the spans costs time on the gateway's path, so the same load runs again untraced and
the table shows both TTFTs. During the untraced run a second table shows, per process, the CPU
it used and the share of the time it was ready to run but waiting for a core (Linux schedstat):
on a small host the hops' tails are mostly that wait. A third table follows the slowest
requests (by traced TTFT) hop by hop, beside those around the median: which hops a tail
request loses its time in, which per-hop percentiles cannot say. The last two split the
untraced run, more coarsely, by what the gateway's audit trail records of each request
(``queue_ms``, ``ttft_ms``): to a worker, from the worker to the first token at the gateway,
and the client's own two hops. Theirs is the tail the stream benchmark measures; the traced
run's is longer by the spans.

    python -m benchmarks.serving_path [--size tiny] [--levels 1 16] [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import uvloop
from transformers import AutoTokenizer

from benchmarks.loadgen import markdown_table, percentile
from benchmarks.stream_engine import random_prompt
from engines.runtime.tiny_model import build_tiny_model
from gateway.audit import export
from slogate.local_redis import LocalRedis
from slogate.processes import Stack

RESULTS = Path(__file__).resolve().parent / "results"
HOPS = ["to the gateway", "gateway", "to a worker", "worker to first token", "back to the client"]
UNTRACED_HOPS = ["to a worker", "worker to first token at the gateway", "client to the gateway and back"]
Sent = tuple[str, float, float]
"""A request's id (its x-request-id), when the client sent it and when its first text came."""
Usage = dict[str, tuple[float, float]]
"""Per process: CPU seconds and seconds runnable but waiting for a core, each per second of wall time."""


def span_time(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def hops(spans: list[dict[str, Any]], sent: float, first: float) -> dict[str, float] | None:
    """Seconds of each hop of one request, from the spans of its trace; None when a span is
    missing (a request the worker had not finished writing spans for)."""
    named = {sp["name"].split(" ")[0]: sp for sp in spans}
    if not {"POST", "enqueue", "queue_wait", "prefill"} <= named.keys():
        return None
    arrived = span_time(named["POST"]["start_time"])
    enqueuing = span_time(named["enqueue"]["start_time"])
    taken = span_time(named["queue_wait"]["end_time"])
    first_out = span_time(named["prefill"]["end_time"])
    return dict(zip(HOPS, (arrived - sent, enqueuing - arrived, taken - enqueuing, first_out - taken,
                           first - first_out)))


def trace_hops(path: Path, sent: list[Sent]) -> list[dict[str, float]]:
    """Each sent request's hops, joined to its trace by the request id on the gateway's span."""
    traces: dict[str, list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        sp = json.loads(line)
        traces.setdefault(sp["context"]["trace_id"], []).append(sp)
    by_request = {sp["attributes"]["slogate.request_id"]: spans for spans in traces.values() for sp in spans
                  if sp["name"].startswith("POST")}
    found = (hops(by_request.get(rid, []), s, f) for rid, s, f in sent)
    return [h for h in found if h is not None]


def audit_hops(records: dict[str, dict[str, Any]], sent: list[Sent]) -> list[dict[str, float]]:
    """Each sent request's untraced hops, from its audit record (found by its request id):
    ``queue_ms`` is to a worker; ``ttft_ms`` less that is the worker, the engine and the way
    back to the gateway; the client's TTFT less ``ttft_ms`` its own hops to the gateway and
    back."""
    out = []
    for rid, s, f in sent:
        rec = records.get(rid, {})
        if "queue_ms" in rec and "ttft_ms" in rec:
            queue, ttft = rec["queue_ms"] / 1000, rec["ttft_ms"] / 1000
            out.append(dict(zip(UNTRACED_HOPS, (queue, ttft - queue, f - s - ttft))))
    return out


async def stream_once(session: aiohttp.ClientSession, url: str, body: dict[str, Any], rid: str) -> Sent:
    sent = time.time()
    first = 0.0
    headers = {"x-request-id": rid, "x-slogate-class": "interactive"}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        async for line in resp.content:
            if not first and line.startswith(b"data: {"):
                chunk = msgspec.json.decode(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    first = time.time()
    return rid, sent, first


async def closed_loop(url: str, model: str, prompts: list[tuple[str, int]], clients: int, tag: str) -> list[Sent]:
    """``clients`` clients, each sending its next request when its last one ends. Each client's
    first request is left out: the clients start together, so those arrive as one burst."""
    out: list[Sent] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(c: int) -> None:
            for i, (prompt, max_tokens) in enumerate(prompts[c::clients]):
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                done = await stream_once(session, url, body, f"{tag}-{c}-{i}")
                if i:
                    out.append(done)

        await asyncio.gather(*(client(c) for c in range(clients)))
    return [s for s in out if s[2]]


def schedstat(pid: int) -> tuple[float, float]:
    """Seconds the threads of ``pid`` ran, and waited runnable for a core (``/proc/*/schedstat``)."""
    ran = waited = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "schedstat").read_text().split()
        ran, waited = ran + int(fields[0]), waited + int(fields[1])
    return ran / 1e9, waited / 1e9


def measured(pids: dict[str, int], load: Any) -> tuple[list[Sent], Usage]:
    """Run the coroutine ``load`` and what each process of ``pids`` did meanwhile."""
    before, began = {name: schedstat(pid) for name, pid in pids.items()}, time.perf_counter()
    sent = uvloop.run(load)
    after, wall = {name: schedstat(pid) for name, pid in pids.items()}, time.perf_counter() - began
    return sent, {name: ((after[name][0] - before[name][0]) / wall, (after[name][1] - before[name][1]) / wall)
                  for name in pids}


def run(model_dir: Path, levels: dict[int, list[tuple[str, int]]], engine: str, threads: int, dtype: str,
        trace_file: Path | None) -> tuple[dict[int, tuple[list[Sent], Usage]], dict[str, dict[str, Any]]]:
    """Each level's requests through one gateway and one worker, after a warm-up, and the
    audit records of them all by request id."""
    with tempfile.TemporaryDirectory() as tmp:
        redis = LocalRedis(Path(tmp)).start()
        env = {"SLOGATE_ADMISSION_CONTROL": "0", "SLOGATE_MODEL": str(model_dir), "OMP_NUM_THREADS": str(threads)}
        if trace_file is not None:
            env |= {"OTEL_TRACES_EXPORTER": "file", "SLOGATE_TRACE_FILE": str(trace_file)}
        stack = Stack(redis.url, env)
        try:
            gateway = stack.gateway()
            worker = stack.worker("interactive", engine, f'dtype="{dtype}"')
            stack.wait_models(model_dir.name, timeout=300)
            children = Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text().split()
            engine_pid = next(int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())
            pids = {"load generator": os.getpid(), "gateway": gateway.pid, "Redis": redis.proc.pid,
                    "worker": worker.pid, "engine process": engine_pid}
            warmup = [(p, 8) for p, _ in next(iter(levels.values()))[:8]]
            uvloop.run(closed_loop(stack.url, model_dir.name, warmup, 2, "warmup"))
            results = {n: measured(pids, closed_loop(stack.url, model_dir.name, prompts, n, f"l{n}"))
                       for n, prompts in levels.items()}
            stack.stop()  # the gateway writes its last audit records as it stops
            records = (json.loads(line) for line in export(redis.url))
            return results, {r["request_id"]: r for r in records if "request_id" in r}
        finally:
            stack.stop()
            redis.stop()


def percentile_rows(split: dict[int, list[dict[str, float]]], names: list[str], total: str) -> list[list[Any]]:
    """Each hop's P50, P90 and P99 per level, then their sum's (the TTFT) as ``total``."""
    rows = [[hop, *(c for n in split for c in _cells([h[hop] for h in split[n]]))] for hop in names]
    rows.append([total, *(c for n in split for c in _cells([sum(h.values()) for h in split[n]]))])
    return rows


def _cells(values: list[float]) -> list[Any]:
    return [round(percentile(values, q) * 1000, 2) for q in (50, 90, 99)]


def report(traced: dict[int, list[dict[str, float]]], untraced: dict[int, list[Sent]]) -> list[list[Any]]:
    rows = percentile_rows(traced, HOPS, "TTFT, traced")
    rows.append(["TTFT, untraced", *(c for n in untraced for c in _cells([f - s for _, s, f in untraced[n]]))])
    return rows


def tail_report(split: dict[int, list[dict[str, float]]], names: list[str] = HOPS,
                total: str = "TTFT, traced") -> tuple[list[str], list[list[Any]]]:
    """Each hop's mean over the slowest 5% of requests by TTFT, beside its mean over the 10%
    around the median TTFT."""
    groups: dict[int, tuple[list[dict[str, float]], list[dict[str, float]]]] = {}
    for n, hops_of in split.items():
        ranked = sorted(hops_of, key=lambda h: sum(h.values()))
        k = max(1, len(ranked) // 20)
        groups[n] = ranked[len(ranked) // 2 - k: len(ranked) // 2 + k], ranked[-k:]

    def mean_ms(group: list[dict[str, float]], hop: str | None) -> float:
        return round(sum(h[hop] if hop else sum(h.values()) for h in group) / len(group) * 1000, 2)

    streams = {n: f"{n} stream{'s' * (n > 1)}" for n in split}
    headers = ["hop", *(f"{streams[n]}, {which} ms" for n in split
                        for which in ("around the median", "slowest 5%"))]
    rows = [[hop or total, *(mean_ms(g, hop) for n in split for g in groups[n])] for hop in [*names, None]]
    return headers, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "100m"])
    parser.add_argument("--model-dir", type=Path, help="an existing model directory instead of building one")
    parser.add_argument("--engine", default="stream", choices=["stream", "paged"])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16], help="concurrent streams")
    parser.add_argument("--requests", type=int, default=300, help="requests per level, each client's first not "
                                                                     "measured")
    parser.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", help="results file name (default: serving_path_<size>_<engine>)")
    args = parser.parse_args()
    name = args.name or f"serving_path_{args.size}_{args.engine}"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir or build_tiny_model(Path(tmp) / args.size, size=args.size))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rng = random.Random(args.seed)
        levels = {n: [(random_prompt(tokenizer, rng, rng.randint(16, 64)), rng.randint(16, 48))
                      for _ in range(args.requests)] for n in args.levels}
        trace_file = Path(tmp) / "spans.jsonl"
        sent, _ = run(model_dir, levels, args.engine, args.threads, args.dtype, trace_file)
        traced = {n: trace_hops(trace_file, s) for n, (s, _) in sent.items()}
        untraced, audited = run(model_dir, levels, args.engine, args.threads, args.dtype, None)
    split = {n: audit_hops(audited, s) for n, (s, _) in untraced.items()}
    streams = {n: f"{n} stream{'s' * (n > 1)}" for n in args.levels}
    headers = ["hop", *(f"{streams[n]} {q} ms" for n in args.levels for q in ("P50", "P90", "P99"))]
    rows = report(traced, {n: s for n, (s, _) in untraced.items()})
    usage = {n: u for n, (_, u) in untraced.items()}
    usage_headers = ["process", *(f"{streams[n]} {what}" for n in args.levels
                                  for what in ("CPU % of a core", "waiting for a core %"))]
    usage_rows = [[name, *(round(v * 100, 1) for n in args.levels for v in usage[n][name])]
                  for name in usage[args.levels[0]]]
    tail_headers, tail_rows = tail_report(traced)
    split_rows = percentile_rows(split, UNTRACED_HOPS, "TTFT, untraced")
    split_tail_headers, split_tail_rows = tail_report(split, UNTRACED_HOPS, "TTFT, untraced")
    text = "\n".join([
        f"# Time to first token through the gateway, hop by hop ({args.size} model, {args.dtype}, {args.engine} "
        f"engine)", "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, x86_64 with {os.cpu_count()} cores shared by the "
        f"load generator, gateway, Redis, worker and engine process; worker at {args.threads} torch thread(s); "
        f"prompts of 16-64 tokens, max_tokens 16-48, closed loop, {args.requests} requests a level, each "
        "client's first left out (the clients start together) "
        f"(traced: {', '.join(f'{len(v)} measured at {n}' for n, v in traced.items())}). TTFT: to the first "
        "chunk with text. Hops as `benchmarks/serving_path.py` defines them; percentiles are per hop, so "
        "they do not add up to the TTFT's.", "",
        markdown_table(headers, rows), "",
        "The untraced run, per process: the CPU it used (CPU seconds per second of wall time) and the share "
        "of the time it was ready to run but waited for a core, from /proc/PID/task/*/schedstat. The worker's "
        "row is its event loop; the engine steps in the engine process.", "",
        markdown_table(usage_headers, usage_rows), "",
        "The traced run's slowest requests: each hop's mean over the slowest 5% by TTFT, beside its mean "
        "over the 10% around the median TTFT.", "",
        markdown_table(tail_headers, tail_rows), "",
        "The untraced run, split by each request's audit record "
        f"({', '.join(f'{len(v)} measured at {n}' for n, v in split.items())}; the gateway rounds to 0.1 ms): "
        "per hop, then the slowest 5% by TTFT beside the 10% around the median, as above.", "",
        markdown_table(headers, split_rows), "",
        markdown_table(split_tail_headers, split_tail_rows), ""])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)
    (RESULTS / f"{name}.json").write_text(json.dumps({"name": name, "args": vars(args) | {"model_dir": None},
                                                      "headers": headers, "rows": rows,
                                                      "process_headers": usage_headers, "process_rows": usage_rows,
                                                      "tail_headers": tail_headers, "tail_rows": tail_rows,
                                                      "untraced_rows": split_rows,
                                                      "untraced_tail_rows": split_tail_rows},
                                                     indent=1))
    print(text)


if __name__ == "__main__":
    main()
