"""Encryption at rest: round trips, what a Redis dump shows, key rotation, tampering, parsing."""

from __future__ import annotations

import base64

import pytest

from slogate import protocol
from slogate.config import ConfigError
from slogate.crypto import KeyRingError, SealError, Sealer, generate_key, parse_key_ring

RID = b"req-7f3a"


def ring(*kids: str) -> list[tuple[str, bytes]]:
    return parse_key_ring(",".join(f"{kid}:{generate_key()}" for kid in kids))


def test_round_trip_of_a_protocol_message() -> None:
    sealer = Sealer(ring("k1"))
    msg = protocol.Delta(text="Bonjour, le monde", offset=3)
    sealed = sealer.seal(protocol.encode(msg), RID)
    assert protocol.decode_result(sealer.open(sealed, RID)) == msg
    assert sealer.enabled and sealer.key_ids == ("k1",)


def test_empty_and_large_messages_round_trip() -> None:
    sealer = Sealer(ring("k1"))
    for data in (b"", b"x" * 1_000_000):
        assert sealer.open(sealer.seal(data, RID), RID) == data


def test_sealing_twice_gives_different_bytes() -> None:
    sealer = Sealer(ring("k1"))
    assert sealer.seal(b"same", RID) != sealer.seal(b"same", RID)


@pytest.mark.parametrize("text", ["The patient's card number is 4111 1111 1111 1111",
                                  "患者的病历编号是机密信息，请勿外传。",
                                  "short"])
def test_a_redis_dump_shows_no_customer_text(text: str, redis_url: str) -> None:
    """Seal a request and a completion, write them to a real Redis, and look at the dump."""
    import redis

    sealer = Sealer(ring("k1"))
    request = protocol.GenerateRequest(id="r1", model="m", pool="p", cls="c",
                                       sampling=protocol.SamplingParams(), deadline=0.0,
                                       enqueued_at=0.0, reply="slogate:r:g", prompt=text)
    completion = protocol.Delta(text=text, offset=0)
    client = redis.Redis.from_url(redis_url)
    client.xadd("q", {protocol.FIELD: sealer.seal(protocol.encode(request), RID)})
    client.xadd("r", {protocol.FIELD: sealer.seal(protocol.encode(completion), RID)})
    dump = client.dump("q") + client.dump("r")
    stored = [fields[protocol.FIELD] for key in ("q", "r") for _, fields in client.xrange(key)]
    client.close()
    for blob in [dump, *stored]:
        for form in (text.encode(), text.encode("utf-16-le"), text.encode("gb18030")):
            assert form not in blob
        for word in text.split():
            assert len(word) < 3 or word.encode() not in blob
    assert protocol.decode_request(sealer.open(stored[0], RID)).prompt == text
    assert protocol.decode_result(sealer.open(stored[1], RID)) == completion


def test_rotation_old_messages_open_until_the_old_key_is_dropped() -> None:
    old_ring, new_ring = ring("kid1"), ring("kid2")
    before = Sealer(old_ring)
    in_flight = before.seal(b"sealed before the rotation", RID)

    # Step 1: the new key is added second everywhere; sealing still uses the old one.
    learning = Sealer(old_ring + new_ring)
    assert learning.open(in_flight, RID) == b"sealed before the rotation"
    learned = learning.seal(b"during step 1", RID)
    assert before.open(learned, RID) == b"during step 1"  # a process not yet rolled still reads it

    # Step 2: the new key moves first; old messages still open, new ones use the new key.
    rotated = Sealer(new_ring + old_ring)
    assert rotated.open(in_flight, RID) == b"sealed before the rotation"
    assert rotated.open(learned, RID) == b"during step 1"
    fresh = rotated.seal(b"after the rotation", RID)
    assert b"kid2" in fresh[:8] and b"kid1" not in fresh
    assert learning.open(fresh, RID) == b"after the rotation"  # a process still at step 1
    with pytest.raises(SealError, match="'kid2', which this process does not have"):
        before.open(fresh, RID)  # why step 1 must reach every process before step 2

    # Step 3: the old key is dropped; what it sealed no longer opens, with an error naming it.
    final = Sealer(new_ring)
    assert final.open(fresh, RID) == b"after the rotation"
    with pytest.raises(SealError, match="sealed with key 'kid1', which this process does not have"):
        final.open(in_flight, RID)


