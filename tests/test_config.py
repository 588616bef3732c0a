import asyncio
import io
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import make_app
from gateway.auth import KeyStore
from gateway.state import STATE
from slogate.cli import main
from slogate.config import ApiKeyConfig, ConfigError, load_config, redacted, served_model_id, unknown_variables


def test_defaults() -> None:
    cfg = load_config(env={})
    assert cfg.port == 8000 and cfg.max_body_bytes == 1 << 20
    assert set(cfg.pools) == {"interactive", "batch"}


def test_yaml_then_env_then_overrides(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("port: 9000\nmax_timeout_s: 5\npools:\n  fast: {engine: sim, workers: 2}\n"
                    "policies:\n  routing:\n    pools: {interactive: [fast], batch: [fast]}\n")
    cfg = load_config(path, env={"SLOGATE_MAX_TIMEOUT_S": "7.5"}, overrides={"port": 9100})
    assert cfg.port == 9100 and cfg.max_timeout_s == 7.5
    assert cfg.pools["fast"].workers == 2


@pytest.mark.parametrize("yaml_text,key", [
    ("port: eighty\n", "port"),
    ("pools:\n  a: {workers: many}\n", "pools.a.workers"),
    ("pools:\n  interactive: {engine: warp}\n", "pools.interactive.engine: unknown engine 'warp'; choose one of sim"),
    ("colour: blue\n", "colour"),
    ("heartbeat_interval_s: 5\nheartbeat_ttl_s: 2\n", "heartbeat_ttl_s"),
    ("claim_idle_s: 0\n", "claim_idle_s"),
    ("engine_stall_s: 0\n", "engine_stall_s"),
    ("engine_stall_s: 4\n", "stall_pause_s: must be below engine_stall_s"),
    ("workerless_grace_s: 0\n", "workerless_grace_s"),
    ("redis_timeout_s: 0\n", "redis_timeout_s"),
    ("redis_grace_s: -1\n", "redis_grace_s"),
    ("alive_ttl_s: 1.5\n", "alive_ttl_s: must be at least 2"),
    ("policies:\n  routing:\n    pools: {batch: [bulk]}\n", "policies.routing.pools.batch: pool 'bulk'"),
    ("policies:\n  routing:\n    interactive_spill: [nope]\n", "policies.routing.interactive_spill: pool 'nope'"),
])
def test_bad_values_name_the_key(tmp_path, yaml_text: str, key: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(path, env={})


async def test_the_gateway_waits_for_redis_as_long_as_its_settings_say(redis_url: str) -> None:
    """All were fixed: its commands' read timeout at 5 s (what a Redis that hangs costs each
    command, and a stopping gateway's exit on its last clean-ups), its result reader's grace at
    3 s (how long the waiting requests outlive a Redis it cannot read) and its alive key's TTL at
    5 s (how long the workers run a dead gateway's requests)."""
    app = make_app(load_config(env={"SLOGATE_REDIS_URL": redis_url, "SLOGATE_REDIS_TIMEOUT_S": "1.5",
                                    "SLOGATE_REDIS_GRACE_S": "2.5", "SLOGATE_ALIVE_TTL_S": "3.5"}))
    async with TestClient(TestServer(app)):
        assert app[STATE].redis.connection_pool.connection_kwargs["socket_timeout"] == 1.5
        assert app[STATE].mux.redis_grace_s == 2.5
        alive = app[STATE].mux.alive
        deadline = time.monotonic() + 5
        while (ttl := await app[STATE].redis.pttl(alive)) < 0:  # set at the reader's first tick
            assert time.monotonic() < deadline, "the alive key was never set"
            await asyncio.sleep(0.05)
        assert 2_500 < ttl <= 3_500


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="SLOGATE_PORT"):
        load_config(env={"SLOGATE_PORT": "x"})


def test_an_empty_env_var_is_unset(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("redis_url: redis://127.0.0.1:18379/0\nport: 9000\n")
    cfg = load_config(path, env={"SLOGATE_REDIS_URL": "", "SLOGATE_PORT": ""})
    assert (cfg.redis_url, cfg.port) == ("redis://127.0.0.1:18379/0", 9000)


def test_a_port_beyond_65535_is_refused() -> None:
    with pytest.raises(ConfigError, match="port: must be at most 65535"):
        load_config(env={"SLOGATE_PORT": "70000"})


def test_broken_yaml_is_one_line_naming_where(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("port: 9000\npools: [a, b\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert "\n" not in str(info.value) and "line 3" in str(info.value)


def test_passwords_are_redacted_from_urls() -> None:
    assert redacted("redis://user:s3cret@cache:6380/1") == "redis://user:***@cache:6380/1"
    assert redacted("redis://:s3cret@cache/0") == "redis://:***@cache/0"
    assert redacted("redis://cache:6379/0") == "redis://cache:6379/0"
    assert redacted("redis://cache/0?db=1&Password=s3cret&x=1") == "redis://cache/0?db=1&Password=***&x=1"
    assert redacted("unix:///run/redis.sock?password=s3cret") == "unix:///run/redis.sock?password=***"


def test_a_key_s_stream_count_outlives_the_longest_stream() -> None:
    """A request without the timeout header gets its class's deadline, which may exceed
    max_timeout_s: the count must not expire under it."""
    from gateway.completions import _longest_stream_s

    assert _longest_stream_s(load_config(env={"SLOGATE_MAX_TIMEOUT_S": "60"})) == 3600
    assert _longest_stream_s(load_config(env={"SLOGATE_MAX_TIMEOUT_S": "7200"})) == 7200


def test_slogate_variables_nothing_reads_are_named() -> None:
    env = {"SLOGATE_PORTT": "1", "SLOGATE_PORT": "9000", "SLOGATE_WORKLOAD": "w.jsonl", "OTHER": "x"}
    assert unknown_variables(env) == ["SLOGATE_PORTT"]


@pytest.mark.parametrize("name", ["max_timeout_s", "client_timeout_s", "heartbeat_ttl_s", "workerless_grace_s",
                                  "redis_timeout_s", "redis_grace_s", "alive_ttl_s"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_setting_that_is_not_a_finite_number_is_refused(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_config(None, env={f"SLOGATE_{name.upper()}": value})


def test_a_nan_setting_in_the_file_is_refused(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("max_timeout_s: .nan\n")
    with pytest.raises(ConfigError, match="max_timeout_s"):
        load_config(path, env={})


@pytest.mark.parametrize("section", ["rate_limits: {per_key: {paymnets: {rpm: 6000}}}",
                                     "classification: {key_classes: {paymnets: interactive}}"])
def test_a_policy_for_a_key_id_no_api_key_has_is_refused(section: str, tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("api_keys: [{id: payments, sha256: " + "ab" * 32 + "}]\npolicies: {" + section + "}\n")
    with pytest.raises(ConfigError, match="paymnets"):
        load_config(path, env={})
    path.write_text("api_keys: [{id: payments, sha256: " + "ab" * 32 + "}]\npolicies: {"
                    + section.replace("paymnets", "payments") + "}\n")
    load_config(path, env={})


@pytest.mark.parametrize("typed", ["sk-abc\r\n", "sk-abc \n", " sk-abc\n"])
def test_a_key_hashed_from_stdin_authenticates(typed: str, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(typed))
    main(["hash-key"])
    digest = capsys.readouterr().out.strip()
    assert KeyStore([ApiKeyConfig("ops", digest)]).authenticate("Bearer sk-abc").key_id == "ops"


def test_an_empty_key_is_not_hashed(monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(" \n"))
    with pytest.raises(SystemExit):
        main(["hash-key"])
    assert "the key is empty" in capsys.readouterr().err


def test_a_non_finite_policy_setting_is_refused(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("policies:\n  objectives:\n    batch:\n      deadline_s: .inf\n")
    with pytest.raises(ConfigError, match="deadline_s"):
        load_config(path, env={})


def test_a_model_directory_is_served_under_its_name_and_a_hub_id_as_given(tmp_path, monkeypatch) -> None:
    (tmp_path / "models" / "my-llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert served_model_id(str(tmp_path / "models" / "my-llama")) == "my-llama"
    assert served_model_id("models/my-llama/") == "my-llama"
    monkeypatch.chdir(tmp_path / "models" / "my-llama")
    assert served_model_id(".") == "my-llama"
    assert served_model_id("..") == "models"
    assert served_model_id("/models/not-on-this-host") == "not-on-this-host"
    assert served_model_id("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
