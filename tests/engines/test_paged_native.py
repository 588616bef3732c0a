"""The fused paged-decode kernel against the torch path (gather + matmuls) on random pools."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engines.base import EngineRequest
from engines.paged import PagedEngine, create, native
from engines.paged.attention import _decode_attention
from slogate.protocol import SamplingParams

pytestmark = pytest.mark.skipif(not native.build(), reason="the paged decode kernel cannot be built here")


def _torch_decode(pool, tables, lengths, q, block_size):
    """The torch path's decode: every sequence's blocks gathered, padding masked."""
    kv_heads, slots, dim = pool[0].shape
    n, heads, _ = q.shape
    blocks = max(len(t) for t in tables)
    width = blocks * block_size
    padded = torch.tensor([t + [0] * (blocks - len(t)) for t in tables])
    rows = ((torch.arange(kv_heads) * (slots // block_size)).view(1, -1, 1) + padded.unsqueeze(1)).reshape(-1)
    k = pool[0].reshape(-1, block_size * dim).index_select(0, rows).view(n, kv_heads, width, dim)
    v = pool[1].reshape(-1, block_size * dim).index_select(0, rows).view(n, kv_heads, width, dim)
    padding = (torch.arange(width).unsqueeze(0) >= lengths.unsqueeze(1)).view(n, 1, 1, width)
    qg = q.reshape(n, kv_heads, heads // kv_heads, dim)
    return _decode_attention(qg, k, v, padding, dim**-0.5).view(n, heads, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("kv_heads,heads,dim", [(4, 12, 64), (2, 2, 32), (1, 8, 128), (2, 4, 80)])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_kernel_matches_torch_path(dtype, block_size, kv_heads, heads, dim, index):
    gen = torch.Generator().manual_seed(block_size * 1000 + heads * 10 + dim)
    num_blocks = 2048 // block_size
    pool = torch.randn(2, kv_heads, num_blocks * block_size, dim, generator=gen).to(dtype)
    lengths = torch.randint(1, 300, (9,), generator=gen)
    lengths[0] = 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for length in lengths.tolist():
        count = -(-length // block_size)
        tables.append(perm[used : used + count])
        used += count
    q = torch.randn(9, heads, dim, generator=gen).to(dtype)
    expected = _torch_decode(pool, tables, lengths, q, block_size)
    width = max(len(t) for t in tables) + 2  # extra padding columns are never read
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=index)
    out = torch.empty_like(q)
    native.paged_decode(q, pool[0], pool[1], table, lengths.to(index), block_size, dim**-0.5, out)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tol)


def test_choice_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(native.KERNEL_ENV, "torch")
    assert not native.use_native()
    monkeypatch.setenv(native.KERNEL_ENV, "native")
    assert native.use_native()
    assert native.use_native("auto")
    monkeypatch.setenv(native.KERNEL_ENV, "cuda")
    with pytest.raises(ValueError):
        native.use_native()


def _greedy_tokens(engine: PagedEngine, prompt: str) -> list[int]:
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("r", sampling, time.time() + 3600, prompt=prompt))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens += out.token_ids
    return tokens


def test_an_fp16_model_on_a_cpu_decodes_on_the_torch_path(tiny_model_dir: Path) -> None:
    """The kernel reads float32 and bfloat16 pools only: an fp16 engine on a CPU took it by
    default and failed its first decode step ("paged_decode supports float32 and bfloat16"),
    and with it every request it held. Asked for by name, it is refused at start instead."""
    options = {"dtype": "fp16", "device": "cpu", "num_blocks": 64}
    engine = create(str(tiny_model_dir), **options)
    expected = _greedy_tokens(create(str(tiny_model_dir), decode_kernel="torch", **options), "the risk score")
    assert _greedy_tokens(engine, "the risk score") == expected and len(expected) == 4
    with pytest.raises(ValueError, match="float16"):
        create(str(tiny_model_dir), decode_kernel="native", **options)
