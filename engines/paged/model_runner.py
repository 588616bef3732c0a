"""Turns a schedule into tensors (token ids, positions, slot mapping, block tables) and runs
the model over the paged KV cache.

The cache is one preallocated tensor, [2, layers, slots, kv_heads, head_dim], where slot
``block * block_size + offset`` holds one token's keys and values. All the step's tokens are
flattened into one batch row, decodes first, so the model runs once per step whatever mix of
decodes and prefill chunks the scheduler chose, and only the rows that sample a token reach
the language-model head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engines.paged import attention
from engines.paged.attention import PagedMetadata, PrefillSpan
from engines.paged.scheduler import Schedule


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
        return cls(config.num_hidden_layers, getattr(config, "num_key_value_heads", heads), head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * self.layers * block_size * self.kv_heads * self.head_dim * item


class ModelRunner:
    def __init__(self, model: PreTrainedModel, num_blocks: int, block_size: int) -> None:
        attention.register()
        model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
        self.model = model
        self.block_size = block_size
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        shape = KVShape.of(model)
        self.kv_cache = torch.zeros(
            2, shape.layers, num_blocks * block_size, shape.kv_heads, shape.head_dim, dtype=dtype, device=self.device
        )

    @torch.inference_mode()
    def run(self, sched: Schedule) -> tuple[list[int], torch.Tensor]:
        """Logits [n, vocab] of the next token for the sequences that sample one this step,
        with their positions in ``sched``."""
        input_ids, positions, meta, sampled, rows = self.prepare(sched)
        out = self.model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            logits_to_keep=rows,
            use_cache=False,
            paged=meta,
        )
        return sampled, out.logits[0] if out.logits.dim() == 3 else out.logits

    def prepare(self, sched: Schedule) -> tuple[torch.Tensor, torch.Tensor, PagedMetadata, list[int], torch.Tensor]:
        bs = self.block_size
        order = sorted(range(len(sched.seqs)), key=lambda i: sched.num_new_tokens[i] != 1)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}
        decodes = [i for i in order if sched.num_new_tokens[i] == 1]
        prefills: list[PrefillSpan] = []
        for i in order:
            seq, n = sched.seqs[i], sched.num_new_tokens[i]
            start = seq.num_computed_tokens
            row = len(ids)
            ids.extend(seq.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            last_row[i] = row + n - 1
            if n > 1:
                prefills.append(self._prefill_span(seq.block_table, row, start, n))
        decode_slots, decode_mask = self._decode_context([sched.seqs[i] for i in decodes])
        meta = PagedMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, device=self.device),
            num_decodes=len(decodes),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefills,
        )
        sampled = [i for i in range(len(sched.seqs)) if sched.samples(i)]
        rows = torch.tensor([last_row[i] for i in sampled], dtype=torch.long, device=self.device)
        return (
            torch.tensor(ids, device=self.device),
            torch.tensor(pos, device=self.device),
            meta,
            sampled,
            rows,
        )

    def _slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _prefill_span(self, block_table: list[int], row: int, start: int, n: int) -> PrefillSpan:
        if start == 0:
            return PrefillSpan(row, row + n, None, None)
        context = torch.arange(start + n, device=self.device)
        table = torch.tensor(block_table, device=self.device)
        query_pos = context[start:].unsqueeze(1)
        return PrefillSpan(row, row + n, self._slots(table, context), context.unsqueeze(0) <= query_pos)

    def _decode_context(self, seqs: list) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every decode's context as padded slot rows plus a mask of the real ones."""
        if not seqs:
            return None, None
        bs = self.block_size
        lengths = torch.tensor([s.num_computed_tokens + 1 for s in seqs], device=self.device)
        width = -(-int(lengths.max()) // bs)
        tables = torch.tensor([s.block_table[:width] + [0] * (width - len(s.block_table[:width])) for s in seqs], device=self.device)
        offsets = torch.arange(bs, device=self.device)
        slots = (tables.unsqueeze(2) * bs + offsets).view(len(seqs), width * bs)
        mask = torch.arange(width * bs, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)
        return slots, mask.view(len(seqs), 1, 1, width * bs)
