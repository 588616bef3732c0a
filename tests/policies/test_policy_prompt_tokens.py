from __future__ import annotations

import pytest

from policies.prompt_tokens import PromptTokens, prior_estimate


def test_a_model_never_seen_is_four_characters_a_token_plus_the_template() -> None:
    tokens = PromptTokens()
    assert tokens.estimate("m", "k", 400, 0) == 100 == prior_estimate(400, 0)
    assert tokens.estimate("m", "k", 400, 2) == 108 == prior_estimate(400, 2)
    assert tokens.estimate("m", "k", 0, 0) == 1


def test_the_workers_counts_teach_each_model_its_own_ratio() -> None:
    tokens = PromptTokens()
    for _ in range(50):
        tokens.observe("chinese", "k", 300, 1, 304)  # a character a token
        tokens.observe("english", "k", 1200, 2, 308)  # four
    assert tokens.estimate("chinese", "k", 600, 1) == 604
    assert tokens.chars_per_token("chinese") == pytest.approx(1.0)
    assert tokens.estimate("english", "k", 1200, 2) == 308
    assert tokens.estimate("other", "k", 400, 0) == 100
    assert tokens.learned() == pytest.approx({"chinese": 1.0, "english": 4.0})


def test_what_one_key_sends_prices_only_its_own_prompts() -> None:
    tokens = PromptTokens()
    for _ in range(90):
        tokens.observe("m", "english", 400, 1, 104)  # 4 characters a token
    for _ in range(10):
        tokens.observe("m", "emoji", 2000, 1, 6004)  # 3 tokens a character
    assert tokens.estimate("m", "english", 400, 1) == 104
    assert tokens.estimate("m", "emoji", 2000, 1) == pytest.approx(6004, abs=1)
    assert tokens.chars_per_token("m") < 1.0, "over all keys (the metric), the emoji weigh as they are long"
    assert tokens.estimate("m", "new", 400, 1) == 104, "a key with no history of its own gets the prior"
    for _ in range(12):
        tokens.observe("m", "new", 800, 1, 104)  # 8 characters a token
    assert tokens.estimate("m", "new", 800, 1) == 104, "and its own once it has sent a few thousand characters"


def test_traffic_that_changes_for_good_is_followed() -> None:
    tokens = PromptTokens()
    for _ in range(100):
        tokens.observe("m", "k", 2000, 1, 504)
    for _ in range(300):
        tokens.observe("m", "k", 2000, 1, 1004)
    assert tokens.chars_per_token("m", "k") == pytest.approx(2.0, rel=0.1)


def test_prompts_that_are_mostly_template_teach_nothing_and_the_ratio_stays_bounded() -> None:
    tokens = PromptTokens()
    tokens.observe("m", "k", 10, 1, 40)  # too short to say anything of the text
    tokens.observe("m", "k", 80, 20, 60)  # fewer tokens than 20 messages' template: not a ratio
    assert not tokens.learned()
    assert tokens.estimate("m", "k", 400, 0) == 100
    tokens.observe("m", "k", 5000, 0, 1_000_000)
    assert tokens.estimate("m", "k", 100, 0) == 400


def test_a_gateway_takes_up_what_another_saved_but_keeps_what_it_learned_itself() -> None:
    before = PromptTokens()
    for _ in range(50):
        before.observe("chinese", "k", 300, 1, 304)
        before.observe("chinese", "j", 1200, 1, 304)
    saved = before.take_changes(now=1000.0)
    later = PromptTokens()
    for _ in range(50):
        later.observe("chinese", "j", 600, 1, 304)  # j's traffic changed: two characters a token now
    bad = {b'["m", null]': b'[0, 0, 1000]', b'["m", "x"]': b'[1e400, 1, 1000]', b'not json': b'[1, 2, 1000]',
           b'["m", "y"]': b'"2"', b'["m", "old"]': b'[1, 1, 10]'}
    taken, stale = later.restore({**saved, **bad}, now=1010.0, max_age_s=100.0)
    assert taken == 1, "k alone: j and the pool it learned itself"
    assert sorted(stale) == sorted(bad), "unreadable, impossible or too old: for the caller to delete"
    assert later.chars_per_token("chinese", "k") == pytest.approx(1.0)
    assert later.chars_per_token("chinese", "j") == pytest.approx(2.0)
    assert later.estimate("m", "x", 400, 0) == 100


def test_a_gateway_saves_only_what_it_learned_not_what_it_took_up() -> None:
    """Else a gateway that took k's ratio up at its start would write it back every save, over
    what another gateway learned of k since."""
    b = PromptTokens()
    for _ in range(50):
        b.observe("m", "k", 1200, 1, 304)
    a = PromptTokens()
    a.restore(b.take_changes(now=0.0), now=0.0, max_age_s=100.0)
    assert a.take_changes(now=1.0) == {}
    a.observe("m", "j", 300, 1, 304)
    assert {name for name in a.take_changes(now=2.0)} == {b'["m","j"]', b'["m",null]'}
    assert a.take_changes(now=3.0) == {}
