from __future__ import annotations

from itertools import pairwise

import pytest

from policies.admission import AdmissionController, deadline_for
from policies.config import load
from policies.predict import PoolSignals
from slogate.protocol import Heartbeat, ModelInfo

CFG = load({"routing": {"interactive_spill": ["batch"]}})  # pools "interactive" and "batch"; spill allowed
BUDGET = 0.150 / 1.2


def hb(worker_id: str, running: int = 0, waiting: int = 0, capacity: int = 8, decode: float = 0.01,
       prefill: float = 0.0001, per_seq: float = 0.0, quiet: float = 0.0,
       quiet_prefill: float = 0.0) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, pool="p", engine="sim", models=[ModelInfo("m", 8192)],
                     running=running, waiting=waiting, capacity=capacity,
                     prefill_s_per_token=prefill, decode_step_s=decode, decode_s_per_seq=per_seq,
                     quiet_step_s=quiet, quiet_prefill_s_per_token=quiet_prefill)


def signals(i_depth: int = 0, i_running: int = 1, b_depth: int = 0, b_running: int = 64,
            b_waiting: int = 0, b_decode: float = 0.03) -> dict[str, PoolSignals]:
    return {
        "interactive": PoolSignals("interactive", i_depth + 2 * i_running,
                                   [hb("i1", running=i_running), hb("i2", running=i_running)]),
        "batch": PoolSignals("batch", b_depth + b_running + b_waiting,
                             [hb("b1", running=b_running, waiting=b_waiting, capacity=64, decode=b_decode)]),
    }


def ask(ctl: AdmissionController, sig: dict[str, PoolSignals], cls: str = "interactive", stream: bool = False,
        max_tokens: int | None = 8, now: float = 0.0, deadline: float | None = None, sent_at: float | None = None,
        n: int = 1):
    return ctl.decide(cls=cls, stream=stream, prompt_tokens=100, max_tokens=max_tokens, signals=sig,
                      now=now, model="m", deadline=deadline, sent_at=sent_at, n=n)


def test_idle_interactive_is_admitted_with_a_worker_hint() -> None:
    d = ask(AdmissionController(CFG), signals(i_running=0))
    assert (d.outcome, d.reason, d.status, d.pool, d.admitted) == ("admit", "fits", 200, "interactive", True)
    assert d.worker in {"i1", "i2"}
    assert d.predicted_s == pytest.approx(100 * 0.0001 + 8 * 0.01)


def test_overloaded_interactive_is_shed_with_a_retry_after() -> None:
    d = ask(AdmissionController(CFG), signals(i_depth=200, i_running=8))
    assert (d.outcome, d.reason, d.status) == ("shed", "overloaded", 429)
    assert d.predicted_s > BUDGET
    assert CFG.admission.min_retry_after_s <= d.retry_after_s <= CFG.admission.max_retry_after_s


def test_admission_is_monotone_in_queue_depth() -> None:
    ctl = AdmissionController(CFG)
    decisions = [ask(ctl, signals(i_depth=depth, i_running=6)) for depth in range(0, 100)]
    predicted = [d.predicted_s for d in decisions]
    assert all(a <= b for a, b in pairwise(predicted))
    admitted = [d.admitted for d in decisions]
    first_shed = admitted.index(False)
    assert first_shed > 0 and not any(admitted[first_shed:])
    retries = [d.retry_after_s for d in decisions[first_shed:]]
    assert all(a <= b for a, b in pairwise(retries))


@pytest.mark.parametrize("cls", ["interactive", "batch"])
def test_n_choices_are_predicted_as_the_last_of_n_requests(cls: str) -> None:
    """Each choice is an engine request: n of them wait as one would behind n - 1 more."""
    for n in (2, 5, 12):
        many = ask(AdmissionController(CFG), signals(i_running=7, b_running=60), cls=cls, n=n)
        behind = signals(i_depth=n - 1, i_running=7, b_depth=n - 1, b_running=60)
        alone = ask(AdmissionController(CFG), behind, cls=cls)
        assert (many.outcome, many.reason, many.predicted_s) == (alone.outcome, alone.reason, alone.predicted_s)


