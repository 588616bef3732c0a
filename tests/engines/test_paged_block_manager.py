from __future__ import annotations

import pytest

from engines.paged.block_manager import BlockManager
from engines.paged.sequence import Sequence
from slogate.protocol import SamplingParams


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8))


def _computed(bm: BlockManager, seq: Sequence) -> None:
    """Pretend the model computed every token but the newest, as after a prefill."""
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)


def _all_free(bm: BlockManager) -> bool:
    return bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_allocate_takes_blocks_for_every_token_and_deallocate_returns_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _seq(list(range(10)))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    bm.deallocate(seq)
    assert _all_free(bm) and seq.block_table == []


def test_can_allocate_honours_reserve() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq(list(range(12)))
    assert bm.can_allocate(seq)
    assert not bm.can_allocate(seq, reserve=2)


def test_append_takes_a_new_block_only_at_a_block_boundary() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq([1, 2, 3, 4])
    bm.allocate(seq)
    _computed(bm, seq)
    seq.append_token(5)
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens += 1
    seq.append_token(6)
    bm.may_append(seq)
    assert len(seq.block_table) == 2


def test_full_pool_refuses_append() -> None:
    bm = BlockManager(num_blocks=1, block_size=2)
    seq = _seq([1, 2])
    bm.allocate(seq)
    seq.append_token(3)
    assert not bm.can_append(seq)


def test_shared_prefix_is_reused_and_refcounted() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prefix = list(range(100, 112))
    a = _seq(prefix + [1, 2], "a")
    bm.allocate(a)
    assert a.num_cached_tokens == 0
    _computed(bm, a)
    b = _seq(prefix + [7, 8, 9], "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 12
    assert a.block_table[:3] == b.block_table[:3]
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:3])
    assert bm.hit_rate == pytest.approx(12 / (14 + 15))
    bm.deallocate(a)
    bm.deallocate(b)
    assert _all_free(bm)


def test_last_token_is_always_recomputed() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(list(range(8)), "a")
    bm.allocate(a)
    _computed(bm, a)
    b = _seq(list(range(8)), "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 4


def test_uncomputed_blocks_are_not_shared() -> None:
    """A block only half through a chunked prefill holds no keys yet: nobody may reuse it."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = _seq(list(range(16)), "a")
    bm.allocate(a)
    a.num_computed_tokens = 4
    bm.commit(a)
    b = _seq(list(range(16)), "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 4


def test_freed_blocks_stay_cached_until_reused() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _seq(list(range(9)), "a")
    bm.allocate(a)
    _computed(bm, a)
    bm.deallocate(a)
    b = _seq(list(range(9)), "b")
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 8
    bm.deallocate(b)
    c = _seq([50 + i for i in range(16)], "c")
    bm.allocate(c)
    d = _seq(list(range(9)), "d")
    bm.deallocate(c)
    bm.allocate(d)
    assert d.num_cached_tokens == 0
    bm.deallocate(d)
    assert _all_free(bm)


def test_hash_names_the_whole_prefix_not_just_the_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = _seq([1, 2, 3, 4, 5], "a")
    bm.allocate(a)
    _computed(bm, a)
    b = _seq([9, 9, 3, 4, 5], "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_prefix_caching_can_be_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = _seq([1, 2, 3, 4, 5], "a")
    bm.allocate(a)
    _computed(bm, a)
    b = _seq([1, 2, 3, 4, 5], "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and bm.hit_rate == 0.0
