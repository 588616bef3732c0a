"""The stream engine's step policy over plain sequences (no model): what each step runs and
how much prompt work it lets in, priced by a known cost model."""

from __future__ import annotations

import pytest

from engines.paged.block_manager import BlockManager
from engines.paged.scheduler import Schedule
from engines.paged.sequence import Sequence, Status
from engines.stream.cost import StepCost
from engines.stream.scheduler import LatencyPolicy, LatencyScheduler
from slogate.protocol import SamplingParams


def cost() -> StepCost:
    """1 ms per pass, 0.1 ms per decode row, 10 us per prompt token, more deep in the context."""
    return StepCost(fixed_s=0.001, per_decode_s=0.0001, per_token_s=1e-5, per_token_per_position_s=1e-8)


def scheduler(max_num_seqs: int = 8, **policy) -> LatencyScheduler:
    return LatencyScheduler(BlockManager(512, 16), max_num_seqs, 2048, 4096, cost(), LatencyPolicy(**policy))


def seq(rid: str, n: int, deadline: float = 100.0, max_tokens: int = 64) -> Sequence:
    return Sequence(rid, [(7 * i + sum(map(ord, rid))) % 50 for i in range(n)], SamplingParams(max_tokens=max_tokens),
                    deadline)


def step(sch: LatencyScheduler) -> Schedule:
    batch = sch.schedule()
    sch.postprocess(batch, {i: 1 for i in range(len(batch.seqs)) if batch.samples(i)})
    return batch


def plan(batch: Schedule) -> dict[str, int]:
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens)}


def test_with_nothing_decoding_a_burst_enters_in_one_step():
    sch = scheduler(step_budget_s=0.0)
    for i in range(8):
        sch.add(seq(f"s{i}", 60))
    assert plan(step(sch)) == {f"s{i}": 60 for i in range(8)}


def test_long_prompt_chunks_keep_each_step_within_the_allowance():
    sch = scheduler()
    streams = [seq(f"s{i}", 20) for i in range(4)]
    for s in streams:
        sch.add(s)
    step(sch)
    long = seq("long", 3000, deadline=200.0)
    sch.add(long)
    allowance = sch.allowance_s(4)
    assert allowance == pytest.approx(1.0 * (0.001 + 4 * 0.0001))
    chunks = []
    while long.is_prefilling or long.num_computed_tokens < len(long) - 1 or not chunks:
        batch = step(sch)
        got = plan(batch)
        assert all(got[s.request_id] == 1 for s in streams), "every stream decodes every step"
        chunks.append((long.num_computed_tokens - got["long"], got["long"]))
        if len(long) > 3000:
            break
    assert sum(n for _, n in chunks) == 3000
    assert all(sch.cost.prefill_s([(start, n)]) <= allowance for start, n in chunks[:-1])
    assert chunks[-1][1] <= chunks[0][1], "deep chunks are no bigger than the first"
    assert chunks[0][1] > 16


def test_the_budget_caps_the_allowance_when_decode_steps_are_slow():
    sch = scheduler(step_budget_s=0.002)
    sch.cost.per_decode_s = 0.01
    assert sch.allowance_s(8) == pytest.approx(0.002)
    assert sch.allowance_s(0) == float("inf")


def test_the_most_urgent_prompt_advances_even_when_decoding_fills_the_step():
    sch = scheduler(step_budget_s=0.0, short_prompt_tokens=0)
    sch.add(seq("running", 10))
    step(sch)
    sch.add(seq("long", 1000))
    sch.add(seq("later", 1000, deadline=300.0))
    assert plan(step(sch)) == {"running": 1, "long": 16}


def test_short_prompts_enter_whole_up_to_their_floor_and_long_ones_wait_their_turn():
    sch = scheduler(step_budget_s=0.0, short_prompt_tokens=100, cut_ins_per_step=0)  # prompts beside decodes
    sch.add(seq("running", 10))
    step(sch)
    for i in range(3):
        sch.add(seq(f"short{i}", 40, deadline=50.0 + i))
    got = plan(step(sch))
    assert got == {"running": 1, "short0": 40, "short1": 40}
    assert plan(step(sch)) == {"running": 1, "short0": 1, "short1": 1, "short2": 40}


def test_an_urgent_newcomer_goes_before_a_prompt_halfway_through():
    sch = scheduler(fixed_chunk_tokens=64)
    long = seq("long", 500, deadline=200.0)
    sch.add(long)
    step(sch)
    assert long.num_computed_tokens == 64
    sch.add(seq("urgent", 20, deadline=10.0))
    batch = step(sch)
    assert [s.request_id for s in batch.seqs] == ["urgent", "long"]
    assert batch.num_new_tokens == [20, 44]


