"""The example configs in configs/: valid, commented, and right for streams.

Each streamwarden config passes ``streamwarden check-config``; the nginx file
passes a real ``nginx -t`` and carries a real stream, token by token, from
the mock through the sidecar and nginx to the client, where nginx's defaults
deliver it in one lump. The timeouts of every hop in front (nginx,
ingress-nginx, Envoy) are checked against the silences streamwarden lets
through, so that changing one without the other fails here.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from locations import REPO
from lockstep import Lockstep, lines_in_lockstep
from nginx import free_port, needs_nginx, nginx_prefix, nginx_test, running_nginx
from sidecars import StartSidecar
from streamwarden.config import Settings, load_settings, parse_duration, parse_size
from streamwarden.core.relay import KEEPALIVE
from streamwarden.tools.mock import MockServer
from waiting import wait_for

CONFIGS = REPO / "configs"
# Files in configs/ that are not streamwarden configs.
NOT_STREAMWARDEN = {"prometheus-rules.yaml"}
NGINX_SITE = CONFIGS / "nginx" / "streamwarden.conf"
INGRESS = CONFIGS / "ingress-nginx" / "ingress.yaml"
ENVOY = CONFIGS / "envoy" / "envoy.yaml"
# The configs whose sidecar the nginx / ingress / Envoy hops sit in front of.
INGRESS_PLACEMENT = ("sidecar-in-front-of-app.yaml", "per-route.yaml")
# Streams framed by lines, where no keep-alive comment can be injected: the
# longest silence a hop sees on them is upstream_idle_timeout. A route left
# on "auto" may turn out to be one of them.
LINE_FRAMED = {"ndjson", "vercel-ai", "auto"}


def streamwarden_configs() -> list[Path]:
    return sorted(p for p in CONFIGS.glob("*.yaml") if p.name not in NOT_STREAMWARDEN)


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    # Without the caller's STREAMWARDEN_* variables, which check-config reads too.
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_")}
    return subprocess.run(
        [sys.executable, "-m", "streamwarden.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


# -- the streamwarden configs --------------------------------------------------


def test_the_promised_examples_exist() -> None:
    names = {p.name for p in streamwarden_configs()}
    assert {
        "sidecar-in-front-of-app.yaml",
        "sidecar-in-front-of-provider.yaml",
        "per-route.yaml",
    } <= names


@pytest.mark.parametrize("path", streamwarden_configs(), ids=lambda p: p.name)
def test_each_example_passes_check_config(path: Path) -> None:
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{path}: ok"
    assert result.stderr == ""


def test_check_config_would_catch_a_typo_in_an_example(tmp_path: Path) -> None:
    """The check above can fail: one misspelt key is exit 2 and one line naming it."""
    text = (CONFIGS / "sidecar-in-front-of-app.yaml").read_text()
    assert "\nkeepalive_interval:" in text
    broken = tmp_path / "typo.yaml"
    broken.write_text(text.replace("\nkeepalive_interval:", "\nkeepalive_intervall:"))
    result = check_config(broken)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert 'unknown key "keepalive_intervall"' in result.stderr
    assert 'did you mean "keepalive_interval"' in result.stderr


def test_the_provider_example_is_egress_over_https() -> None:
    path = CONFIGS / "sidecar-in-front-of-provider.yaml"
    settings = load_settings(path, environ={})
    assert settings.upstream is not None and settings.upstream.startswith("https://")
    assert settings.preserve_host is False
    assert settings.listen.startswith("127.0.0.1:")  # only the app in the pod
    assert settings.early_headers_after == 0  # SDK retries need real statuses
    # The CA bundle is there to uncomment, not set (its file would not exist).
    assert settings.upstream_ca_bundle is None
    assert re.search(r"^# upstream_ca_bundle: /\S+\.pem$", path.read_text(), re.MULTILINE)


def test_the_per_route_example_sets_a_dialect_and_timeouts_per_prefix() -> None:
    settings = load_settings(CONFIGS / "per-route.yaml", environ={})
    assert len(settings.routes) >= 3
    for prefix, route in settings.routes.items():
        assert prefix.startswith("/")
        assert route.dialect not in (None, "auto"), prefix
    chat = settings.for_path("/v1/chat/completions")
    reasoning = settings.for_path("/v1/responses")
    assert (chat.dialect, reasoning.dialect) == ("openai-chat", "openai-responses")
    assert reasoning.limits.upstream_idle_timeout > chat.limits.upstream_idle_timeout
    assert settings.for_path("/healthz").route == "/"  # unmatched: top-level values


def paragraphs(text: str) -> list[list[str]]:
    found: list[list[str]] = []
    for is_blank, group in itertools.groupby(text.splitlines(), lambda line: not line.strip()):
        if not is_blank:
            found.append([line.strip() for line in group])
    return found


@pytest.mark.parametrize(
    "path", [*streamwarden_configs(), NGINX_SITE], ids=lambda p: p.relative_to(CONFIGS).name
)
def test_every_setting_comes_with_its_reason(path: Path) -> None:
    """Each paragraph that sets something starts with a comment (block braces aside)."""
    for paragraph in paragraphs(path.read_text()):
        body = list(itertools.dropwhile(lambda line: line.endswith(("{", "}")), paragraph))
        if any(not line.startswith("#") for line in body):
            assert body[0].startswith("#"), "\n".join(paragraph)


def test_the_readme_indexes_every_file() -> None:
    readme = (CONFIGS / "README.md").read_text()
    files = [p for p in CONFIGS.rglob("*") if p.is_file() and p.name != "README.md"]
    assert len(files) >= 7
    for path in files:
        assert f"]({path.relative_to(CONFIGS).as_posix()})" in readme, path


# -- the hops in front: their timeouts against streamwarden's ------------------


def longest_silences() -> tuple[float, float, float]:
    """The longest silences a hop in front of the example sidecars must sit through.

    (on event streams, on line-framed streams, before the response headers)
    """
    event, lines, headers = 0.0, 0.0, 0.0
    for name in INGRESS_PLACEMENT:
        settings = load_settings(CONFIGS / name, environ={})
        for prefix in ["/", *settings.routes]:
            route = settings.for_path(prefix)
            event = max(event, route.limits.keepalive_interval)
            if route.dialect in LINE_FRAMED:
                lines = max(lines, route.limits.upstream_idle_timeout)
            headers = max(headers, route.early_headers_after)
    return event, lines, headers


def largest_body() -> int:
    return max(
        load_settings(CONFIGS / name, environ={}).max_request_body_bytes
        for name in INGRESS_PLACEMENT
    )


def nginx_directive(text: str, name: str) -> str:
    (value,) = re.findall(rf"^\s*{name}\s+([^;]+);", text, re.MULTILINE)
    return value.strip()


def test_nginx_waits_longer_than_any_silence_streamwarden_lets_through() -> None:
    text = NGINX_SITE.read_text()
    event, lines, headers = longest_silences()
    read_timeout = parse_duration(nginx_directive(text, "proxy_read_timeout"))
    assert read_timeout > max(event, lines, headers)
    # ... and longer than the defaults, for a sidecar configured with none.
    assert read_timeout > max(Settings().keepalive_interval, Settings().upstream_idle_timeout)
    assert parse_size(nginx_directive(text, "client_max_body_size")) >= largest_body()
    for directive, value in [
        ("proxy_buffering", "off"),
        ("proxy_cache", "off"),
        ("proxy_http_version", "1.1"),
        ("chunked_transfer_encoding", "on"),
        ("gzip", "off"),
    ]:
        assert nginx_directive(text, directive) == value


def test_ingress_nginx_annotations_match_the_nginx_settings() -> None:
    ingress = yaml.safe_load(INGRESS.read_text())
    assert ingress["apiVersion"] == "networking.k8s.io/v1"
    assert ingress["kind"] == "Ingress"
    prefix = "nginx.ingress.kubernetes.io/"
    annotations = {
        key.removeprefix(prefix): value
        for key, value in ingress["metadata"]["annotations"].items()
        if key.startswith(prefix)
    }
    # Annotation values must be strings: Kubernetes rejects a bare number or bool.
    assert all(isinstance(value, str) for value in annotations.values())
    assert annotations["proxy-buffering"] == "off"
    assert annotations["proxy-request-buffering"] == "off"
    assert annotations["proxy-http-version"] == "1.1"
    event, lines, headers = longest_silences()
    assert parse_duration(annotations["proxy-read-timeout"]) > max(event, lines, headers)
    assert parse_size(annotations["proxy-body-size"]) >= largest_body()
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"].endswith("-streamwarden")  # the chart's Service, not the app
    assert backend["port"] == {"name": "http"}


def test_envoy_never_times_out_a_whole_stream_and_outwaits_its_silences() -> None:
    bootstrap = yaml.safe_load(ENVOY.read_text())
    (listener,) = bootstrap["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (manager,) = chain["filters"]
    config = manager["typed_config"]
    assert config["@type"].endswith("HttpConnectionManager")
    event, lines, headers = longest_silences()
    silence = max(event, lines, headers)
    assert parse_duration(config["stream_idle_timeout"]) > silence
    routes = [r for vhost in config["route_config"]["virtual_hosts"] for r in vhost["routes"]]
    assert routes
    for entry in routes:
        route = entry["route"]
        # Envoy's default route timeout (15s) bounds the WHOLE response.
        assert parse_duration(route["timeout"]) == 0
        assert parse_duration(route["idle_timeout"]) > silence
        assert route["retry_policy"]["num_retries"] == 0
        assert route["cluster"] == "streamwarden"
    assert {"upgrade_type": "websocket"} in config["upgrade_configs"]
    filters = [f["name"] for f in config["http_filters"]]
    assert filters[-1] == "envoy.filters.http.router"
    assert not any("compressor" in name or "buffer" in name for name in filters)
    (cluster,) = bootstrap["static_resources"]["clusters"]
    assert cluster["name"] == "streamwarden"
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"]["port_value"] == 8080  # the proxy port


# -- a real nginx --------------------------------------------------------------


@needs_nginx
def test_nginx_accepts_the_snippet(tmp_path: Path) -> None:
    result = nginx_test(nginx_prefix(tmp_path, NGINX_SITE.read_text()))
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


@needs_nginx
def test_nginx_t_would_catch_a_mistake_in_the_snippet(tmp_path: Path) -> None:
    broken = NGINX_SITE.read_text().replace("proxy_buffering off;", "proxy_bufering off;")
    result = nginx_test(nginx_prefix(tmp_path, broken))
    assert result.returncode != 0
    assert 'unknown directive "proxy_bufering"' in result.stderr


def site_in_front_of(upstream_port: int, listen_port: int, **directives: str) -> str:
    """The snippet with its two addresses (and ``directives``) replaced for a test."""
    text = NGINX_SITE.read_text()
    replacements = {
        "server 127.0.0.1:8080;": f"server 127.0.0.1:{upstream_port};",
        "listen 80;": f"listen 127.0.0.1:{listen_port};",
    }
    for name, value in directives.items():
        replacements[f"{name} {nginx_directive(text, name)};"] = f"{name} {value};"
    for old, new in replacements.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def naive_site(upstream_port: int, listen_port: int, **directives: str) -> str:
    """What people write first: proxy_pass and nginx's defaults for everything else."""
    extra = "".join(f"        {name} {value};\n" for name, value in directives.items())
    return (
        "server {\n"
        f"    listen 127.0.0.1:{listen_port};\n"
        "    location / {\n"
        f"        proxy_pass http://127.0.0.1:{upstream_port};\n"
        f"{extra}"
        "    }\n"
        "}\n"
    )


