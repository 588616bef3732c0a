"""Tracing is set from the standard OTEL_* variables, and refuses what it cannot do by name."""

from __future__ import annotations

import pytest

from slogate import tracing


@pytest.mark.parametrize("env,named", [
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json",
      "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin'"),
])
def test_an_exporter_it_cannot_build_is_refused_by_name(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError) as err:
        tracing.setup("test", env)
    assert named in str(err.value)
    assert not tracing.enabled()


def test_otlp_over_http_is_accepted() -> None:
    try:
        assert tracing.setup("test", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                                      "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
        assert tracing.enabled()
    finally:
        tracing.setup("test", {})
