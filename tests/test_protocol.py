import msgspec
import pytest

from slogate import protocol
from slogate.protocol import Delta, Error, Final, GenerateRequest, SamplingParams


def test_round_trip_of_every_message() -> None:
    req = GenerateRequest(id="a", model="m", pool="p", cls="interactive",
                          sampling=SamplingParams(max_tokens=4, stop=["\n"], json_schema="{}", schema_param="tools"),
                          deadline=2.0, enqueued_at=1.0, reply="slogate:r:g1",
                          messages=[{"role": "user", "content": "hi"}],
                          tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert protocol.decode_request(protocol.encode(req)) == req
    for rec in (Delta("x", 3, attempt=2), Final("stop", 5, 2), Error("boom", "engine_error", 500)):
        assert protocol.decode_result(protocol.encode(rec)) == rec


def test_other_version_fails_loudly() -> None:
    data = protocol.encode(Delta("x", 0, v=protocol.VERSION + 1))
    with pytest.raises(protocol.ProtocolError, match="version"):
        protocol.decode_result(data)


def test_garbage_is_a_protocol_error() -> None:
    with pytest.raises(protocol.ProtocolError, match="malformed"):
        protocol.decode_request(b"\x93\x01\x02")
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_result(msgspec.msgpack.encode({"type": "nope"}))


def test_determinism_flag() -> None:
    assert SamplingParams(temperature=0).deterministic
    assert SamplingParams(temperature=1e-6).deterministic  # sampled greedily, as 0 is
    assert SamplingParams(temperature=0.7, seed=3).deterministic
    assert not SamplingParams(temperature=0.7).deterministic


def test_a_reply_entry_keeps_its_records_in_order() -> None:
    records = [(b"a", protocol.encode(Delta("x", 0))), (b"b", protocol.encode(Final("stop", 1, 1))),
               (b"a", protocol.encode(Final("length", 1, 1)))]
    assert protocol.decode_batch(protocol.encode_batch(records)) == records
    with pytest.raises(protocol.ProtocolError, match="malformed reply entry"):
        protocol.decode_batch(msgspec.msgpack.encode([["a", 1]]))
    with pytest.raises(protocol.ProtocolError, match="malformed reply entry"):
        protocol.decode_batch(b"\xc1")
