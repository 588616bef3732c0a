"""The fused paged-decode kernel against the torch path (gather + matmuls) on random pools."""

from __future__ import annotations

import pytest
import torch

from engines.paged import native
from engines.paged.attention import _decode_attention

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
