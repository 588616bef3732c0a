"""Turns a schedule into tensors (token ids, positions, slot mapping, block tables) and runs
the model over the paged KV cache.

The cache is one preallocated tensor, [2, layers, kv_heads, slots, head_dim], where slot
``block * block_size + offset`` holds one token's keys and values. All the step's tokens are
flattened into one batch row, decodes first (shortest context first, so that groups of
similar length pad little), so the model runs once per step whatever mix of decodes and
prefill chunks the scheduler chose, and only the rows that sample a token reach the
language-model head. On a GPU the steps that fit run as CUDA graphs instead
(:mod:`engines.paged.step_graphs`). Given a ``pause``, a step runs a layer at a time and lets
other passes run between two layers (:mod:`engines.paged.layered`); on CPU the layers run with
their projections fused (:mod:`engines.paged.fused`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel

from engines.paged import attention, native
from engines.paged.attention import DecodeGroup, PagedMetadata, PrefillSpan
from engines.paged.layered import Decoder
from engines.paged.scheduler import Schedule
from engines.paged.sequence import Sequence
from engines.paged.step_graphs import StepGraphs

log = logging.getLogger(__name__)

PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Prompt attention on a GPU, cuDNN's left out: it builds a plan for every new shape, and each
prompt length (each chunk of a long prompt) is one. On an H200 that made the first step of a
new length 50 ms against 10 ms after it (430-580 ms with a mask); the flash and
memory-efficient kernels build nothing per shape."""

Pause = Callable[[int], None]
"""Called between two layers with how many the step has passed; what it runs (other passes
over other sequences' blocks) does not touch the step's state."""

GROUP_SPREAD = 1.5
"""A decode group's longest context is at most this many times its shortest: the padding it
allows is traded against one more attention call per layer."""


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: PagedMetadata
    sampled: list[int]
    """Positions in the schedule of the sequences that sample a token this step."""
    logit_rows: torch.Tensor
    """Where their last tokens sit in the flattened batch row."""


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: PreTrainedModel) -> KVShape:
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * self.layers * block_size * self.kv_heads * self.head_dim * item


