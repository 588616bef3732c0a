"""Docker cannot run here, so compose.yaml is kept right by checking it against the CLI."""

import json
import re
from pathlib import Path

import pytest
import yaml

from engines.metrics import WorkerMetrics
from gateway.metrics import GatewayMetrics
from slogate.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_every_service_has_a_healthcheck_or_cannot_have_one() -> None:
    runs_once, distroless = "model", "otel-collector"
    for name, svc in COMPOSE["services"].items():
        assert "healthcheck" in svc or name in (runs_once, distroless), name


def interpolated(arg: str, env: dict[str, str]) -> str:
    """``${VAR:-default}`` as compose reads it."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m[1]) or m[2], arg)


def test_workers_serve_the_model_the_model_service_builds_unless_told_otherwise() -> None:
    built = COMPOSE["services"]["model"]["command"][-1]
    for name in ("worker-interactive", "worker-batch"):
        command = COMPOSE["services"][name]["command"]
        for env, model in (({}, built), ({"SLOGATE_MODEL": "Qwen/Qwen2.5-0.5B"}, "Qwen/Qwen2.5-0.5B")):
            assert build_parser().parse_args([interpolated(a, env) for a in command]).model == model, name


@pytest.mark.parametrize("name", [n for n, s in COMPOSE["services"].items() if "build" in s])
def test_service_command_parses_with_the_cli(name: str) -> None:
    svc = COMPOSE["services"][name]
    args = build_parser().parse_args(svc["command"])
    assert callable(args.func)
    dockerfile = ROOT / svc["build"].get("dockerfile", "Dockerfile")
    assert dockerfile.exists()
    assert 'ENTRYPOINT ["slogate"]' in dockerfile.read_text()


def test_gateway_image_has_no_torch() -> None:
    gateway = COMPOSE["services"]["gateway"]
    text = (ROOT / gateway["build"]["dockerfile"]).read_text()
    assert "torch" not in text.replace("no torch", "")
    assert "[engines]" not in text


def test_gateway_replicas_can_each_publish_a_port() -> None:
    """``--scale gateway=N`` (the header's advice) fails on one fixed host port."""
    (published,) = COMPOSE["services"]["gateway"]["ports"]
    host, container = published.rsplit(":", 1)
    first, _, last = host.partition("-")
    assert container == "8000" and int(last) - int(first) >= 3


def test_workers_depend_on_healthy_redis() -> None:
    for name, svc in COMPOSE["services"].items():
        if name.startswith(("worker", "gateway")):
            assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
            assert svc["environment"]["SLOGATE_REDIS_URL"].startswith("redis://redis:")


OBSERVABILITY = {"prometheus", "grafana", "otel-collector", "jaeger"}
DEPLOY = ROOT / "deploy"


def _deploy_mounts() -> list[tuple[str, Path, str]]:
    """(service, source on the host, target in the container) for every bind mount from ./deploy."""
    mounts = []
    for name, svc in COMPOSE["services"].items():
        for volume in svc.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("./deploy"):
                mounts.append((name, ROOT / source, target))
    return mounts


def _mounted(service: str, source: Path) -> str:
    return next(t for n, s, t in _deploy_mounts() if n == service and s == source)


def test_every_file_mounted_from_deploy_exists() -> None:
    assert {n for n, _, _ in _deploy_mounts()} == OBSERVABILITY - {"jaeger"}
    for name, source, _ in _deploy_mounts():
        assert source.exists(), f"{name} mounts {source}, which is missing"


def test_observability_services_are_opt_in() -> None:
    for name, svc in COMPOSE["services"].items():
        assert svc.get("profiles") == (["observability"] if name in OBSERVABILITY else None), name


def test_prometheus_scrapes_the_gateways_and_workers_ports() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    scraped = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            scraped.update({host: sd["port"] for host in sd["names"]})
        for static in job.get("static_configs", []):
            scraped.update(dict(t.rsplit(":", 1) for t in static["targets"]))
    metrics_port = {"gateway": "port", "worker": "metrics_port"}
    serving = {}
    for name, svc in COMPOSE["services"].items():
        args = build_parser().parse_args(svc["command"]) if "build" in svc else None
        if args and args.command in metrics_port:
            serving[name] = getattr(args, metrics_port[args.command])
    assert {host: int(port) for host, port in scraped.items()} == serving


def test_grafana_provisioning_points_at_the_services_and_the_dashboard_mount() -> None:
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert _mounted("grafana", provisioning) == "/etc/grafana/provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "slogate.yml").read_text())["datasources"]
    for source in sources:
        host = source["url"].split("//")[1].split(":")[0]
        assert host in COMPOSE["services"], source["url"]
    providers = yaml.safe_load((provisioning / "dashboards" / "slogate.yml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == [_mounted("grafana", DEPLOY / "grafana" / "dashboards")]


def _exported_metric_names() -> set[str]:
    """Every series name the gateway and a worker can expose, as Prometheus will store it."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    names = set()
    for registry in (GatewayMetrics().registry, WorkerMetrics("p", "w", "e").registry):
        for family in registry.collect():
            names.update(family.name + s for s in suffixes[family.type])
    return names


def _metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects: what is left once grouping labels, label
    matchers, ranges and function calls are taken out."""
    expr = re.sub(r"\b(?:by|without)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    return {name for name, call in re.findall(r"([A-Za-z_:][\w:]*)\s*(\()?", expr) if not call}


def test_dashboard_queries_only_metrics_the_code_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "slogate.json").read_text())
    datasources = {s["uid"] for s in yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "slogate.yml").read_text())["datasources"]}
    exported = _exported_metric_names()
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] in datasources, panel["title"]
            used = _metric_names(target["expr"])
            assert used and all(m.startswith("slogate_") for m in used), (panel["title"], used)
            assert used <= exported, (panel["title"], used - exported)
            exprs.append(target["expr"])
    assert len(exprs) >= 10
    for metric in ("slogate_e2e_request_latency_seconds_bucket", "slogate_time_to_first_token_seconds_bucket",
                   "slogate_worker_step_seconds_bucket", "slogate_prefix_cache_hit_ratio",
                   "slogate_worker_time_to_first_token_seconds_bucket", "slogate_objective_requests_total"):
        assert any(metric in e for e in exprs), metric


def test_otel_collector_receives_otlp_and_exports_to_jaeger() -> None:
    config = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    protocols = config["receivers"]["otlp"]["protocols"]
    assert {p["endpoint"].rsplit(":", 1)[1] for p in protocols.values()} == {"4317", "4318"}
    traces = config["service"]["pipelines"]["traces"]
    assert set(traces["exporters"]) == {"otlp/jaeger", "debug"}
    assert config["exporters"]["otlp/jaeger"]["endpoint"].split(":")[0] in COMPOSE["services"]
    for name in ("gateway", "worker-interactive", "worker-batch"):
        endpoint = COMPOSE["services"][name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert "http://otel-collector:4318" in endpoint, name
