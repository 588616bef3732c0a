"""API keys: stored as SHA-256 hashes (never the secret), checked in constant time.

A key is found by comparing the hash of the presented secret against every configured hash
with ``hmac.compare_digest``, so neither the match position nor a partial match shows in the
time taken.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from multidict import CIMultiDictProxy

from gateway.errors import APIError
from slogate.config import ApiKeyConfig


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    key_id: str
    models: frozenset[str]
    """Models the key may use; empty means all."""


ANONYMOUS = Caller("anonymous", frozenset())


class KeyStore:
    def __init__(self, keys: list[ApiKeyConfig]) -> None:
        self._keys = [(bytes.fromhex(k.sha256), Caller(k.id, frozenset(k.models))) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def for_request(self, headers: CIMultiDictProxy[str]) -> Caller:
        """The caller a request's one Authorization header names. Two are refused, not the first
        taken: a proxy that checks the last would disagree with this gateway on who is calling."""
        sent = headers.getall("Authorization", [])
        if self.enabled and len(sent) > 1:
            raise APIError(401, f"send one Authorization header, got {len(sent)}", None, "invalid_api_key")
        return self.authenticate(sent[0] if sent else None)

    def authenticate(self, authorization: str | None) -> Caller:
        if not self._keys:
            return ANONYMOUS
        if not authorization:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", None,
                           "missing_api_key")
        scheme, _, secret = authorization.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise APIError(401, "malformed Authorization header: expected 'Bearer <key>'", None,
                           "invalid_api_key")
        # aiohttp keeps bytes that are not UTF-8 as surrogates; such a key matches nothing
        digest = hashlib.sha256(secret.strip().encode("utf-8", "surrogateescape")).digest()
        found = None
        for stored, caller in self._keys:
            if hmac.compare_digest(stored, digest):
                found = caller
        if found is None:
            raise APIError(401, "invalid API key", None, "invalid_api_key")
        return found

    @staticmethod
    def check_model(caller: Caller, model: str) -> None:
        if caller.models and model not in caller.models:
            raise APIError(403, f"this API key may not use model '{model}'", "model",
                           "model_not_allowed")
