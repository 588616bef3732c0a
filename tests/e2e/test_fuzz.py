"""Schemathesis throws schema-driven bodies and headers (valid and invalid) at a real gateway with
sim workers behind it: whatever a client sends, the answer is a documented status in the
documented shape, never a crash (5xx) and never silence (a hang)."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import content_type_conformance, response_schema_conformance, status_code_conformance

from gateway.openapi import openapi_document
from slogate.processes import Stack
from tests.e2e.conftest import MODEL

REQUEST_TIMEOUT_S = 20.0
"""No request may take longer: the sim decodes the largest context (8192 tokens at 1 ms a step)
well inside it, so a request still open by then has hung."""
SLO_REFUSALS = {503: {"no_live_worker", "circuit_open", "shutting_down"}, 504: {"deadline_exceeded"}}
"""The only 5xx answers that are the gateway doing its job (shedding, enforcing a deadline)
rather than failing; their codes come from ``gateway.admit`` and ``gateway.completions``."""


schema = schemathesis.openapi.from_dict(openapi_document(MODEL))
"""Built in-process until the gateway serves ``/openapi.json``; eager, not
``schemathesis.pytest.from_fixture``, whose lazy loading breaks on pytest 9."""


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_no_hang(case: schemathesis.Case, stack: Stack) -> None:
    try:
        response = case.call(base_url=stack.url, timeout=REQUEST_TIMEOUT_S)
    except requests.Timeout:
        pytest.fail(f"no answer within {REQUEST_TIMEOUT_S:g} s; reproduce with:\n{case.as_curl_command()}")
    if response.status_code >= 500:
        code = (response.json().get("error") or {}).get("code")
        assert code in SLO_REFUSALS.get(response.status_code, ()), (
            f"{response.status_code} {response.text[:500]}\nreproduce with:\n{case.as_curl_command()}")
    case.validate_response(response, checks=[status_code_conformance, content_type_conformance,
                                             response_schema_conformance])
