"""The config model: precedence, parsing, per-route overrides, one-line errors, the CLI's exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamwarden.config import (
    ConfigError,
    Settings,
    load_settings,
    parse_duration,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("15s", 15.0),
        ("250ms", 0.25),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("1.5s", 1.5),
        (3, 3.0),
        ("10", 10.0),
        (0.5, 0.5),
    ],
)
def test_durations_parse(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("64KiB", 65536),
        ("1MiB", 1 << 20),
        ("1GiB", 1 << 30),
        ("8MiB", 8 << 20),
        (100, 100),
        ("1kB", 1000),
        ("512", 512),
    ],
)
def test_sizes_parse(text: object, size: int) -> None:
    assert parse_size(text) == size


def test_defaults_match_the_design() -> None:
    s = Settings()
    assert s.listen == "0.0.0.0:8080"
    assert s.admin_listen == "0.0.0.0:9090"
    assert s.keepalive_interval == 15.0
    assert s.upstream_connect_timeout == 10.0
    assert s.upstream_idle_timeout == 60.0
    assert s.max_stream_duration == 1800.0
    assert s.client_write_timeout == 30.0
    assert s.max_event_bytes == 8 << 20
    assert s.max_request_body_bytes == 64 << 20
    assert s.max_concurrent_streams == 0
    assert s.drain_timeout == 25.0
    assert s.dialect == "auto"
    assert s.log_format == "json"
    assert s.log_level == "info"


def test_flags_beat_environment_beat_file(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("keepalive_interval: 5s\nupstream_idle_timeout: 30s\ndrain_timeout: 10s\n")
    env = {"STREAMWARDEN_UPSTREAM_IDLE_TIMEOUT": "20s", "STREAMWARDEN_DRAIN_TIMEOUT": "9s"}
    s = load_settings(config, environ=env, overrides={"drain_timeout": "8s"})
    assert s.keepalive_interval == 5.0  # file
    assert s.upstream_idle_timeout == 20.0  # environment over file
    assert s.drain_timeout == 8.0  # flag over both


def test_a_bare_off_in_the_file_is_the_word_not_yaml_false(tmp_path: Path) -> None:
    # PyYAML reads YAML 1.1, where a bare `off` is false: a user who wrote
    # the key's own value must get it, at the top and in a route.
    config = tmp_path / "c.yaml"
    config.write_text("usage_injection: off\nroutes:\n  /v1:\n    usage_injection: off\n")
    s = load_settings(config, environ={}, overrides={"usage_injection": "auto"})
    assert s.usage_injection == "auto"  # the flag
    s = load_settings(config, environ={})
    assert s.usage_injection == "off"
    assert s.for_path("/v1/chat/completions").usage_injection == "off"


def test_config_file_from_environment(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("upstream: http://127.0.0.1:9\n")
    s = load_settings(environ={"STREAMWARDEN_CONFIG": str(config)})
    assert s.upstream == "http://127.0.0.1:9"


def test_routes_override_per_prefix_longest_wins() -> None:
    s = load_settings(
        environ={},
        overrides={
            "keepalive_interval": "15s",
            "routes": {
                "/v1": {"keepalive_interval": "5s"},
                "/v1/messages": {"keepalive_interval": "1s", "dialect": "anthropic"},
            },
        },
    )
    assert s.for_path("/v1/messages").limits.keepalive_interval == 1.0
    assert s.for_path("/v1/messages").dialect == "anthropic"
    assert s.for_path("/v1/messages").route == "/v1/messages"
    assert s.for_path("/v1/chat/completions").limits.keepalive_interval == 5.0
    assert s.for_path("/v1/chat/completions").dialect == "auto"
    assert s.for_path("/health").limits.keepalive_interval == 15.0
    assert s.for_path("/health").route == "/"


def test_a_route_sets_its_own_tool_arguments_depth() -> None:
    assert load_settings(environ={}).for_path("/x").limits.max_tool_arguments_depth == 128
    s = load_settings(
        environ={"STREAMWARDEN_MAX_TOOL_ARGUMENTS_DEPTH": "64"},
        overrides={"routes": {"/deep": {"max_tool_arguments_depth": 300}}},
    )
    assert s.for_path("/deep/v1/chat/completions").limits.max_tool_arguments_depth == 300
    assert s.for_path("/v1/chat/completions").limits.max_tool_arguments_depth == 64


def test_routes_from_environment_as_yaml() -> None:
    s = load_settings(environ={"STREAMWARDEN_ROUTES": "{/v1: {dialect: openai-chat}}"})
    assert s.for_path("/v1/x").dialect == "openai-chat"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"keepalive_interval": "fast"},
            'keepalive_interval: "fast" is not a duration (e.g. 15s, 250ms, 2m)',
        ),
        ({"max_event_bytes": "huge"}, 'max_event_bytes: "huge" is not a size (e.g. 64KiB'),
        ({"listen": "8080"}, 'listen: "8080" is not HOST:PORT'),
        ({"upstream": "ftp://x"}, 'upstream: "ftp://x" is not an upstream URL'),
        ({"dialect": "klingon"}, 'dialect: "klingon" is not one of'),
        ({"max_concurrent_streams": "many"}, 'max_concurrent_streams: "many" is not an integer'),
        ({"max_concurrent_streams": -1}, "max_concurrent_streams: -1 must be at least 0"),
        # An open tool call alone counts 256 bytes: less than 1KiB fails every call.
        (
            {"max_tool_arguments_bytes": 0},
            "max_tool_arguments_bytes: 0 must be a size of at least 1KiB",
        ),
        (
            {"routes": {"/v1": {"max_tool_arguments_bytes": "512"}}},
            'routes./v1.max_tool_arguments_bytes: "512" must be a size of at least 1KiB',
        ),
        # A Gemini part's streamed arguments sit two levels down; past 512, json
        # itself (which recurses) is too near its limit to parse or write them.
        ({"max_tool_arguments_depth": 8}, "max_tool_arguments_depth: 8 must be at least 16"),
        (
            {"routes": {"/v1": {"max_tool_arguments_depth": 1000}}},
            "routes./v1.max_tool_arguments_depth: 1000 must be at most 512",
        ),
        (
            {"keepalive": "1s"},
            'keepalive: unknown key "keepalive" (did you mean "keepalive_interval"?)',
        ),
        ({"routes": {"/v1": {"dialekt": "x"}}}, 'unknown key "dialekt" (did you mean "dialect"?)'),
        (
            {"routes": {"/v1": {"keepalive_interval": "soon"}}},
            'routes./v1.keepalive_interval: "soon" is not a duration',
        ),
        ({"log_format": "xml"}, 'log_format: "xml" is not one of'),
        ({"event_loop": "fast"}, 'event_loop: "fast" is not one of'),
        (
            {"upstream_ca_bundle": "/nonexistent/ca.pem"},
            'upstream_ca_bundle: "/nonexistent/ca.pem" is not a readable file',
        ),
    ],
)
def test_bad_values_get_one_clear_line(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(environ={}, overrides=overrides)
    text = str(caught.value)
    assert message in text
    assert "\n" not in text


def test_unknown_environment_variable_is_an_error_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match='did you mean "STREAMWARDEN_KEEPALIVE_INTERVAL"'):
        load_settings(environ={"STREAMWARDEN_KEEPALIVE_INTERVALL": "1s"})


def test_bad_yaml_and_missing_file_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("keepalive_interval: [1\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_settings(bad, environ={})
    with pytest.raises(ConfigError, match="config file"):
        load_settings(tmp_path / "missing.yaml", environ={})
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_settings(listed, environ={})


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamwarden.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


def test_check_config_accepts_a_good_file_and_rejects_a_bad_one(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("upstream: http://127.0.0.1:8000\nkeepalive_interval: 10s\n")
    ok = run_cli("check-config", str(good))
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("keepalive_interval: fast\n")
    result = run_cli("check-config", str(bad))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        'streamwarden: error: keepalive_interval: "fast" is not a duration (e.g. 15s, 250ms, 2m)'
    ]


def test_a_tool_argument_limit_under_1kib_exits_2_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "tools.yaml"
    config.write_text("upstream: http://127.0.0.1:8000\nmax_tool_arguments_bytes: 0\n")
    result = run_cli("check-config", str(config))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "max_tool_arguments_bytes" in line and "at least 1KiB" in line, line


def test_bad_flag_exits_2_with_one_line() -> None:
    result = run_cli("run", "--no-such-flag")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1


def test_run_without_upstream_exits_2() -> None:
    result = run_cli("run", "--listen", "127.0.0.1:0", env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert "upstream: required" in result.stderr


def test_kubernetes_service_link_variables_are_not_settings() -> None:
    environ = {
        "STREAMWARDEN_PORT": "tcp://10.0.0.1:8080",
        "STREAMWARDEN_PORT_8080_TCP": "tcp://10.0.0.1:8080",
        "STREAMWARDEN_PORT_8080_TCP_ADDR": "10.0.0.1",
        "STREAMWARDEN_SERVICE_HOST": "10.0.0.1",
        "STREAMWARDEN_SERVICE_PORT_HTTP": "8080",
        "STREAMWARDEN_METRICS_SERVICE_PORT": "9090",
        "STREAMWARDEN_KEEPALIVE_INTERVAL": "5s",
    }
    assert load_settings(environ=environ).keepalive_interval == 5.0


def test_the_variable_that_asks_for_the_sources_is_not_a_setting() -> None:
    # STREAMWARDEN_PURE_PYTHON is read by streamwarden._native, at build and
    # at import time; refusing it as an unknown setting would stop every run.
    environ = {"STREAMWARDEN_PURE_PYTHON": "1", "STREAMWARDEN_KEEPALIVE_INTERVAL": "5s"}
    assert load_settings(environ=environ).keepalive_interval == 5.0
    result = run_cli("run", "--listen", "127.0.0.1:0", env={**environ, "PATH": "/usr/bin:/bin"})
    assert "upstream: required" in result.stderr, result.stderr  # past the environment


def test_busy_port_is_one_line_and_exit_2() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli(
            "run",
            "--upstream",
            "http://127.0.0.1:1",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            f"127.0.0.1:{port}",
        )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_listen_address_without_a_host_means_every_interface() -> None:
    assert load_settings(environ={}, overrides={"listen": ":8080"}).listen == "0.0.0.0:8080"


def test_any_key_is_reachable_from_the_command_line_with_set() -> None:
    from streamwarden.cli import _assignments

    overrides = _assignments(
        ["max_concurrent_streams=500", "on_client_gone=detach", "stream_media_types=[a/b]"]
    )
    settings = load_settings(environ={}, overrides=overrides)
    assert settings.max_concurrent_streams == 500
    assert settings.on_client_gone == "detach"
    assert settings.stream_media_types == ("a/b",)


def test_help_that_teaches() -> None:
    run = [sys.executable, "-m", "streamwarden.cli"]
    bare = subprocess.run(run, capture_output=True, text=True, timeout=30)
    assert bare.returncode == 2
    for command in ("run", "demo", "mock-upstream", "check-config"):
        assert command in bare.stderr
    wide = {**os.environ, "COLUMNS": "200"}  # argparse wraps at hyphens otherwise
    helped = subprocess.run(
        [*run, "run", "--help"], capture_output=True, text=True, timeout=30, env=wide
    )
    text = " ".join(helped.stdout.split())
    assert "(default: 0.0.0.0:8080; env STREAMWARDEN_LISTEN)" in text
    assert "one of auto, openai-chat, openai-responses, anthropic" in text
    assert "--set KEY=VALUE" in text and "STREAMWARDEN_<KEY>" in text


def test_check_config_reports_every_problem_in_one_run(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "upstream: http://127.0.0.1:8000\n"
        "keepalive_interval: fast\n"
        "max_evnt_bytes: 1MiB\n"
        "routes:\n  /v1/chat:\n    upstream: http://other:1\n"
    )
    checked = subprocess.run(
        [sys.executable, "-m", "streamwarden.cli", "check-config", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert checked.returncode == 2
    lines = checked.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert any('keepalive_interval: "fast" is not a duration' in line for line in lines)
    assert any('did you mean "max_event_bytes"' in line for line in lines)
    assert any('"upstream" cannot be set per route' in line for line in lines)


def test_a_key_given_twice_is_refused_not_silently_overwritten(tmp_path: Path) -> None:
    twice = tmp_path / "twice.yaml"
    twice.write_text("listen: 0.0.0.0:1\nlisten: 0.0.0.0:2\n")
    with pytest.raises(ConfigError, match='line 2: "listen" is given twice'):
        load_settings(twice, environ={})


def test_check_config_says_what_run_still_needs(tmp_path: Path) -> None:
    partial = tmp_path / "partial.yaml"
    partial.write_text("keepalive_interval: 5s\n")
    checked = subprocess.run(
        [sys.executable, "-m", "streamwarden.cli", "check-config", str(partial)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert checked.returncode == 0
    assert "ok, but streamwarden run also needs upstream" in checked.stdout


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"upstream": "ftp://user:hunter2-secret@llm.internal/v1?key=sk-live-123"},
            'upstream: "ftp://llm.internal/v1" is not an upstream URL',
        ),
        (
            {"resume_store": "mongodb://:hunter2-secret@cache:6379/0?key=sk-live-123"},
            'resume_store: "mongodb://cache:6379/0" is not a resume store',
        ),
        (
            {"engine_metrics_url": "ftp://u:hunter2-secret@vllm:8000/metrics?key=sk-live-123"},
            'engine_metrics_url: "ftp://vllm:8000/metrics" is not an http(s) URL',
        ),
        (
            {"resume_secret": "hunter2-secret"},
            "resume_secret: (the value given) must be at least 32",
        ),
    ],
)
def test_a_bad_value_that_holds_a_secret_is_told_without_it(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(environ={}, overrides=overrides)
    text = str(caught.value)
    assert message in text
    assert "hunter2" not in text and "sk-live" not in text


@pytest.mark.parametrize(
    ("value", "networks"),
    [
        ("[]", ()),  # as the file writes it, and as run --help shows the default
        ("", ()),
        ("10.0.0.0/8, ::1", ("10.0.0.0/8", "::1/128")),
        ("[10.0.0.0/8, 127.0.0.1]", ("10.0.0.0/8", "127.0.0.1/32")),
    ],
)
def test_trusted_proxies_from_the_environment_as_a_list_or_a_string(
    value: str, networks: tuple[str, ...]
) -> None:
    environ = {"STREAMWARDEN_TRUSTED_PROXIES": value}
    assert load_settings(environ=environ).trusted_proxies == networks
