"""The pool of fixed-size KV-cache blocks: who holds which block, and which blocks already
hold a given prefix.

A full block is named by a hash of its tokens chained with the hash of the block before it,
so equal hashes mean equal prefixes. Once its keys and values are computed the block is
registered under that hash; a later request with the same prefix takes a reference to it
instead of recomputing it (a repeated system prompt is computed once). Freed blocks keep their
hash until the pool needs them for something else, oldest first, so the prefix cache costs no
memory of its own: it is whatever the free blocks still hold.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engines.paged.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    """Names a full block by its tokens and everything before it."""
    return hash((prev, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        """Free block ids, least recently freed first, with O(1) removal from anywhere (a plain
        dict would slow down as its front fills with deleted entries)."""
        self._by_hash: dict[int, int] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / len(self.blocks)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Whether ``seq`` fits now while leaving ``reserve`` blocks free for running ones."""
        return self.free_blocks_taken(seq) + reserve <= len(self._free)

    def free_blocks_taken(self, seq: Sequence) -> int:
        """How many free blocks allocating ``seq`` now takes: cached blocks of its prefix that
        others hold are shared, not taken."""
        shared = sum(1 for b in self._cached_prefix(seq) if self.blocks[b].ref_count > 0)
        return self.blocks_for(len(seq)) - shared

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached full blocks of its prefix."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        hits = self._cached_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(self.blocks_for(len(seq)) - len(hits)):
            seq.block_table.append(self._take_free_block())
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.queried_tokens += len(seq)
        self.hit_tokens += seq.num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody holds go back to the pool at once."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released twice"
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table.clear()
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        return not self._needs_block(seq) or bool(self._free)

    def may_append(self, seq: Sequence) -> None:
        """Make room for the newest token of ``seq`` before it is computed."""
        if self._needs_block(seq):
            seq.block_table.append(self._take_free_block())

    def commit(self, seq: Sequence) -> None:
        """Register the full blocks whose keys and values are now computed, so later
        requests can share them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        for i in range(full - 1, -1, -1):
            if self.blocks[seq.block_table[i]].hash is not None:
                break
        else:
            i = -1
        hashes = self._hashes(seq, full)
        for j in range(i + 1, full):
            block = self.blocks[seq.block_table[j]]
            block.hash = hashes[j]
            block.token_ids = self._block_tokens(seq, j)
            self._by_hash.setdefault(hashes[j], block.block_id)

    def _needs_block(self, seq: Sequence) -> bool:
        return len(seq.block_table) * self.block_size < len(seq)

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self._by_hash.get(block.hash) == block_id:
            del self._by_hash[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks that hold a prefix of ``seq``, leaving at least its last
        token to compute (its logits give the next token)."""
        if not self.enable_prefix_caching:
            return []
        limit = (len(seq) - 1) // self.block_size
        hits: list[int] = []
        for i, h in enumerate(self._hashes(seq, limit)):
            block_id = self._by_hash.get(h)
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(seq, i):
                break
            hits.append(block_id)
        return hits

    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            prev = hashes[-1] if hashes else None
            hashes.append(chain_hash(prev, self._block_tokens(seq, len(hashes))))
        return hashes

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
