import pytest

from gateway.relay import Relay, SplicedOutput
from slogate.protocol import Delta, Final, TokenLogprob


def feed(relay: Relay, *records) -> str:
    return "".join(t for r in records if (t := relay.accept(r)))


def test_replay_of_a_deterministic_request_is_not_repeated() -> None:
    relay = Relay(streamed=True, deterministic=True)
    sent = feed(relay, Delta(" a", 0), Delta(" b", 2))
    resumed = feed(relay, Delta(" a", 0, attempt=2), Delta(" b", 2, attempt=2), Delta(" c", 4, attempt=2))
    assert sent + resumed == " a b c"
    assert relay.accept(Final("length", 1, 3, attempt=2)) is None


def test_partly_overlapping_delta_keeps_only_the_new_part() -> None:
    relay = Relay(streamed=True, deterministic=True)
    feed(relay, Delta("abc", 0))
    assert relay.accept(Delta("bcdef", 1, attempt=2)) == "def"


def test_stale_attempt_is_ignored() -> None:
    relay = Relay(streamed=False, deterministic=True)
    feed(relay, Delta("x", 0, attempt=2))
    assert relay.accept(Delta("zzz", 1, attempt=1)) is None
    assert relay.text == "x"


def test_non_deterministic_stream_cannot_be_spliced() -> None:
    relay = Relay(streamed=True, deterministic=False)
    feed(relay, Delta("abc", 0))
    with pytest.raises(SplicedOutput):
        relay.accept(Delta("xyz", 0, attempt=2))


def test_non_deterministic_buffered_answer_restarts_cleanly() -> None:
    relay = Relay(streamed=False, deterministic=False)
    feed(relay, Delta("abc", 0))
    feed(relay, Delta("xy", 0, attempt=2), Delta("z", 2, attempt=2))
    assert relay.text == "xyz"


def test_a_delta_after_a_gap_is_never_joined_to_the_text_before_it() -> None:
    relay = Relay(streamed=True, deterministic=True)
    feed(relay, Delta("abc", 0))
    with pytest.raises(SplicedOutput, match="lost"):
        relay.accept(Delta("xyz", 5))
    assert relay.text == "abc"


@pytest.mark.parametrize("streamed", [True, False])
def test_a_final_record_after_lost_text_is_never_an_answer_that_ends_short(streamed: bool) -> None:
    relay = Relay(streamed=streamed, deterministic=True)
    feed(relay, Delta("abc", 0))
    with pytest.raises(SplicedOutput, match="lost"):
        relay.accept(Final("stop", 1, 3, offset=5))
    assert relay.accept(Final("stop", 1, 2, offset=3)) is None


def lp(token: str) -> TokenLogprob:
    return TokenLogprob(token, token.encode(), -1.0)


def test_log_probabilities_are_relayed_once_across_a_replay_even_without_text() -> None:
    relay = Relay(streamed=False, deterministic=True)
    assert relay.accept(Delta(" a", 0, logprobs=[lp(" a")])) == " a"
    assert relay.accept(Delta("", 2, logprobs=[lp("\ufffd")], token_offset=1)) == "", "part of a character"
    assert relay.fresh == [lp("\ufffd")]
    assert relay.accept(Delta(" a", 0, attempt=2, logprobs=[lp(" a"), lp("\ufffd")])) is None
    assert relay.accept(Delta("é", 2, attempt=2, logprobs=[lp("\ufffd"), lp("\ufffd")], token_offset=1)) == "é"
    assert [e.token for e in relay.fresh] == ["\ufffd"], "the replayed token is dropped, the new one kept"
    assert relay.tokens == 3 and len(relay.logprobs) == 3
    with pytest.raises(SplicedOutput, match="token 5 after 3"):
        relay.accept(Delta("", 3, attempt=2, logprobs=[lp("x")], token_offset=5))


def test_a_non_deterministic_retry_restarts_the_log_probabilities_too() -> None:
    relay = Relay(streamed=False, deterministic=False)
    feed(relay, Delta("ab", 0, logprobs=[lp("a"), lp("b")]))
    feed(relay, Delta("x", 0, attempt=2, logprobs=[lp("x")]))
    assert relay.text == "x" and [e.token for e in relay.logprobs] == ["x"] and relay.tokens == 1


@pytest.mark.parametrize("streamed", [True, False])
def test_a_retry_after_log_probabilities_alone_is_not_spliced_onto_them(streamed: bool) -> None:
    """A first token inside a character sends its log-probability and no text yet."""
    relay = Relay(streamed=streamed, deterministic=False)
    assert relay.accept(Delta("", 0, logprobs=[lp("\ufffd")])) == ""
    if streamed:
        with pytest.raises(SplicedOutput):
            relay.accept(Delta("Hi", 0, attempt=2, logprobs=[lp("H"), lp("i")]))
        return
    assert relay.accept(Delta("Hi", 0, attempt=2, logprobs=[lp("H"), lp("i")])) == "Hi"
    assert [e.token for e in relay.logprobs] == ["H", "i"]