TRICKLE = {"x-mock-tps": "20", "x-mock-ttft": "0", "x-mock-tokens": "10"}
# A chunk carrying a token (the first chunk's empty "content" carries none).
TOKEN = re.compile(rb'"content":"[^"]')


async def completed_at_first_token(url: str, mock: MockServer, request_id: str) -> tuple[int, bool]:
    """Read a stream: its tokens, and whether the mock had finished it when the first arrived."""
    headers = {**TRICKLE, "x-mock-request-id": request_id}
    tokens, completed_at_first = 0, False
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        async with session.post(
            url + "/v1/chat/completions", headers=headers, json={"stream": True}
        ) as response:
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: {") and TOKEN.search(line):
                    if tokens == 0:
                        record = mock.stats.get(request_id)
                        completed_at_first = record is not None and record.completed
                    tokens += 1
    return tokens, completed_at_first


@needs_nginx
async def test_tokens_arrive_one_by_one_through_nginx_and_the_sidecar(
    mock: MockServer, start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    # The problem: nginx's defaults buffer the stream, and the client gets
    # its first token only once the upstream has written its last.
    port = free_port()
    async with running_nginx(tmp_path / "naive", naive_site(mock.port, port), port) as url:
        tokens, completed = await completed_at_first_token(url, mock, "naive")
    assert tokens == 10 and completed
    # Through the snippet and the sidecar, from an upstream in lockstep with
    # the client (each token written once the one before arrived): one held
    # back anywhere on the way, and the next is never written.
    async with Lockstep(tokens=10) as upstream:
        sidecar = await start_sidecar(upstream.url)
        port = free_port()
        site = site_in_front_of(sidecar.proxy_port, port)
        async with (
            running_nginx(tmp_path / "snippet", site, port) as url,
            aiohttp.ClientSession() as session,
            asyncio.timeout(10),
            session.post(url + "/v1/chat/completions", json={"stream": True}) as response,
        ):
            lines = await lines_in_lockstep(response.content, upstream)
    assert sum(b'"content":"t' in line for line in lines) == 10
    await wait_for(lambda: bool(sidecar.tracker.finished), what="the stream's end")
    (record,) = sidecar.tracker.finished
    assert record.meter.end_state == "completed"
    assert record.meter.tokens_delivered == 10


async def read_until(
    url: str, headers: dict[str, str], keepalives: int | None = None
) -> tuple[bytes, bool]:
    """The body, read to its end or until ``keepalives`` keep-alives; whether it was still open."""
    body = b""
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        async with session.post(
            url + "/v1/chat/completions", headers=headers, json={"stream": True}
        ) as response:
            assert response.status == 200
            try:
                async for chunk in response.content.iter_any():
                    body += chunk
                    if keepalives is not None and body.count(KEEPALIVE) >= keepalives:
                        return body, True
            except aiohttp.ClientPayloadError:
                pass  # nginx gave up on the upstream mid-response
    return body, False


@needs_nginx
async def test_keepalives_hold_a_silent_stream_open_past_nginx_read_timeout(
    mock: MockServer, start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    """proxy_read_timeout above keepalive_interval is what keeps a thinking model's stream."""
    stall = {**TRICKLE, "x-mock-tps": "0", "x-mock-fault": "stall", "x-mock-fault-after": "2"}
    # The problem: nginx ends a stream silent for proxy_read_timeout (1s
    # here). The upstream is silent for ever after 2 tokens: nothing else ends it.
    port = free_port()
    site = naive_site(mock.port, port, proxy_buffering="off", proxy_read_timeout="1s")
    async with running_nginx(tmp_path / "naive", site, port) as url:
        body, still_open = await read_until(url, {**stall, "x-mock-request-id": "cut"})
    assert not still_open
    assert len(TOKEN.findall(body)) == 2 and b"[DONE]" not in body
    # nginx closed the upstream in its silence, after its timer ran (a lower
    # bound: nginx's cached clock cuts a 1 s timeout after 0.9 s).
    cut = await mock.stats.wait_ended("cut")
    assert cut.closed_early and cut.closed_at is not None
    assert cut.closed_at - cut.started_at >= 0.8
    # Through the sidecar (keep-alive every 300 ms), the same nginx timeout
    # never fires: the stream is still open after 4 keep-alives, that is
    # 1.2 s or more after the upstream's last byte (a timer never fires early).
    sidecar = await start_sidecar(mock.url, keepalive_interval="300ms")
    port = free_port()
    site = site_in_front_of(sidecar.proxy_port, port, proxy_read_timeout="1s")
    async with running_nginx(tmp_path / "snippet", site, port) as url:
        body, still_open = await read_until(url, stall, keepalives=4)
        # The client left: nginx closes the sidecar's side, which ends the stream.
        await wait_for(lambda: bool(sidecar.tracker.finished), what="the stream's end")
    assert still_open
    assert len(TOKEN.findall(body)) == 2
    (record,) = sidecar.tracker.finished
    assert record.meter.end_state == "client_cancelled"