@pytest.mark.parametrize("cls", ["interactive", "batch"])
def test_each_choice_is_given_its_own_slots_predicted_end(cls: str) -> None:
    """Choices queue one behind another: the first starts on a free slot while the last waits for
    one to free. All given the last's end, the earlier ones' slots counted as held until then, and
    the requests after them were predicted waits for slots those choices had freed long before."""
    def behind(i: int) -> dict[str, PoolSignals]:  # i requests queued on a pool with 2 free slots
        if cls == "interactive":
            return signals(i_depth=i, i_running=7)
        return signals(i_running=0, b_depth=i, b_running=62)

    def taught() -> AdmissionController:  # an interactive request may queue only on a pool of learned costs
        ctl = AdmissionController(CFG)
        for i in range(CFG.admission.estimator.min_samples):
            ctl.observe(pool="interactive", cls="batch", stream=False, prompt_tokens=100, completion_tokens=8,
                        queue_wait_s=0.0, ttft_s=0.011, e2e_s=0.081, now=float(i), epoch=0)
        return ctl

    for n in (1, 2, 3):
        many = ask(taught(), behind(0), cls=cls, n=n)
        assert many.admitted and len(many.slot_ends) == n, many
        for i, end in enumerate(many.slot_ends):
            assert end == pytest.approx(ask(taught(), behind(i), cls=cls).slot_ends[0]), (n, i)
        assert many.slot_ends[0] < many.slot_ends[-1] or n < 3, "the first choice needs no slot to free"


def test_what_fits_once_may_not_fit_n_times() -> None:
    assert ask(AdmissionController(CFG), signals(i_running=7)).admitted
    many = ask(AdmissionController(CFG), signals(i_running=7), n=8)
    assert (many.outcome, many.reason) == ("shed", "overloaded")


def test_streamed_requests_are_judged_on_the_first_token() -> None:
    ctl = AdmissionController(CFG)
    long_answer = ask(ctl, signals(), max_tokens=400)
    assert (long_answer.outcome, long_answer.reason, long_answer.retry_after_s) == ("shed", "exceeds-objective", 0.0)
    assert ask(ctl, signals(), stream=True, max_tokens=400).admitted


def test_a_host_busy_with_other_work_is_overload_not_a_request_that_never_fits() -> None:
    """Steps of 20 ms while another job holds the cores: 8 tokens miss the budget now, but the
    worker's quiet step (4 ms) says they fit once the host is free, so the client may retry."""
    def contended(quiet: float) -> dict[str, PoolSignals]:
        return {"interactive": PoolSignals("interactive", 1, [hb("i1", running=1, decode=0.02, quiet=quiet)])}

    never = ask(AdmissionController(CFG), contended(quiet=0.0), max_tokens=8)
    assert (never.outcome, never.reason) == ("shed", "exceeds-objective")
    later = ask(AdmissionController(CFG), contended(quiet=0.004), max_tokens=8)
    assert (later.outcome, later.reason) == ("shed", "overloaded") and later.retry_after_s > 0


def test_a_prompt_cost_left_high_by_contention_is_overload_and_probes_bring_it_down() -> None:
    """After a spell of contention the engine's prompt cost stays high (1.5 ms a token here)
    until it prefills again: judged on it, 100 prompt tokens could never fit, and with nothing
    let through it never came down (a whole stack shed 97% of a risk mix on an idle pool, as
    requests never to retry). Its quiet cost (0.1 ms) says they fit: the request is overload,
    to retry, and the pool's probes go through to teach it."""
    def after_contention(quiet_prefill: float) -> dict[str, PoolSignals]:
        return {"interactive": PoolSignals("interactive", 0, [hb("i1", prefill=0.0015, quiet=0.01,
                                                                 quiet_prefill=quiet_prefill)])}

    never = ask(AdmissionController(CFG), after_contention(quiet_prefill=0.0), max_tokens=8)
    assert (never.outcome, never.reason, never.retry_after_s) == ("shed", "exceeds-objective", 0.0)
    ctl = AdmissionController(CFG)
    first = ask(ctl, after_contention(quiet_prefill=0.0001), max_tokens=8, now=1.0)
    assert (first.outcome, first.reason) == ("admit", "probe")
    later = ask(ctl, after_contention(quiet_prefill=0.0001), max_tokens=8, now=1.0)
    assert (later.outcome, later.reason) == ("shed", "overloaded") and later.retry_after_s > 0


def test_interactive_decisions_do_not_depend_on_batch_demand() -> None:
    calm, busy = AdmissionController(CFG), AdmissionController(CFG)
    outcomes = set()
    for i_depth in (0, 3, 10, 40):
        quiet = ask(calm, signals(i_depth=i_depth, i_running=6, b_depth=0, b_running=0))
        flooded = ask(busy, signals(i_depth=i_depth, i_running=6, b_depth=999, b_running=64, b_waiting=500))
        assert quiet.pool == "interactive"
        assert (flooded.outcome, flooded.pool, flooded.predicted_s) == (quiet.outcome, quiet.pool, quiet.predicted_s)
        outcomes.add(quiet.outcome)
    assert outcomes == {"admit", "shed"}


def test_interactive_spills_to_batch_only_when_that_meets_the_objective() -> None:
    ctl = AdmissionController(CFG)
    d = ask(ctl, signals(i_depth=200, i_running=8, b_running=10, b_decode=0.01))
    assert (d.outcome, d.reason, d.pool) == ("admit", "spill", "batch")
    d = ask(ctl, signals(i_depth=200, i_running=8, b_depth=300, b_running=64))
    assert (d.outcome, d.pool) == ("shed", "interactive")


