"""Latency of the streaming engine as a client sees it: time to first token (TTFT) and the gaps
between streamed chunks, measured at the client through the gateway (SSE, ``stream: true``),
and the gaps between tokens where each token can be seen (in process).

Contenders, all on the same requests (distinct random-token prompts of 16-64 tokens, greedy,
``ignore_eos``):

- the stream engine (pool ``interactive``) and the paged engine (pool ``batch``), each behind
  the gateway + Redis, as real processes, at 1, 4 and 16 concurrent streams (closed loop: each
  client sends its next request when the last one ends);
- the same two engines in this process, driven by the same loop with no gateway, Redis or
  worker, timed as each token leaves ``step()``: what the gateway rows add to these is the
  serving path's cost, not the engine's;
- transformers ``generate`` with a ``TextIteratorStreamer`` in this process, one thread per
  concurrent stream (1 torch thread), timed the same way. That streamer holds text back to a
  word boundary, so its chunks are fewer than its tokens; the per-token row times ``put``.

Arrivals are staggered by default, as independent users' are: each request's ``max_tokens`` is
drawn (seeded) between half and 1.5x ``--max-tokens``, and each client starts at a seeded
random offset within one request's lifetime (or ``--stagger-ms``), so streams do not finish,
and their successors do not arrive, in the same step. Each client's first request is the ramp
(clients still joining) and is reported apart; the other columns are the steady state, with
the contenders taking turns at each level, and the levels in turn too (``--cycles`` rounds of
1, 4 and 16 streams), so the one-stream baseline sees the same host as the 16 streams.
``--arrivals burst`` gives every request the same ``max_tokens`` and starts all clients at
once: every round then arrives as one burst of prefills, the worst case for TTFT rather than
a typical one. ``--pin`` gives the serving worker CPUs of its own.

A client sees text chunks, not tokens: a token that is part of a UTF-8 character carries no
text, so one chunk gap can span several engine steps. The gateway rows ask for running usage
on every chunk (``stream_options.continuous_usage_stats``), so a chunk that carries exactly one
token times the gap between two tokens at the client; those are their token gaps, beside the
chunk gaps. In process every token is seen as it leaves the engine.

Then a 2,000-token prompt arrives while 8 short streams run, through the gateway and in
process (token and chunk gaps): the short streams' worst gap while the long prompt is prefilled,
against their median gap, with the same 8 streams alone as the control (what the host's noise
does). Run::

    python -m benchmarks.stream_engine                  # tiny model, about a minute on 2 cores
    python -m benchmarks.stream_engine --size 100m --dtype bf16 --threads 2 --rounds 4 --max-tokens 16 --long-repeats 1

Results are printed and written to
``benchmarks/results/stream_engine_<size>[_bf16][_threads<N>][_burst][_pinned].{md,json}``.
Everything (load generator, gateway, Redis, both workers) shares this machine, so each
scenario also records the CPU seconds every process spent, the load average and the Redis
commands served per token.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import redis
import torch
import uvloop
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, TextIteratorStreamer

from benchmarks.loadgen import markdown_table, percentile, ratio_interval
from benchmarks.prompt_floor import PassTimes, prompts_alone, time_passes
from engines import paged, stream
from engines.base import Engine, EngineRequest, StepOutput
from engines.runtime.loader import resolve_device
from engines.runtime.tiny_model import build_tiny_model
from slogate import keys, protocol
from slogate.cli import engine_options
from slogate.cpus import parse_cpus, run_first
from slogate.heap import freeze_startup_heap
from slogate.local_redis import LocalRedis
from slogate.processes import Stack
from slogate.protocol import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
POOLS = {"stream": "interactive", "paged": "batch"}
"""Engine -> the pool the benchmark's stack serves it from (forced with x-slogate-class)."""


@dataclass
class Trace:
    """One stream: when it was sent, when each non-empty text chunk arrived and, where the
    tokens themselves are seen (in process), when each token left the engine."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    status: int = 200
    token_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    """Through the gateway: the completion tokens each chunk's running usage reported."""
    first: bool = False
    """Its client's first request: sent while the clients were still joining (the ramp)."""
    prompt: str = ""
    prompts_alone: float | None = None
    """Its TTFT had the engine run nothing but the level's prompts (:mod:`benchmarks.prompt_floor`)."""

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def first_text_tokens(self) -> int:
        """Tokens it took to show text: more than one when the first ends inside a character
        (a byte of it) or may start a stop string."""
        if self.chunk_tokens:
            return self.chunk_tokens[0]
        return sum(t <= self.chunks[0] for t in self.token_times)

    def token_pairs(self) -> list[tuple[float, float]]:
        """(previous, this) arrival times of consecutive tokens. In process every token is
        seen. At the client only a chunk that carries exactly one token ends a gap between two
        tokens; a chunk of several (a character split over tokens) hides its inner gaps, and
        which tokens split a character does not depend on timing, so leaving those out does not
        bias the gaps against stalls."""
        if self.token_times:
            return list(zip(self.token_times, self.token_times[1:]))
        return [(a, b) for a, b, n, m in zip(self.chunks, self.chunks[1:], self.chunk_tokens, self.chunk_tokens[1:])
                if m - n == 1]


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def gap_stats(series: list[list[tuple[float, float]]], start: float, end: float) -> dict[str, float]:
    """Gaps of several streams' (previous, this) timestamp pairs around a window [start, end):
    the median of every gap ending after ``start``, the worst one ending inside the window or
    spanning its end (where a prefill stall shows), and the worst anywhere after ``start``."""
    after = [b - a for pairs in series for a, b in pairs if b > start]
    in_window = [b - a for pairs in series for a, b in pairs if start <= b < end or a < end <= b]
    return {"median_gap_s": statistics.median(after) if after else float("nan"),
            "worst_gap_s": max(in_window, default=float("nan")),
            "worst_gap_anywhere_s": max(after, default=float("nan"))}


