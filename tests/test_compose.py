"""Docker cannot run here, so compose.yaml is kept right by checking it against the CLI."""

from pathlib import Path

import pytest
import yaml

from slogate.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_every_service_has_a_healthcheck_or_runs_once() -> None:
    for name, svc in COMPOSE["services"].items():
        assert "healthcheck" in svc or name == "model", name


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


def test_workers_depend_on_healthy_redis() -> None:
    for name, svc in COMPOSE["services"].items():
        if name.startswith(("worker", "gateway")):
            assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
            assert svc["environment"]["SLOGATE_REDIS_URL"].startswith("redis://redis:")