def test_batch_waits_while_interactive_is_busy_on_shared_pools() -> None:
    ctl = AdmissionController(CFG)
    assert ask(ctl, signals(i_running=2), cls="batch").admitted
    d = ask(ctl, signals(i_running=8, i_depth=2), cls="batch")
    assert (d.outcome, d.reason, d.status, d.retry_after_s) == ("wait", "interactive-busy", 429, 1.0)


def test_batch_that_comes_while_others_are_held_waits_behind_them_for_a_shared_pool_only() -> None:
    ctl = AdmissionController(CFG)
    d = ctl.decide(cls="batch", stream=False, prompt_tokens=100, max_tokens=8, signals=signals(i_running=2),
                   now=0.0, model="m", behind_held=True)
    assert (d.outcome, d.reason, d.status, d.retry_after_s) == ("wait", "behind-held", 429, 1.0)
    full = ctl.decide(cls="batch", stream=False, prompt_tokens=100, max_tokens=2000, signals=signals(b_depth=1009),
                      now=0.0, model="m", behind_held=True)
    assert full.reason == "batch-queue-full", "a refusal is answered at once, not after the line"
    alone = AdmissionController(load({"routing": {"interactive_spill": []}}))
    d = alone.decide(cls="batch", stream=False, prompt_tokens=100, max_tokens=8, signals=signals(i_running=2),
                     now=0.0, model="m", behind_held=True)
    assert d.admitted, "nothing holds back a pool interactive work does not use"


@pytest.mark.parametrize(("batch_pools", "unshared"), [(["batch"], False), (["batch", "bulk"], True)])
def test_a_batch_pool_nobody_waits_for_is_known_from_the_routing(batch_pools: list[str], unshared: bool) -> None:
    """Held requests behind others ask again only when there is one: else every answer is
    "behind-held" (the batch pool is the interactive spill)."""
    ctl = AdmissionController(load({"routing": {"pools": {"batch": batch_pools}, "interactive_spill": ["batch"]}}))
    assert ctl.has_unshared_batch_pool is unshared


def test_batch_is_not_held_when_it_shares_nothing_with_interactive() -> None:
    ctl = AdmissionController(load({"routing": {"interactive_spill": []}}))
    d = ask(ctl, signals(i_running=8, i_depth=50), cls="batch")
    assert (d.outcome, d.reason, d.pool) == ("admit", "queued", "batch")


def test_batch_is_shed_only_when_its_queue_is_full() -> None:
    ctl = AdmissionController(CFG)
    assert ask(ctl, signals(b_depth=999), cls="batch", max_tokens=2000).admitted
    assert not ask(ctl, signals(b_depth=1000), cls="batch", max_tokens=2000).admitted
    d = ask(ctl, signals(b_depth=1009), cls="batch", max_tokens=2000)
    assert (d.outcome, d.reason, d.status, d.pool) == ("shed", "batch-queue-full", 429, "batch")
    # Ten entries over: the time ten of 64 slots take to free, at (256 x 0.0001 + 64 x 0.03) s each.
    assert d.retry_after_s == pytest.approx(10 * (256 * 0.0001 + 64 * 0.03) / 64, abs=1e-3)
    further = ask(ctl, signals(b_depth=1100), cls="batch", max_tokens=2000)
    assert further.retry_after_s > d.retry_after_s


def test_batch_past_its_deadline_fails() -> None:
    ctl = AdmissionController(CFG)
    d = ask(ctl, signals(), cls="batch", now=100.0, deadline=100.0)
    assert (d.outcome, d.reason, d.status) == ("expired", "deadline", 504)
    d = ask(ctl, signals(b_depth=900), cls="batch", now=100.0, deadline=101.0)
    assert (d.outcome, d.reason) == ("shed", "cannot-meet-deadline")
    assert ask(ctl, signals(b_depth=900), cls="batch", now=100.0, deadline=deadline_for("batch", 100.0, CFG)).admitted


def test_a_streamed_batch_request_must_finish_by_its_deadline_not_just_start() -> None:
    """A batch deadline is for the whole answer: a stream admitted on its first token's time
    failed mid-answer at the deadline."""
    ctl = AdmissionController(CFG)
    idle = signals(b_running=0)
    for stream in (False, True):
        d = ask(ctl, idle, cls="batch", stream=stream, max_tokens=500, now=100.0, deadline=100.5)
        assert (d.outcome, d.reason) == ("shed", "cannot-meet-deadline"), stream
        assert d.predicted_s == pytest.approx(100 * 0.0001 + 500 * 0.03, rel=0.2)
        assert d.retry_after_s == 0.0, "it misses on an idle pool: retrying will not help"
        assert ask(ctl, idle, cls="batch", stream=stream, max_tokens=500, now=100.0, deadline=130.0).admitted


