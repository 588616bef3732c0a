"""The gateway's OpenAPI 3.1 document.

Request bodies are generated from the msgspec structs that decode them (``gateway.schema``),
so the published contract cannot drift from what the gateway accepts; only the response
shapes, which ``openai_shapes`` builds as plain dicts, are written out here.
"""

from __future__ import annotations

import copy
from importlib.metadata import version
from typing import Any

import msgspec

from gateway.schema import ChatBody, CompletionBody

_REF = "#/components/schemas/{name}"

ERROR_STATUSES = {
    400: "The body or a header is invalid; `param` names the offending field.",
    401: "Authentication is on and the API key is missing, malformed or unknown.",
    403: "The API key may not use this model.",
    404: "No live worker serves the requested model.",
    408: "The body did not arrive within the gateway's `client_timeout_s`.",
    413: "The body exceeds the gateway's `max_body_bytes`.",
    415: "The body is in a `Content-Encoding` the gateway does not decode.",
    417: "An `Expect` header other than `100-continue`.",
    429: "Shed by admission control or over the key's rate limit; see `Retry-After`.",
    500: "The worker's engine failed while serving the request, or the gateway failed unexpectedly.",
    502: "The worker failed or ended the request.",
    503: "No live worker, a paused pool, Redis unavailable, or the gateway is draining.",
    504: "The request's deadline passed before it finished.",
}
"""Every error a completion endpoint can answer, all in OpenAI's error shape."""

_RETRY_AFTER = {"Retry-After": {"description": "Whole seconds to wait before retrying.",
                                "schema": {"type": "string"}},
                "retry-after-ms": {"description": "Milliseconds to wait (read by the OpenAI SDKs).",
                                   "schema": {"type": "string"}},
                "x-should-retry": {"description": "`false` (in place of the two above) when retrying the same "
                                                  "request cannot help; the OpenAI SDKs then do not retry.",
                                   "schema": {"type": "string"}}}
_REQUEST_ID = {"x-request-id": {"description": "The client's id if it sent a valid one, else a new one.",
                                "schema": {"type": "string"}}}


def _obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": {**required, **(optional or {})}, "required": list(required)}


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF.format(name=name)}}}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_STR, _INT = {"type": "string"}, {"type": "integer"}


def _response_schemas() -> dict[str, dict[str, Any]]:
    """What ``openai_shapes`` and the plain handlers in ``app`` send back."""
    num, nums = {"type": ["number", "null"]}, {"type": "array", "items": _INT}
    alternative = {"token": _STR, "logprob": num, "bytes": nums}
    chat_logprobs = _obj({"content": {"type": "array", "items": _obj({
        **alternative, "top_logprobs": {"type": "array", "items": _obj(alternative)}})}})
    completion_logprobs = _obj({
        "tokens": {"type": "array", "items": _STR}, "token_logprobs": {"type": "array", "items": num},
        "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": num}},
        "text_offset": nums})
    choice = {"index": _INT, "finish_reason": _nullable(_STR)}
    tool_call = _obj({"id": _STR, "type": {"const": "function"},
                      "function": _obj({"name": _STR, "arguments": _STR})})
    return {
        "Error": _obj({"error": _obj({"message": _STR, "type": _STR, "param": _nullable(_STR),
                                      "code": _nullable(_STR)})}),
        "Usage": _obj({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT}),
        "ChatCompletion": _obj({
            "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
            "choices": {"type": "array", "items": _obj({
                **choice, "logprobs": _nullable(chat_logprobs),
                "message": _obj({"role": {"const": "assistant"}, "content": _nullable(_STR)},
                                {"tool_calls": {"type": "array", "items": tool_call}})})},
            "usage": {"$ref": _REF.format(name="Usage")}}),
        "Completion": _obj({
            "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
            "choices": {"type": "array", "items": _obj({**choice, "logprobs": _nullable(completion_logprobs),
                                                         "text": _STR})},
            "usage": {"$ref": _REF.format(name="Usage")}}),
        "Model": _obj({"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR},
                      {"max_model_len": _INT, "pools": {"type": "array", "items": _STR}}),
        "ModelList": _obj({"object": {"const": "list"}, "data": {"type": "array",
                                                                  "items": {"$ref": _REF.format(name="Model")}}}),
        "Health": _obj({"status": _STR}),
        "Readiness": _obj({"status": {"enum": ["ok", "unavailable"]}, "reason": _STR}),
    }


def _error_responses() -> dict[str, dict[str, Any]]:
    out = {}
    for status, why in ERROR_STATUSES.items():
        headers = {**_REQUEST_ID, **(_RETRY_AFTER if status in (429, 503) else {})}
        out[f"Error{status}"] = {"description": why, "headers": headers, "content": _json("Error")}
    return out


_HEADERS = [
    {"name": "x-request-id", "in": "header", "required": False,
     "description": "Echoed back; an id that is not 1-128 printable ASCII characters is replaced.",
     "schema": {"type": "string"}},
    {"name": "x-slogate-class", "in": "header", "required": False,
     "description": "Force the request's class instead of letting the gateway classify it.",
     "schema": {"enum": ["interactive", "batch"]}},
    {"name": "x-slogate-timeout", "in": "header", "required": False,
     "description": "Deadline in seconds, at most the gateway's `max_timeout_s`; 504 when it passes.",
     "schema": {"type": "number", "exclusiveMinimum": 0}},
]


def _completion_op(summary: str, op_id: str, body: str, result: str,
                   example: dict[str, Any]) -> dict[str, Any]:
    ok = {"description": "The answer: one JSON object, or server-sent events when `stream` is true.",
          "headers": _REQUEST_ID,
          "content": {**_json(result), "text/event-stream": {"schema": _STR}}}
    return {"post": {
        "summary": summary, "operationId": op_id,
        "security": [{}, {"bearer": []}], "parameters": _HEADERS,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(name=body)}, "example": example}}},
        "responses": {"200": ok, **{str(s): {"$ref": f"#/components/responses/Error{s}"}
                                    for s in ERROR_STATUSES}}}}


