from __future__ import annotations

from engines.paged.block_manager import BlockManager
from engines.paged.scheduler import Scheduler
from engines.paged.sequence import Sequence, Status
from slogate.protocol import SamplingParams


def _scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_model_len=256)


def _seq(rid: str, prompt_len: int, max_tokens: int, deadline: float = float("inf"), base: int = 0) -> Sequence:
    prompt = [(base + 7 * i) % 50 for i in range(prompt_len)]
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), deadline)


def _fake_token(seq: Sequence) -> int:
    """A token that depends on every token before it, so a corrupted or lost token shows."""
    return hash(tuple(seq.token_ids)) % 1000


def _run(sch: Scheduler, seqs: list[Sequence], max_steps: int = 5000) -> dict[str, list[int]]:
    for seq in seqs:
        assert sch.rejection(seq) is None
        sch.add(seq)
    bs = sch.block_manager.block_size
    steps = 0
    while sch.has_unfinished():
        steps += 1
        assert steps < max_steps, "no progress"
        batch = sch.schedule()
        assert batch.seqs, "scheduled nothing while work remains"
        assert batch.num_tokens <= sch.max_batched_tokens
        assert len(sch.running) <= sch.max_num_seqs
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status is Status.RUNNING
            assert len(seq.block_table) * bs >= seq.num_computed_tokens + n
        sampled = {i: _fake_token(s) for i, s in enumerate(batch.seqs) if batch.samples(i)}
        sch.postprocess(batch, sampled)
        for i in sampled:
            seq = batch.seqs[i]
            if seq.num_completion_tokens == seq.sampling.max_tokens:
                sch.finish(seq)
    return {s.request_id: s.completion_token_ids for s in seqs}


def _assert_pool_clean(sch: Scheduler) -> None:
    bm = sch.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def _workload() -> list[Sequence]:
    return [_seq(f"r{i}", 3 + 5 * i, 4 + 3 * i, base=i) for i in range(8)]


def test_every_request_completes_and_frees_its_blocks() -> None:
    sch = _scheduler()
    out = _run(sch, _workload())
    assert [len(out[f"r{i}"]) for i in range(8)] == [4 + 3 * i for i in range(8)]
    assert sch.num_preemptions == 0
    _assert_pool_clean(sch)


def test_preemption_by_recompute_loses_and_corrupts_nothing() -> None:
    expected = _run(_scheduler(), _workload())
    tight = _scheduler(num_blocks=17)
    assert _run(tight, _workload()) == expected
    assert tight.num_preemptions > 0
    assert tight.num_preemptions <= 3 * len(expected), "preemption thrashes"
    _assert_pool_clean(tight)


def test_preemption_without_prefix_cache_also_recovers() -> None:
    expected = _run(_scheduler(), _workload())
    sch = Scheduler(BlockManager(17, 4, enable_prefix_caching=False), 8, 64, 256)
    assert _run(sch, _workload()) == expected
    assert sch.num_preemptions > 0
    _assert_pool_clean(sch)


def test_long_prompt_is_chunked_while_decodes_keep_running() -> None:
    sch = _scheduler(budget=8)
    short = _seq("short", 4, 20)
    sch.add(short)
    first = sch.schedule()
    sch.postprocess(first, {0: 1})
    long = _seq("long", 40, 2, base=1)
    sch.add(long)
    chunks = []
    while long.num_completion_tokens == 0:
        batch = sch.schedule()
        assert batch.num_tokens <= 8
        assert short in batch.seqs, "a running decode was stalled by a prefill"
        chunks.append(batch.num_new_tokens[batch.seqs.index(long)])
        sch.postprocess(batch, {i: 1 for i in range(len(batch.seqs)) if batch.samples(i)})
    assert len(chunks) > 3 and sum(chunks) == 40 and max(chunks) <= 7


def test_waiting_requests_are_admitted_earliest_deadline_first() -> None:
    sch = _scheduler(max_num_seqs=1)
    late, soon = _seq("late", 4, 2, deadline=200.0), _seq("soon", 4, 2, deadline=100.0)
    sch.add(late)
    sch.add(soon)
    assert sch.schedule().seqs == [soon]


def test_max_num_seqs_bounds_the_running_set() -> None:
    sch = _scheduler(max_num_seqs=3)
    for i in range(6):
        sch.add(_seq(f"r{i}", 4, 4))
    batch = sch.schedule()
    assert len(batch.seqs) == 3 and len(sch.waiting) == 3


def test_finish_frees_blocks_of_running_and_waiting_requests() -> None:
    sch = _scheduler(max_num_seqs=1)
    a, b = _seq("a", 10, 4), _seq("b", 10, 4)
    sch.add(a)
    sch.add(b)
    sch.postprocess(sch.schedule(), {0: 1})
    sch.finish(a)
    sch.finish(b)
    assert not sch.has_unfinished()
    _assert_pool_clean(sch)


def test_requests_that_can_never_fit_are_rejected_up_front() -> None:
    sch = _scheduler(num_blocks=8, block_size=4)
    assert "context" in sch.rejection(_seq("ctx", 200, 100))
    assert "KV blocks" in sch.rejection(_seq("pool", 20, 20))
    assert sch.rejection(_seq("ok", 20, 12)) is None
