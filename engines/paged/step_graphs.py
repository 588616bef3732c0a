"""Engine steps replayed as CUDA graphs.

Why: on a GPU an eager step of the ~100M model is bound by the host issuing ~3,000 small
operators, not by the device. On an H200 (bf16) a step of 16 decodes took 10.4 ms eager, of
which the kernels ran 2.8 ms; the same step replayed as a graph took 1.6 ms. Every stream
engine step pays that, and a step that carries a prompt chunk pays it too, so graphs serve
mixed steps as well as decode-only ones.

A graph replays fixed shapes, so a step is recast in a shape that does not depend on what it
runs: its tokens become rows, each the query of one position with its own block table and
length (the position plus one). A decode is one row; a prompt chunk is one row per token. The
step's keys and values are written into the pool before attention (as on the eager path), so a
prompt row reads the chunk's earlier tokens from the cache like any other context. Rows are
padded to a power of two, and block tables to a power-of-two width: one graph per (rows,
blocks) bucket, all sharing one memory pool. Padding rows point at a scratch block that the
block manager never hands out.

The cost of that uniformity is that every row gathers its whole context, so a bucket is only
captured while what its rows gather stays under :data:`MAX_GATHER_BYTES`; larger steps run
eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engines.paged.attention import DecodeGroup, PagedMetadata
from engines.paged.scheduler import Schedule

MAX_ROWS = 256
"""Most tokens a step may run as a graph."""
MAX_GATHER_BYTES = 512 * 2**20
"""Most keys and values one layer of a graph gathers (rows times context positions times
their size): 2^19 row-positions of the ~100M model in bf16 (1 KiB each), so 256 rows reach
2,048 positions; 2^17 of an 8B Llama (4 KiB)."""


def bucket(n: int) -> int:
    """The power of two at or above ``n``."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None
    inputs: torch.Tensor
    logits: torch.Tensor


class StepGraphs:
    """Runs schedules through a static-shape step, captured as a CUDA graph per bucket when
    ``capture`` is set (on a CPU, the same step runs eagerly: what tests compare)."""

    def __init__(self, model: PreTrainedModel, kv_cache: torch.Tensor, block_size: int, scratch_block: int,
                 max_context: int, capture: bool) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.capture = capture
        self.device = kv_cache.device
        kv_heads = kv_cache.shape[2]
        self._head_offsets = torch.arange(kv_heads, device=self.device) * (kv_cache.shape[3] // block_size)
        self.max_blocks = bucket(-(-max_context // block_size))
        position_bytes = 2 * kv_heads * kv_cache.shape[4] * kv_cache.element_size()
        self.max_row_positions = MAX_GATHER_BYTES // position_bytes
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def key(self, sched: Schedule) -> tuple[int, int] | None:
        """The (rows, blocks) bucket that runs ``sched``, or None when it is too large. Blocks
        count the context this step reaches, not the whole block table: a prompt's table is
        allocated in full when it starts, and its first chunk must not gather all of it."""
        rows = bucket(sched.num_tokens)
        blocks = bucket(max(-(-(s.num_computed_tokens + n) // self.block_size)
                            for s, n in zip(sched.seqs, sched.num_new_tokens)))
        return (rows, blocks) if self._fits(rows, blocks) else None

    @torch.inference_mode()
    def run(self, sched: Schedule, key: tuple[int, int]) -> tuple[list[int], torch.Tensor]:
        """Logits of the sampling sequences, as :meth:`ModelRunner.run` returns them."""
        rows, blocks = key
        entry = self._graphs.get(key) or self._build(rows, blocks)
        host, sampled = self._host_inputs(sched, rows, blocks)
        entry.inputs.copy_(host)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            entry.logits = self._forward(entry.inputs, rows, blocks)
        return sampled, entry.logits[: len(sampled)]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now, largest first (the shared pool is then sized once), so
        no request pays a capture."""
        for rows in reversed([1 << i for i in range(MAX_ROWS.bit_length())]):
            for blocks in reversed([1 << i for i in range(self.max_blocks.bit_length())]):
                if self._fits(rows, blocks) and (rows, blocks) not in self._graphs:
                    self._build(rows, blocks)

    def _fits(self, rows: int, blocks: int) -> bool:
        positions = rows * blocks * self.block_size
        return rows <= MAX_ROWS and blocks <= self.max_blocks and positions <= self.max_row_positions

    def _build(self, rows: int, blocks: int) -> _Captured:
        inputs = torch.zeros(4 * rows + (rows + 1) * blocks, dtype=torch.long, device=self.device)
        inputs[4 * rows:] = self.scratch_block
        inputs[2 * rows: 3 * rows] = rows  # every row on the scratch table until real inputs arrive
        if not self.capture:
            entry = _Captured(None, inputs, torch.empty(0))
        else:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(inputs, rows, blocks)  # first runs allocate workspaces outside the graph
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._forward(inputs, rows, blocks)
            entry = _Captured(graph, inputs, logits)
        self._graphs[(rows, blocks)] = entry
        return entry

    def _forward(self, inputs: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
        """The step on device tensors only: ``inputs`` holds token ids, positions, each row's
        sequence, the rows whose logits are kept, then one block table per sequence plus the
        scratch one."""
        ids, positions, owner, keep = inputs[: 4 * rows].view(4, rows)
        tables = inputs[4 * rows:].view(rows + 1, blocks)[owner]
        width = blocks * self.block_size
        slots = tables.gather(1, (positions // self.block_size).unsqueeze(1)).squeeze(1) * self.block_size
        padding = torch.arange(width, device=self.device).unsqueeze(0) > positions.unsqueeze(1)
        meta = PagedMetadata(
            kv_cache=self.kv_cache,
            block_size=self.block_size,
            slot_mapping=slots + positions % self.block_size,
            decodes=[DecodeGroup(0, rows, (self._head_offsets.view(1, -1, 1) + tables.unsqueeze(1)).reshape(-1),
                                 padding.view(rows, 1, 1, width))],
            prefills=[],
        )
        logits = self.model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), logits_to_keep=keep,
                            use_cache=False, paged=meta).logits
        return logits[0] if logits.dim() == 3 else logits

    def _host_inputs(self, sched: Schedule, rows: int, blocks: int) -> tuple[torch.Tensor, list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        owner: list[int] = []
        keep: list[int] = []
        tables: list[int] = []
        sampled = []
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens)):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start: start + n])
            positions.extend(range(start, start + n))
            owner.extend([i] * n)
            if sched.samples(i):
                sampled.append(i)
                keep.append(len(ids) - 1)
            table = seq.block_table[:blocks]
            tables.extend(table)
            tables.extend([self.scratch_block] * (blocks - len(table)))
        pad = rows - len(ids)
        tables.extend([self.scratch_block] * (blocks * (rows + 1 - len(sched.seqs))))
        host = torch.tensor(
            ids + [0] * pad + positions + [0] * pad + owner + [rows] * pad + keep + [0] * (rows - len(keep)) + tables,
            dtype=torch.long,
        )
        return host, sampled