def test_a_deadline_missed_only_for_the_backlog_says_when_to_send_it_again() -> None:
    """Its deadline starts when it is sent: once the backlog has drained, the same request fits."""
    d = ask(AdmissionController(CFG), signals(b_depth=900), cls="batch", max_tokens=8, now=100.0, deadline=103.0)
    assert (d.outcome, d.reason) == ("shed", "cannot-meet-deadline")
    assert d.retry_after_s > 0


def test_a_held_batch_request_is_held_to_its_deadline_not_told_never_to_retry() -> None:
    """The time it spent held is not the request's fault: near its deadline it is still held
    (and expires, 504), not shed as if it could never fit."""
    ctl = AdmissionController(CFG)
    busy = signals(i_depth=200, i_running=8, b_running=0)
    for now in (0.0, 20.0, 29.0):
        d = ask(ctl, busy, cls="batch", max_tokens=100, now=now, deadline=30.0, sent_at=0.0)
        assert (d.outcome, d.reason) == ("wait", "interactive-busy"), now
    assert ask(ctl, busy, cls="batch", max_tokens=100, now=30.0, deadline=30.0, sent_at=0.0).outcome == "expired"


def test_an_interactive_request_whose_own_deadline_comes_first_is_shed_not_run_into_a_504() -> None:
    """A client's timeout (``x-slogate-timeout``) below the predicted answer: it was admitted,
    ran, and ended in a 504 at its deadline, its engine time spent for nothing."""
    ctl = AdmissionController(CFG)
    idle = signals(i_running=0)
    for stream in (False, True):
        d = ask(ctl, idle, stream=stream, now=100.0, deadline=100.05)
        assert (d.outcome, d.reason, d.status) == ("shed", "cannot-meet-deadline", 429), stream
        assert d.retry_after_s == 0.0, "it misses on an idle pool: retrying will not help"
        assert ask(ctl, idle, stream=stream, now=100.0, deadline=101.0).admitted
    ctl.observe(pool="interactive", cls="batch", stream=False, prompt_tokens=100, completion_tokens=8,
                queue_wait_s=0.0, ttft_s=0.02, e2e_s=0.09, now=100.0, epoch=0)  # heard from: no probe due
    d = ask(ctl, signals(i_depth=2, i_running=8), now=100.0, deadline=100.1, sent_at=100.0)
    assert (d.outcome, d.reason) == ("shed", "cannot-meet-deadline")
    assert d.retry_after_s > 0, "it fits once the queue ahead has gone"


def test_deadlines_per_class() -> None:
    assert deadline_for("interactive", 10.0, CFG) == 40.0
    assert deadline_for("batch", 10.0, CFG) == 3610.0


def test_no_workers() -> None:
    ctl = AdmissionController(CFG)
    empty = {"interactive": PoolSignals("interactive", 0, []), "batch": PoolSignals("batch", 3, [])}
    d = ask(ctl, empty)
    assert (d.outcome, d.reason, d.status) == ("unavailable", "no-workers", 503)
    d = ask(ctl, empty, cls="batch")  # batch may queue while workers restart
    assert (d.outcome, d.pool, d.worker, d.predicted_s) == ("admit", "batch", None, None)


def test_open_circuit_fails_fast_then_probes() -> None:
    ctl = AdmissionController(CFG)
    only_interactive = {"interactive": signals()["interactive"]}
    for _ in range(CFG.circuit.consecutive_failures):
        ctl.observe_failure("interactive", now=10.0)
    d = ask(ctl, only_interactive, now=11.0)
    assert (d.outcome, d.reason, d.status, d.retry_after_s) == ("unavailable", "circuit-open", 503, 4.0)
    # With the batch pool in sight, interactive work spills there instead.
    assert ask(ctl, signals(b_running=0, b_decode=0.01), now=11.0).pool == "batch"
    probe = ask(ctl, only_interactive, now=15.0)
    assert probe.admitted and probe.pool == "interactive"
    assert ask(ctl, only_interactive, now=15.1).reason == "circuit-open"
    ctl.observe(pool="interactive", cls="interactive", stream=False, prompt_tokens=100, completion_tokens=8,
                queue_wait_s=0.0, ttft_s=0.02, e2e_s=0.09, now=15.2, epoch=0, probe=probe.breaker_probe)
    second = ask(ctl, only_interactive, now=15.3)
    assert second.admitted
    ctl.observe(pool="interactive", cls="interactive", stream=False, prompt_tokens=100, completion_tokens=8,
                queue_wait_s=0.0, ttft_s=0.02, e2e_s=0.09, now=15.4, epoch=0, probe=second.breaker_probe)
    assert ctl.breaker("interactive").state(15.5) == "closed"


