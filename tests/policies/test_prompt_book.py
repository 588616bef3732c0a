from __future__ import annotations

import math

import pytest

from policies.prompt_book import RATE_WINDOW_S, PromptBook


def test_prompts_ahead_drain_in_real_time() -> None:
    book = PromptBook()
    for _ in range(3):
        book.book(0.01, now=100.0)
    assert book.ahead(100.0) == pytest.approx(0.03)
    assert book.ahead(100.02) == pytest.approx(0.01)
    assert book.ahead(101.0) == 0.0
    book.book(0.01, now=101.0)  # an idle pool starts the next prompt at once
    assert book.ahead(101.0) == pytest.approx(0.01)


def test_a_burst_uses_up_a_promise_until_it_ends() -> None:
    book = PromptBook()
    assert book.room(10.0) == (math.inf, 10.0)
    book.promise(0.025, until=10.1)
    book.promise(0.5, until=12.0)
    book.book(0.01, now=10.0)
    book.book(0.01, now=10.0)
    room, until = book.room(10.0)
    assert room == pytest.approx(0.005) and until == 10.1
    book.book(0.01, now=10.0)
    assert book.room(10.0)[0] < 0
    room, until = book.room(10.1)  # the tight promise is done: the loose one is left
    assert until == 12.0 and 0.47 < room <= 0.5


def test_prompts_at_a_steady_rate_leave_promises_their_slack() -> None:
    book = PromptBook()
    now = 0.0
    for _ in range(round(5 * RATE_WINDOW_S / 0.01)):  # 5 ms of prefill every 10 ms
        now += 0.01
        book.book(0.005, now)
    book.promise(0.01, until=now + 0.2)
    for _ in range(10):
        now += 0.01
        book.book(0.005, now)
        assert book.room(now)[0] > 0.008  # the rate the costs were learned at is priced in
    book.book(0.02, now)  # a burst beyond it is not
    assert book.room(now)[0] < 0
