"""What the gateway's error log holds: its own failures, not clients' malformed HTTP (pure logic)."""

from __future__ import annotations

import logging
import sys

import pytest
from aiohttp.http_exceptions import BadHttpMessage, InvalidHeader, LineTooLong
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import MalformedHttpAtInfo, make_app
from slogate.config import Config


def aiohttp_record(exc: Exception) -> logging.LogRecord:
    """The record aiohttp's server logs when handling a request fails with ``exc``."""
    try:
        raise exc
    except Exception:  # noqa: BLE001 - the record carries whatever was raised
        return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                                 ("127.0.0.1",), sys.exc_info())


@pytest.mark.parametrize("exc,words", [
    (BadHttpMessage("Duplicate 'Content-Type' header found."), ["400", "Duplicate 'Content-Type'"]),
    (LineTooLong(b"x-big: " + b"a" * 20000, "8190", "20007"), ["400", "x-big"]),
])
def test_a_malformed_request_is_one_info_line(caplog: pytest.LogCaptureFixture, exc: Exception,
                                              words: list[str]) -> None:
    caplog.set_level(logging.INFO)
    record = aiohttp_record(exc)
    assert MalformedHttpAtInfo().filter(record)
    assert record.levelno == logging.INFO and record.levelname == "INFO"
    assert record.exc_info is None
    for word in words:
        assert word in record.getMessage()
    assert len(record.getMessage()) < 300, "a client's oversized line is not copied into the log"


@pytest.mark.parametrize("exc", [
    InvalidHeader(b"Authorization: Bearer sk-SECRET\x01zz"),
    InvalidHeader(b"Authorization: Bearer sk-SECRET\\'zz"),
    LineTooLong(b"Bearer sk-SECRET" + b"A" * 9000, "8190"),
    LineTooLong(b"x-api-key: sk-SECRET" + b"A" * 9000, "8190"),
])
def test_header_values_of_a_malformed_request_are_not_logged(caplog: pytest.LogCaptureFixture,
                                                              exc: Exception) -> None:
    caplog.set_level(logging.INFO)
    record = aiohttp_record(exc)
    assert MalformedHttpAtInfo().filter(record)
    message = record.getMessage()
    assert "SECRET" not in message and "zz" not in message and "***" in message, message


def test_it_is_dropped_when_the_log_level_is_above_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    assert not MalformedHttpAtInfo().filter(aiohttp_record(BadHttpMessage("bad header")))


def test_the_gateways_own_failures_keep_their_level_and_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    record = aiohttp_record(RuntimeError("a bug in a handler"))
    assert MalformedHttpAtInfo().filter(record)
    assert record.levelno == logging.ERROR and record.exc_info is not None


async def test_a_body_that_does_not_decompress_logs_no_error(redis_url: str, caplog) -> None:
    """Answered with a 400, it is met again as aiohttp drains the payload (a RequestPayloadError
    caused by the encoding's error): the client's mistake, not an error of the gateway's."""
    logging.getLogger("aiohttp.server").addFilter(MalformedHttpAtInfo())
    caplog.set_level(logging.INFO)
    async with TestClient(TestServer(make_app(Config(redis_url=redis_url)))) as client:
        resp = await client.post("/v1/chat/completions", data=b"this is not compressed",
                                 headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert resp.status == 400
        await resp.read()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [(r.name, r.getMessage(), r.exc_info and type(r.exc_info[1]).__name__) for r in errors]
