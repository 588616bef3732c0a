from __future__ import annotations

import torch

from engines.stream.kv import DecodeBatch, cache_bytes, new_cache
from engines.stream.schedule import EdfQueue, PrefillCost


def filled_cache(rows: int, length: int, seed: int, layers: int = 2):
    generator = torch.Generator().manual_seed(seed)
    cache = new_cache()
    parts = []
    for layer in range(layers):
        k = torch.randn(rows, 2, length, 4, generator=generator)
        v = torch.randn(rows, 2, length, 4, generator=generator)
        cache.update(k, v, layer)
        parts.append((k, v))
    return cache, parts


def test_growing_layer_keeps_everything_written_across_growth():
    cache = new_cache()
    written = []
    for step in range(100):
        k = torch.full((1, 2, 3 if step == 0 else 1, 4), float(step))
        keys, values = cache.update(k, k + 0.5, 0)
        written.append(k)
    expected = torch.cat(written, dim=2)
    assert torch.equal(keys, expected) and torch.equal(values, expected + 0.5)
    assert cache.get_seq_length() == 102
    assert cache_bytes(cache) >= 2 * expected.numel() * 4


def test_rows_of_different_lengths_join_left_padded_and_leave_without_padding():
    batch = DecodeBatch(torch.device("cpu"))
    short, short_parts = filled_cache(1, 3, seed=1)
    long, _ = filled_cache(1, 7, seed=2)
    batch.join(["short"], short, torch.ones(1, 3, dtype=torch.long), [11])
    batch.join(["long"], long, torch.ones(1, 7, dtype=torch.long), [12])
    assert batch.positions == [3, 7] and batch.last_tokens == [11, 12]
    assert batch.mask.tolist() == [[0, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]
    inputs = batch.forward_inputs("cache")
    assert inputs["position_ids"].tolist() == [[3], [7]]
    assert inputs["attention_mask"].shape == (2, 8)
    before = batch.nbytes()
    batch.leave({"long"})
    assert batch.tokens_of("long") == 0 and batch.tokens_of("short") == 3
    assert batch.mask.tolist() == [[1, 1, 1]]
    assert batch.nbytes() < before / 2
    for layer, (k, v) in zip(batch.cache.layers, short_parts):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    assert batch.forward_inputs("cache")["attention_mask"] is None
    batch.leave({"short"})
    assert len(batch) == 0 and batch.nbytes() == 0


def test_edf_queue_orders_by_deadline_then_arrival_and_forgets_removed():
    queue = EdfQueue()
    for rid, deadline in [("a", 5.0), ("b", 1.0), ("c", 5.0), ("d", 3.0)]:
        queue.push(rid, deadline)
    queue.remove("d")
    assert len(queue) == 3 and "d" not in queue
    assert [queue.pop() for _ in range(4)] == ["b", "a", "c", None]


def test_prefill_cost_sizes_chunks_to_the_time_left():
    cost = PrefillCost.fit(fixed_s=0.004, tokens=256, near_s=0.012, far_start=1024, far_s=0.020)
    assert cost.per_token_per_position_s > 0
    shallow = cost.tokens_within(0.02, 0, 16, 4096)
    deep = cost.tokens_within(0.02, 1500, 16, 4096)
    assert 16 < deep < shallow
    for start, n in ((0, shallow), (1500, deep)):
        assert cost.predict(1, n, start) <= 0.02 < cost.predict(1, n + 2, start)
    assert cost.tokens_within(0.001, 0, 16, 4096) == 16
    cost.add(1, 256, 0, 0.004 + 2 * (0.012 - 0.004))
    assert cost.scale.value > 1
    assert cost.tokens_within(0.02, 0, 16, 4096) < shallow
