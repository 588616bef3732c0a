"""The OpenAPI document is valid, matches the routes the app serves, and carries the request
schemas the gateway actually decodes with."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from unittest import mock

import msgspec
import pytest
from aiohttp import streams
from aiohttp.test_utils import make_mocked_request
from openapi_spec_validator import validate

from gateway import schema
from gateway.completions import _final_error, _read_body
from gateway.errors import APIError
from gateway.app import make_app
from gateway.openapi import ERROR_STATUSES, openapi_document
from slogate.config import Config
from slogate.protocol import Error

DOC = openapi_document()
COMPLETION_PATHS = {"/v1/chat/completions": ("chat", "ChatBody"), "/v1/completions": ("completion", "CompletionBody")}


def _resolve(ref: str) -> dict:
    node = DOC
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def test_document_is_valid_openapi_3_1() -> None:
    assert DOC["openapi"].startswith("3.1")
    validate(DOC)


def test_documented_operations_are_the_routes_the_app_serves() -> None:
    """Every route but the document's own (``GET /openapi.json``)."""
    served = {(r.method.lower(), r.resource.canonical) for r in make_app(Config()).router.routes()
              if r.method != "HEAD"} - {("get", "/openapi.json")}
    documented = {(method, path) for path, ops in DOC["paths"].items() for method in ops}
    assert documented == served


def test_request_schemas_are_the_msgspec_structs() -> None:
    _, expected = msgspec.json.schema_components((schema.ChatBody, schema.CompletionBody),
                                                 ref_template="#/components/schemas/{name}")
    for name, body in expected.items():
        assert DOC["components"]["schemas"][name] == body, name
    for path, (_, name) in COMPLETION_PATHS.items():
        body = DOC["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{name}"}
    assert {"model", "messages", "max_tokens", "stream"} <= set(DOC["components"]["schemas"]["ChatBody"]["properties"])
    assert "prompt" in DOC["components"]["schemas"]["CompletionBody"]["properties"]


@pytest.mark.parametrize("path", COMPLETION_PATHS)
def test_request_examples_pass_the_gateways_own_validation(path: str) -> None:
    kind, _ = COMPLETION_PATHS[path]
    example = DOC["paths"][path]["post"]["requestBody"]["content"]["application/json"]["example"]
    parsed = schema.parse(kind, msgspec.json.encode(example), default_max_tokens=16)
    assert parsed.model == "tiny"
    assert openapi_document("slogate-sim")["paths"][path]["post"]["requestBody"]["content"][
        "application/json"]["example"]["model"] == "slogate-sim"


@pytest.mark.parametrize("path", COMPLETION_PATHS)
def test_every_error_status_answers_in_openais_error_shape(path: str) -> None:
    responses = DOC["paths"][path]["post"]["responses"]
    assert {400, 401, 403, 404, 413, 429, 503, 504} <= set(ERROR_STATUSES)
    for status in ERROR_STATUSES:
        resp = _resolve(responses[str(status)]["$ref"])
        error = _resolve(resp["content"]["application/json"]["schema"]["$ref"])
        inner = error["properties"]["error"]
        assert error["required"] == ["error"]
        assert set(inner["required"]) == {"message", "type", "param", "code"}
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}


@pytest.mark.parametrize("path", COMPLETION_PATHS)
async def test_a_body_that_never_arrives_is_a_documented_answer(path: str) -> None:
    """The completion endpoints answer a body that does not arrive within ``client_timeout_s``
    with a 408: the published contract, which says it lists every error they answer, must list it."""
    protocol = mock.Mock(_reading_paused=False)
    never = streams.StreamReader(protocol, 2**16, loop=asyncio.get_running_loop())
    request = make_mocked_request("POST", path, headers={"Content-Length": "10"}, payload=never)
    with pytest.raises(APIError) as refused:
        await _read_body(request, limit=1 << 20, timeout_s=0.05)
    assert str(refused.value.status) in DOC["paths"][path]["post"]["responses"]


@pytest.mark.parametrize("path", COMPLETION_PATHS)
def test_an_engine_failure_is_a_documented_answer(path: str) -> None:
    """A worker whose engine fails under a request answers it ``engine_error``, 500, which the
    gateway passes on (as it does the gateway's own ``internal_error``): the contract lists it."""
    job = SimpleNamespace(parsed=SimpleNamespace(messages=None), free_slot=lambda: None)
    err = _final_error(job, Error("the engine failed while serving this request", "engine_error", 500, attempt=1))
    assert err is not None
    assert str(err.status) in DOC["paths"][path]["post"]["responses"]
