"""What holding output to a JSON schema (``response_format``) costs the engines, in process.

Two figures, each with and without a schema, on the same engine:

- decode steps at 1, 4 and 16 streams: only steps where every stream decodes one token count,
  so both sides time the same work but for the schema's mask (computed per stream, applied to
  its row) and the matcher's advance;
- time to the first token of one request arriving at an idle engine, its schema compiled as it
  arrives (every request compiles its own: the engine keeps no compiled schemas).

Free text runs with ``ignore_eos``; the JSON is an array of exactly 40 integers from 0 to 999,
so both sides decode long enough to time. Run::

    python -m benchmarks.json_output [--size 100m] [--engine paged]

Results are printed and written to ``benchmarks/results/json_output_<size>_<engine>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engines.base import EngineRequest
from engines.paged import PagedEngine
from engines.paged import create as paged_create
from engines.runtime.tiny_model import build_tiny_model
from engines.stream import create as stream_create
from slogate.protocol import SamplingParams

RESULTS = Path(__file__).parent / "results"
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 40, "maxItems": 40}
VERDICT = {"type": "object", "properties": {"risk": {"type": "integer", "minimum": 0, "maximum": 100},
                                            "label": {"enum": ["approve", "review", "decline"]}},
           "required": ["risk", "label"], "additionalProperties": False}
PROMPT = "Score the card payment of 9,800 EUR to a new payee and list the evidence"


def _sampling(schema: dict[str, Any] | None, max_tokens: int) -> SamplingParams:
    if schema is None:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, json_schema=json.dumps(schema))


def decode_steps(engine: PagedEngine, streams: int, schema: dict[str, Any] | None, rounds: range) -> list[float]:
    """Seconds of each step in which all ``streams`` decode one token each."""
    times: list[float] = []
    for r in rounds:
        live = set()
        for i in range(streams):
            rid = f"{r}-{i}"
            live.add(rid)
            engine.add_request(EngineRequest(rid, _sampling(schema, 160), time.time() + 3600,
                                             prompt=f"{PROMPT} #{r}-{i}"))
        started: set[str] = set()
        while engine.has_unfinished():
            began = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - began
            tokens = [o for o in outputs if o.token_ids]
            if (started == live and len(tokens) == streams
                    and all(o.finish_reason is None for o in outputs)):
                times.append(seconds)
            started.update(o.request_id for o in tokens)
            assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return times


class GrammarClock:
    """Seconds the engine spends in its grammar work (masks, then advancing the matchers), and
    the held tokens it did it for: a figure the step's noise on a shared host does not drown."""

    def __init__(self, engine: PagedEngine) -> None:
        self.seconds, self.tokens = 0.0, 0
        grammars = engine.grammars
        for name in ("blocked", "advance"):
            setattr(grammars, name, self._timed(getattr(grammars, name), count=name == "advance"))

    def _timed(self, fn: Any, count: bool) -> Any:
        def timed(matchers: list[Any], *rest: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(matchers, *rest)
            finally:
                self.seconds += time.perf_counter() - began
                self.tokens += len(matchers) if count else 0
        return timed

    def take(self) -> float:
        """Microseconds per held token since the last take."""
        per = self.seconds / max(self.tokens, 1) * 1e6
        self.seconds, self.tokens = 0.0, 0
        return per


def first_token(engine: PagedEngine, schema: dict[str, Any] | None, repeats: int, fresh: bool = False) -> list[float]:
    """Seconds from ``add_request`` to the first token, one request at a time; ``fresh``: each
    with a schema the engine has not compiled (its description differs)."""
    times = []
    for r in range(repeats):
        rid = f"ttft-{r}-{fresh}"
        own = {**schema, "description": f"request {r}"} if fresh and schema is not None else schema
        began = time.perf_counter()
        engine.add_request(EngineRequest(rid, _sampling(own, 4), time.time() + 3600, prompt=f"{PROMPT} ({r})"))
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.token_ids and first is None:
                    first = time.perf_counter() - began
        assert first is not None
        times.append(first)
    return times


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "100m"])
    parser.add_argument("--engine", default="stream", choices=["stream", "paged"])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=6, help="batches of streams per level and side, in turns")
    parser.add_argument("--repeats", type=int, default=40, help="first-token requests per side")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--name", default=None, help="results file stem")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / args.size, size=args.size)
        create = stream_create if args.engine == "stream" else paged_create
        engine = create(str(model_dir), dtype="fp32", device="cpu")
        clock = GrammarClock(engine)
        decode_steps(engine, 4, NUMBERS, range(-1, 0))  # warm both paths
        decode_steps(engine, 4, None, range(-2, -1))
        rows = []
        for streams in args.levels:
            clock.take()
            sides: dict[str, list[float]] = {"free text": [], "JSON schema": []}
            for r in range(args.rounds):  # the sides take turns, so drift on the host hits both alike
                turns = [("free text", None), ("JSON schema", NUMBERS)]
                for label, schema in turns if r % 2 == 0 else turns[::-1]:
                    sides[label] += decode_steps(engine, streams, schema, range(r, r + 1))
            free, held = statistics.median(sides["free text"]), statistics.median(sides["JSON schema"])
            rows.append({"streams": streams, "steps": [len(v) for v in sides.values()],
                         "free_ms": free * 1e3, "json_ms": held * 1e3,
                         "free_p99_ms": _p(sides["free text"], 0.99) * 1e3,
                         "json_p99_ms": _p(sides["JSON schema"], 0.99) * 1e3,
                         "per_stream_us": (held - free) / streams * 1e6, "grammar_us": clock.take()})
        ttft = {"free text": first_token(engine, None, args.repeats),
                "JSON schema, kept from an earlier request": first_token(engine, VERDICT, args.repeats),
                "JSON schema, new (compiled on arrival)": first_token(engine, VERDICT, args.repeats, fresh=True)}
    report(args, rows, ttft)


