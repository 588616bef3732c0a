from __future__ import annotations

import math

import pytest

from policies.prompt_book import PromptBook


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
    book.promise(0.025, until=10.1, now=10.0)
    book.promise(0.5, until=12.0, now=10.0)
    book.book(0.01, now=10.0)
    book.book(0.01, now=10.0)
    room, until = book.room(10.0)
    assert room == pytest.approx(0.005)
    assert until == pytest.approx(10.12)  # the prompts it made room for delay its end
    book.book(0.01, now=10.0)
    assert book.room(10.0)[0] < 0
    assert book.room(10.1)[1] > 10.1  # not done: still delayed by the burst
    room, until = book.room(10.14)  # the tight promise is done: the loose one is left
    assert room == pytest.approx(0.5 - 0.03) and until == pytest.approx(12.03)


@pytest.mark.parametrize("priced_share", [0.0, 0.5])
def test_only_prompts_beyond_the_priced_share_use_up_a_promise(priced_share: float) -> None:
    book = PromptBook()
    now = 0.0
    for _ in range(100):  # 5 ms of prefill every 10 ms: half the workers' time
        now += 0.01
        book.book(0.005, now, priced_share)
    book.promise(0.01, until=now + 0.2, now=now)
    rooms = []
    for _ in range(10):
        now += 0.01
        book.book(0.005, now, priced_share)
        rooms.append(book.room(now, priced_share)[0])
    if priced_share:
        assert min(rooms) > 0.008  # the costs were learned at this rate: it is priced in
    else:
        assert rooms[0] == pytest.approx(0.005) and rooms[-1] < 0  # costs learned idle: every prompt counts
    book.book(0.02, now, priced_share)  # a burst is never priced in
    assert book.room(now, priced_share)[0] < 0


def test_credit_does_not_bank_while_no_prompts_come() -> None:
    book = PromptBook()
    book.book(0.01, now=1.0, priced_share=0.9)
    assert book.room(3.0, priced_share=0.9)[0] == math.inf
    book.promise(0.015, until=5.0, now=3.0)
    assert book.room(3.0, priced_share=0.9)[0] == pytest.approx(0.015)  # idle for 2 s, no credit saved up
    book.book(0.01, now=3.0, priced_share=0.9)
    book.book(0.01, now=3.0, priced_share=0.9)
    assert book.room(3.0, priced_share=0.9)[0] < 0


def test_ended_promises_do_not_pile_up_under_tighter_ones() -> None:
    book = PromptBook()
    now = 0.0
    for i in range(10_000):  # each request lasts 50 ms; roomy and tight ones alternate
        now += 0.01
        book.promise(1.0 if i % 2 else 0.001, until=now + 0.05, now=now)
        book.room(now)
    assert len(book._promises) < 200
