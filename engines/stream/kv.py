"""The stream engine's KV memory: one cache per prefilling request, and one left-padded cache
for all decoding requests, so a decode step is a single forward pass.

Rows join the decode cache when their prefill ends and leave it when they finish or are
aborted. The remaining rows are copied out of the shared tensors on every such change, so a
request that leaves frees its memory at once instead of lingering in a view.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """A cache layer with spare room at the end.

    transformers' dynamic layer concatenates on every update, copying the whole cache each
    decode step; with a long context that copy costs more than the step's attention. Here a
    step writes in place, and the buffer grows by a quarter when full.
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.replace(key_states[:, :, :0], value_states[:, :, :0], 0)
        length = self.length + key_states.shape[-2]
        if length > self.key_buffer.shape[-2]:
            self._grow(_capacity(length))
        self.key_buffer[:, :, self.length : length] = key_states
        self.value_buffer[:, :, self.length : length] = value_states
        self.length = length
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def replace(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
        """Take these buffers, whose first ``length`` positions hold the content."""
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        self.keys, self.values = key_buffer[:, :, :length], value_buffer[:, :, :length]
        self.length = length
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.key_buffer, self.value_buffer))


class GrowingCache(DynamicCache):
    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)


def new_cache() -> GrowingCache:
    return GrowingCache()


def _capacity(length: int) -> int:
    return length + max(length // 4, 64)


def _stacked(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """The rows of ``parts`` in one buffer, each right-aligned at ``width`` with zeros to its
    left (padding must be finite: attention weighs it by exactly zero, and zero times NaN is
    still NaN), and room to grow after ``width`` so the next step need not copy again."""
    first = parts[0]
    rows = sum(part.shape[0] for part in parts)
    out = first.new_empty(rows, first.shape[1], _capacity(width), first.shape[3])
    row = 0
    for part in parts:
        pad = width - part.shape[-2]
        out[row : row + part.shape[0], :, :pad] = 0
        out[row : row + part.shape[0], :, pad:width] = part
        row += part.shape[0]
    return out


def cache_argument(model: PreTrainedModel) -> str:
    """The forward argument that takes the cache: recent transformers renamed
    ``past_key_values`` to ``cache`` and warn on the old name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_length(cache: GrowingCache) -> int:
    return cache.get_seq_length()


def cache_bytes(cache: GrowingCache) -> int:
    return sum(layer.nbytes() for layer in cache.layers)


class DecodeBatch:
    """Decoding requests as rows of one cache, left-padded to a common length.

    ``mask`` marks real (1) and padding (0) positions; ``positions`` is each row's next
    position id. Padding never outgrows what the rows need: when the longest row leaves, the
    columns that only padded it are cut.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ids: list[str] = []
        self.last_tokens: list[int] = []
        self.cache: GrowingCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.positions: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.ids

    def tokens_of(self, request_id: str) -> int:
        """How many KV positions the request holds (0 when it holds none)."""
        return self.positions[self.ids.index(request_id)] if request_id in self.ids else 0

    def nbytes(self) -> int:
        return cache_bytes(self.cache) if self.cache is not None else 0

    def join(
        self, request_ids: list[str], cache: GrowingCache, mask: torch.Tensor, last_tokens: list[int]
    ) -> None:
        """Add requests whose prefill just ended: ``cache`` holds their prompts as rows,
        left-padded as ``mask`` says."""
        if self.cache is None:
            self.cache, self.mask = cache, mask
        else:
            width = max(self.mask.shape[1], mask.shape[1])
            for mine, new in zip(self.cache.layers, cache.layers):
                keys = _stacked([mine.keys, new.keys], width)
                mine.replace(keys, _stacked([mine.values, new.values], width), width)
            self.mask = torch.cat(
                [F.pad(self.mask, (width - self.mask.shape[1], 0)), F.pad(mask, (width - mask.shape[1], 0))]
            )
        self.ids.extend(request_ids)
        self.last_tokens.extend(last_tokens)
        self.positions.extend(mask.sum(dim=1).tolist())

    def leave(self, request_ids: set[str]) -> None:
        """Drop rows and give their memory back."""
        keep = [i for i, rid in enumerate(self.ids) if rid not in request_ids]
        if len(keep) == len(self.ids):
            return
        self.ids = [self.ids[i] for i in keep]
        self.last_tokens = [self.last_tokens[i] for i in keep]
        self.positions = [self.positions[i] for i in keep]
        if not keep:
            self.cache = None
            self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
            return
        index = torch.tensor(keep, device=self.device)
        width = max(self.positions)
        cut = self.mask.shape[1] - width
        for layer in self.cache.layers:
            keys = _stacked([layer.keys.index_select(0, index)[:, :, cut:]], width)
            layer.replace(keys, _stacked([layer.values.index_select(0, index)[:, :, cut:]], width), width)
        self.mask = self.mask.index_select(0, index)[:, cut:].clone()

    def forward_inputs(self, cache_arg: str) -> dict[str, torch.Tensor | GrowingCache | None]:
        """Inputs for one decode step over every row."""
        mask = torch.cat([self.mask, self.mask.new_ones(len(self.ids), 1)], dim=1)
        return {
            "input_ids": torch.tensor(self.last_tokens, device=self.device).unsqueeze(1),
            "position_ids": torch.tensor(self.positions, device=self.device).unsqueeze(1),
            "attention_mask": None if bool(mask.all()) else mask,
            cache_arg: self.cache,
        }

    def advance(self, tokens: list[int]) -> None:
        """Record the step's sampled tokens; the forward pass already grew the cache."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.ids), 1)], dim=1)
        self.last_tokens = tokens
        self.positions = [p + 1 for p in self.positions]