def test_the_batch_never_exceeds_max_num_seqs_and_the_rest_waits_in_deadline_order():
    sch = scheduler(max_num_seqs=2)
    for rid, deadline in (("c", 3.0), ("a", 1.0), ("b", 2.0)):
        sch.add(seq(rid, 10, deadline=deadline))
    assert set(plan(step(sch))) == {"a", "b"}
    assert [s.request_id for s in sch.waiting] == ["c"]
    assert all(s.status is Status.RUNNING for s in sch.running)
    sch.finish(sch.running[0])
    assert set(plan(step(sch))) == {"b", "c"}


def test_with_streams_decoding_a_step_takes_no_more_tokens_than_a_graph_runs():
    sch = scheduler(step_budget_s=1.0, max_stall_ratio=1000.0, max_tokens_with_decodes=32)
    for i in range(4):
        sch.add(seq(f"s{i}", 20))
    step(sch)
    sch.add(seq("long", 500))
    assert sum(step(sch).num_new_tokens) == 32
    idle = scheduler(step_budget_s=1.0, max_tokens_with_decodes=32)
    idle.add(seq("long", 500))
    assert plan(step(idle)) == {"long": 500}, "with nothing decoding the cap does not apply"


def cut_in_step(sch: LatencyScheduler, arrivals: list[list[Sequence]]) -> tuple[Schedule, list[list[str]]]:
    """A step during which requests arrive, one batch of newcomers at each pause; each pass
    that cuts in runs (its first tokens sampled) before the step goes on. Returns the step and
    who cut in at each pause."""
    batch = sch.schedule()
    passes = []
    for newcomers in arrivals:
        for s in newcomers:
            sch.add(s)
        extra = sch.cut_in()
        passes.append([s.request_id for s in extra.seqs])
        step_pass(sch, extra)
    step_pass(sch, batch)
    return batch, passes


def step_pass(sch: LatencyScheduler, batch: Schedule) -> None:
    sch.postprocess(batch, {i: 1 for i in range(len(batch.seqs)) if batch.samples(i)})


def test_newcomers_cut_in_with_whole_prompts_most_urgent_first():
    sch = scheduler()
    for i in range(2):
        sch.add(seq(f"s{i}", 10))
    step(sch)
    newcomers = [seq("a", 30, deadline=1.0), seq("one", 1, deadline=0.5), seq("b", 30, deadline=2.0),
                 seq("c", 90, deadline=3.0)]
    batch, passes = cut_in_step(sch, [newcomers])
    assert passes == [["one", "a", "b", "c"]]
    assert plan(batch) == {"s0": 1, "s1": 1}, "the paused step runs what it planned"
    assert sch.last_plan == (2, []), "and teaches the cost model as planned"
    assert all(len(s) == s.num_prompt_tokens + 1 and not s.is_prefilling for s in newcomers), "first tokens out"
    assert plan(step(sch)) == {"s0": 1, "s1": 1, "one": 1, "a": 1, "b": 1, "c": 1}


def test_at_most_cut_ins_per_step_passes_pause_a_step():
    sch = scheduler(max_num_seqs=16, cut_ins_per_step=2)
    for i in range(4):
        sch.add(seq(f"s{i}", 10))
    step(sch)
    _, passes = cut_in_step(sch, [[seq(f"n{k}", 20)] for k in range(4)])
    assert passes == [["n0"], ["n1"], [], []], "the third and fourth wait for the next step"
    assert plan(step(sch)) == {"n2": 20, "n3": 20}, "they run first in a pass of their own"
    _, passes = cut_in_step(sch, [[seq("n4", 20)]])
    assert passes == [["n4"]], "the streams' step may be paused again"
    off = scheduler(cut_ins_per_step=0)
    off.add(seq("s", 10))
    step(off)
    _, passes = cut_in_step(off, [[seq("n", 20)]])
    assert passes == [[]]


def test_while_streams_decode_waiting_prompts_run_first_in_a_pass_of_their_own_then_the_streams_step():
    sch = scheduler(short_prompt_tokens=100)
    for i in range(2):
        sch.add(seq(f"s{i}", 10))
    step(sch)
    assert plan(step(sch)) == {"s0": 1, "s1": 1}
    for rid, n in [("a", 30), ("b", 60), ("c", 30), ("long", 400)]:
        sch.add(seq(rid, n, deadline=50.0 + len(sch.waiting)))
    assert plan(step(sch)) == {"a": 30, "b": 60}, "up to short_prompt_tokens, most urgent first"
    assert sch.last_plan == (0, [(0, 30), (0, 60)])
    assert sch.cut_in() == Schedule(), "a pass of prompts is not paused: all in it come first"
    got = plan(step(sch))
    assert got["s0"] == got["s1"] == got["a"] == got["b"] == 1 and got["c"] == 30 and got["long"] < 400, (
        "never two prompt passes in a row: then the streams step, with what waits beside them as before"
    )
    assert not sch.prompt_pass