class ModelRunner:
    def __init__(self, model: PreTrainedModel, num_blocks: int, block_size: int, kernel: str | None = None,
                 cuda_graphs: bool = True, max_context: int = 2048) -> None:
        """``kernel``: decode attention on ``native``, ``torch`` or ``auto`` (see
        :mod:`engines.paged.native`; None reads ``SLOGATE_PAGED_KERNEL``). ``cuda_graphs``: on
        a GPU, run the steps that fit as CUDA graphs (:mod:`engines.paged.step_graphs`) for
        contexts up to ``max_context``."""
        attention.check_supported(model.config)
        attention.register()
        model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
        self.model = model
        self.block_size = block_size
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        shape = KVShape.of(model)
        self.kv_heads = shape.kv_heads
        graphs = cuda_graphs and self.device.type == "cuda"
        pool_blocks = num_blocks + 1 if graphs else num_blocks  # the graphs' scratch block is the last
        self.kv_cache = torch.zeros(
            2, shape.layers, shape.kv_heads, pool_blocks * block_size, shape.head_dim, dtype=dtype, device=self.device
        )
        self._head_offsets = torch.arange(shape.kv_heads, device=self.device) * pool_blocks
        self.native = self.device.type == "cpu" and native.use_native(kernel, dtype)
        self.graphs: StepGraphs | None = None
        if graphs:
            self.graphs = StepGraphs(model, self.kv_cache, block_size, num_blocks, max_context, capture=True)
            try:
                self.graphs.capture_all()  # at start-up, not in the first requests that meet each shape
            except RuntimeError as exc:  # a forward a graph cannot hold (one that waits on the device, say)
                log.warning("CUDA graphs are off, the steps run eagerly: capturing one failed (%s)", exc)
                self.graphs = None
        self.decoder = Decoder.of(model)
        """Set when a step can pause between layers for other passes."""

    @torch.inference_mode()
    def run(self, sched: Schedule, pause: Pause | None = None) -> tuple[list[int], torch.Tensor]:
        """Logits [n, vocab] of the next token for the sequences that sample one this step,
        with their positions in ``sched``. A model :class:`Decoder` can run runs through it,
        without transformers' model forward around the layers (and must, once its projections
        are fused: :mod:`engines.paged.fused`); with ``pause`` too, the step runs a layer at a
        time and calls it between layers."""
        key = self.graphs.key(sched) if self.graphs is not None else None
        if key is not None:
            return self.graphs.run(sched, key)
        inputs = self.prepare(sched)
        backends = sdpa_kernel(PREFILL_BACKENDS) if self.device.type == "cuda" else contextlib.nullcontext()
        with backends:
            if self.decoder is not None:
                return self._run_decoder(inputs, pause)
            logits = self.model(
                input_ids=inputs.input_ids.unsqueeze(0),
                position_ids=inputs.positions.unsqueeze(0),
                logits_to_keep=inputs.logit_rows,
                use_cache=False,
                paged=inputs.meta,
            ).logits
        return inputs.sampled, logits[0] if logits.dim() == 3 else logits

    def _run_decoder(self, inputs: StepInputs, pause: Pause | None) -> tuple[list[int], torch.Tensor]:
        decoder = self.decoder
        state = decoder.start(inputs.input_ids, inputs.positions)
        for layer in range(len(decoder.layers)):
            if layer and pause is not None:
                pause(layer)
            state = decoder.run(state, inputs.meta, layer, layer + 1)
        return inputs.sampled, decoder.logits(state, inputs.logit_rows)

    def prepare(self, sched: Schedule) -> StepInputs:
        seqs, counts = sched.seqs, sched.num_new_tokens
        decodes = sorted((i for i in range(len(seqs)) if counts[i] == 1), key=lambda i: seqs[i].num_computed_tokens)
        prefills = [i for i in range(len(seqs)) if counts[i] > 1]
        ids: list[int] = []
        pos: list[int] = []
        last_row: dict[int, int] = {}
        spans: list[PrefillSpan] = []
        for i in decodes + prefills:
            seq, n = seqs[i], counts[i]
            start = seq.num_computed_tokens
            row = len(ids)
            ids.extend(seq.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            last_row[i] = row + n - 1
            if n > 1:
                spans.append(self._prefill_span(seq.block_table, row, start, n))
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        tables = [seqs[i].block_table for i in decodes + prefills]
        meta = PagedMetadata(
            kv_cache=self.kv_cache,
            block_size=self.block_size,
            slot_mapping=self._slot_mapping(tables, [counts[i] for i in decodes + prefills], positions),
            decodes=[] if self.native else self._decode_groups([seqs[i] for i in decodes]),
            prefills=spans,
        )
        if self.native and decodes:
            width = max(len(t) for t in tables[: len(decodes)])
            meta.decode_tables = torch.tensor(
                [t + [0] * (width - len(t)) for t in tables[: len(decodes)]], dtype=torch.int32, device=self.device
            )
            meta.decode_lengths = torch.tensor(
                [seqs[i].num_computed_tokens + 1 for i in decodes], dtype=torch.int32, device=self.device
            )
        sampled = [i for i in range(len(seqs)) if sched.samples(i)]
        rows = torch.tensor([last_row[i] for i in sampled], dtype=torch.long, device=self.device)
        return StepInputs(torch.tensor(ids, dtype=torch.long, device=self.device), positions, meta, sampled, rows)

    def _slot_mapping(self, tables: list[list[int]], counts: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Cache slot of every token of the step: its sequence's block for its position."""
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device)
        owner = torch.repeat_interleave(
            torch.arange(len(tables), device=self.device),
            torch.tensor(counts, device=self.device),
            output_size=sum(counts),  # known here: on a GPU, finding it would wait for the device
        )
        return padded[owner, positions // self.block_size] * self.block_size + positions % self.block_size

    def _gather_rows(self, tables: list[list[int]], num_blocks: int) -> torch.Tensor:
        """Pool rows (one head's block each) of each sequence's first ``num_blocks`` blocks,
        in [seqs, kv_heads, blocks] order; padding points at block 0, which masks then hide."""
        padded = torch.tensor(
            [t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in tables],
            dtype=torch.long,
            device=self.device,
        )
        return (self._head_offsets.view(1, -1, 1) + padded.unsqueeze(1)).reshape(-1)

    def _prefill_span(self, block_table: list[int], row: int, start: int, n: int) -> PrefillSpan:
        if start == 0:
            return PrefillSpan(row, row + n, None, None)
        blocks = -(-(start + n) // self.block_size)
        key_pos = torch.arange(blocks * self.block_size, device=self.device)
        query_pos = torch.arange(start, start + n, device=self.device)
        mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
        return PrefillSpan(row, row + n, self._gather_rows([block_table], blocks), mask)

    def _decode_groups(self, seqs: list[Sequence]) -> list[DecodeGroup]:
        """Decodes (sorted by length) cut into groups of similar context length."""
        groups = []
        first = 0
        while first < len(seqs):
            last = first + 1
            limit = GROUP_SPREAD * seqs[first].num_computed_tokens + self.block_size
            while last < len(seqs) and seqs[last].num_computed_tokens <= limit:
                last += 1
            groups.append(self._decode_group(seqs[first:last], first))
            first = last
        return groups

    def _decode_group(self, seqs: list[Sequence], start: int) -> DecodeGroup:
        context = [s.num_computed_tokens + 1 for s in seqs]
        lengths = torch.tensor(context, device=self.device)
        blocks = -(-max(context) // self.block_size)
        width = blocks * self.block_size
        padding = torch.arange(width, device=self.device).unsqueeze(0) >= lengths.unsqueeze(1)
        rows = self._gather_rows([s.block_table for s in seqs], blocks)
        return DecodeGroup(start, start + len(seqs), rows, padding.view(len(seqs), 1, 1, width))
