from __future__ import annotations

import pytest

from policies.config import load
from policies.feedback import LatencyFeedback

CFG = load({"admission": {"feedback": {"samples": 100, "tighten": 1.5, "relax": 1.1, "headroom": 0.7,
                                       "min_factor": 0.8, "max_factor": 3.0}}}).admission.feedback


def window(fb: LatencyFeedback, ratio: float, late: int = 0, late_ratio: float = 2.0) -> None:
    """A window's worth of requests admitted together, the late ones answered first."""
    epoch = fb.epoch
    for i in range(CFG.samples):
        fb.record(late_ratio if i < late else ratio, epoch)


def test_p99_over_objective_tightens() -> None:
    fb = LatencyFeedback(CFG)
    window(fb, 0.5, late=2)  # 2 of 100 late: the P99 is late
    assert fb.factor == pytest.approx(1.5)
    assert fb.last_quantile == 2.0


def test_one_late_in_a_hundred_is_within_p99() -> None:
    fb = LatencyFeedback(CFG)
    window(fb, 0.8, late=1)
    assert fb.factor == 1.0  # P99 = 0.8: within objective, above headroom


def test_headroom_relaxes_the_faster_the_further_under() -> None:
    fb = LatencyFeedback(CFG)
    window(fb, 1.5)
    window(fb, 0.65)  # just under the headroom: the smallest step
    assert fb.factor == pytest.approx(1.5 / 1.1)
    window(fb, 0.56)  # 0.7 / 0.56 = 1.25
    assert fb.factor == pytest.approx(1.5 / 1.1 / 1.25)
    fb = LatencyFeedback(CFG)
    window(fb, 1.5)
    window(fb, 1.5)
    window(fb, 0.1)  # far under: as fast as it tightens, no faster
    assert fb.factor == pytest.approx(1.5)


def test_a_window_that_cannot_come_back_under_is_judged_at_once() -> None:
    fb = LatencyFeedback(CFG)
    fb.record(0.2, 0)
    fb.record(5.0, 0)  # one late in a hundred is still within a P99
    assert fb.factor == 1.0
    fb.record(3.0, 0)  # two are not, whatever the other 98 will be
    assert fb.factor == 1.5
    assert fb.last_quantile == 3.0


def test_relaxing_waits_for_a_full_window() -> None:
    fb = LatencyFeedback(CFG)
    for _ in range(CFG.samples - 1):
        fb.record(0.65, 0)
    assert fb.factor == 1.0
    fb.record(0.65, 0)
    assert fb.factor == pytest.approx(1 / 1.1)


def test_a_burst_admitted_under_one_factor_tightens_it_once() -> None:
    fb = LatencyFeedback(CFG)
    for _ in range(20):  # admitted together, all late; the verdict comes with the second
        fb.record(3.0, 0)
    assert fb.factor == 1.5 and fb.epoch == 1
    for _ in range(2):  # admitted after that verdict: judged
        fb.record(3.0, 1)
    assert fb.factor == pytest.approx(2.25)


def test_one_bad_window_tightens_once() -> None:
    fb = LatencyFeedback(CFG)
    window(fb, 5.0)
    for _ in range(CFG.samples // 2):
        fb.record(0.8, fb.epoch)
    assert fb.factor == pytest.approx(1.5)


def test_factor_stays_within_bounds() -> None:
    fb = LatencyFeedback(CFG)
    for _ in range(10):
        window(fb, 9.0)
    assert fb.factor == 3.0
    for _ in range(50):
        window(fb, 0.01)
    assert fb.factor == 0.8