def test_tampering_anywhere_fails() -> None:
    sealer = Sealer(ring("k1"))
    sealed = sealer.seal(b"do not touch", RID)
    for i in range(len(sealed)):
        tampered = bytearray(sealed)
        tampered[i] ^= 0x01
        with pytest.raises(SealError):
            sealer.open(bytes(tampered), RID)
    for cut in range(len(sealed)):
        with pytest.raises(SealError):
            sealer.open(sealed[:cut], RID)


def test_a_ciphertext_moved_to_another_request_fails() -> None:
    sealer = Sealer(ring("k1"))
    sealed = sealer.seal(b"for request one", RID)
    with pytest.raises(SealError, match="key 'k1' failed authentication: tampered with, or moved"):
        sealer.open(sealed, b"req-other")


def test_a_key_with_the_same_id_but_other_bytes_fails() -> None:
    sealed = Sealer(ring("k1")).seal(b"x", RID)
    with pytest.raises(SealError, match="failed authentication"):
        Sealer(ring("k1")).open(sealed, RID)


def test_off_passes_through_and_refuses_sealed_messages() -> None:
    off = Sealer.from_text(None)
    data = protocol.encode(protocol.Delta(text="plain", offset=0))
    assert not off.enabled and off.key_ids == ()
    assert off.seal(data, RID) is data
    assert off.open(data, RID) is data
    sealed = Sealer(ring("k1")).seal(data, RID)
    with pytest.raises(SealError, match="sealed with key 'k1', but this process has no encryption keys"):
        off.open(sealed, RID)


def test_on_refuses_plain_messages() -> None:
    plain = protocol.encode(protocol.Delta(text="plain", offset=0))
    with pytest.raises(SealError, match="not sealed"):
        Sealer(ring("k1")).open(plain, RID)


def test_generate_key_makes_distinct_32_byte_keys() -> None:
    keys = {generate_key() for _ in range(10)}
    assert len(keys) == 10
    assert all(len(base64.b64decode(k, validate=True)) == 32 for k in keys)


def test_parse_key_ring_keeps_order_and_tolerates_spaces() -> None:
    k1, k2 = generate_key(), generate_key()
    parsed = parse_key_ring(f" kid2:{k2} , kid1:{k1},")
    assert parsed == [("kid2", base64.b64decode(k2)), ("kid1", base64.b64decode(k1))]
    assert Sealer.from_text(f"kid2:{k2},kid1:{k1}").key_ids == ("kid2", "kid1")


@pytest.mark.parametrize("text, error", [
    ("", "empty"),
    (" , ", "empty"),
    ("kid1", "entry 1 has no ':'"),
    (":" + "A" * 44, "key id '' must be"),
    ("bad id:" + "A" * 44, "key id 'bad id' must be"),
    ("kid1:not base64!", "key 'kid1' is not valid base64"),
    ("kid1:" + base64.b64encode(b"x" * 16).decode(), "key 'kid1' is 16 bytes, must be 32"),
    ("kid1:{k},kid1:{k}", "key id 'kid1' appears twice"),
])
def test_parse_key_ring_errors_name_the_problem(text: str, error: str) -> None:
    text = text.replace("{k}", generate_key())
    with pytest.raises(KeyRingError, match=error) as info:
        parse_key_ring(text)
    assert isinstance(info.value, ConfigError)
    assert "AAAA" not in str(info.value)  # never echo key material


def test_from_text_rejects_a_set_but_empty_setting() -> None:
    with pytest.raises(KeyRingError, match="empty"):
        Sealer.from_text("")


def test_sealer_rejects_a_bad_ring_given_directly() -> None:
    with pytest.raises(KeyRingError, match="'k1'"):
        Sealer([("k1", b"short")])
    with pytest.raises(KeyRingError, match="'k1'"):
        Sealer([("k1", b"x" * 32), ("k1", b"y" * 32)])


def test_gen_key_prints_only_entries_the_ring_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    from slogate.cli import main

    main(["gen-key", "--id", "k2"])
    assert [kid for kid, _ in parse_key_ring(capsys.readouterr().out.strip())] == ["k2"]
    with pytest.raises(SystemExit) as info:
        main(["gen-key", "--id", "a,b"])
    assert info.value.code == 2 and "key id" in capsys.readouterr().err