def test_next_tokens_runs_decodes_alone_and_never_preempts_for_them():
    sch = LatencyScheduler(BlockManager(8, 16), 4, 2048, 4096, cost(), LatencyPolicy())
    full, other, waiting = seq("full", 16), seq("other", 20), seq("waiting", 10)
    for s in (full, other):
        sch.add(s)
    step(sch)
    sch.add(waiting)
    sch.block_manager.allocate(seq("elsewhere", 5 * 16))
    assert sch.block_manager.num_free_blocks == 0
    assert plan(sch.next_tokens([full, other, waiting])) == {"other": 1}, (
        "'full' needs a block no one has free, 'waiting' has no prompt computed"
    )
    assert sch.running == [full, other] and sch.waiting == [waiting] and not sch.num_preemptions


def test_a_long_prompt_never_cuts_in_and_a_full_batch_takes_no_one():
    sch = scheduler(max_num_seqs=2, short_prompt_tokens=512)
    sch.add(seq("s0", 10))
    step(sch)
    batch, passes = cut_in_step(sch, [[seq("long", 1000), seq("short", 8, deadline=50.0)]])
    assert passes == [["short"]], "a long prompt is chunked into steps instead"
    assert plan(step(sch)) == {"s0": 1, "short": 1}, "the batch is full: the long prompt waits"
    _, passes = cut_in_step(sch, [[seq("other", 8)]])
    assert passes == [[]], "the batch is full"


def test_a_pass_takes_short_prompts_up_to_short_prompt_tokens_in_all():
    sch = scheduler(max_num_seqs=8, short_prompt_tokens=100)
    sch.add(seq("s0", 10))
    step(sch)
    _, passes = cut_in_step(sch, [[seq("a", 60, deadline=1.0), seq("b", 60, deadline=2.0), seq("c", 40, deadline=3.0)]])
    assert passes == [["a", "c"]]


def test_a_newcomer_does_not_cut_in_ahead_of_a_more_urgent_prompt_in_the_step():
    sch = scheduler()
    sch.add(seq("s0", 10))
    step(sch)
    sch.add(seq("first", 20, deadline=5.0))  # distinct prompts: no prefix cache hits
    _, passes = cut_in_step(sch, [[seq("later", 20, deadline=6.0)], [seq("urgent", 20, deadline=4.0)]])
    assert passes == [[], ["urgent"]], "'first' gets its first token from the step: 'later' would delay it"
    batch, passes = cut_in_step(sch, [[seq("next", 20, deadline=7.0)]])
    assert plan(batch)["later"] == 20 and passes == [[]], "'later' is in this step, ahead of 'next'"
    assert plan(step(sch))["next"] == 20
    batch, passes = cut_in_step(sch, [[seq("free", 20, deadline=9.0)]])
    assert set(plan(batch).values()) == {1} and passes == [["free"]], "a step of decodes delays no first token"


def test_the_most_urgent_request_waiting_for_blocks_is_not_starved_by_later_ones_that_fit():
    sch = LatencyScheduler(BlockManager(16, 16), 8, 2048, 4096, cost(), LatencyPolicy())
    for i in range(3):
        sch.add(seq(f"s{i}", 40, deadline=50.0 + i, max_tokens=20))
    step(sch)
    urgent = seq("urgent", 200, deadline=1.0)  # 13 of the 16 blocks: it starts once few others run
    assert starts_among_later_ones(sch, urgent, 60), "requests with later deadlines kept taking every block freed"


def starts_among_later_ones(sch: LatencyScheduler, urgent: Sequence, steps: int) -> bool:
    """Whether ``urgent`` starts within ``steps`` steps, a request with a later deadline
    arriving at each and the finished ones leaving."""
    sch.add(urgent)
    for k in range(steps):
        sch.add(seq(f"later{k}", 40, deadline=60.0 + k, max_tokens=20))
        step(sch)
        for s in [s for s in sch.running if s.num_completion_tokens >= s.sampling.max_tokens]:
            sch.finish(s)
        if urgent.status is Status.RUNNING:
            return True
    return False


@pytest.mark.parametrize("num_blocks,max_num_seqs", [(48, 8), (512, 3)], ids=["blocks", "slots"])
def test_the_most_urgent_long_prompt_is_not_starved_by_later_ones_that_go_first_in_prompt_passes(
        num_blocks: int, max_num_seqs: int):
    sch = LatencyScheduler(BlockManager(num_blocks, 16), max_num_seqs, 2048, 4096, cost(), LatencyPolicy())
    for i in range(max_num_seqs):
        sch.add(seq(f"s{i}", 40, deadline=50.0 + i, max_tokens=20 - 4 * i))
    step(sch)
    urgent = seq("urgent", 600, deadline=1.0)  # over short_prompt_tokens: never in a pass of prompts that go first
    assert starts_among_later_ones(sch, urgent, 100), "later ones took in each prompt pass the slot or blocks it had"
