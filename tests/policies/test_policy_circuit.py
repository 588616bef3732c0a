from __future__ import annotations

from policies.circuit import CircuitBreaker
from policies.config import load

CFG = load({"circuit": {"consecutive_failures": 3, "failure_rate": 0.5, "window": 10, "min_calls": 6,
                        "open_s": 5.0, "half_open_probes": 1, "close_after": 2}}).circuit


def opened(now: float = 0.0) -> CircuitBreaker:
    br = CircuitBreaker(CFG)
    for _ in range(3):
        br.record_failure(now)
    return br


def test_consecutive_failures_open() -> None:
    br = CircuitBreaker(CFG)
    br.record_failure(0.0)
    br.record_failure(0.0)
    assert br.state(0.0) == "closed" and br.ready(0.0)
    br.record_failure(1.0)
    assert br.state(1.0) == "open" and not br.ready(1.0)
    assert br.retry_after(2.0) == 4.0


def test_success_resets_the_run_of_failures() -> None:
    br = CircuitBreaker(load({"circuit": {"consecutive_failures": 3, "failure_rate": 1.0}}).circuit)
    for _ in range(4):
        br.record_failure(0.0)
        br.record_failure(0.0)
        br.record_success(0.0)
    assert br.state(0.0) == "closed"
    br.record_failure(0.0)
    br.record_failure(0.0)
    br.record_failure(0.0)
    assert br.state(0.0) == "open"


def test_failure_rate_opens_once_enough_calls() -> None:
    br = CircuitBreaker(CFG)
    for _ in range(2):
        br.record_success(0.0)
        br.record_failure(0.0)
    assert br.state(0.0) == "closed"  # 2 of 4: under min_calls
    br.record_success(0.0)
    br.record_failure(0.0)
    assert br.state(0.0) == "open"  # 3 of 6 failed


def test_cool_down_then_half_open_lets_one_probe() -> None:
    br = opened()
    assert br.state(4.9) == "open" and not br.ready(4.9)
    assert br.state(5.0) == "half_open" and br.ready(5.0)
    br.acquire(5.0)
    assert not br.ready(5.1)


def test_refusals_while_the_probe_is_out_say_when_it_will_be_given_up() -> None:
    """Not 0 s (clients retried every 50 ms while a batch probe ran for minutes)."""
    br = opened()
    br.acquire(5.0)
    assert br.retry_after(6.0) == 4.0
    assert br.retry_after(4.0) == 1.0, "open: the cool-down's end"


def test_successful_probes_close() -> None:
    br = opened()
    br.record_success(5.2, probe=br.acquire(5.0))
    assert br.state(5.2) == "half_open" and br.ready(5.2)
    br.record_success(5.3, probe=br.acquire(5.2))
    assert br.state(5.3) == "closed"
    br.record_failure(5.4)
    br.record_failure(5.4)
    assert br.state(5.4) == "closed"  # the old failures were forgotten


def test_only_probes_close_a_half_open_breaker() -> None:
    """Requests let through before it opened that succeed late say nothing of the pool now."""
    br = opened()
    br.record_success(5.1)
    br.record_success(5.2)
    assert br.state(5.3) == "half_open"


def test_failed_probe_reopens_for_another_cool_down() -> None:
    br = opened()
    br.acquire(5.0)
    br.record_failure(5.5)
    assert br.state(10.4) == "open"
    assert br.state(10.5) == "half_open"


def test_a_lost_probe_does_not_wedge_the_breaker() -> None:
    br = opened()
    br.acquire(5.0)
    assert not br.ready(9.9)
    assert br.ready(10.0)


def test_outcomes_while_open_change_nothing() -> None:
    br = opened()
    br.record_success(1.0)
    br.record_failure(2.0)
    assert br.state(4.9) == "open" and br.state(5.0) == "half_open"


def test_answers_of_requests_sent_before_it_opened_do_not_stand_in_for_the_probes() -> None:
    """Requests let through before it opened that answer while a probe is out say nothing of the
    pool now: taken for the probe's success, two of them closed the breaker with no probe
    answered."""
    br = opened()
    first = br.acquire(5.0)
    br.record_success(5.1)
    assert not br.ready(5.1), "the probe is still out"
    br.record_success(5.2, probe=first)
    second = br.acquire(5.3)
    br.record_success(5.4)
    assert br.state(5.5) == "half_open"
    br.record_success(5.6, probe=second)
    assert br.state(5.6) == "closed"


def test_a_probe_of_an_earlier_half_open_spell_is_not_one_of_the_next() -> None:
    """Out when another probe failed and reopened the breaker, which forgot it: its late answer,
    once half-open again, is no probe of the new spell, whose own probe it would stand in for."""
    br = opened()
    stale = br.acquire(5.0)
    br.acquire(10.0)
    br.record_failure(10.1)
    assert br.state(15.1) == "half_open"
    fresh = br.acquire(15.1)
    br.record_success(15.2, probe=stale)
    assert not br.ready(15.2), "the new probe is still out"
    br.record_success(15.3, probe=fresh)
    assert br.probe_successes == 1


def test_the_late_answer_of_a_given_up_probe_frees_no_slot_for_another() -> None:
    """Given up after ``open_s``, its slot went to the next probe; its answer coming late then
    freed that one's slot too, and a third went out with the second still out."""
    br = opened()
    given_up = br.acquire(5.0)
    assert br.ready(10.0)
    br.acquire(10.0)
    br.record_success(10.1, probe=given_up)
    assert not br.ready(10.2), "the second probe is still out"


def test_the_late_success_of_a_given_up_probe_counts_toward_closing() -> None:
    """Late is no failure here (a 504 is none either): the pool answered since the breaker
    opened. Ignored, the breaker needed ``close_after`` more probes, one at a time."""
    br = opened()
    given_up = br.acquire(5.0)
    assert br.ready(10.0)
    out = br.acquire(10.0)
    br.record_success(10.1, probe=given_up)
    assert br.state(10.1) == "half_open" and br.probe_successes == 1
    br.record_success(10.2, probe=out)
    assert br.state(10.2) == "closed"


def test_the_late_failure_of_a_given_up_probe_opens_the_breaker_again() -> None:
    br = opened()
    br.acquire(5.0)
    assert br.ready(10.0)
    br.acquire(10.0)
    br.record_failure(10.1)
    assert br.state(10.1) == "open" and br.retry_after(10.1) == 5.0


def test_a_given_up_probe_answering_after_the_breaker_opened_again_counts_for_nothing() -> None:
    """Its answer is from before the new cool-down: it says nothing of the pool since."""
    br = opened()
    given_up = br.acquire(5.0)
    assert br.ready(10.0)
    br.acquire(10.0)
    br.record_failure(10.1)
    fresh = br.acquire(15.1)
    br.record_success(15.2, probe=given_up)
    assert br.probe_successes == 0 and not br.ready(15.2)
    br.record_success(15.3, probe=fresh)
    assert br.probe_successes == 1 and br.state(15.3) == "half_open"
