"""``max_concurrent_streams`` in the middleware: refused before the app runs, as in the sidecar.

A FastAPI app under a real uvicorn on loopback, driven by the ``openai``
SDK (which asks for a stream with ``"stream": true`` in its body) and by
httpx with ``Accept: text/event-stream``. Without the setting the same
app takes every stream, which is the baseline.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, StreamingResponse

from middleware_apps import serve_in_process
from streamwarden.config import SIDECAR_ONLY, Settings
from streamwarden.middleware import StreamWardenMiddleware
from waiting import wait_for

CHAT = "/v1/chat/completions"


class Provider:
    """Counts the app's provider calls; each stream waits until released."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = asyncio.Event()


def relay_app(provider: Provider, **options: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(StreamWardenMiddleware, **options)

    @app.post(CHAT, response_model=None)
    async def chat(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        if not body.get("stream"):
            return JSONResponse({"choices": [{"message": {"content": "hi"}}]})
        provider.calls += 1

        async def events() -> AsyncIterator[bytes]:
            chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            await provider.release.wait()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def _open_stream(client: openai.AsyncOpenAI) -> list[str]:
    stream = await client.chat.completions.create(model="m", messages=[], stream=True)
    return [c.choices[0].delta.content or "" async for c in stream if c.choices]


async def test_without_a_limit_every_stream_reaches_the_app() -> None:
    provider = Provider()
    async with serve_in_process(relay_app(provider)) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        streams = [asyncio.create_task(_open_stream(client)) for _ in range(3)]
        # All three reach the app and stay open there (none is released yet).
        await wait_for(lambda: provider.calls == 3, what="three streams in the app")
        provider.release.set()
        assert [await s for s in streams] == [["hi"]] * 3


@pytest.mark.parametrize("ask", ["body", "accept"])
async def test_streams_over_the_limit_get_503_with_retry_after_and_the_app_never_runs(
    ask: str,
) -> None:
    provider = Provider()
    app = relay_app(provider, max_concurrent_streams=2)
    async with serve_in_process(app) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        open_streams = [asyncio.create_task(_open_stream(client)) for _ in range(2)]
        await wait_for(lambda: provider.calls == 2, what="two streams in the app")
        async with httpx.AsyncClient(base_url=url) as http:
            async with asyncio.timeout(5):  # admitted, it would wait for the release
                if ask == "body":
                    with pytest.raises(openai.APIStatusError) as refused:
                        await _open_stream(client)
                    response = refused.value.response
                else:
                    response = await http.post(
                        CHAT, headers={"Accept": "text/event-stream"}, json={"stream": True}
                    )
            assert response.status_code == 503
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "too_many_streams"
            assert provider.calls == 2  # the refused request never reached the app
            # A request that asks for no stream is not limited.
            plain = await http.post(CHAT, json={"stream": False})
            assert plain.status_code == 200
        provider.release.set()
        assert [await s for s in open_streams] == [["hi"]] * 2  # untouched
        assert await _open_stream(client) == ["hi"]  # capacity is back
        assert provider.calls == 3


@pytest.mark.parametrize("key", sorted(SIDECAR_ONLY))
def test_a_sidecar_only_setting_is_accepted_with_a_warning_not_ignored_silently(
    key: str, caplog: pytest.LogCaptureFixture
) -> None:
    value = {
        "event_loop": "uvloop",
        "preserve_host": True,
        "readiness_check_upstream": True,
        "upstream": "http://127.0.0.1:1",
        "upstream_ca_bundle": __file__,  # any readable file passes the check
        "listen": "127.0.0.1:1",
        "admin_listen": "127.0.0.1:2",
        "trusted_proxies": ["10.0.0.0/8"],
        "usage_injection": "off",
    }.get(key, "1s" if "timeout" in key or key.endswith("_after") else 1000)
    with caplog.at_level("WARNING", logger="streamwarden.middleware"):
        StreamWardenMiddleware(FastAPI(), **{key: value})
    assert f"{key}: a sidecar-only setting" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="streamwarden.middleware"):
        StreamWardenMiddleware(FastAPI(), keepalive_interval="5s")
    assert "sidecar-only" not in caplog.text


def test_every_other_setting_is_one_the_middleware_uses() -> None:
    shared = set(Settings.model_fields) - SIDECAR_ONLY
    assert shared == {
        "keepalive_interval",
        "upstream_idle_timeout",
        "max_stream_duration",
        "client_write_timeout",
        "max_event_bytes",
        # tests/faces/test_toolcalls_faces.py: the tool calls' arguments held, both faces.
        "max_tool_arguments_bytes",
        # tests/faces/test_toolcalls_depth_cost.py: arguments nested past it, both faces.
        "max_tool_arguments_depth",
        "max_concurrent_streams",
        "early_headers_after",
        "dialect",
        "stream_media_types",
        "redact_headers",
        "routes",
        "metrics_path",
        "log_format",
        "log_level",
        # tests/features/test_middleware_resume.py: detach and drain run the app on.
        "on_client_gone",
        "resume_window",
        "resume_store",
        "resume_ttl",
        "resume_max_bytes",
        "resume_max_total_bytes",
        "resume_owner_headers",
        "resume_owner_query_params",
        "resume_secret",
        # tests/observation/test_telemetry.py: spans and GenAI metrics from both faces.
        "otel_exporter",
        "otel_record_models",
        # tests/faces/test_filters_faces.py, tests/core/test_filters.py: redact or block,
        # both faces.
        "output_filters",
        "output_filter_tool_arguments",
        # tests/features/test_engine_reconcile.py: the engine's counters against either face's.
        "engine_metrics_url",
        "engine",
        "engine_scrape_interval",
    }


def _stream_request() -> dict[str, Any]:
    return {
        "type": "http",
        "http_version": "1.1",
        "method": "GET",
        "path": CHAT,
        "query_string": b"",
        "headers": [(b"accept", b"text/event-stream")],
    }


async def _no_disconnect() -> dict[str, Any]:
    await asyncio.Event().wait()  # the client stays
    raise AssertionError("unreachable")


@pytest.mark.parametrize("answer", ["stream", "json"])
async def test_a_slot_is_free_by_the_time_the_client_has_the_end_of_its_response(
    answer: str,
) -> None:
    """A client that asks again the moment its answer ends (an agent loop does) gets in.

    The second request is made from inside the server's send() of the first
    one's last message: from the client's side, no sooner is possible. A
    slot given back only once the app has unwound (its task group, the
    middleware's own helpers) refused it with 503: on uvloop, a real client
    on a kept-alive connection got there first every time.
    """

    async def app(scope: Any, receive: Any, send: Any) -> None:
        kind = b"text/event-stream" if answer == "stream" else b"application/json"
        status = 200 if answer == "stream" else 429
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]}
        )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    middleware = StreamWardenMiddleware(app, max_concurrent_streams=1)
    again: list[asyncio.Task[None]] = []
    answered: list[dict[str, Any]] = []

    async def second_send(message: dict[str, Any]) -> None:
        answered.append(message)

    async def first_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            again.append(
                asyncio.create_task(middleware(_stream_request(), _no_disconnect, second_send))
            )

    await middleware(_stream_request(), _no_disconnect, first_send)
    async with asyncio.timeout(5):
        await again[0]
    assert answered[0]["status"] == (200 if answer == "stream" else 429)
    assert middleware.streams.admitted == 0