def test_an_answer_sent_before_the_circuit_opened_is_not_its_probes() -> None:
    """Requests let through before the pool's breaker opened, answered while its probe is out:
    counted as probes, two closed it with the probe unanswered."""
    ctl = AdmissionController(load({"circuit": {"half_open_probes": 1, "close_after": 2}}))
    only_interactive = {"interactive": signals()["interactive"]}
    before = ask(ctl, only_interactive, now=9.0)
    for _ in range(ctl.cfg.circuit.consecutive_failures):
        ctl.observe_failure("interactive", now=10.0)
    probe = ask(ctl, only_interactive, now=15.0)
    assert probe.admitted and probe.breaker_probe is not None and before.breaker_probe is None
    for now in (15.1, 15.2):
        ctl.answered(pool="interactive", cls="interactive", stream=False, ttft_s=0.02, e2e_s=0.09, now=now,
                     epoch=0, probe=before.breaker_probe)
        assert ask(ctl, only_interactive, now=now).reason == "circuit-open", "its probe is still out"
    ctl.answered(pool="interactive", cls="interactive", stream=False, ttft_s=0.02, e2e_s=0.09, now=15.3, epoch=0,
                 probe=probe.breaker_probe)
    assert ctl.breaker("interactive").state(15.3) == "half_open"


def test_a_half_open_pool_is_probed_by_no_more_engine_requests_than_its_probes() -> None:
    """Each of a request's choices is an engine request on the pool: a probe of eight choices would
    send eight to a pool that may still be failing."""
    ctl = AdmissionController(load({"circuit": {"half_open_probes": 2, "close_after": 2}}))
    only_interactive = {"interactive": signals()["interactive"]}
    for _ in range(ctl.cfg.circuit.consecutive_failures):
        ctl.observe_failure("interactive", now=10.0)
    first = ask(ctl, only_interactive, now=15.0)
    assert first.admitted
    d = ask(ctl, only_interactive, now=15.0, n=2)
    assert (d.outcome, d.reason, d.status) == ("unavailable", "circuit-open", 503), "one probe is left, not two"
    second = ask(ctl, only_interactive, now=15.1)
    assert second.admitted
    for now, probe in ((15.2, first), (15.3, second)):
        ctl.answered(pool="interactive", cls="interactive", stream=False, ttft_s=0.02, e2e_s=0.09, now=now, epoch=0,
                     probe=probe.breaker_probe)
    assert ctl.breaker("interactive").state(15.4) == "closed"


def test_a_request_of_more_choices_than_probes_probes_alone() -> None:
    """Refused while half-open, a client that always asks for several samples would keep the pool
    half-open, and refused, for as long as no request of fewer came."""
    ctl = AdmissionController(load({"circuit": {"half_open_probes": 1, "close_after": 2}}))
    only_interactive = {"interactive": signals()["interactive"]}
    for _ in range(ctl.cfg.circuit.consecutive_failures):
        ctl.observe_failure("interactive", now=10.0)
    probe = ask(ctl, only_interactive, now=15.0, n=3)
    assert probe.admitted
    assert ask(ctl, only_interactive, now=15.1, n=3).reason == "circuit-open", "it probes alone"
    assert ask(ctl, only_interactive, now=15.1).reason == "circuit-open"
    ctl.answered(pool="interactive", cls="interactive", stream=False, ttft_s=0.02, e2e_s=0.09, now=15.2, epoch=0,
                 n=3, probe=probe.breaker_probe)
    assert ctl.breaker("interactive").state(15.3) == "closed", "each choice answered is a probe that succeeded"


def report(ctl: AdmissionController, e2e_s: float, n: int) -> None:
    """``n`` requests admitted together, now. Reported against a pool no test request goes to,
    so only the feedback loop (global to the interactive class) changes, not the interactive
    pool's learned costs."""
    epoch = ctl.feedback.epoch
    for _ in range(n):
        ctl.observe(pool="elsewhere", cls="interactive", stream=False, prompt_tokens=100, completion_tokens=8,
                    queue_wait_s=0.0, ttft_s=e2e_s / 2, e2e_s=e2e_s, now=0.0, epoch=epoch)


def test_late_answers_tighten_admission_and_headroom_relaxes_it() -> None:
    ctl = AdmissionController(CFG)
    sig = signals(i_running=0)
    assert ask(ctl, sig, max_tokens=11).admitted  # predicted 0.12 s, budget 0.125 s
    report(ctl, e2e_s=0.3, n=CFG.admission.feedback.samples)
    assert ctl.feedback.factor == pytest.approx(1.25)
    assert ctl.budget(False) == pytest.approx(BUDGET / 1.25)
    # Each asks after the one admitted before it should be done (its prompt no longer in the way).
    assert not ask(ctl, sig, max_tokens=11, now=0.13).admitted
    assert ask(ctl, sig, max_tokens=8, now=0.14).admitted
    for _ in range(10):
        report(ctl, e2e_s=0.05, n=CFG.admission.feedback.samples)
    assert ctl.feedback.factor < 0.8
    assert ask(ctl, sig, max_tokens=12, now=0.24).admitted


