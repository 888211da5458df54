"""The admin port's /metrics: the names, types and labels of DESIGN.md, read by a real Prometheus.

First the exposition itself, parsed with prometheus-client's own parser
after a known mix of streams: every metric the design names is there with
its type and label names, counters carry the counts the streams produced,
and the histograms' buckets span the latencies LLM streams have. Then a real
Prometheus server (Debian's ``prometheus``) scrapes the admin port and its
query API returns exactly the end states of the streams that ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecars import StartSidecar
from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock import MockServer

FAST = {"x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "8"}
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"

# DESIGN.md "Metrics": each exposed name, its type and its label names. The
# route label is the configured route prefix ("/" when none matched).
DESIGN_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "streamwarden_streams_total": ("counter", frozenset({"dialect", "end_state", "route"})),
    "streamwarden_active_streams": ("gauge", frozenset()),
    "streamwarden_ttft_seconds": ("histogram", frozenset({"dialect"})),
    "streamwarden_inter_token_seconds": ("histogram", frozenset()),
    "streamwarden_stream_duration_seconds": ("histogram", frozenset({"dialect"})),
    "streamwarden_tokens_generated_total": ("counter", frozenset({"dialect", "source"})),
    "streamwarden_tokens_delivered_total": ("counter", frozenset({"dialect", "source"})),
    "streamwarden_zombie_tokens_total": ("counter", frozenset({"dialect", "source"})),
    "streamwarden_cancel_propagation_seconds": ("histogram", frozenset()),
    "streamwarden_keepalives_total": ("counter", frozenset()),
    "streamwarden_synthesized_errors_total": ("counter", frozenset({"code"})),
}
# Labels whose values come from a small fixed set (or the configured routes).
# source: provider, provider_partial or estimated (the token counters).
LOW_CARDINALITY_LABELS = {"dialect", "end_state", "route", "code", "le", "source"}


# -- streams -------------------------------------------------------------------


async def stream(
    url: str, path: str, headers: dict[str, str], body: dict[str, Any] | None = None
) -> bytes:
    async with aiohttp.ClientSession() as session:
        async with asyncio.timeout(10):
            sent = {"stream": True} if body is None else body
            async with session.post(url + path, headers=headers, json=sent) as r:
                assert r.status == 200
                return await r.read()


async def cancel_after_two_tokens(url: str) -> None:
    """Read until two tokens arrived from a stalled upstream, then hang up."""
    headers = {**FAST, "x-mock-fault": "stall", "x-mock-fault-after": "2"}
    async with aiohttp.ClientSession() as session:
        async with asyncio.timeout(10):
            async with session.post(url + CHAT, headers=headers, json={"stream": True}) as r:
                received = b""
                while received.count(b'"content":"') < 3:  # the role chunk + 2 tokens
                    received += await r.content.readany()
                r.close()


async def wait_finished(sidecar: Sidecar, count: int) -> None:
    async with asyncio.timeout(5):
        while len(sidecar.tracker.finished) < count or sidecar.tracker.active:
            await asyncio.sleep(0.01)


async def scrape(sidecar: Sidecar) -> tuple[str, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(sidecar.admin_url + "/metrics") as response:
            assert response.status == 200
            return response.headers["Content-Type"], await response.text()


# -- the exposition --------------------------------------------------------------


def samples_by_name(text: str) -> tuple[dict[str, str], dict[str, list[Any]]]:
    """(family name -> type, sample name -> samples) of a text exposition."""
    types: dict[str, str] = {}
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return types, samples


def bucket_bounds(samples: list[Any]) -> list[float]:
    return sorted({float(s.labels["le"]) for s in samples})


async def test_metrics_have_the_designed_names_types_labels_and_buckets(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, keepalive_interval="100ms")
    # One stream of each kind, so that every labelled metric has a child:
    # completed after a slow first token (keep-alives), truncated (an error
    # event), and cancelled by the client (cancel propagation).
    # The whole one asks for usage itself: its count is the provider's.
    asks = {"stream": True, "stream_options": {"include_usage": True}}
    await stream(sidecar.proxy_url, CHAT, {**FAST, "x-mock-ttft": "0.35"}, asks)
    await stream(sidecar.proxy_url, CHAT, {**FAST, "x-mock-fault": "truncate"})
    await cancel_after_two_tokens(sidecar.proxy_url)
    await wait_finished(sidecar, 3)

    content_type, text = await scrape(sidecar)
    # The Prometheus text format (its version follows prometheus-client's).
    assert content_type.startswith("text/plain; version=")
    types, samples = samples_by_name(text)

    # Every designed metric is there, and nothing exposed has a label that
    # could grow with traffic (a path, a model, a user).
    assert {name.removesuffix("_total") for name in DESIGN_METRICS} <= set(types)
    assert all(name.startswith("streamwarden_") for name in types)
    for sample_list in samples.values():
        for sample in sample_list:
            assert set(sample.labels) <= LOW_CARDINALITY_LABELS, sample
    for name, (kind, labels) in DESIGN_METRICS.items():
        assert types[name.removesuffix("_total")] == kind, name
        if kind == "histogram":
            assert {frozenset(s.labels) for s in samples[name + "_bucket"]} == {labels | {"le"}}
            for suffix in ("_count", "_sum"):
                assert {frozenset(s.labels) for s in samples[name + suffix]} == {labels}, name
        else:
            assert {frozenset(s.labels) for s in samples[name]} == {labels}, name

    # The counts the three streams produced.
    states = Counter(
        {s.labels["end_state"]: s.value for s in samples["streamwarden_streams_total"]}
    )
    assert states == {"completed": 1, "upstream_truncated": 1, "client_cancelled": 1}
    assert {s.labels["dialect"] for s in samples["streamwarden_streams_total"]} == {"openai-chat"}
    assert {s.labels["route"] for s in samples["streamwarden_streams_total"]} == {"/"}
    (error,) = samples["streamwarden_synthesized_errors_total"]
    assert (error.labels["code"], error.value) == ("stream_truncated", 1)
    (keepalives,) = samples["streamwarden_keepalives_total"]
    assert keepalives.value >= 2  # 350 ms of silence at a 100 ms interval
    (active,) = samples["streamwarden_active_streams"]
    assert active.value == 0
    (cancels,) = samples["streamwarden_cancel_propagation_seconds_count"]
    assert cancels.value == 1
    delivered = samples["streamwarden_tokens_delivered_total"]
    # The whole answer's count is the provider's; the cut streams' are
    # estimated: one child per source.
    assert {d.labels["source"] for d in delivered} == {"provider", "estimated"}
    total = sum(d.value for d in delivered)
    assert total == sum(r.meter.tokens_delivered for r in sidecar.tracker.finished)
    assert total >= 8 + 2  # the whole answer, and at least two tokens of each cut

    # Buckets span the latencies of LLM streams: TTFT from a warm small model
    # (10 ms) to a 100K-token prefill (60 s); inter-token gaps from batched
    # tokens (1 ms) to a long tool call (10 s).
    for name, low, high in [
        ("streamwarden_ttft_seconds", 0.01, 60.0),
        ("streamwarden_inter_token_seconds", 0.001, 10.0),
    ]:
        bounds = bucket_bounds(samples[name + "_bucket"])
        assert bounds[-1] == math.inf
        finite = bounds[:-1]
        assert finite[0] <= low and finite[-1] >= high, (name, finite)
        assert len(finite) >= 10, (name, finite)  # enough resolution for quantiles


# -- a real Prometheus ---------------------------------------------------------

PROMETHEUS = shutil.which("prometheus") or next(
    (p for p in ("/usr/bin/prometheus",) if os.access(p, os.X_OK)), None
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def query(session: aiohttp.ClientSession, base: str, promql: str) -> list[dict[str, Any]]:
    async with session.get(base + "/api/v1/query", params={"query": promql}) as response:
        body = await response.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def by_label(result: list[dict[str, Any]], *labels: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(series["metric"].get(label, "") for label in labels): float(series["value"][1])
        for series in result
    }


@pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed (Debian: apt-get install -y prometheus)"
)
async def test_prometheus_scrapes_the_end_states_of_a_known_mix_of_streams(
    mock: MockServer, start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    assert PROMETHEUS is not None
    sidecar = await start_sidecar(mock.url)
    url = sidecar.proxy_url
    await stream(url, CHAT, FAST)
    await stream(url, CHAT, FAST)
    await stream(url, MESSAGES, FAST)
    await stream(url, CHAT, {**FAST, "x-mock-fault": "truncate"})
    await stream(url, MESSAGES, {**FAST, "x-mock-fault": "truncate-mid"})
    await cancel_after_two_tokens(url)
    await wait_finished(sidecar, 6)

    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "scrape_configs:\n"
        "  - job_name: streamwarden\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{sidecar.admin_port}']\n"
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "prometheus.log"
    with log.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
        )
    try:
        async with aiohttp.ClientSession() as session:
            # Up, then the first scrape in (the target's first scrape comes
            # within one interval of the start).
            deadline = time.monotonic() + 30
            states: dict[tuple[str, ...], float] = {}
            while not states:
                if process.returncode is not None or time.monotonic() > deadline:
                    pytest.fail(f"no scrape from prometheus:\n{log.read_text(errors='replace')}")
                await asyncio.sleep(0.2)
                with contextlib.suppress(aiohttp.ClientError):
                    result = await query(
                        session, base, "sum by (end_state) (streamwarden_streams_total)"
                    )
                    states = by_label(result, "end_state")
            assert states == {
                ("completed",): 3,
                ("upstream_truncated",): 2,
                ("client_cancelled",): 1,
            }
            result = await query(
                session, base, "sum by (dialect, end_state) (streamwarden_streams_total)"
            )
            assert by_label(result, "dialect", "end_state") == {
                ("openai-chat", "completed"): 2,
                ("anthropic", "completed"): 1,
                ("openai-chat", "upstream_truncated"): 1,
                ("anthropic", "upstream_truncated"): 1,
                ("openai-chat", "client_cancelled"): 1,
            }
            result = await query(session, base, "streamwarden_synthesized_errors_total")
            assert by_label(result, "code") == {("stream_truncated",): 2}
            result = await query(session, base, "sum(streamwarden_tokens_delivered_total)")
            delivered = sum(r.meter.tokens_delivered for r in sidecar.tracker.finished)
            assert by_label(result) == {(): delivered}
            result = await query(session, base, "streamwarden_active_streams")
            assert by_label(result) == {(): 0}
            # Prometheus parsed the whole exposition without complaint.
            async with session.get(base + "/api/v1/targets") as response:
                targets = (await response.json())["data"]["activeTargets"]
            (target,) = targets
            assert (target["health"], target["lastError"]) == ("up", "")
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()


def test_no_created_series_double_the_exposition() -> None:
    from streamwarden.observation.metrics import StreamMetrics

    assert "_created" not in StreamMetrics().render().decode()
