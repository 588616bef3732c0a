from __future__ import annotations

import pytest

from policies.prompt_tokens import PromptTokens, prior_estimate


def test_a_model_never_seen_is_four_characters_a_token_plus_the_template() -> None:
    tokens = PromptTokens()
    assert tokens.estimate("m", 400, 0) == 100 == prior_estimate(400, 0)
    assert tokens.estimate("m", 400, 2) == 108 == prior_estimate(400, 2)
    assert tokens.estimate("m", 0, 0) == 1


def test_the_workers_counts_teach_each_model_its_own_ratio() -> None:
    tokens = PromptTokens()
    for _ in range(50):
        tokens.observe("chinese", 300, 1, 304)  # a character a token
        tokens.observe("english", 1200, 2, 308)  # four
    assert tokens.estimate("chinese", 600, 1) == 604
    assert tokens.chars_per_token("chinese") == pytest.approx(1.0)
    assert tokens.estimate("english", 1200, 2) == 308
    assert tokens.estimate("other", 400, 0) == 100
    assert tokens.learned() == pytest.approx({"chinese": 1.0, "english": 4.0})


def test_each_prompt_weighs_as_much_as_it_is_long() -> None:
    tokens = PromptTokens()
    for _ in range(100):
        tokens.observe("m", 2000, 1, 504)  # 4 characters a token
    for _ in range(25):  # short prompts of emoji: 3 tokens a character
        tokens.observe("m", 64, 1, 196)
    assert tokens.chars_per_token("m") > 3.0, "25 short prompts do not make long ones look 12 times longer"
    for _ in range(300):  # but traffic that changes for good is followed
        tokens.observe("m", 2000, 1, 1004)
    assert tokens.chars_per_token("m") == pytest.approx(2.0, rel=0.1)


def test_prompts_that_are_mostly_template_teach_nothing_and_the_ratio_stays_bounded() -> None:
    tokens = PromptTokens()
    tokens.observe("m", 10, 1, 40)  # too short to say anything of the text
    tokens.observe("m", 80, 20, 60)  # fewer tokens than 20 messages' template: not a ratio
    assert "m" not in tokens.learned()
    assert tokens.estimate("m", 400, 0) == 100
    tokens.observe("m", 100, 0, 10_000)
    assert tokens.estimate("m", 100, 0) == 400