def test_interactive_answers_that_ran_out_of_time_past_the_objective_count_as_late() -> None:
    ctl = AdmissionController(CFG)
    for _ in range(10):  # clients that allowed less than the objective: nothing is known
        ctl.observe_expired(cls="interactive", stream=False, latency_s=0.05, measured=False, epoch=0)
    for _ in range(10):
        ctl.observe_expired(cls="batch", stream=False, latency_s=30.0, measured=False, epoch=0)
    assert ctl.feedback.factor == 1.0 and not ctl.feedback._ratios
    for _ in range(5):  # streams whose first token came in time, then ran out: on time
        ctl.observe_expired(cls="interactive", stream=True, latency_s=0.05, measured=True, epoch=0)
    assert len(ctl.feedback._ratios) == 5
    for _ in range(3):  # past the objective: 3 in a window of 200 put its P99 over
        ctl.observe_expired(cls="interactive", stream=True, latency_s=0.4, measured=False, epoch=0)
    assert ctl.feedback.factor == pytest.approx(1.25)


def test_batch_latencies_do_not_move_the_interactive_loop() -> None:
    ctl = AdmissionController(CFG)
    for _ in range(CFG.admission.feedback.samples):
        ctl.observe(pool="batch", cls="batch", stream=False, prompt_tokens=100, completion_tokens=500,
                    queue_wait_s=30.0, ttft_s=31.0, e2e_s=60.0, now=60.0, epoch=0)
    assert ctl.feedback.factor == 1.0


def test_learned_costs_move_predictions() -> None:
    ctl = AdmissionController(CFG)
    sig = signals(i_running=0)
    before = ask(ctl, sig)
    assert before.admitted
    for _ in range(CFG.admission.estimator.min_samples):  # the pool got five times slower per token
        ctl.observe(pool="interactive", cls="batch", stream=False, prompt_tokens=100, completion_tokens=8,
                    queue_wait_s=0.0, ttft_s=0.06, e2e_s=0.41, now=0.41, epoch=0)
    after = ask(ctl, sig)
    assert after.predicted_s > 3 * before.predicted_s
    assert not after.admitted


def test_missing_max_tokens_is_costed_at_the_mean_answer() -> None:
    ctl = AdmissionController(CFG)
    mean = round(CFG.admission.estimator.prior_completion_tokens)
    assert ask(ctl, signals(), max_tokens=None).predicted_s == ask(ctl, signals(), max_tokens=mean).predicted_s


def test_multiple_pools_per_class_take_the_least_loaded() -> None:
    cfg = load({"routing": {"pools": {"interactive": ["a", "b"]}, "interactive_spill": []}})
    sig = {"a": PoolSignals("a", 38, [hb("a1", running=8)]), "b": PoolSignals("b", 3, [hb("b1", running=3)])}
    d = AdmissionController(cfg).decide(cls="interactive", stream=True, prompt_tokens=10, max_tokens=50,
                                        signals=sig, now=0.0)
    assert (d.pool, d.worker) == ("b", "b1")


def test_a_silent_shedding_pool_gets_one_probe_per_interval() -> None:
    ctl = AdmissionController(CFG)
    overloaded = signals(i_depth=200, i_running=8, b_depth=500, b_running=64)
    interval = CFG.admission.probe_interval_s
    now = 100.0
    first = ask(ctl, overloaded, now=now)
    assert (first.outcome, first.reason) == ("admit", "probe"), "a pool never heard from may be probed"
    assert not ask(ctl, overloaded, now=now + interval / 2).admitted
    assert ask(ctl, overloaded, now=now + interval).reason == "probe"
    ctl.observe(pool="interactive", cls="interactive", stream=False, prompt_tokens=100, completion_tokens=8,
                queue_wait_s=0.0, ttft_s=0.01, e2e_s=0.05, now=now + 2 * interval, epoch=0)
    assert not ask(ctl, overloaded, now=now + 2.5 * interval).admitted, "a pool just heard from is not probed"


def test_a_request_that_misses_on_an_idle_pool_is_never_a_probe() -> None:
    """It would miss its objective whatever the load, and teach the estimates nothing."""
    ctl = AdmissionController(CFG)
    never = ask(ctl, signals(i_running=0), max_tokens=60, now=100.0)
    assert (never.outcome, never.reason, never.retry_after_s) == ("shed", "exceeds-objective", 0.0)


