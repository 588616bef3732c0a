"""Linear layers on oneDNN weights packed once, for CPU inference.

Why: ``torch.nn.functional.linear`` on CPU hands oneDNN (bf16) or MKL (fp32) a plain
row-major weight, and the library re-blocks it for its micro-kernel on every call. With a
~100M model that extra pass over the weights cost a third of a decode step and more than
40% of a batch engine's prefill time (benchmarks/batch_engine.py, 2 threads: the varied
workload went from 47 s to 35 s). Packing the weights once into oneDNN's own layout, as
vLLM's CPU backend and torch's inductor (freezing) also do, removes that pass. The modules
are swapped in place, so transformers' model definitions run unchanged around them.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(torch.nn.Module):
    """``y = x W^T + b`` with W held in oneDNN's blocked layout (inference only)."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def can_pack(model: torch.nn.Module) -> bool:
    """oneDNN is built in, and the model is a CPU model in a dtype it packs."""
    param = next(model.parameters(), None)
    return (
        param is not None
        and param.device.type == "cpu"
        and param.dtype in _DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_linears(model: torch.nn.Module, batch_hint: int = 64) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a :class:`PackedLinear`; how many were
    swapped (0 when the model cannot be packed, or already was). ``batch_hint`` is the
    typical number of rows, which oneDNN may use to choose the layout."""
    if not can_pack(model):
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child, batch_hint))
                swapped += 1
    if swapped:
        log.info("packed %d linear layers for oneDNN", swapped)
    return swapped