class CpuMeter:
    """CPU seconds of named processes, with their children (a worker's engine process), from
    /proc, and of this one around a call: on a shared machine, which process burned the cores
    says more than wall time. With a Redis,
    also the commands it served (``redis_commands``), a count no host noise moves."""

    def __init__(self, pids: dict[str, int], redis_url: str | None = None) -> None:
        self.pids = pids
        self._tick = os.sysconf("SC_CLK_TCK")
        self._redis = redis.Redis.from_url(redis_url) if redis_url else None

    def _read(self) -> dict[str, float]:
        out = {"client": time.process_time()}
        for name, pid in self.pids.items():
            out[name] = self._cpu_s(pid)
        if self._redis is not None:
            out["redis_commands"] = self._redis.info("stats")["total_commands_processed"]
        return out

    def _cpu_s(self, pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return (int(fields[11]) + int(fields[12])) / self._tick + sum(self._cpu_s(int(c)) for c in children)

    def measure(self, fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
        before, wall = self._read(), time.perf_counter()
        result = fn()
        after = self._read()
        cpu = {k: after[k] - before[k] for k in after}
        cpu["wall"] = time.perf_counter() - wall
        return result, cpu


def worker_fit(redis_url: str, pool: str) -> dict[str, float]:
    """The stream worker's warmup as its first heartbeat reports it: ``decode_step_s`` starts
    as a timed step of a full batch of decodes and ``prefill_s_per_token`` as a timed prompt
    pass at position 0, per token."""
    client = redis.Redis.from_url(redis_url)
    try:
        key = next(client.scan_iter(match=keys.heartbeat(pool, "*")))
        beat = protocol.decode_heartbeat(client.get(key))
    finally:
        client.close()
    return {"decode_step_ms": beat.decode_step_s * 1000, "prefill_per_token_us": beat.prefill_s_per_token * 1e6}


# -- prompts ------------------------------------------------------------------------------


def random_prompt(tokenizer: PreTrainedTokenizerBase, rng: random.Random, tokens: int) -> str:
    """Text that encodes to at most ``tokens`` tokens (BOS included): decoded random ids,
    trimmed until re-encoding fits, since decoding then encoding may split or merge."""
    special = set(tokenizer.all_special_ids)
    vocab = range(max(special) + 1, len(tokenizer))
    ids = [rng.choice(vocab) for _ in range(tokens - 1)]
    while True:
        text = tokenizer.decode(ids)
        excess = len(tokenizer(text, verbose=False).input_ids) - tokens
        if excess <= 0:
            return text
        ids = ids[: len(ids) - excess]


# -- through the gateway ------------------------------------------------------------------


async def sse_stream(session: aiohttp.ClientSession, url: str, model: str, pool: str, prompt: str,
                     max_tokens: int, trace: Trace | None = None) -> Trace:
    """One streamed completion, timestamping each ``data:`` chunk that carries text into
    ``trace`` (pass one to watch it fill while the stream runs)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    trace = trace or Trace(time.perf_counter(), prompt=prompt)
    async with session.post(url + "/v1/completions", json=body, headers={"x-slogate-class": pool}) as resp:
        trace.status = resp.status
        async for line in resp.content:
            now = time.perf_counter()
            if not line.startswith(b"data: {"):
                continue
            chunk = msgspec.json.decode(line[6:])
            if "error" in chunk:
                trace.status = chunk["error"].get("status") or 599
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                trace.chunks.append(now)
                trace.chunk_tokens.append(chunk["usage"]["completion_tokens"])
            elif chunk.get("usage"):
                trace.tokens = chunk["usage"]["completion_tokens"]
    return trace


async def closed_loop(url: str, model: str, pool: str, level: Level) -> list[Trace]:
    """One client per offset: each starts at its offset and sends its next request when the
    last one ends."""
    traces: list[Trace] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        async def client(offset: float, requests: list[tuple[str, int]]) -> None:
            await asyncio.sleep(offset)
            for i, (prompt, max_tokens) in enumerate(requests):
                traces.append(await sse_stream(session, url, model, pool, prompt, max_tokens))
                traces[-1].first = i == 0

        await asyncio.gather(*(client(o, r) for o, r in zip(level.offsets, level.per_client())))
    return traces


async def long_prefill(url: str, model: str, pool: str, shorts: list[str], long: str | None,
                       short_tokens: int, lead_chunks: int = 8) -> dict[str, Any]:
    """Short streams run; once each has ``lead_chunks`` chunks the long prompt (if any) is
    sent. Gaps are between text chunks; the window is the long prompt's prefill (sent until its
    first chunk), or everything after the lead without one."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        traces = [Trace(time.perf_counter()) for _ in shorts]
        tasks = [asyncio.create_task(sse_stream(session, url, model, pool, p, short_tokens, t))
                 for p, t in zip(shorts, traces)]
        while any(len(t.chunks) < lead_chunks for t in traces):
            if all(task.done() for task in tasks):
                statuses = [t.status for t in traces]
                raise RuntimeError(f"short streams ended before {lead_chunks} chunks each: {statuses}")
            await asyncio.sleep(0.002)
        sent = time.perf_counter()
        big = await sse_stream(session, url, model, pool, long, 1) if long else None
        await asyncio.gather(*tasks)
    window_end = big.chunks[0] if big and big.chunks else float("inf")
    tokens = gap_stats([t.token_pairs() for t in traces], sent, window_end)
    return {
        **gap_stats([list(zip(t.chunks, t.chunks[1:])) for t in traces], sent, window_end),
        **{f"token_{k}": v for k, v in tokens.items()},
        "long_ttft_s": big.ttft if big else None,
        "statuses": sorted({t.status for t in traces} | ({big.status} if big else set())),
    }


# -- engines in process ---------------------------------------------------------------


def stream_request(rid: str, prompt: str, max_tokens: int) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, sampling, time.time() + 3600, prompt=prompt)


def add_stream(engine: Engine, live: dict[str, Trace], rid: str, prompt: str, max_tokens: int,
               sent: float) -> Trace:
    live[rid] = trace = Trace(sent, prompt=prompt)
    engine.add_request(engine.prepare(stream_request(rid, prompt, max_tokens)))
    return trace


