"""OpenTelemetry through the sidecar: spans and GenAI metrics, as a real OTLP receiver decodes them.

The receiver is an aiohttp server on loopback that decodes the exporter's
real OTLP/HTTP requests with ``opentelemetry-proto``. The client sends a
``traceparent``; each request must become a server span under it and a
client span for the upstream call, whose context the upstream receives.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

pytest.importorskip("opentelemetry.sdk")

from otlp_receiver import TRACE_ID, Receiver, attributes, servers
from sidecars import StartSidecar
from streamwarden.tools.mock import MockServer
from upstreams import ServeUpstream
from waiting import wait_for

CHAT = "/v1/chat/completions"
PARENT = "00f067aa0ba902b7"
FAST = {"x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "8"}


@pytest.fixture
async def receiver(monkeypatch: pytest.MonkeyPatch, serve_upstream: ServeUpstream) -> Receiver:
    served = Receiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", await serve_upstream(served.app))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    return served


async def stream(url: str, request_id: str, *, usage: bool = False, **controls: str) -> None:
    headers = {
        **FAST,
        **{f"x-mock-{k}": v for k, v in controls.items()},
        "x-mock-request-id": request_id,
        "traceparent": f"00-{TRACE_ID}-{PARENT}-01",
    }
    async with aiohttp.ClientSession() as session:
        body: dict[str, Any] = {"stream": True}
        if usage:
            body["stream_options"] = {"include_usage": True}
        async with session.post(url + CHAT, headers=headers, json=body) as response:
            if controls.get("cancel"):
                await response.content.readany()
                response.close()
                return
            await response.read()


async def test_each_stream_is_a_server_span_under_the_clients_trace_and_a_client_span_upstream(
    mock: MockServer, start_sidecar: StartSidecar, receiver: Receiver
) -> None:
    sidecar = await start_sidecar(
        mock.url, otel_exporter="otlp-http", upstream_idle_timeout="300ms"
    )
    await stream(sidecar.proxy_url, "completed", usage=True)  # the provider counts
    await stream(sidecar.proxy_url, "truncated", fault="truncate")
    await stream(sidecar.proxy_url, "cancelled", tokens="400", tps="20", cancel="1")
    await stream(sidecar.proxy_url, "timed-out", fault="stall", **{"fault-after": "2"})
    await wait_for(lambda: len(sidecar.tracker.finished) == 4, what="four streams")
    await wait_for(lambda: len(servers(receiver)) == 4, what="four server spans exported")
    clients = {s.parent_span_id: s for s in receiver.spans if s.kind == 3}  # CLIENT
    by_state: dict[str, tuple[Any, Any]] = {}
    for server in servers(receiver):
        assert server.trace_id.hex() == TRACE_ID and server.parent_span_id.hex() == PARENT
        assert server.name == "POST /"
        client = clients[server.span_id]
        assert client.trace_id == server.trace_id
        by_state[attributes(server)["streamwarden.end_state"]] = (server, client)
    assert set(by_state) == {
        "completed",
        "upstream_truncated",
        "client_cancelled",
        "upstream_timeout",
    }
    server, client = by_state["completed"]
    seen = attributes(server)
    assert seen["gen_ai.operation.name"] == "chat"
    assert seen["gen_ai.provider.name"] == "openai"
    assert seen["gen_ai.request.stream"] is True
    assert seen["gen_ai.usage.output_tokens"] == 8
    assert seen["gen_ai.usage.input_tokens"] >= 1  # the mock's count of the request body
    assert seen["streamwarden.tokens.source"] == "provider"
    assert seen["streamwarden.tokens.delivered"] == 8
    assert seen["http.response.status_code"] == 200
    assert client.name == "chat openai-chat"
    assert [event.name for event in server.events] == ["gen_ai.first_token", "streamwarden.end"]
    truncated = attributes(by_state["upstream_truncated"][0])
    assert truncated["streamwarden.error_code"] == "stream_truncated"
    assert by_state["upstream_truncated"][0].status.code == 2  # STATUS_CODE_ERROR
    cancelled = attributes(by_state["client_cancelled"][0])
    assert "streamwarden.cancel_propagation_s" in cancelled
    timed_out = attributes(by_state["upstream_timeout"][0])
    assert timed_out["streamwarden.error_code"] == "upstream_timeout"
    # The upstream received the client span's context, not the client's own.
    for request_id, state in (("completed", "completed"), ("truncated", "upstream_truncated")):
        sent = mock.stats.get(request_id)
        assert sent is not None and sent.traceparent is not None
        _, trace_id, span_id, _ = sent.traceparent.split("-")
        assert trace_id == TRACE_ID and span_id == by_state[state][1].span_id.hex()
    # The GenAI metrics, from the same records.
    await wait_for(
        lambda: "gen_ai.server.time_to_first_token" in receiver.metrics,
        what="the GenAI metrics exported",
    )
    ttft = receiver.metrics["gen_ai.server.time_to_first_token"].histogram
    assert sum(p.count for p in ttft.data_points) >= 3
    assert list(ttft.data_points[0].explicit_bounds)[:3] == [0.001, 0.005, 0.01]
    usage = receiver.metrics["gen_ai.client.token.usage"].histogram
    kinds = {
        kv.value.string_value
        for p in usage.data_points
        for kv in p.attributes
        if kv.key == "gen_ai.token.type"
    }
    assert kinds == {"input", "output"}  # input: only where the provider counted the prompt


async def test_a_collector_that_is_down_never_touches_a_stream(
    mock: MockServer, start_sidecar: StartSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    sidecar = await start_sidecar(mock.url, otel_exporter="otlp-http")
    for n in range(3):
        await stream(sidecar.proxy_url, f"fine-{n}")
    assert [r.meter.end_state for r in sidecar.tracker.finished] == ["completed"] * 3
    await wait_for(
        lambda: sidecar.metrics.otel_errors._value.get() >= 1,
        timeout=30,
        what="the failed export counted",
    )


async def test_the_middleware_exports_the_same_spans_and_makes_the_upstream_call_current(
    receiver: Receiver,
) -> None:
    from fastapi import FastAPI
    from opentelemetry import trace
    from starlette.responses import StreamingResponse

    from middleware_apps import serve_in_process
    from streamwarden.middleware import StreamWardenMiddleware

    app = FastAPI()
    seen_by_the_app: list[str] = []

    @app.post(CHAT)
    async def chat() -> StreamingResponse:
        # What an instrumented HTTP client in the app would continue.
        seen_by_the_app.append(format(trace.get_current_span().get_span_context().span_id, "016x"))

        async def tokens() -> AsyncIterator[bytes]:
            yield b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(tokens(), media_type="text/event-stream")

    middleware = StreamWardenMiddleware(app, otel_exporter="otlp-http")
    async with serve_in_process(middleware) as url:
        headers = {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}
        async with aiohttp.ClientSession() as session:
            async with session.post(url + CHAT, headers=headers, json={"stream": True}) as reply:
                await reply.read()
        await wait_for(lambda: len(servers(receiver)) == 1, what="the middleware's server span")
    await middleware.close()  # its exporters' threads, as the server's lifespan shutdown would
    (server,) = servers(receiver)
    assert server.trace_id.hex() == TRACE_ID and server.parent_span_id.hex() == PARENT
    (client,) = [s for s in receiver.spans if s.kind == 3]
    assert client.parent_span_id == server.span_id
    assert seen_by_the_app == [client.span_id.hex()]
    assert attributes(server)["streamwarden.end_state"] == "completed"


async def test_a_traceparent_header_is_found_whatever_its_case(receiver: Receiver) -> None:
    from streamwarden.config import load_settings
    from streamwarden.observation.telemetry import Telemetry

    telemetry = Telemetry(load_settings(environ={}, overrides={"otel_exporter": "otlp-http"}))
    trace = telemetry.request("POST", "/", {"Traceparent": f"00-{TRACE_ID}-{PARENT}-01"})
    context = trace.server.get_span_context()
    assert format(context.trace_id, "032x") == TRACE_ID
    trace.end(200)
    await wait_for(lambda: len(servers(receiver)) == 1, what="the span exported")
    assert servers(receiver)[0].parent_span_id.hex() == PARENT
    telemetry.shutdown()