def test_no_spill_by_default() -> None:
    ctl = AdmissionController(load({}))
    d = ask(ctl, signals(i_depth=200, i_running=8, b_running=0), now=0.0)
    assert (d.outcome, d.pool) == ("shed", "interactive"), "an idle batch pool does not take interactive work"


def teach(ctl: AdmissionController) -> None:
    """Enough finished requests that the interactive pool's costs count as learned: 0.0001 s a
    prompt token and 0.01 s a decode step (the heartbeats' figures), 100-token prompts, 8-token
    answers, so a request holds a slot 0.09 s on average. Reported as batch work, so the latency
    feedback stays out of it."""
    for _ in range(CFG.admission.estimator.min_samples):
        ctl.observe(pool="interactive", cls="batch", stream=False, prompt_tokens=100, completion_tokens=8,
                    queue_wait_s=0.0, ttft_s=0.02, e2e_s=0.09, now=0.09, epoch=0)


def test_an_unlearned_pool_takes_only_what_fits_its_free_slots() -> None:
    ctl = AdmissionController(CFG)
    assert ask(ctl, signals(i_running=7, i_depth=1)).admitted  # 15 of 16 slots held
    d = ask(ctl, signals(i_running=8, i_depth=1))  # one would have to wait
    assert (d.outcome, d.reason) == ("shed", "overloaded")
    teach(ctl)
    assert ask(ctl, signals(i_running=8, i_depth=1)).admitted


def test_long_holders_take_free_slots_but_do_not_queue() -> None:
    ctl = AdmissionController(CFG)
    teach(ctl)
    long_stream = {"stream": True, "max_tokens": 100}  # holds its slot ~1 s, 11x the mean
    assert ask(ctl, signals(i_running=7), **long_stream).admitted
    d = ask(ctl, signals(i_running=8, i_depth=1), **long_stream)
    assert (d.outcome, d.reason) == ("shed", "overloaded")
    assert d.retry_after_s >= CFG.admission.min_retry_after_s
    assert ask(ctl, signals(i_running=8, i_depth=1)).admitted  # a short answer may queue there
    unlimited = AdmissionController(load({"admission": {"queue_hold_factor": 0}}))
    teach(unlimited)
    assert ask(unlimited, signals(i_running=8, i_depth=1), **long_stream).admitted


def test_a_burst_on_free_slots_is_admitted_only_as_far_as_its_prompts_fit() -> None:
    # 16 free slots, 10 ms a prompt (100 tokens at 0.1 ms) spread over two workers, 80 ms of decode.
    ctl = AdmissionController(CFG)
    sig = signals(i_running=0)
    burst = [ask(ctl, sig, now=5.0) for _ in range(16)]
    admitted = [d for d in burst if d.admitted]
    assert 1 < len(admitted) < 16
    assert [d.admitted for d in burst] == [True] * len(admitted) + [False] * (16 - len(admitted))
    assert all(b.predicted_s > a.predicted_s for a, b in pairwise(admitted))  # each waits for the prompts before
    assert admitted[-1].predicted_s <= BUDGET
    shed = burst[len(admitted)]
    assert (shed.outcome, shed.reason) == ("shed", "overloaded")
    assert shed.retry_after_s >= CFG.admission.min_retry_after_s
    # Once the burst should be done, its prompts and promises no longer hold the pool.
    assert ask(ctl, sig, now=5.0 + admitted[-1].predicted_s + 0.001).admitted


def test_a_burst_is_admitted_only_as_far_as_the_steps_it_makes_longer_fit() -> None:
    # An idle worker, 64 slots, 4 ms a step plus 1 ms per running request, prompts nearly free:
    # 8 tokens fit 125 ms while no more than 11 run, whatever the slots say.
    def burst(per_seq: float) -> list[str]:
        ctl = AdmissionController(CFG)
        sig = {"interactive": PoolSignals("interactive", 0, [hb("i1", capacity=64, decode=0.004, prefill=1e-6,
                                                                per_seq=per_seq)])}
        reasons = []
        for _ in range(40):
            d = ask(ctl, sig, now=1.0)
            reasons.append(d.reason)
            if d.admitted:
                sig = {"interactive": PoolSignals("interactive", sig["interactive"].in_flight + 1,
                                                  sig["interactive"].workers)}
        return reasons

    growing = burst(0.001)
    assert growing[:11] == ["fits"] * 11 and "fits" not in growing[11:]
    assert set(growing[11:]) <= {"overloaded", "probe"}
    assert burst(0.0) == ["fits"] * 40  # a worker that does not say how its step grows: slots alone


