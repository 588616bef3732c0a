"""Encryption at rest: prompts and completions are sealed before they reach Redis.

Whoever can read a Redis dump (a backup, a replica, an RDB file left on a disk) should learn no
customer text from it. Each message is sealed with AES-256-GCM under the first key of a key
ring; every key of the ring can open. That split is what makes rotation need no downtime: a
process learns a new key (to open) before any process seals with it, and keeps the old key
(to open) until no message sealed with it can still be in Redis. See :class:`Sealer`.

A sealed message is ``FORMAT | len(key id) | key id | nonce (12) | ciphertext | tag (16)``.
The key id travels in clear so that the opener picks the right key and, when it lacks it, says
which one. The header is authenticated along with the caller's ``aad`` (the request id), so
neither the header nor the context of a ciphertext can be changed without the open failing.

The nonce is random: safe for about 2**32 messages per key (NIST SP 800-38D), which is one more
reason to rotate keys, say every few months at a thousand messages a second.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from slogate.config import ConfigError

FORMAT = 0x01
"""First byte of a sealed message. A msgpack message of :mod:`slogate.protocol` is a map, whose
first byte is never 0x01, so a sealed message and a plain one cannot be mistaken for another."""
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")

KeyRing = list[tuple[str, bytes]]


class KeyRingError(ConfigError):
    """A key ring that cannot be used; a ConfigError, so the process does not start with it."""


class SealError(ValueError):
    """A message that cannot be opened: unknown key, tampered, moved, or not sealed."""


def generate_key() -> str:
    """A fresh random key, base64, as the key ring takes it (``slogate gen-key``)."""
    return base64.b64encode(os.urandom(KEY_BYTES)).decode()


def check_key_id(kid: str, where: str = "") -> None:
    if not _KEY_ID.fullmatch(kid):
        raise KeyRingError(f"{where}key id {kid!r} must be 1-64 of letters, digits, '.', '_', '-'")


def parse_key_ring(text: str) -> KeyRing:
    """Parse ``"kid2:BASE64,kid1:BASE64"``: the first key seals, all of them open.

    Each error names the entry and what is wrong with it, never the key material itself.
    """
    ring: KeyRing = []
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise KeyRingError("encryption keys: empty; expected 'KEY_ID:BASE64_KEY[,KEY_ID:BASE64_KEY...]'")
    for position, entry in enumerate(entries, 1):
        kid, sep, encoded = entry.partition(":")
        kid = kid.strip()
        if not sep:
            raise KeyRingError(f"encryption keys: entry {position} has no ':'; expected KEY_ID:BASE64_KEY")
        check_key_id(kid, f"encryption keys: entry {position}: ")
        try:
            key = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise KeyRingError(f"encryption keys: key {kid!r} is not valid base64") from None
        if len(key) != KEY_BYTES:
            raise KeyRingError(f"encryption keys: key {kid!r} is {len(key)} bytes, must be {KEY_BYTES} "
                               "(AES-256; make one with 'slogate gen-key')")
        if any(kid == seen for seen, _ in ring):
            raise KeyRingError(f"encryption keys: key id {kid!r} appears twice")
        ring.append((kid, key))
    return ring


class Sealer:
    """Seals with the first key of its ring, opens with any of them.

    One class for both states: built from an empty ring it is off and passes messages through
    unchanged, so a call site reads ``sealer.seal(data, aad)`` whether or not keys are set,
    with no ``if sealer`` anywhere. Off, :meth:`open` still refuses a sealed message, naming the
    key it needs, rather than handing ciphertext to the msgpack decoder.
    """

    def __init__(self, ring: Sequence[tuple[str, bytes]] = ()) -> None:
        self._openers: dict[bytes, AESGCM] = {}
        for kid, key in ring:
            if not _KEY_ID.fullmatch(kid) or len(key) != KEY_BYTES or kid.encode() in self._openers:
                raise KeyRingError(f"encryption keys: invalid or duplicate key {kid!r}; use parse_key_ring")
            self._openers[kid.encode()] = AESGCM(key)
        self.key_ids: tuple[str, ...] = tuple(kid for kid, _ in ring)
        """The ring's key ids, sealing key first (for the start log); empty when off."""
        if ring:
            kid = ring[0][0].encode()
            self._header = bytes((FORMAT, len(kid))) + kid
            self._sealer: AESGCM | None = self._openers[kid]
        else:
            self._sealer = None

    @classmethod
    def from_text(cls, text: str | None) -> Sealer:
        """From the ``encryption_keys`` setting: unset means off, set but empty is an error."""
        return cls() if text is None else cls(parse_key_ring(text))

    @property
    def enabled(self) -> bool:
        return self._sealer is not None

    def seal(self, plaintext: bytes, aad: bytes) -> bytes:
        """Encrypt ``plaintext`` bound to ``aad`` (the request id); off: ``plaintext`` itself."""
        if self._sealer is None:
            return plaintext
        nonce = os.urandom(NONCE_BYTES)
        header = self._header + nonce
        return header + self._sealer.encrypt(nonce, plaintext, header + aad)

    def open(self, sealed: bytes, aad: bytes) -> bytes:
        """Decrypt what :meth:`seal` made with the same ``aad``; off: ``sealed`` itself, if plain."""
        if not sealed or sealed[0] != FORMAT:
            if self._sealer is None:
                return sealed
            raise SealError("message is not sealed, but this process has encryption keys: was it "
                            "written by a process without them?")
        end = 2 + sealed[1] if len(sealed) > 1 else 2
        if len(sealed) < end + NONCE_BYTES + TAG_BYTES:
            raise SealError(f"sealed message truncated ({len(sealed)} bytes)")
        kid = sealed[2:end]
        opener = self._openers.get(kid)
        if opener is None:
            name = kid.decode(errors="replace")
            if self._sealer is None:
                raise SealError(f"message sealed with key {name!r}, but this process has no encryption keys")
            raise SealError(f"message sealed with key {name!r}, which this process does not have "
                            f"(it has {', '.join(map(repr, self.key_ids))})")
        body = end + NONCE_BYTES
        try:
            return opener.decrypt(sealed[end:body], sealed[body:], sealed[:body] + aad)
        except InvalidTag:
            raise SealError(f"message sealed with key {kid.decode()!r} failed authentication: tampered "
                            "with, or moved from another request") from None