def report(args: argparse.Namespace, rows: list[dict[str, Any]], ttft: dict[str, list[float]]) -> None:
    lines = [
        f"# JSON output cost ({args.size} model, {args.engine} engine, fp32, CPU, in process)", "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()} with "
        f"{torch.get_num_threads()} torch thread(s). `python -m benchmarks.json_output --size {args.size} "
        f"--engine {args.engine}`. Decode steps: only steps where every stream decodes one token; free "
        "text (ignore_eos) against an array of exactly 40 integers 0-999; "
        f"{args.rounds} batches of streams per level and side, the sides taking turns.", "",
        "| streams | steps timed (free / JSON) | step P50 free ms | step P50 JSON ms | step P99 free ms "
        "| step P99 JSON ms | step P50 difference per stream µs | grammar work per token µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['streams']} | {r['steps'][0]} / {r['steps'][1]} | {r['free_ms']:.2f} | {r['json_ms']:.2f} "
                     f"| {r['free_p99_ms']:.2f} | {r['json_p99_ms']:.2f} | {r['per_stream_us']:.0f} "
                     f"| {r['grammar_us']:.0f} |")
    lines += ["", "Grammar work: the engine's time in computing the masks and advancing the matchers (timed "
              "around those calls, all steps of the JSON side), per token held to the schema; applying the "
              "mask while sampling is not in it."]
    lines += ["", f"Time to the first token, one request at a time at an idle engine ({args.repeats} each; the "
              "schema is a two-field risk verdict):", "",
              "| request | P50 ms | P99 ms |", "|---|---|---|"]
    for label, values in ttft.items():
        lines.append(f"| {label} | {statistics.median(values) * 1e3:.2f} | {_p(values, 0.99) * 1e3:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    stem = args.name or f"json_output_{args.size}_{args.engine}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.md").write_text(text)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"rows": rows, "ttft_s": ttft}, indent=1))


if __name__ == "__main__":
    main()
