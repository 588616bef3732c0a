"""Schemathesis throws schema-driven bodies and headers (valid and invalid) at a real gateway with
sim workers behind it: whatever a client sends, the answer is a documented status in the
documented shape, never a crash (5xx) and never silence (a hang)."""

from __future__ import annotations

from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import content_type_conformance, response_schema_conformance, status_code_conformance

from gateway.openapi import openapi_document
from slogate.processes import Stack
from tests.e2e.conftest import MODEL

REQUEST_TIMEOUT_S = 20.0
"""No request may take longer: the sim decodes the largest context (8192 tokens at 1 ms a step)
well inside it, so a request still open by then has hung."""
CLIENT_DEADLINE = (504, "deadline_exceeded")
"""The one 5xx a healthy fleet may answer: the client's own ``x-slogate-timeout`` passed.
Anything else (a 500, a 502, a breaker opened, a worker missing) is the gateway failing."""

schema = schemathesis.openapi.from_dict(openapi_document(MODEL))
"""Built in-process until the gateway serves ``/openapi.json``; eager, not
``schemathesis.pytest.from_fixture``, whose lazy loading breaks on pytest 9."""
schema.config.output.sanitization.enabled = False  # it hides max_tokens, which a repro needs


@schema.hook
def flatmap_body(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy[Any]:
    """Half the bodies name the served model, so that they get past the model check to
    admission and a worker instead of all ending as 404s."""
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        return st.sampled_from([body, {**body, "model": MODEL}])
    return st.just(body)


def _error_code(response: schemathesis.Response) -> str | None:
    try:
        return (response.json().get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_no_hang(case: schemathesis.Case, stack: Stack) -> None:
    try:
        response = case.call(base_url=stack.url, timeout=REQUEST_TIMEOUT_S)
    except requests.Timeout:
        pytest.fail(f"no answer within {REQUEST_TIMEOUT_S:g} s; reproduce with:\n{case.as_curl_command()}")
    if response.status_code >= 500:
        assert (response.status_code, _error_code(response)) == CLIENT_DEADLINE, (
            f"{response.status_code} {response.text[:500]}\nreproduce with:\n{case.as_curl_command()}")
    case.validate_response(response, checks=[status_code_conformance, content_type_conformance,
                                             response_schema_conformance])
