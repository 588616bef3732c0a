"""The upstream engine's translation to and from an OpenAI server's shapes (pure functions; the
engine against a real server: tests/e2e/test_upstream_e2e.py)."""

from __future__ import annotations

import json

from engines.base import EngineRequest
from engines.upstream import chunk_event, error_of, refused, request_body
from slogate.protocol import SamplingParams


def _request(**sampling: object) -> EngineRequest:
    return EngineRequest("r1", SamplingParams(**sampling), 0.0, prompt="Risk:")


def test_plain_request_carries_no_extension_a_plain_openai_server_would_refuse() -> None:
    body = request_body(_request(max_tokens=9, temperature=0.0), "m")
    assert body == {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
                    "top_p": 1.0, "max_tokens": 9, "prompt": "Risk:"}


def test_the_gateways_default_cap_is_not_sent() -> None:
    assert "max_tokens" not in request_body(_request(max_tokens=256, max_tokens_default=True), "m")


def test_set_parameters_are_passed_on_by_their_openai_and_vllm_names() -> None:
    body = request_body(_request(stop=["\n"], seed=3, top_k=5, min_tokens=2, ignore_eos=True, logit_bias={42: -100.0},
                                 stop_token_ids=[7], presence_penalty=0.5, logprobs=2,
                                 json_schema='{"type": "object"}'), "m", continuous_usage=True)
    assert body["stop"] == ["\n"] and body["seed"] == 3 and body["top_k"] == 5 and body["min_tokens"] == 2
    assert body["ignore_eos"] is True and body["stop_token_ids"] == [7] and body["presence_penalty"] == 0.5
    assert body["logit_bias"] == {"42": -100.0}
    assert body["logprobs"] == 2  # completions: a count
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert body["stream_options"]["continuous_usage_stats"] is True
    chat = request_body(EngineRequest("r2", SamplingParams(logprobs=3), 0.0,
                                      messages=[{"role": "user", "content": "hi"}]), "m")
    assert chat["logprobs"] is True and chat["top_logprobs"] == 3 and chat["messages"][0]["content"] == "hi"


def test_tools_are_refused_by_name() -> None:
    req = EngineRequest("r3", SamplingParams(), 0.0, messages=[{"role": "user", "content": "x"}],
                        tools=[{"type": "function", "function": {"name": "f"}}])
    out = refused(req)
    assert out is not None and out.error_status == 400 and out.error_param == "tools"
    assert refused(_request()) is None


def test_chunks_become_text_tokens_logprobs_and_usage() -> None:
    h = {"token": "h", "logprob": -0.1, "bytes": [104]}
    chat = chunk_event("r", {"choices": [{"delta": {"content": "hé"}, "logprobs": {"content": [
        {**h, "top_logprobs": [h]}, {"token": "é", "logprob": -0.2, "bytes": [195, 169], "top_logprobs": []}]}}]},
        chat=True, counted=False)
    assert chat.text == "hé" and chat.tokens == 2 and chat.logprobs[1].raw == "é".encode()
    assert chat.logprobs[0].top == [("h", b"h", -0.1)]
    plain = chunk_event("r", {"choices": [{"text": " risk", "finish_reason": "length"}],
                              "usage": {"prompt_tokens": 4, "completion_tokens": 7}}, chat=False, counted=True)
    assert plain.text == " risk" and plain.finish_reason == "length" and plain.usage == (4, 7)
    assert plain.tokens == 0  # counted by the usage on every chunk instead
    assert chunk_event("r", {"choices": [{"text": " x"}]}, chat=False, counted=False).tokens == 1
    role_only = chunk_event("r", {"choices": [{"delta": {"role": "assistant"}}]}, chat=True, counted=False)
    assert role_only.text == "" and role_only.tokens == 0


def test_refusals_keep_the_clients_fault_and_hide_the_servers() -> None:
    bad = json.dumps({"error": {"message": "max_tokens is too large", "code": "invalid_value", "param": "max_tokens"}})
    assert error_of(400, bad.encode()) == (400, "max_tokens is too large", "invalid_value", "max_tokens")
    assert error_of(422, b'{"error": {"message": "top_k: extra field"}}')[:2] == (400, "top_k: extra field")
    for status in (401, 403, 404):  # the worker's key, URL or model: not the client's to fix
        assert error_of(status, b'{"error": {"message": "no"}}')[0::2] == (502, "upstream_error")
    assert error_of(429, b"slow down")[0::2] == (503, "upstream_overloaded")
    status, message, code, _ = error_of(500, b"<html>oops at /srv/app.py</html>")
    assert (status, code) == (502, "upstream_error") and "oops" not in message, "the server's insides go to the log"
