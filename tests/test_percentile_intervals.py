"""The confidence intervals the stream benchmark puts beside each TTFT target."""

from __future__ import annotations

import math
import random
import re

import pytest

from benchmarks.loadgen import percentile, quantile_interval, ratio_interval


def _exponential(n: int, rng: random.Random) -> list[float]:
    return [rng.expovariate(1.0) for _ in range(n)]


@pytest.mark.parametrize(("q", "n"), [(50, 60), (90, 200), (99, 1000)])
def test_the_interval_holds_the_true_percentile_as_often_as_it_claims(q: float, n: int) -> None:
    rng = random.Random(q)
    truth = -math.log(1 - q / 100)  # the exponential distribution's q-th percentile
    trials = 300
    held = sum(low <= truth <= high for low, high in (quantile_interval(_exponential(n, rng), q)
                                                        for _ in range(trials)))
    assert held >= 0.95 * trials - 2 * math.sqrt(trials * 0.05 * 0.95)
    assert held < trials  # not trivially wide


def test_a_p99_of_200_requests_has_no_upper_bound_and_of_1000_has() -> None:
    rng = random.Random(1)
    low, high = quantile_interval(_exponential(200, rng), 99)
    assert math.isfinite(low) and math.isinf(high)
    low, high = quantile_interval(values := _exponential(1000, rng), 99)
    assert low <= percentile(values, 99) <= high <= max(values)
    assert math.isfinite(high)


def test_the_interval_is_made_of_the_samples_and_narrows_with_more() -> None:
    rng = random.Random(2)
    few, many = _exponential(100, rng), _exponential(10000, rng)
    low_few, high_few = quantile_interval(few, 50)
    low_many, high_many = quantile_interval(many, 50)
    assert low_few in few and high_few in few
    assert high_many - low_many < (high_few - low_few) / 4


def test_a_ratio_of_groups_far_apart_is_bounded_away_from_one() -> None:
    slow, fast = [40.0 + i for i in range(1000)], [10.0 + i / 100 for i in range(200)]
    low, high = ratio_interval(slow, 99, fast, 50)
    assert percentile(slow, 99) / max(fast) <= high
    assert 1.0 < low <= percentile(slow, 99) / percentile(fast, 50) <= high


def test_targets_state_the_interval_beside_the_verdict() -> None:
    pytest.importorskip("torch")
    from benchmarks.stream_engine import targets

    def row(contender: str, streams: int, ttfts: list[float]) -> dict:
        return {"contender": contender, "streams": streams, "ttft_ms": ttfts,
                "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
                "prompts_alone_ttft_p99_ms": None}

    one = [5.0 + i / 50 for i in range(200)]
    many = [6.0 + i / 10 for i in range(200)]
    paged = [8.0 + i / 5 for i in range(200)]
    rows = [row("stream engine", 1, one), row("stream engine", 16, many), row("paged engine", 16, paged)]
    lines = targets(rows, [], [], 16)
    ratio_line = next(line for line in lines if "2x its 1-stream TTFT P50" in line)
    assert "**not met**" in ratio_line
    shown = re.search(r"met\*\*, ([\d.]+)x \(95% interval ([\d.]+)x to unbounded\)", ratio_line)
    assert shown is not None
    point, low = map(float, shown.groups())
    assert point == pytest.approx(percentile(many, 99) / percentile(one, 50), abs=0.01)
    assert 2.0 < low <= point
    paged_line = next(line for line in lines if "below the paged" in line)
    assert "**met**" in paged_line and "95% interval" in paged_line
