"""Throughput of the paged engine against transformers and vLLM's CPU build, and what a
prefix-cache hit does to time to first token.

Two workloads, seeded so every run and every contender sees the same token ids: ``varied``
(the issue's target), 64 requests submitted at once with prompts of 32-512 tokens and outputs
of 16-256 tokens; ``reference`` (the issue's reference figures), 32 prompts of 64 tokens with
128 output tokens each. All greedy with ``ignore_eos``. Contenders: the paged engine;
transformers ``generate`` one request at a time; ``generate`` over static batches of 32 (left
padding, each batch runs to its longest output, only the tokens each request asked for
count); transformers' own continuous batching manager; and vLLM's offline ``LLM.generate``
run by ``--vllm-python`` (an interpreter with vLLM installed) on ``vllm_offline.py``. Run::

    python -m benchmarks.batch_engine                # tiny model, fp32
    python -m benchmarks.batch_engine --size 100m --dtype bf16 --threads 2 --sequential 4 \
        --skip-transformers-cb --vllm-python /work/vllm-venv/bin/python --repeats 3 [--workload reference]

Results are printed and written to
``benchmarks/results/batch_engine_<size>_<workload>_<dtype>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from engines.base import EngineRequest
from engines.paged import PagedEngine, PagedOptions
from engines.runtime.loader import LoadedModel, load_model
from engines.runtime.tiny_model import build_tiny_model
from slogate.protocol import SamplingParams

RESULTS = Path(__file__).parent / "results"
RESULT_MARK = "vllm_offline result: "
"""Starts the line ``vllm_offline.py`` prints its result on (vLLM logs to stdout too)."""


@dataclass
class Job:
    prompt: str
    prompt_ids: list[int]
    """What the engine's tokenizer makes of ``prompt``; the transformers runs get the same ids."""
    max_tokens: int


@dataclass
class Row:
    name: str
    output_tokens: int
    seconds: float
    cpu_seconds: float = 0.0
    """Process CPU time: on a shared machine it moves less than wall time with other load."""
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


class _Clock:
    """Wall and process CPU time since creation."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def row(self, name: str, tokens: int) -> Row:
        return Row(name, tokens, time.perf_counter() - self.wall, time.process_time() - self.cpu)


def make_jobs(loaded: LoadedModel, workload: str, n: int, seed: int) -> list[Job]:
    """``varied``: prompts of 32-512 tokens, outputs of 16-256; ``reference``: prompts of
    exactly 64 tokens, 128 output tokens."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        if workload == "reference":
            jobs.append(Job(*_exact_prompt(loaded, rng, 64), 128))
        else:
            text = _random_text(loaded, rng, rng.randint(32, 512))
            jobs.append(Job(text, loaded.encode(text, None), rng.randint(16, 256)))
    return jobs


def _exact_prompt(loaded: LoadedModel, rng: random.Random, num_tokens: int) -> tuple[str, list[int]]:
    """A text that encodes to exactly ``num_tokens`` ids, and those ids: the engine takes text,
    the other contenders take ids, and all must see the same prompt."""
    for _ in range(100):
        ids = loaded.encode(_random_text(loaded, rng, num_tokens + 16), None)[:num_tokens]
        text = loaded.tokenizer.decode(ids, skip_special_tokens=True)
        if loaded.encode(text, None) == ids:
            return text, ids
    raise RuntimeError(f"no text found that encodes to exactly {num_tokens} tokens")


def _random_text(loaded: LoadedModel, rng: random.Random, num_tokens: int) -> str:
    """Text of about ``num_tokens`` tokens (decoding random ids and encoding again may merge
    a few)."""
    special = set(loaded.tokenizer.all_special_ids)
    vocab = range(max(special) + 1, len(loaded.tokenizer))
    return loaded.tokenizer.decode([rng.choice(vocab) for _ in range(num_tokens)])


def run_paged(engine: PagedEngine, jobs: list[Job]) -> Row:
    """All jobs submitted at once; the clock runs until the last token."""
    tokens = 0
    clock = _Clock()
    for i, job in enumerate(jobs):
        engine.add_request(_request(engine, f"j{i}", job.prompt, job.max_tokens))
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens += len(out.token_ids)
    return clock.row("slogate paged engine", tokens)


