"""The decoder stack one layer at a time, so a step can pause between two layers and let a
request that arrived meanwhile run first.

Why: on CPU a step of the ~100M model reads every weight once, tens of milliseconds whatever
it holds, and 16 streams' step is longer still. A request that arrived just after a step began
waited for that step to end and then for a whole step of its own, its prompt beside 16 decodes:
at 16 streams its time to first token was two to three times a lone request's. Run a layer at
a time, the step can stop between layers while the newcomer's prompt runs alone, through every
layer, and its first token is out; the step then goes on from where it stopped. Its state (the
hidden states between layers, the paged metadata) belongs to the step alone, and the newcomer
writes only its own blocks, so the step computes exactly what it would have. When a newcomer
may cut in is the scheduler's call (:mod:`engines.stream.scheduler`).

Only models laid out as transformers' Llama run this way: token embedding, rotary embedding,
decoder layers, final norm and head, with nothing else in between (no embedding scale, no
logit soft-capping). The others run whole and take newcomers at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engines.paged.attention import PagedMetadata
from engines.paged.fused import LAYOUTS, FusedLayer

Hidden = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
"""Hidden states [1, tokens, hidden] and the rotary embedding (cos, sin) of their positions."""


@dataclass
class Decoder:
    embed: torch.nn.Module
    rotary: torch.nn.Module
    layers: list[torch.nn.Module | FusedLayer]
    norm: torch.nn.Module
    head: torch.nn.Module

    @classmethod
    def of(cls, model: PreTrainedModel) -> Decoder | None:
        """The model's parts, or None when its forward may do more than chain them."""
        base = getattr(model, "model", None)
        parts = [getattr(base, name, None) for name in ("embed_tokens", "rotary_emb", "layers", "norm")]
        head = getattr(model, "lm_head", None)
        if model.config.model_type not in LAYOUTS or head is None or any(p is None for p in parts):
            return None
        embed, rotary, layers, norm = parts
        return cls(embed, rotary, [FusedLayer.of(layer) or layer for layer in layers], norm, head)

    def start(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Hidden:
        hidden = self.embed(input_ids.unsqueeze(0))
        return hidden, self.rotary(hidden, position_ids=positions.unsqueeze(0))

    def run(self, state: Hidden, meta: PagedMetadata, first: int, end: int) -> Hidden:
        """``state`` through layers ``first`` to ``end`` (exclusive), over the paged cache."""
        hidden, rotary = state
        for layer in self.layers[first:end]:
            hidden = layer(hidden, position_embeddings=rotary, paged=meta)
        return hidden, rotary

    def logits(self, state: Hidden, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), vocab] logits of the given token rows."""
        return self.head(self.norm(state[0][0, rows]))
