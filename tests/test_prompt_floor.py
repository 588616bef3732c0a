import pytest

from benchmarks.prompt_floor import PassTimes, prompts_alone, time_passes


def linear(tokens: int) -> float:
    return 0.010 + 0.001 * tokens


def test_a_prompt_alone_takes_the_fixed_cost_and_its_tokens():
    assert prompts_alone([(0.0, 20, 1), (5.0, 40, 1)], linear) == pytest.approx([0.030, 0.050])


def test_prompts_waiting_together_share_one_pass():
    assert prompts_alone([(1.0, 20, 1), (1.0, 30, 1)], linear) == pytest.approx([0.060, 0.060])


def test_a_prompt_that_arrives_during_a_pass_waits_for_it_and_joins_the_next_with_later_ones():
    # the first pass runs 0 -> 0.030; the second takes both that came meanwhile: 0.030 -> 0.070
    ttft = prompts_alone([(0.0, 20, 1), (0.005, 10, 1), (0.020, 20, 1)], linear)
    assert ttft == pytest.approx([0.030, 0.065, 0.050])


def test_a_pass_holds_at_most_pass_tokens_in_order_sent_but_always_one_prompt():
    # at 0 all three wait; 30 + 30 > 50, so each runs in a pass of its own, in the order sent
    ttft = prompts_alone([(0.0, 30, 1), (0.0, 30, 1), (0.0, 60, 1)], linear, pass_tokens=50)
    assert ttft == pytest.approx([0.040, 0.080, 0.150])


def test_a_request_whose_first_token_shows_no_text_goes_on_in_one_token_passes_before_the_next_prompts():
    # pass of 20 + 30: 0 -> 0.060; "a" needs 3 tokens: passes of 1 row (0.011) to 0.071, 0.082;
    # "b" shows text at once; "c" arrived meanwhile and waits for them: 0.082 -> 0.112
    ttft = prompts_alone([(0.0, 20, 3), (0.0, 30, 1), (0.001, 20, 1)], linear)
    assert ttft == pytest.approx([0.082, 0.060, 0.111])
    together = prompts_alone([(0.0, 20, 2), (0.0, 30, 2)], linear)
    assert together == pytest.approx([0.072, 0.072]), "both go on in one pass of two rows"


def test_results_follow_the_order_given_not_the_order_sent():
    assert prompts_alone([(5.0, 40, 1), (0.0, 20, 1)], linear) == pytest.approx([0.050, 0.030])


def test_pass_times_follow_the_timed_points_and_the_nearest_segment_beyond_them():
    times = PassTimes([8, 16, 64], [0.020, 0.024, 0.072])
    assert [times(n) for n in (8, 12, 16, 40, 64)] == pytest.approx([0.020, 0.022, 0.024, 0.048, 0.072])
    assert times(128) == pytest.approx(0.136)  # 1 ms a token, as from 16 to 64
    assert times(4) == pytest.approx(0.018)
    assert times(1) >= 0.0


def test_time_passes_keeps_the_fastest_of_each_size_over_sweeps_of_all_sizes():
    runs = iter([(16, 0.05), (32, 0.09), (16, 0.03), (32, 0.07), (16, 0.04), (32, 0.08)])

    def time_pass(n: int) -> float:
        size, seconds = next(runs)
        assert size == n  # one of each size a sweep, in order
        return seconds

    assert time_passes(time_pass, [16, 32], sweeps=3).seconds == [0.03, 0.07]


def test_time_passes_keeps_earlier_timings_that_were_faster():
    runs = iter([0.05, 0.09, 0.03, 0.07])
    earlier = PassTimes([16, 32], [0.02, 0.08])
    assert time_passes(lambda n: next(runs), [16, 32], sweeps=2, before=earlier).seconds == [0.02, 0.07]
    with pytest.raises(ValueError, match="sizes"):
        time_passes(lambda n: 0.01, [16, 64], sweeps=1, before=earlier)