def _get_op(summary: str, op_id: str, content: dict[str, Any], secured: bool = False,
            parameters: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    """``extra``: more responses, by status."""
    op: dict[str, Any] = {"summary": summary, "operationId": op_id, "responses": {
        "200": {"description": summary, "content": content}, **extra}}
    if parameters:
        op["parameters"] = parameters
    if secured:
        op["security"] = [{}, {"bearer": []}]
        op["responses"]["401"] = {"$ref": "#/components/responses/Error401"}
    return {"get": op}


def openapi_document(example_model: str = "tiny") -> dict[str, Any]:
    """The document served at ``/openapi.json``. ``example_model`` fills the request examples
    (``tiny`` is what ``slogate up`` serves); fuzzers start from them, so a test names the model
    its workers serve to get requests past the model check."""
    _, request_schemas = msgspec.json.schema_components((ChatBody, CompletionBody), ref_template=_REF)
    chat_example = {"model": example_model, "max_tokens": 8,
                    "messages": [{"role": "user", "content": "Score txn 1: 10 EUR at merchant 5"}]}
    completion_example = {"model": example_model, "max_tokens": 8, "prompt": "Risk report:"}
    # A deep copy: the module's shared fragments must not change if a caller (a fuzzer resolving
    # references) edits its document in place.
    return copy.deepcopy({
        "openapi": "3.1.0",
        "info": {"title": "slogate", "version": version("slogate"),
                 "description": "An SLO-aware, OpenAI-compatible gateway for LLM inference."},
        "paths": {
            "/v1/chat/completions": _completion_op("Create a chat completion", "createChatCompletion",
                                                   "ChatBody", "ChatCompletion", chat_example),
            "/v1/completions": _completion_op("Create a text completion", "createCompletion",
                                              "CompletionBody", "Completion", completion_example),
            "/v1/models": _get_op("Models that live workers serve (those the API key may use)", "listModels",
                                  _json("ModelList"), secured=True),
            "/v1/models/{model}": _get_op("One model that live workers serve (if the API key may use it)",
                                          "retrieveModel", _json("Model"), secured=True,
                                          parameters=[{"name": "model", "in": "path", "required": True,
                                                       "schema": _STR}],
                                          **{"404": {"$ref": "#/components/responses/Error404"}}),
            "/healthz": _get_op("The process is alive", "healthz", _json("Health")),
            "/readyz": _get_op("Redis answers and every configured pool has a live worker", "readyz",
                               _json("Readiness"), **{"503": {"description": "Not ready; `reason` says why.",
                                                              "content": _json("Readiness")}}),
            "/metrics": _get_op("Prometheus metrics", "metrics",
                                {"text/plain": {"schema": _STR}}),
        },
        "components": {
            "schemas": {**request_schemas, **_response_schemas()},
            "responses": _error_responses(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "Needed only when the gateway has `api_keys`."}},
        },
    })