def engine_step(engine: Engine, live: dict[str, Trace], arrivals: Callable[[], bool] | None = None) -> list[str]:
    """One step, timestamping every token and every output with text as it leaves the engine
    (sent during the step or returned at its end); returns the requests that finished.
    ``arrivals``: as the engine loop hands a step."""
    finished: list[str] = []

    def send(outputs: list[StepOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            trace = live[out.request_id]
            trace.token_times += [now] * len(out.token_ids)
            if out.text:
                trace.chunks.append(now)
            trace.tokens = out.completion_tokens
            if out.error:
                trace.status = out.error_status
            if out.finish_reason is not None:
                del live[out.request_id]
                finished.append(out.request_id)

    send(engine.step(arrivals, send))
    return finished


def engine_closed_loop(engine: Engine, level: Level) -> list[Trace]:
    """The same closed loop with no gateway, Redis or worker: requests go straight into the
    engine. A client's first request counts as sent at its offset, even when it waits for
    the step in progress, as it would at a worker."""
    queues = [iter(requests) for requests in level.per_client()]
    live: dict[str, Trace] = {}
    owner: dict[str, int] = {}
    traces: list[Trace] = []
    began = time.perf_counter()
    starts = sorted((began + offset, client) for client, offset in enumerate(level.offsets))

    def send(client: int, sent: float, first: bool = False) -> None:
        item = next(queues[client], None)
        if item is not None:
            rid = f"p{len(traces)}"
            owner[rid] = client
            traces.append(add_stream(engine, live, rid, *item, sent))
            traces[-1].first = first

    def arrivals() -> bool:
        """Sends the first requests whose start came, during a step too (as a worker would)."""
        now, sent = time.perf_counter(), False
        while starts and starts[0][0] <= now:
            at, client = starts.pop(0)
            send(client, at, first=True)
            sent = True
        return sent

    while starts or engine.has_unfinished():
        arrivals()
        if not engine.has_unfinished():
            time.sleep(max(0.0, starts[0][0] - time.perf_counter()) if starts else 0.0)
            continue
        for rid in engine_step(engine, live, arrivals):
            send(owner.pop(rid), time.perf_counter())
    return traces


def engine_long_prefill(engine: Engine, shorts: list[str], long: str | None, short_tokens: int,
                        lead_tokens: int = 8) -> dict[str, Any]:
    """The long-prompt scenario in process: short streams run; once each has ``lead_tokens``
    tokens the long prompt (if any) is sent: tokenized on a side thread while the steps go on
    (as the worker does), then added. Reports both token and chunk gaps of the short streams
    around the long prompt's prefill (sent until its first token), and how long
    ``add_request`` took: it runs between two steps, so it lands in a gap."""
    live: dict[str, Trace] = {}
    traces = [add_stream(engine, live, f"short{i}", p, short_tokens, time.perf_counter())
              for i, p in enumerate(shorts)]
    while any(len(t.token_times) < lead_tokens for t in traces):
        if not engine.has_unfinished():
            raise RuntimeError(f"short streams ended before {lead_tokens} tokens each")
        engine_step(engine, live)
    sent = time.perf_counter()
    big = None
    if long:
        # tokenized beside the steps, as the worker does; add_request then only queues it
        with ThreadPoolExecutor(max_workers=1) as preparer:
            pending = preparer.submit(engine.prepare, stream_request("long", long, 1))
            while not pending.done():
                engine_step(engine, live)
        live["long"] = big = Trace(sent)
        adding = time.perf_counter()
        engine.add_request(pending.result())
        added_s = time.perf_counter() - adding
    while engine.has_unfinished():
        engine_step(engine, live)
    window_end = big.token_times[0] if big and big.token_times else float("inf")
    tokens = gap_stats([t.token_pairs() for t in traces], sent, window_end)
    chunks = gap_stats([list(zip(t.chunks, t.chunks[1:])) for t in traces], sent, window_end)
    return {**{f"token_{k}": v for k, v in tokens.items()}, **{f"chunk_{k}": v for k, v in chunks.items()},
            "long_ttft_s": big.token_times[0] - big.sent if big and big.token_times else None,
            "long_add_s": added_s if big else None,
            "statuses": sorted({t.status for t in traces} | ({big.status} if big else set()))}


def warmup_fit(engine: stream.StreamEngine) -> dict[str, float]:
    """What the stream engine's warmup measured: every chunk and whole-prompt decision is
    priced from it, so a fit taken while the host was busy shows up in TTFT."""
    cost = engine.cost
    return {"fixed_ms": cost.fixed_s * 1000, "per_decode_us": cost.per_decode_s * 1e6,
            "per_token_us": cost.per_token_s * 1e6, "per_token_per_position_ns": cost.per_token_per_position_s * 1e9}


def stream_engine(args: argparse.Namespace, model_dir: Path) -> stream.StreamEngine:
    return stream.create(str(model_dir), dtype=args.dtype, device=args.device, max_batch=args.max_batch,
                         **engine_options(args.stream_option))


PASS_SIZES = [1, 8, 16, 24, 32, 48, 64, 128, 256, 512]
"""Prompt lengths whose passes are timed for the prompts-alone TTFT (up to a pass's most)."""


def pass_times(engine: stream.StreamEngine, before: PassTimes | None = None) -> PassTimes:
    return time_passes(lambda n: engine.time_step([(0, n)]), PASS_SIZES, before=before)


def pass_fit(passes: PassTimes) -> dict[str, float]:
    """The timed prompt passes as the report's fit line shows them."""
    return {f"pass_{n}_tokens_ms": seconds * 1000 for n, seconds in zip(passes.tokens, passes.seconds)}


def stream_pass_times(engine: Callable[[], stream.StreamEngine], threads: int,
                      before: PassTimes | None = None) -> PassTimes:
    """Prompt passes of the stream engine (``engine`` builds it, or gives the one it built)
    at the workers' thread count, timed here while the stack is idle (a worker does not report
    them), at the workers' ordinary priority even when this process runs at a real-time one:
    the engines' steps never do."""
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    torch.set_num_threads(threads)
    try:
        return pass_times(engine(), before)
    finally:
        torch.set_num_threads(1)
        os.sched_setscheduler(0, policy, param)


def run_in_process(args: argparse.Namespace, model_dir: Path, prompts: Prompts,
                   threads: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, float]]:
    """Both engines in this process at the workers' thread count."""
    torch.set_num_threads(threads)
    engines: dict[str, Engine] = {
        "stream": stream_engine(args, model_dir),
        "paged": paged.create(str(model_dir), dtype=args.dtype, device=args.device),
    }
    fit = warmup_fit(engines["stream"])
    before = pass_times(engines["stream"])
    passes = functools.cache(lambda: pass_times(engines["stream"], before))
    meter = CpuMeter({})
    for engine in engines.values():
        engine_closed_loop(engine, prompts.warmup)
    freeze_startup_heap()  # as the worker does once its engine is up
    rows, prefill = take_turns([Contender(
        f"{name} engine, in process", meter,
        lambda level, engine=engine: engine_closed_loop(engine, level),
        lambda shorts, big, engine=engine: engine_long_prefill(engine, shorts, big, args.long_short_tokens),
        passes,
    ) for name, engine in engines.items()], prompts, args.stagger_ms, args.cycles)
    fit |= pass_fit(passes())
    torch.set_num_threads(1)
    return rows, prefill, fit


@dataclass
class Contender:
    label: str
    meter: CpuMeter
    closed_loop: Callable[[Level], list[Trace]]
    long_prefill: Callable[[list[str], str | None], dict[str, Any]]
    passes: Callable[[], PassTimes]
    """The engine's timed prompt passes, for its TTFT with prompts alone; called once the
    levels have run, so that they can be timed again then."""


def take_turns(contenders: list[Contender], prompts: Prompts, stagger_ms: float | None,
               cycles: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The load levels, then the long-prompt scenario, the contenders taking turns at each
    (rows come out grouped by contender), so a host that speeds up or slows down over the
    run favours none of them. The levels themselves run in ``cycles`` rounds (1, 4, 16 streams,
    then again), each level's requests split among them: the one-stream baseline and the
    16-stream figure it is held against then sample the same stretches of host noise."""
    traces: dict[tuple[str, int], list[Trace]] = {}
    cpus: dict[tuple[str, int], dict[str, float]] = {}
    spreads = {c.label: Spread(stagger_ms) for c in contenders}
    for cycle in range(cycles):
        for level, batch in prompts.levels.items():
            for c in contenders:
                spread = spreads[c.label]
                got, cpu = c.meter.measure(lambda: c.closed_loop(spread.level(batch.part(cycle, cycles))))
                spread.learn(got)
                traces.setdefault((c.label, level), []).extend(got)
                total = cpus.setdefault((c.label, level), {})
                for k, v in cpu.items():
                    total[k] = total.get(k, 0.0) + v
    rows: dict[str, list[dict[str, Any]]] = {c.label: [] for c in contenders}
    prefill: dict[str, list[dict[str, Any]]] = {c.label: [] for c in contenders}
    passes = {c.label: c.passes() for c in contenders}
    for (label, level), got in traces.items():
        arrivals = [(t.sent, prompts.tokens[t.prompt], t.first_text_tokens if t.chunks else 1) for t in got]
        for t, alone in zip(got, prompts_alone(arrivals, passes[label])):
            t.prompts_alone = alone
        rows[label].append(latency_row(label, level, got, cpus[(label, level)], spreads[label].seconds))
        print(json.dumps(rows[label][-1]), flush=True)
    for repeat, (control, beside, long) in enumerate(prompts.long, 1):
        for shorts, big in ((control, None), (beside, long)):
            for c in contenders:
                result, cpu = c.meter.measure(lambda: c.long_prefill(shorts, big))
                prefill[c.label].append({"contender": c.label, "repeat": repeat, "long_prompt": big is not None,
                                         **result, "cpu_s": {k: round(v, 2) for k, v in cpu.items()}})
                print(json.dumps(prefill[c.label][-1]), flush=True)
    return [r for c in contenders for r in rows[c.label]], [p for c in contenders for p in prefill[c.label]]


# -- transformers in process --------------------------------------------------------------


class _TimedStreamer(TextIteratorStreamer):
    """Also timestamps every token ``generate`` hands over (``put``), before any text is held."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__(tokenizer, skip_prompt=True)
        self.token_times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.token_times += [time.perf_counter()] * value.numel()
        self._prompt_seen = True
        super().put(value)


def hf_closed_loop(model: Any, tokenizer: PreTrainedTokenizerBase, level: Level) -> tuple[list[Trace], list[Trace]]:
    """One thread per concurrent stream, each starting at its offset and running ``generate``
    with its own streamer and a consumer thread that timestamps what the streamer yields.
    Returns (chunk traces, token traces)."""
    lock = threading.Lock()
    chunks: list[Trace] = []
    tokens: list[Trace] = []

    def client(offset: float, requests: list[tuple[str, int]]) -> None:
        time.sleep(offset)
        for i, (prompt, max_tokens) in enumerate(requests):
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
            streamer = _TimedStreamer(tokenizer)
            trace = Trace(time.perf_counter(), first=i == 0)
            gen = threading.Thread(target=model.generate, kwargs={
                "input_ids": ids, "attention_mask": torch.ones_like(ids), "streamer": streamer,
                "do_sample": False, "max_new_tokens": max_tokens, "min_new_tokens": max_tokens})
            gen.start()
            for text in streamer:
                if text:
                    trace.chunks.append(time.perf_counter())
            gen.join()
            trace.tokens = len(streamer.token_times)
            trace.token_times = streamer.token_times
            with lock:
                chunks.append(trace)
                tokens.append(Trace(trace.sent, streamer.token_times, trace.tokens, token_times=streamer.token_times,
                                    first=trace.first))

    threads = [threading.Thread(target=client, args=args) for args in zip(level.offsets, level.per_client())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return chunks, tokens


# -- report -------------------------------------------------------------------------------


def latency_row(name: str, streams: int, traces: list[Trace], cpu: dict[str, float],
                spread_s: float | None) -> dict[str, Any]:
    ok = [t for t in traces if t.status == 200 and t.chunks]
    ramp = [t.ttft for t in ok if t.first]
    ok = [t for t in ok if not t.first]
    ttfts = [t.ttft for t in ok]
    alone = [t.prompts_alone for t in ok if t.prompts_alone is not None]
    chunk_gaps = [g for t in ok for g in gaps(t.chunks)]
    token_gaps = [b - a for t in ok for a, b in t.token_pairs()]
    return {
        "contender": name, "streams": streams, "requests": len(traces),
        "errors": sum(t.status != 200 or not t.chunks for t in traces),
        "measured": len(ok), "ramp_ttft_p99_ms": percentile(ramp, 99) * 1000 if ramp else None,
        "start_spread_ms": (spread_s or 0.0) * 1000 if streams > 1 else None,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000, "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "ttft_ms": [round(t * 1000, 3) for t in ttfts],
        "first_text_split_pct": 100 * sum(t.first_text_tokens > 1 for t in ok) / len(ok) if ok else 0.0,
        "ttft_p99_first_token_text_ms": percentile([t.ttft for t in ok if t.first_text_tokens == 1], 99) * 1000,
        "prompts_alone_ttft_p50_ms": percentile(alone, 50) * 1000 if alone else None,
        "prompts_alone_ttft_p99_ms": percentile(alone, 99) * 1000 if alone else None,
        "chunk_gap_p50_ms": percentile(chunk_gaps, 50) * 1000, "chunk_gap_p99_ms": percentile(chunk_gaps, 99) * 1000,
        "token_gap_p50_ms": percentile(token_gaps, 50) * 1000 if token_gaps else None,
        "token_gap_p99_ms": percentile(token_gaps, 99) * 1000 if token_gaps else None,
        "chunks_per_stream": statistics.mean(len(t.chunks) for t in ok) if ok else 0.0,
        "tokens_per_stream": statistics.mean(t.tokens for t in ok) if ok else 0.0,
        "cpu_s": {k: round(v, 2) for k, v in cpu.items() if k != "redis_commands"},
        "redis_commands_per_token": (cpu["redis_commands"] / max(1, sum(t.tokens for t in ok))
                                     if "redis_commands" in cpu else None),
        "loadavg_1m": os.getloadavg()[0],
    }


def targets(rows: list[dict[str, Any]], gateway_prefill: list[dict[str, Any]],
            engine_prefill: list[dict[str, Any]], top: int) -> list[str]:
    def get(name: str, streams: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["contender"] == name and r["streams"] == streams), None)

    def met(ok: bool) -> str:
        return f"**{'met' if ok else 'not met'}**"

    def ratio(many: dict[str, Any], q: int, one: dict[str, Any]) -> str:
        """The P99 over the other row's P``q``, and where the true ratio lies (95%)."""
        low, high = ratio_interval(many["ttft_ms"], 99, one["ttft_ms"], q)
        point = f"{many['ttft_p99_ms'] / one[f'ttft_p{q}_ms']:.2f}x"
        if low <= 0 and math.isinf(high):
            return f"{point} (95% interval unbounded: too few requests to bound a P99)"
        return f"{point} (95% interval {low:.2f}x to {'unbounded' if math.isinf(high) else f'{high:.2f}x'})"

    lines = []
    for where in ("", ", in process"):
        one, many = get(f"stream engine{where}", 1), get(f"stream engine{where}", top)
        paged = get(f"paged engine{where}", top)
        label = f"stream engine{where or ' (gateway)'}"
        if one and many:
            alone = many.get("prompts_alone_ttft_p99_ms")
            ok = many["ttft_p99_ms"] <= 2 * one["ttft_p50_ms"]
            lines.append(f"- {label}: TTFT P99 at {top} streams {many['ttft_p99_ms']:.1f} ms <= 2x its 1-stream TTFT "
                         f"P50 ({2 * one['ttft_p50_ms']:.1f} ms): {met(ok)}, "
                         f"{ratio(many, 50, one)} its 1-stream P50 (against its 1-stream P99, "
                         f"{2 * one['ttft_p99_ms']:.1f} ms doubled: {ratio(many, 99, one)}"
                         + (f"; with prompts alone the {top}-stream P99 would be {alone:.1f} ms" if alone else "")
                         + ")")
        if many and paged:
            lines.append(f"- {label}: TTFT P99 at {top} streams {many['ttft_p99_ms']:.1f} ms below the paged "
                         f"engine's {paged['ttft_p99_ms']:.1f} ms: {met(many['ttft_p99_ms'] < paged['ttft_p99_ms'])}, "
                         f"{ratio(many, 99, paged)} its P99")
    for p in engine_prefill:
        if p["long_prompt"]:
            worst, median = p["token_worst_gap_s"], p["token_median_gap_s"]
            lines.append(f"- {p['contender']}: worst token gap during the long prefill {worst * 1000:.1f} ms vs 3x "
                         f"median token gap {3 * median * 1000:.1f} ms (repeat {p['repeat']}): "
                         f"{met(worst <= 3 * median)}")
    for p in gateway_prefill:
        if p["long_prompt"]:
            worst, median = p["token_worst_gap_s"], p["token_median_gap_s"]
            lines.append(f"- {p['contender']} (gateway, token gaps): worst token gap during the long prefill "
                         f"{worst * 1000:.1f} ms vs 3x median token gap {3 * median * 1000:.1f} ms (repeat "
                         f"{p['repeat']}): {met(worst <= 3 * median)}")
            worst, median = p["worst_gap_s"], p["median_gap_s"]
            lines.append(f"- {p['contender']} (gateway, chunk gaps): worst chunk gap during the long prefill "
                         f"{worst * 1000:.1f} ms vs 3x median chunk gap {3 * median * 1000:.1f} ms (repeat "
                         f"{p['repeat']}): {met(worst <= 3 * median)}")
    return lines


def _ms(seconds: float | None) -> float | str:
    return seconds * 1000 if seconds is not None else "-"


def _ms_or_dash(ms: float | None) -> float | str:
    return ms if ms is not None else "-"


def _ratio(worst: float, median: float) -> str:
    return f"{worst / median:.2f}x"


def arrivals_text(args: argparse.Namespace) -> str:
    if args.arrivals == "burst":
        return (f"Arrivals: burst (every request max_tokens {args.max_tokens}, all clients start together, so "
                f"streams finish in the same step and each round arrives as one burst of prefills: the worst "
                f"case for TTFT).")
    low, high = max_tokens_range(args.max_tokens)
    spread = (f"within {args.stagger_ms:g} ms" if args.stagger_ms is not None else
              "within one request's lifetime (the mean time from sending a request to its last chunk, measured "
              "for that contender at the lowest level; column 'starts within')")
    return (f"Arrivals: staggered (max_tokens drawn per request, uniform {low}-{high}; each client starts at a "
            f"random offset {spread}; seeded), so streams do not move in lockstep, as independent users' do "
            f"not. `--arrivals burst` gives the lockstep worst case.")


def render(args: argparse.Namespace, rows: list[dict[str, Any]], gateway_prefill: list[dict[str, Any]],
           engine_prefill: list[dict[str, Any]], fits: dict[str, dict[str, float]], long_tokens: list[int],
           threads: int) -> str:
    latency = markdown_table(
        ["contender", "streams", "requests", "measured", "starts within ms", "errors", "TTFT P50 ms", "TTFT P99 ms",
         "prompts alone TTFT P50 ms", "prompts alone TTFT P99 ms", "ramp TTFT P99 ms", "chunk gap P50 ms",
         "chunk gap P99 ms", "token gap P50 ms", "token gap P99 ms", "first text after 2+ tokens %",
         "TTFT P99 of the rest ms",
         "chunks/stream", "tokens/stream", "wall s", "CPU s gateway", "CPU s worker", "CPU s redis", "CPU s client",
         "Redis commands per token", "load 1m"],
        [[r["contender"], r["streams"], r["requests"], r["measured"], _ms_or_dash(r["start_spread_ms"]), r["errors"],
          r["ttft_p50_ms"], r["ttft_p99_ms"], _ms_or_dash(r.get("prompts_alone_ttft_p50_ms")),
          _ms_or_dash(r.get("prompts_alone_ttft_p99_ms")), _ms_or_dash(r["ramp_ttft_p99_ms"]), r["chunk_gap_p50_ms"],
          r["chunk_gap_p99_ms"], r["token_gap_p50_ms"] or "-", r["token_gap_p99_ms"] or "-",
          r["first_text_split_pct"], r["ttft_p99_first_token_text_ms"], r["chunks_per_stream"], r["tokens_per_stream"],
          r["cpu_s"]["wall"], r["cpu_s"].get("gateway", "-"), r["cpu_s"].get("worker", "-"),
          r["cpu_s"].get("redis", "-"), r["cpu_s"]["client"],
          r["redis_commands_per_token"] if r["redis_commands_per_token"] is not None else "-", r["loadavg_1m"]]
         for r in rows])
    gateway_long = markdown_table(
        ["engine", "repeat", "long prompt", "median token gap ms", "worst token gap in window ms",
         "worst / median (tokens)", "median chunk gap ms", "worst chunk gap in window ms", "worst / median (chunks)",
         "worst chunk gap anywhere ms", "long prompt TTFT ms", "statuses", "CPU s worker", "wall s"],
        [[p["contender"], p["repeat"], "yes" if p["long_prompt"] else "no (control)", p["token_median_gap_s"] * 1000,
          p["token_worst_gap_s"] * 1000, _ratio(p["token_worst_gap_s"], p["token_median_gap_s"]),
          p["median_gap_s"] * 1000, p["worst_gap_s"] * 1000, _ratio(p["worst_gap_s"], p["median_gap_s"]),
          p["worst_gap_anywhere_s"] * 1000, _ms(p["long_ttft_s"]), p["statuses"], p["cpu_s"]["worker"],
          p["cpu_s"]["wall"]] for p in gateway_prefill])
    engine_long = markdown_table(
        ["engine", "repeat", "long prompt", "median token gap ms", "worst token gap in window ms",
         "worst / median (tokens)", "median chunk gap ms", "worst chunk gap in window ms", "worst / median (chunks)",
         "long prompt add_request ms", "long prompt TTFT ms", "statuses", "wall s"],
        [[p["contender"], p["repeat"], "yes" if p["long_prompt"] else "no (control)", p["token_median_gap_s"] * 1000,
          p["token_worst_gap_s"] * 1000, _ratio(p["token_worst_gap_s"], p["token_median_gap_s"]),
          p["chunk_median_gap_s"] * 1000, p["chunk_worst_gap_s"] * 1000,
          _ratio(p["chunk_worst_gap_s"], p["chunk_median_gap_s"]), _ms(p["long_add_s"]), _ms(p["long_ttft_s"]),
          p["statuses"],
          p["cpu_s"]["wall"]] for p in engine_prefill])
    top = max(args.levels)
    sizes = "-".join(str(n) for n in sorted(set(long_tokens)))
    return "\n".join([
        f"# Stream engine benchmark ({args.size} model, {args.dtype}, {device_text(args.device)})",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()} with {os.cpu_count()} cores "
        f"shared with the load generator and other jobs. Prompts of 16-{args.prompt_tokens} tokens (distinct, "
        f"random ids), greedy, ignore_eos; closed loop, {args.rounds} request(s) per client and at least "
        f"{args.min_measured} measured per level, the levels run in {args.cycles} rounds ({', '.join(map(str, args.levels * 2))}, ...; "
        f"the contenders alternating at each). {arrivals_text(args)} "
        f"Gateway rows: SSE at the client through gateway + Redis (admission control off), workers at "
        f"{threads} torch thread(s)"
        f"{engine_place_text(args)}"
        f"{pinned_text(args, threads) if args.pin else ''}"
        f"{realtime_text(args)}; they see text chunks (a token that is part of a UTF-8 "
        f"character carries no text, so one chunk gap can span several steps); their token gaps are the gaps ended by "
        f"a chunk whose running usage shows it carries exactly one token. 'in process' rows: the same engines "
        f"and loop with no gateway, Redis or worker, timed as outputs leave step(): token gaps are between "
        f"tokens. transformers rows: in process, one thread per stream, 1 torch thread; 'chunks' times what "
        f"TextIteratorStreamer yields (held to word boundaries), 'tokens' times its put(). CPU s: seconds each "
        f"process spent in the scenario ('worker' is the serving one with its engine process); load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end. P99 is nearest rank: of n samples the "
        f"ceil(0.99 n)-th smallest (of 200 the third largest, of 64 the second largest). Measured: every request but "
        f"each client's first in each round. The first requests are the ramp, sent while the clients are still "
        f"joining: with starts spread over a lifetime at one stream they arrive faster than N streams in steady state "
        f"would (a model whose steps slow with N streams sees a burst), so their TTFT is apart ('ramp TTFT P99'). "
        f"Prompts alone: the TTFT each request would have had if its engine ran nothing but the level's prompts, "
        f"as they were sent, at this host's timed pass lengths (each the fastest of 7 sweeps before the levels and 7 "
        f"after them, on the stream engine; both engines run the same model runner; each pass takes every prompt "
        f"waiting, in order sent, and a request whose first token showed no text goes on in one-token passes right "
        f"after until it does): no decodes, no serving path. At {max(args.levels)} streams that queue of prompts lies "
        f"under every scheduler's TTFT on this host (`benchmarks/prompt_floor.py`). First text after 2+ tokens: the "
        f"requests whose first token showed no text (a byte of a character), so that the client waits for a second "
        f"pass at least; TTFT P99 of the rest: the P99 of the others.",
        "",
        latency,
        "",
        "Stream engine warmup fit (it prices every prefill decision) and, timed in this process, the prompt "
        "passes behind the prompts-alone TTFT: "
        + "; ".join(f"{where}: " + ", ".join(f"{k} {v:.3g}" for k, v in fit.items()) for where, fit in fits.items())
        + ".",
        "",
        *([f"## A {sizes}-token prompt arriving while 8 short streams run",
           "",
           f"8 streams of max_tokens {args.long_short_tokens}; once each has 8 tokens (in process) or 8 chunks "
           f"(gateway) the long prompt (max_tokens 1) is added to the same engine. Median gap: the short streams' "
           f"gaps after that moment; worst gap in window: the largest gap that ends between adding the long prompt "
           f"and its first token, or spans that token. Control rows: the same with no long prompt; their window "
           f"is everything after the lead. Each repeat uses fresh prompts, so the paged engine's prefix cache "
           f"never helps.",
           "",
           "In process, per token (what the engine's scheduling controls) and per text chunk. The long prompt "
           "is tokenized on a side thread while the steps go on, as in the worker; add_request then runs "
           "between two steps, so its time is part of the gap spanning it:",
           "",
           engine_long,
           "",
           "Through the gateway, at the client (token gaps: those ended by a one-token chunk):",
           "",
           gateway_long,
           ""] if gateway_prefill or engine_prefill else []),
        "## Targets",
        "",
        "Beside each TTFT ratio, where the true ratio lies with 95% confidence, from the order statistics "
        "alone (`benchmarks.loadgen.ratio_interval`; it assumes independent requests, so it is too narrow if "
        "anything): a target whose interval straddles its line was not decided by this run, and a P99 of fewer "
        "than 300 requests has no upper bound.",
        "",
        *targets(rows, gateway_prefill, engine_prefill, top),
    ])


# -- main ---------------------------------------------------------------------------------


@dataclass
class Level:
    """One load level: the requests ``(prompt, max_tokens)`` and each client's start, in
    seconds after the level begins (as fractions of the spread until :meth:`spread_over`)."""

    requests: list[tuple[str, int]]
    offsets: list[float]

    def per_client(self) -> list[list[tuple[str, int]]]:
        """Each client's own requests, so a client that starts late still finds its share
        and the level keeps its concurrency."""
        n = len(self.offsets)
        return [self.requests[i::n] for i in range(n)]

    def spread_over(self, seconds: float) -> Level:
        return Level(self.requests, [f * seconds for f in self.offsets])

    def part(self, index: int, parts: int) -> Level:
        """The ``index``-th of ``parts`` rounds of this level: every client gets its share."""
        clients = len(self.offsets)
        rounds = len(self.requests) // clients
        lo, hi = rounds * index // parts * clients, rounds * (index + 1) // parts * clients
        return Level(self.requests[lo:hi], self.offsets)


class Spread:
    """How far apart the clients of a level start: ``--stagger-ms`` when given, else one
    request's lifetime (sent to last chunk) at the lowest level measured, for each contender
    its own. Clients spread over a lifetime arrive as independent users do in steady state;
    spread over a fixed few ms they are a burst on a model whose prefill takes longer."""

    def __init__(self, fixed_ms: float | None) -> None:
        self.seconds = fixed_ms / 1000 if fixed_ms is not None else None

    def level(self, level: Level) -> Level:
        return level.spread_over(self.seconds or 0.0)

    def learn(self, traces: list[Trace]) -> None:
        lifetimes = [t.chunks[-1] - t.sent for t in traces if t.chunks]
        if self.seconds is None and lifetimes:
            self.seconds = statistics.mean(lifetimes)


@dataclass
class Prompts:
    """Every contender gets the same requests, and each engine sees each prompt once, so the
    paged engine's prefix cache never turns a repeat into a free prefill."""

    warmup: Level
    levels: dict[int, Level]
    long: list[tuple[list[str], list[str], str]]
    """Per repeat: the control's 8 short prompts, the 8 beside the long prompt, the long one."""
    tokens: dict[str, int]
    """Each short prompt's length in tokens."""


def max_tokens_range(max_tokens: int) -> tuple[int, int]:
    """Staggered arrivals draw each request's max_tokens from half to 1.5x the nominal one."""
    return max(1, max_tokens // 2), max(1, max_tokens * 3 // 2)


def make_prompts(tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace) -> Prompts:
    rng = random.Random(args.seed)
    # lengths and offsets draw from their own generator, so both arrival modes get the same prompts
    arrivals = random.Random(args.seed + 1)

    def shorts(n: int) -> list[str]:
        return [random_prompt(tokenizer, rng, rng.randint(16, args.prompt_tokens)) for _ in range(n)]

    def level(clients: int) -> Level:
        prompts = shorts(clients * max(args.rounds, args.cycles + -(-args.min_measured // clients)))
        if args.arrivals == "burst":
            return Level([(p, args.max_tokens) for p in prompts], [0.0] * clients)
        low, high = max_tokens_range(args.max_tokens)
        return Level([(p, arrivals.randint(low, high)) for p in prompts],
                     [arrivals.random() if clients > 1 else 0.0 for _ in range(clients)])

    warmup = Level([(p, 8) for p in shorts(4)], [0.0] * 4)
    levels = {clients: level(clients) for clients in args.levels}
    long = [(shorts(8), shorts(8), random_prompt(tokenizer, rng, args.long_tokens)) for _ in range(args.long_repeats)]
    tokens = {p: len(tokenizer(p, verbose=False).input_ids) for lv in levels.values() for p, _ in lv.requests}
    return Prompts(warmup, levels, long, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "100m"])
    parser.add_argument("--model-dir", type=Path, help="an existing model directory instead of building one")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="auto", help="where the engines run: cpu, cuda[:N] or auto (the GPU if "
                                                         "there is one)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16], help="concurrent streams")
    parser.add_argument("--rounds", type=int, default=8, help="requests per client at each level")
    parser.add_argument("--min-measured", type=int, default=200,
                        help="steady-state requests per level at least (a level of few clients gets more rounds): "
                             "the P99 of fewer than 100 is their largest, one stall on a shared host")
    parser.add_argument("--cycles", type=int, default=4,
                        help="rounds over the levels (1, 4, 16, 1, 4, 16, ...), each with a share of every level's "
                             "requests; each client's first request of a round is part of that round's ramp")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="every request's max_tokens (burst), or the middle of their range (staggered)")
    parser.add_argument("--arrivals", choices=["staggered", "burst"], default="staggered",
                        help="staggered: varied max_tokens and client start offsets; burst: streams in lockstep")
    parser.add_argument("--stagger-ms", type=float,
                        help="the latest client start (staggered; default: one request's lifetime at the lowest "
                             "level, for each contender)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="longest short prompt (BOS included)")
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--long-short-tokens", type=int, default=96, help="max_tokens of the 8 short streams")
    parser.add_argument("--long-repeats", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=16, help="the stream engine's max_batch")
    parser.add_argument("--stream-option", action="append", default=[], metavar="KEY=VALUE",
                        help="another stream engine option, through the gateway and in process (as slogate "
                             "worker -o; e.g. cut_ins_per_step=0 for the A/B)")
    parser.add_argument("--threads", type=int,
                        help="torch threads of the workers and the in-process engines (default: as `slogate up` "
                             "sets them, the cores shared among the two workers)")
    parser.add_argument("--pin", action="store_true",
                        help="gateway rows: the engine processes on CPUs of their own (the last --threads), the "
                             "gateway, Redis, the workers' event loops and the load generator on the rest")
    parser.add_argument("--realtime", action="store_true",
                        help="gateway rows: the gateway, the workers' event loops and Redis at a real-time priority "
                             "(slogate up --realtime)")
    parser.add_argument("--realtime-client", action="store_true",
                        help="the load generator at a real-time priority: it stands in for clients on other "
                             "machines, and its own wait for a core is none of the serving path's")
    parser.add_argument("--engine-in-worker", action="store_true",
                        help="workers step their engine on a thread (slogate worker --in-process), not in a "
                             "process of their own")
    parser.add_argument("--skip-in-process", action="store_true", help="skip the engines without the gateway")
    parser.add_argument("--skip-gateway", action="store_true", help="only the engines in process (and transformers)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", help="results file name under benchmarks/results (default: from the options)")
    args = parser.parse_args()
    args.device = str(resolve_device(args.device))

    threads = args.threads or max(1, (os.cpu_count() or 1) // len(POOLS))
    torch.set_num_threads(1)
    engine_prefill: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir or build_tiny_model(Path(tmp) / args.size, size=args.size))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = make_prompts(tokenizer, args)
        long_tokens = [len(tokenizer(long).input_ids) for _, _, long in prompts.long]
        rows: list[dict[str, Any]] = []
        gateway_prefill: list[dict[str, Any]] = []
        fits: dict[str, dict[str, float]] = {}
        if not args.skip_gateway:
            rows, gateway_prefill, fits["worker (first heartbeat)"] = run_gateway(args, model_dir, prompts, threads)
        if not args.skip_in_process:
            in_process, engine_prefill, fits["in process"] = run_in_process(args, model_dir, prompts, threads)
            rows += in_process
        if not args.skip_transformers:
            rows += run_transformers(model_dir, tokenizer, prompts, args.dtype, args.device, args.stagger_ms)

    text = render(args, rows, gateway_prefill, engine_prefill, fits, long_tokens, threads)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"stream_engine_{args.size}" + (f"_{args.dtype}" if args.dtype != "fp32" else "")
    name += "_cuda" if args.device.startswith("cuda") else ""
    name += f"_threads{args.threads}" if args.threads else ""
    name += "_burst" if args.arrivals == "burst" else ""
    name += "_pinned" if args.pin else ""
    name += "_engine_in_worker" if args.engine_in_worker else ""
    name += "_realtime" if args.realtime else ""
    name += "_realtime_client" if args.realtime_client else ""
    name = args.name or name
    (RESULTS / f"{name}.md").write_text(text + "\n")
    payload = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "long_prompt_tokens": long_tokens, "stream_engine_warmup_fit": fits, "rows": rows,
               "long_prefill_gateway": gateway_prefill, "long_prefill_in_process": engine_prefill}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")


def run_gateway(args: argparse.Namespace, model_dir: Path, prompts: Prompts,
                threads: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, float]]:
    """Both engines behind one gateway."""
    model = model_dir.name
    everywhere = os.sched_getaffinity(0)
    timer = functools.cache(lambda: stream_engine(args, model_dir))
    before = stream_pass_times(timer, threads)
    passes = functools.cache(lambda: stream_pass_times(timer, threads, before))
    with tempfile.TemporaryDirectory() as tmp:
        redis = LocalRedis(Path(tmp)).start()
        env = {"SLOGATE_ADMISSION_CONTROL": "0", "SLOGATE_MODEL": str(model_dir)}
        stack = Stack(redis.url, {**env, "OMP_NUM_THREADS": str(threads)})
        layout = pinned_layout(threads) if args.pin else None
        try:
            stack.gateway(*(["--cpus", layout[0]] if layout else []), *(["--realtime"] if args.realtime else []))
            if args.realtime:
                run_first(redis.proc.pid)
            if args.realtime_client:
                run_first()
            dtype = f'dtype="{args.dtype}"'
            device = f'device="{args.device}"'
            cpus = layout[1] if layout else None
            inside = args.engine_in_worker
            workers = {"stream": stack.worker("interactive", "stream", dtype, device, f"max_batch={args.max_batch}",
                                              *args.stream_option, cpus=cpus, in_process=inside,
                                              realtime=args.realtime),
                       "paged": stack.worker("batch", "paged", dtype, device, cpus=cpus, in_process=inside,
                                             realtime=args.realtime)}
            if layout:
                for pid in (0, redis.proc.pid):
                    os.sched_setaffinity(pid, parse_cpus(layout[0]))
            stack.wait_models(model, pools=2, timeout=300)
            if layout and not args.engine_in_worker:
                for proc in workers.values():  # the engine processes keep the workers' CPUs
                    for tid in os.listdir(f"/proc/{proc.pid}/task"):
                        os.sched_setaffinity(int(tid), parse_cpus(layout[0]))
            fit = worker_fit(redis.url, POOLS["stream"])
            for pool in POOLS.values():
                uvloop.run(closed_loop(stack.url, model, pool, prompts.warmup))
            rows, prefill = take_turns([Contender(
                f"{engine} engine",
                CpuMeter({"gateway": stack.procs[0].pid, "worker": workers[engine].pid, "redis": redis.proc.pid},
                         redis.url),
                lambda level, pool=pool: uvloop.run(closed_loop(stack.url, model, pool, level)),
                lambda shorts, big, pool=pool: uvloop.run(long_prefill(stack.url, model, pool, shorts, big,
                                                                        args.long_short_tokens)),
                passes,
            ) for engine, pool in POOLS.items()], prompts, args.stagger_ms, args.cycles)
            fit |= pass_fit(passes())
        finally:
            stack.stop()
            redis.stop()
            os.sched_setaffinity(0, everywhere)
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return rows, prefill, fit


def device_text(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))} ({device})"
    return "CPU"


