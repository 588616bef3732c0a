from __future__ import annotations

import pytest

from policies.prompt_tokens import PromptTokens


def test_a_model_never_seen_is_four_characters_a_token_plus_the_template() -> None:
    tokens = PromptTokens()
    assert tokens.estimate("m", 400, 0) == 100
    assert tokens.estimate("m", 400, 2) == 108
    assert tokens.estimate("m", 0, 0) == 1


def test_the_workers_counts_teach_each_model_its_own_ratio() -> None:
    tokens = PromptTokens()
    for _ in range(50):
        tokens.observe("chinese", 300, 1, 304)  # a character a token
        tokens.observe("english", 1200, 2, 308)  # four
    assert tokens.estimate("chinese", 600, 1) == 604
    assert tokens.chars_per_token("chinese") == 1.0
    assert tokens.estimate("english", 1200, 2) == 308
    assert tokens.estimate("other", 400, 0) == 100


def test_the_first_count_replaces_the_guess_and_later_ones_move_it_gradually() -> None:
    tokens = PromptTokens()
    tokens.observe("m", 1000, 0, 500)
    assert tokens.estimate("m", 1000, 0) == 500
    tokens.observe("m", 1000, 0, 1500)  # one odd prompt moves the ratio a tenth of the way
    assert tokens.chars_per_token("m") == pytest.approx(1 / 0.6)


def test_prompts_that_are_mostly_template_teach_nothing_and_the_ratio_stays_bounded() -> None:
    tokens = PromptTokens()
    tokens.observe("m", 10, 1, 40)
    assert tokens.estimate("m", 400, 0) == 100
    tokens.observe("m", 100, 0, 10_000)
    assert tokens.estimate("m", 100, 0) == 400
