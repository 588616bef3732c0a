from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from policies.config import PolicyConfig, PolicyConfigError, load

DEFAULT_YAML = Path(__file__).parents[2] / "policies" / "default.yaml"


def test_empty_config_is_the_documented_default() -> None:
    assert load(None) == load({}) == PolicyConfig()
    assert load(yaml.safe_load(DEFAULT_YAML.read_text())) == PolicyConfig()


def test_defaults_carry_the_objectives() -> None:
    cfg = load({})
    assert cfg.objectives.interactive.e2e_p99_s == 0.150
    assert cfg.objectives.interactive.ttft_p99_s == 0.150
    assert cfg.objectives.batch.max_queue == 1000
    assert (cfg.routing.pools["interactive"], cfg.routing.pools["batch"]) == (["interactive"], ["batch"])


def test_partial_sections_keep_other_defaults() -> None:
    cfg = load({"admission": {"margin": 1.5}, "classification": {"key_classes": {"risk": "interactive"}}})
    assert cfg.admission.margin == 1.5
    assert cfg.admission.feedback.samples == 200
    assert cfg.classification.key_classes == {"risk": "interactive"}
    assert cfg.classification.heuristics.interactive_max_tokens == 64


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"admission": {"margin": 0.9}}, "policies.admission.margin"),
        ({"admission": {"margin": "lots"}}, "policies.admission.margin"),
        ({"objectives": {"interactive": {"e2e_p99_s": 0}}}, "policies.objectives.interactive.e2e_p99_s"),
        ({"circuit": {"opne_s": 3}}, "opne_s"),
        ({"classification": {"default_class": "urgent"}}, "policies.classification.default_class"),
        ({"classification": {"key_classes": {"k": "urgent"}}}, "policies.classification.key_classes"),
        ({"classification": {"heuristics": {"interactive_max_tokens": 2048}}}, "interactive_max_tokens"),
        ({"routing": {"pools": {"batch": []}}}, "policies.routing.pools.batch"),
        ({"admission": {"feedback": {"min_factor": 1.5}}}, "min_factor"),
        ({"circuit": {"min_calls": 50, "window": 20}}, "min_calls"),
        ({"rate_limits": {"per_key": {"k": {"rpm": -1}}}}, "policies.rate_limits.per_key"),
    ],
)
def test_bad_values_name_the_key(data: dict, names: str) -> None:
    with pytest.raises(PolicyConfigError, match=names.replace(".", r"\.")):
        load(data)


def test_a_section_that_is_not_a_mapping_is_named() -> None:
    with pytest.raises(PolicyConfigError, match=r"^policies: Expected `object`, got `array`"):
        load([1, 2])  # type: ignore[arg-type]


def test_root_name_follows_the_callers_file() -> None:
    with pytest.raises(PolicyConfigError, match=r"^slo\.admission\.margin"):
        load({"admission": {"margin": 0}}, root="slo")


def test_pools_default_per_class() -> None:
    pools = load({"routing": {"pools": {"batch": ["paged-a", "paged-b"]}}}).routing.pools
    assert pools["batch"] == ["paged-a", "paged-b"]
    assert pools["interactive"] == ["interactive"]


def test_rate_limits_per_key_override_only_what_they_set() -> None:
    limits = load({"rate_limits": {"rpm": 100, "tpm": 5000, "per_key": {"big": {"tpm": 0}}}}).rate_limits
    assert limits.for_key("big") == (100, 0)
    assert limits.for_key("other") == (100, 5000)
