"""Every way a request can fail, as one exception whose status follows from what went wrong.

Handlers raise :class:`APIError`; one middleware turns it into OpenAI's error shape, so no
code path can answer a client's mistake with a 500 or a bare HTML page.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import msgspec
from aiohttp import compression_utils, web
from redis.exceptions import NoPermissionError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 415: "invalid_request_error", 417: "invalid_request_error",
          429: "rate_limit_error", 502: "api_error", 503: "service_unavailable", 504: "timeout_error"}
log = logging.getLogger("slogate.gateway")


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "api_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=msgspec.json.encode(self.body()),
                            content_type="application/json", headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def redis_unavailable(what: str, exc: BaseException) -> APIError:
    """A 503 that says Redis failed, not where it is: redis-py's text names its host and port
    or socket path, which is the operator's to see (logged here), not a client's. One its ACL
    refused says so: Redis is there, and the cause is its user's permissions."""
    if isinstance(exc, NoPermissionError):
        why = acl_refused(acl_refusal(exc))
        log.warning("%s: %s", what, why)
        return APIError(503, f"{what}: {why}", None, "redis_unavailable")
    log.warning("%s: %s", what, exc)
    return APIError(503, f"{what}: Redis is unavailable", None, "redis_unavailable")


NEEDS = "+eval +evalsha +script|load, and reads and writes of the slogate:* keys"
"""What the gateway's Redis user must be allowed, besides the plain commands: its scripts."""

_NO_PERMISSION = re.compile(r"no permissions to (?:run the '[^']+' command|access an? \w+)", re.IGNORECASE)


def acl_refusal(exc: NoPermissionError) -> str:
    """What Redis refused, without the script text a pipeline's error quotes."""
    found = _NO_PERMISSION.search(str(exc))
    return found[0] if found else str(exc)


def acl_refused(refusal: str) -> str:
    """A refusal by Redis's ACL as readiness and a refused request say it, with what the user
    needs: a client's 503 that said Redis was unreachable sent its operator to the network."""
    return f"Redis's ACL refuses this gateway's user a command it needs ({NEEDS}): {refusal}"


DECODED_CODINGS = ("gzip", "deflate", *(("br",) if compression_utils.HAS_BROTLI else ()),
                   *(("zstd",) if compression_utils.HAS_ZSTD else ()))
"""The Content-Encodings aiohttp decodes: one of these, never a list of them."""


def unsupported_encoding(coding: str | None) -> APIError:
    """A body in a coding aiohttp does not decode is read as it came, and would be refused as
    JSON malformed at its first byte: this names the coding instead (``None``: aiohttp's error
    did not say which)."""
    what = f"Content-Encoding {coding!r}" if coding else "the body's Content-Encoding"
    return APIError(415, f"{what} is not supported: send the body uncompressed or in one of "
                         f"{', '.join(DECODED_CODINGS)}", None, "unsupported_content_encoding")