def test_a_request_that_fits_an_idle_pool_is_shed_overloaded_with_a_retry() -> None:
    ctl = AdmissionController(CFG)
    sig = signals(i_running=0)
    for _ in range(CFG.admission.estimator.min_samples):  # under load, 30 ms a token was learned
        ctl.observe(pool="interactive", cls="interactive", stream=False, prompt_tokens=100, completion_tokens=8,
                    queue_wait_s=0.0, ttft_s=0.04, e2e_s=0.25, now=0.25, epoch=0)
    score = ask(ctl, sig, now=0.1)  # 8 tokens: 240 ms now, 90 ms on the workers' own 10 ms step
    assert (score.outcome, score.reason) == ("shed", "overloaded") and score.retry_after_s > 0
    report = ask(ctl, sig, max_tokens=400, now=0.1)  # 4 s even on an idle pool
    assert (report.outcome, report.reason, report.retry_after_s) == ("shed", "exceeds-objective", 0.0)


def test_a_draining_workers_requests_do_not_fill_the_slots_of_the_live_one() -> None:
    """A worker told to stop reports no capacity while it finishes the 8 requests it holds; they
    are still in the pool's stream. They take none of the live worker's slots: a request that
    finds that worker idle is admitted, not told the pool is full."""
    sig = {"interactive": PoolSignals("interactive", 8, [hb("live", capacity=8),
                                                         hb("leaving", running=8, capacity=0)])}
    ctl = AdmissionController(CFG)
    d = ask(ctl, sig)
    assert (d.outcome, d.reason, d.worker) == ("admit", "fits", "live")
    assert d.predicted_s == pytest.approx(100 * 0.0001 + 8 * 0.01)
    # Nor do they make interactive load high, holding back batch headed for the spill pool.
    b = ask(ctl, {**sig, "batch": signals(b_running=0)["batch"]}, cls="batch", max_tokens=300)
    assert (b.outcome, b.reason) == ("admit", "queued")


def test_a_request_admitted_on_an_idle_pool_is_never_told_it_exceeds_the_objective() -> None:
    """Measured answers well under the objective relaxed the loop (budget 0.25 s): 14 tokens,
    0.15 s even on an idle pool, are admitted there. On a busy pool the same request is
    overloaded, to retry, not one that "exceeds the objective even on an idle pool"."""
    ctl = AdmissionController(CFG)
    ctl.feedback.factor = 0.5
    idle = ask(ctl, signals(i_running=0), max_tokens=14)
    assert (idle.outcome, idle.reason) == ("admit", "fits")
    busy = ask(ctl, signals(i_depth=20, i_running=8), max_tokens=14, now=0.1)
    assert (busy.outcome, busy.reason) == ("shed", "overloaded")
    assert busy.retry_after_s > 0


def test_probes_admitted_against_the_prediction_do_not_tighten_the_loop() -> None:
    """A probe goes through a pool predicted too slow for it, to keep the learned costs honest:
    that it is late says the prediction was right. Counted by the loop, three late probes of
    a sustained overload tightened admission for every request (and the loop kept tightening
    for as long as the overload lasted, up to its maximum)."""
    ctl = AdmissionController(CFG)
    overloaded = signals(i_depth=200, i_running=8, b_depth=500, b_running=64)
    now = 100.0
    for _ in range(2 * CFG.admission.feedback.samples):
        probe = ask(ctl, overloaded, now=now)
        assert (probe.outcome, probe.reason) == ("admit", "probe")
        now += 0.3
        ctl.observe(pool=probe.pool, cls="interactive", stream=False, prompt_tokens=100, completion_tokens=8,
                    queue_wait_s=0.2, ttft_s=0.25, e2e_s=0.3, now=now, epoch=probe.epoch)
        now += 2 * CFG.admission.probe_interval_s
    assert ctl.feedback.factor == 1.0


def test_a_pool_whose_learned_costs_say_it_misses_every_deadline_is_still_probed() -> None:
    """One answer held up 40 s between its two tokens (its records waited out a Redis outage)
    taught a cost that puts 8 tokens past the 30 s interactive deadline, while the workers'
    own steps say the pool is idle and fast. Only a probe lets the costs learn again: shed for
    its deadline instead, every request was refused, without a retry, for as long as the
    gateway ran."""
    ctl = AdmissionController(CFG)
    for i in range(CFG.admission.estimator.min_samples):
        ctl.observe(pool="interactive", cls="batch", stream=False, prompt_tokens=100, completion_tokens=8,
                    queue_wait_s=0.0, ttft_s=0.02, e2e_s=0.09, now=float(i), epoch=0)
    ctl.observe(pool="interactive", cls="batch", stream=False, prompt_tokens=100, completion_tokens=2,
                queue_wait_s=0.0, ttft_s=0.02, e2e_s=40.02, now=10.0, epoch=0)
    idle = {"interactive": signals(i_running=0)["interactive"]}
    now = 10.0 + 2 * CFG.admission.probe_interval_s
    d = ask(ctl, idle, now=now, deadline=deadline_for("interactive", now, CFG))
    assert (d.outcome, d.reason) == ("admit", "probe"), d