def run_sequential(model: PreTrainedModel, jobs: list[Job]) -> Row:
    tokens = 0
    clock = _Clock()
    for job in jobs:
        ids = torch.tensor([job.prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **_greedy(job.max_tokens))
        tokens += out.shape[1] - ids.shape[1]
    return clock.row("transformers generate, one at a time", tokens)


def run_static(model: PreTrainedModel, jobs: list[Job], batch_size: int, pad_id: int) -> Row:
    tokens = 0
    clock = _Clock()
    for first in range(0, len(jobs), batch_size):
        batch = jobs[first : first + batch_size]
        width = max(len(j.prompt_ids) for j in batch)
        ids = torch.full((len(batch), width), pad_id)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, job in enumerate(batch):
            ids[row, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            mask[row, width - len(job.prompt_ids) :] = 1
        model.generate(ids, attention_mask=mask, pad_token_id=pad_id, **_greedy(max(j.max_tokens for j in batch)))
        tokens += sum(j.max_tokens for j in batch)
    return clock.row(f"transformers generate, static batches of {batch_size}", tokens)


def run_transformers_cb(model: PreTrainedModel, jobs: list[Job]) -> Row:
    """transformers' continuous batching manager (its own paged cache and scheduler)."""
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=256)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    tokens = 0
    clock = _Clock()
    try:
        for i, job in enumerate(jobs):
            manager.add_request(job.prompt_ids, request_id=f"j{i}", max_new_tokens=job.max_tokens, eos_token_id=-1)
        done = 0
        while done < len(jobs):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("no result within 60 s")
            if result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
        row = clock.row("transformers continuous batching (init_continuous_batching)", tokens)
    finally:
        manager.stop(block=True)
    return row


def median_row(runs: list[Row]) -> Row:
    """The median of repeated runs, the others in its note: on a shared 2-core host one run
    can move by 15%."""
    row = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    if len(runs) > 1:
        row.note = f"median of {len(runs)} runs: " + ", ".join(f"{r.seconds:.1f}" for r in runs) + " s"
    return row


def run_vllm(python: str | None, model_dir: Path, dtype: str, jobs: list[Job], threads: int,
             repeats: int = 1) -> Row:
    """vLLM's offline ``LLM.generate`` on the same token ids, in a subprocess under ``python``
    (vLLM needs its own torch and transformers). Its OpenMP threads are bound to the first
    ``threads`` cores with none reserved, so it computes on as many cores as the others."""
    name = "vLLM CPU, offline LLM.generate"
    if not python:
        return Row(name, 0, 0.0, note="not run: no --vllm-python")
    spec = {
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": max(len(j.prompt_ids) + j.max_tokens for j in jobs),
        "prompts": [j.prompt_ids for j in jobs],
        "max_tokens": [j.max_tokens for j in jobs],
        "repeats": repeats,
    }
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as spec_file:
        json.dump(spec, spec_file)
        spec_file.flush()
        script = Path(__file__).with_name("vllm_offline.py")
        try:
            done = subprocess.run(
                [python, str(script), spec_file.name], capture_output=True, text=True, env=env, timeout=1800
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Row(name, 0, 0.0, note=f"failed: {exc!r}"[:160])
    found = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if done.returncode != 0 or not found:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Row(name, 0, 0.0, note=f"failed (exit {done.returncode}): {last}"[:160])
    result = json.loads(found[-1][len(RESULT_MARK) :])
    row = median_row([Row(name, result["output_tokens"], s) for s in result["seconds"]])
    row.note = f"{threads} OpenMP threads, wall time only" + (f"; {row.note}" if row.note else "")
    return row


def prefix_ttft(engine: PagedEngine, seed: int, repeats: int = 5) -> tuple[float, float]:
    """Median TTFT of a request whose 512-token prefix is cached, and of one whose is not."""
    rng = random.Random(seed)
    cached, uncached = [], []
    for r in range(repeats):
        prefix = _random_text(engine.loaded, rng, 512)
        uncached.append(_ttft(engine, f"u{r}", prefix + " first question"))
        cached.append(_ttft(engine, f"c{r}", prefix + " second question"))
    return statistics.median(cached), statistics.median(uncached)


def _ttft(engine: PagedEngine, rid: str, prompt: str) -> float:
    started = time.perf_counter()
    engine.add_request(_request(engine, rid, prompt, 1))
    while True:
        if any(out.token_ids for out in engine.step()):
            return time.perf_counter() - started


def _request(engine: PagedEngine, rid: str, prompt: str, max_tokens: int) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, sampling, time.time() + 86400, prompt=prompt)


def _greedy(max_new_tokens: int) -> dict:
    return {"do_sample": False, "max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "100m"])
    parser.add_argument("--model-dir", type=Path, help="an existing model directory instead of building one")
    parser.add_argument("--workload", default="varied", choices=["varied", "reference"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--requests", type=int, help="default: 64 (varied), 32 (reference)")
    parser.add_argument("--sequential", type=int, default=64, help="how many jobs the one-at-a-time run serves (0: skip)")
    parser.add_argument("--static-batch", type=int, default=32)
    parser.add_argument("--skip-transformers-cb", action="store_true")
    parser.add_argument("--vllm-python", help="a Python interpreter with vLLM installed (the vLLM row is skipped without)")
    parser.add_argument("--max-batched-tokens", type=int, default=PagedOptions.max_batched_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=PagedOptions.max_num_seqs)
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of the paged engine (a fresh one each) and of vLLM; the median counts")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--name", help="results file stem (default: from the options)")
    args = parser.parse_args()
    args.requests = args.requests or (32 if args.workload == "reference" else 64)

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_tiny_model(Path(tmp) / args.size, size=args.size)
        loaded = load_model(str(model_dir), dtype=args.dtype, device="cpu")
        jobs = make_jobs(loaded, args.workload, args.requests, args.seed)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
        hf.generation_config.eos_token_id = None
        pad_id = loaded.tokenizer.pad_token_id

        options = PagedOptions(
            max_batched_tokens=args.max_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            kv_cache_bytes=args.kv_cache_mib * 2**20,
        )
        run_paged(PagedEngine(loaded, options), jobs[:4])
        runs = []
        for _ in range(args.repeats):
            engine = PagedEngine(loaded, options)
            runs.append(run_paged(engine, jobs))
        rows = [median_row(runs)]
        rows.append(run_static(hf, jobs, args.static_batch, pad_id))
        rows.append(run_vllm(args.vllm_python, model_dir, args.dtype, jobs, torch.get_num_threads(), args.repeats))
        if args.sequential:
            seq_jobs = jobs[: args.sequential]
            seq = run_sequential(hf, seq_jobs)
            if len(seq_jobs) < len(jobs):
                seq.note = f"first {len(seq_jobs)} requests only"
            rows.append(seq)
        if not args.skip_transformers_cb:
            try:
                cb_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
                rows.append(run_transformers_cb(cb_model, jobs))
            except Exception as exc:  # noqa: BLE001 - report what broke, keep the other figures
                rows.append(Row("transformers continuous batching", 0, 0.0, note=f"failed: {exc!r}"[:120]))
        cached, uncached = prefix_ttft(engine, args.seed + 1)

    report(args, jobs, rows, cached, uncached, engine)


def report(
    args: argparse.Namespace, jobs: list[Job], rows: list[Row], cached: float, uncached: float, engine: PagedEngine
) -> None:
    static = next(r for r in rows if r.name.startswith("transformers generate, static"))
    vllm = next(r for r in rows if r.name.startswith("vLLM"))
    threads = torch.get_num_threads()
    lines = [
        f"# Batch engine benchmark ({args.size} model, {args.dtype}, {args.workload} workload, CPU, "
        f"{threads} torch threads)",
        "",
        f"{len(jobs)} requests at once, prompts {min(len(j.prompt_ids) for j in jobs)}-"
        f"{max(len(j.prompt_ids) for j in jobs)} tokens, outputs {min(j.max_tokens for j in jobs)}-"
        f"{max(j.max_tokens for j in jobs)} tokens (greedy, ignore_eos), seed {args.seed}; "
        f"paged engine max_num_seqs {args.max_num_seqs}, max_batched_tokens {args.max_batched_tokens}.",
        "",
        f"Load average when done: {' '.join(f'{x:.1f}' for x in os.getloadavg())} "
        f"(on a shared machine, compare the CPU-time columns).",
        "",
        "| contender | output tokens | wall s | tokens/s | vs static | vs vLLM | CPU s | tokens/CPU s "
        "| vs static (CPU) | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        per_cpu = r.output_tokens / r.cpu_seconds if r.cpu_seconds else 0.0
        static_per_cpu = static.output_tokens / static.cpu_seconds if static.cpu_seconds else 0.0
        lines.append(
            f"| {r.name} | {r.output_tokens} | {r.seconds:.2f} | {r.tokens_per_s:.1f} "
            f"| {_ratio(r.tokens_per_s, static.tokens_per_s)} | {_ratio(r.tokens_per_s, vllm.tokens_per_s)} "
            f"| {r.cpu_seconds:.2f} | {per_cpu:.1f} | {_ratio(per_cpu, static_per_cpu)} | {r.note} |"
        )
    lines += [
        "",
        "| prefix cache (512-token shared prefix) | TTFT ms |",
        "| --- | ---: |",
        f"| uncached | {uncached * 1000:.1f} |",
        f"| cached | {cached * 1000:.1f} |",
        f"| speed-up | {uncached / cached:.1f}x |",
        "",
        f"Paged engine: preemptions {engine.scheduler.num_preemptions}, "
        f"{engine.block_manager.num_blocks} blocks of {engine.block_manager.block_size} tokens.",
    ]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"batch_engine_{args.size}_{args.workload}_{args.dtype}"
    (RESULTS / f"{stem}.md").write_text(text + "\n")
    payload = {
        "size": args.size,
        "workload": args.workload,
        "dtype": args.dtype,
        "torch_threads": threads,
        "loadavg": os.getloadavg(),
        "requests": len(jobs),
        "rows": [{**vars(r), "tokens_per_s": r.tokens_per_s} for r in rows],
        "prefix_ttft_s": {"cached": cached, "uncached": uncached, "speedup": uncached / cached},
    }
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


if __name__ == "__main__":
    main()