def engine_place_text(args: argparse.Namespace) -> str:
    options = f"; stream engine options: {', '.join(args.stream_option)}" if args.stream_option else ""
    if args.engine_in_worker:
        return ", each engine on a thread of its worker (--engine-in-worker)" + options
    return ", each engine in a process of its own beside its worker" + options


def pinned_text(args: argparse.Namespace, threads: int) -> str:
    rest, own = pinned_layout(threads)
    if args.engine_in_worker:
        return f", pinned (--pin): workers on CPU(s) {own}, gateway, Redis and load generator on CPU(s) {rest}"
    return (f", pinned (--pin): engine processes on CPU(s) {own}; gateway, Redis, the workers' own threads "
            f"and the load generator on CPU(s) {rest}")


def realtime_text(args: argparse.Namespace) -> str:
    parts = (["the gateway's and the workers' event loops and Redis (--realtime; the engines' steps are not)"]
             if args.realtime else []) + (["the load generator (--realtime-client)"] if args.realtime_client else [])
    return f", {' and '.join(parts)} at a real-time priority" if parts else ""


def pinned_layout(threads: int) -> tuple[str, str]:
    """``--pin``: (CPUs of the gateway, Redis and this load generator; CPUs of the engines).
    The engines get the last ``threads`` CPUs, everything else the rest, as a deployment
    would give a latency-bound engine cores of its own. Only one worker serves at a time."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) <= threads:
        raise SystemExit(f"--pin needs more CPUs than the workers' {threads} thread(s); this process has {len(cpus)}")
    rest, own = cpus[:-threads], cpus[-threads:]
    return ",".join(map(str, rest)), ",".join(map(str, own))


def run_transformers(model_dir: Path, tokenizer: PreTrainedTokenizerBase, prompts: Prompts,
                     dtype: str, device: str, stagger_ms: float | None) -> list[dict[str, Any]]:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]).to(device).eval()
    model.generation_config.eos_token_id = None
    meter = CpuMeter({})
    hf_closed_loop(model, tokenizer, prompts.warmup)
    freeze_startup_heap()
    rows = []
    spread = Spread(stagger_ms)
    for level, batch in prompts.levels.items():
        (chunks, tokens), cpu = meter.measure(lambda: hf_closed_loop(model, tokenizer, spread.level(batch)))
        rows.append(latency_row("transformers TextIteratorStreamer (chunks)", level, chunks, cpu, spread.seconds))
        rows.append(latency_row("transformers TextIteratorStreamer (tokens)", level, tokens, cpu, spread.seconds))
        spread.learn(chunks)
        print(json.dumps(rows[-2]), flush=True)
    return rows


if __name__ == "__main__":
    main()
