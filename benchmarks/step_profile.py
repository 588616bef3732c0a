"""What one engine step costs, by shape, on the device the engine runs on: the quick check to
run first on a new machine (a GPU above all) before the serving benchmarks.

It answers three questions the serving figures cannot separate:

- how a step's time grows with decode rows and prompt tokens (the stream engine's cost model);
- whether the first step of a new shape costs more than the next ones of the same shape (a
  backend that builds a kernel or plan per shape makes every new prompt length pay it, which a
  closed-loop benchmark sees as a slow TTFT tail and a chunked prompt as slow chunks);
- how much of a decode step is the host issuing work rather than the device doing it
  (torch.profiler: operator calls per step, host time, device time), which decides whether a
  faster device helps at all.

Run::

    python -m benchmarks.step_profile                       # tiny model, the default device
    python -m benchmarks.step_profile --size 100m --dtype bf16 --device cuda

Each step runs on scratch KV blocks through the stream engine (as its start-up warmup does),
synchronized on a GPU. The table goes to ``benchmarks/results/step_profile_<size>_<dtype>_<device>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.loadgen import markdown_table
from engines import stream
from engines.runtime.tiny_model import build_tiny_model

RESULTS = Path(__file__).resolve().parent / "results"
STEPS: list[tuple[str, list[tuple[int, int]]]] = [
    ("1 decode at 64", [(64, 1)]),
    ("4 decodes at 64", [(64, 1)] * 4),
    ("16 decodes at 64", [(64, 1)] * 16),
    ("16 decodes at 500", [(500, 1)] * 16),
    ("prompt of 16", [(0, 16)]),
    ("prompt of 37", [(0, 37)]),
    ("prompt of 64", [(0, 64)]),
    ("16 decodes + prompt of 64", [(64, 1)] * 16 + [(0, 64)]),
    ("16 decodes + two prompts of 48", [(64, 1)] * 16 + [(0, 48)] * 2),
    ("prompt of 1000", [(0, 1000)]),
    ("prompt of 2000", [(0, 2000)]),
    ("chunk of 64 at 1000", [(1000, 64)]),
    ("chunk of 300 at 1500", [(1500, 300)]),
    ("8 decodes + chunk of 64 at 1000", [(64, 1)] * 8 + [(1000, 64)]),
]


def measure(engine: stream.StreamEngine, parts: list[tuple[int, int]], repeats: int) -> tuple[float, float]:
    """(first run, median of the next ``repeats``) in seconds."""
    first = engine.time_step(parts)
    return first, statistics.median(engine.time_step(parts) for _ in range(repeats))


def host_and_device(engine: stream.StreamEngine, parts: list[tuple[int, int]], steps: int) -> dict[str, float]:
    """Per step: wall time, operator calls, host time in operators and device time in
    kernels (0 on a CPU, where the host does the work)."""
    engine.time_step(parts)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.loaded.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            engine.time_step(parts)
        wall = time.perf_counter() - began
    events = prof.key_averages()
    calls = sum(e.count for e in events if e.key.startswith("aten::"))
    host = sum(e.self_cpu_time_total for e in events)
    device = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
    return {"wall_ms": wall / steps * 1e3, "aten_calls": calls / steps, "host_ms": host / steps / 1e3,
            "device_ms": device / steps / 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=["tiny", "100m"])
    parser.add_argument("--model-dir", type=Path, help="an existing model directory instead of building one")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto (the GPU if there is one)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--name", help="results file stem (default: from the options)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_tiny_model(Path(tmp) / args.size, size=args.size)
        engine = stream.create(str(model_dir), dtype=args.dtype, device=args.device)
    device, dtype = engine.loaded.device, str(engine.loaded.dtype).removeprefix("torch.")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    rows = []
    for label, parts in STEPS:
        first, steady = measure(engine, parts, args.repeats)
        rows.append([label, first * 1e3, steady * 1e3, f"{first / steady:.1f}x"])
        print(rows[-1], flush=True)
    split = {label: host_and_device(engine, parts, args.repeats) for label, parts in STEPS[:3]}
    cost = engine.cost
    text = "\n".join([
        f"# Engine step profile ({args.size} model, {dtype}, {where})",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}. Each step runs on scratch "
        f"KV blocks through the stream engine, after its start-up warmup (which times steps of 1 token, of "
        f"decodes and of 256-token prompts). 'first' is the first step of that shape, 'steady' the median of the "
        f"next {args.repeats}.",
        "",
        markdown_table(["step", "first ms", "steady ms", "first / steady"], rows),
        "",
        "Where a decode step's time goes (torch.profiler over "
        f"{args.repeats} steps; device time is the kernels' own, 0 on a CPU):",
        "",
        markdown_table(["step", "wall ms", "aten calls (nested ones too)", "host ms in operators",
                        "device ms in kernels"],
                       [[label, s["wall_ms"], f"{s['aten_calls']:.0f}", s["host_ms"], s["device_ms"]]
                        for label, s in split.items()]),
        "",
        f"The stream engine's warmup fit: fixed {cost.fixed_s * 1e3:.2f} ms, per decode row "
        f"{cost.per_decode_s * 1e6:.1f} us, per prompt token {cost.per_token_s * 1e6:.2f} us, per token and "
        f"position {cost.per_token_per_position_s * 1e9:.2f} ns.",
    ])
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name or f'step_profile_{args.size}_{dtype}_{device.type}'}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
