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
        self.dtype = linear.weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        padded = padded_rows(m)
        if padded != m:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, padded - m))
        elif not rows.is_contiguous():
            rows = rows.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y[:m].view(*x.shape[:-1], self.out_features)


def padded_rows(m: int) -> int:
    """The row count a call runs with. oneDNN builds a kernel for every new shape (0.5-2.5 ms
    per layer here, more than the call itself for a small model) and keeps 1,024 of them, and
    a batch step's row count takes any value up to its token budget. So rows above 16 are
    padded up to one of 8 sizes per power of two (72 sizes up to 2,048): padding costs under
    1/8 of a call, and each size is built once."""
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def can_pack(model: torch.nn.Module) -> bool:
    """oneDNN is built in, and the model is a CPU model in a dtype it packs on this CPU: its
    bf16 kernels need AVX-512 (or AVX-NE-CONVERT), and on a CPU without them packing a bf16
    weight raises, where a plain bf16 ``linear`` still runs."""
    param = next(model.parameters(), None)
    return (
        param is not None
        and param.device.type == "cpu"
        and param.dtype in _DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (param.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack_linears(model: torch.nn.Module, batch_hint: int = 64, warm_rows: int = 128) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a :class:`PackedLinear`; how many were
    swapped (0 when the model cannot be packed, or already was). ``batch_hint`` is the
    typical number of rows, which oneDNN may use to choose the layout. The kernels for every
    padded row count up to ``warm_rows`` (an engine passes its step's token budget) are built
    here, once per layer shape, instead of inside the first steps that need them: a step whose
    row count was new took 1.3-3 ms longer on the tiny model, the tail of the stream engine's
    time to first token at 16 streams. All 72 sizes to 2,048 took 0.3 s on the tiny model and
    0.9 s on the ~100M one (2 cores)."""
    if not can_pack(model):
        return 0
    swapped: list[PackedLinear] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                swapped.append(PackedLinear(child, batch_hint))
                setattr(parent, name, swapped[-1])
    shapes = {(p.in_features, p.out_features, p.bias is not None, p.dtype): p for p in swapped}
    with torch.inference_mode():
        for rows in sorted({padded_rows(m) for m in range(1, warm_rows + 1)}):
            for layer in shapes.values():
                layer(torch.zeros(rows, layer.in_features, dtype=layer.dtype))
    if swapped:
        log.info("packed %d linear layers for oneDNN", len(swapped))
    return len(swapped)
