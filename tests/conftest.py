"""Shared fixtures: a real mock upstream and real sidecars on loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from sidecars import StartSidecar, sidecars
from streamwarden.tools.mock import MockServer, start_mock
from upstreams import ServeUpstream, serving

if os.environ.get("TEST_EVENT_LOOP") == "uvloop":
    # ``streamwarden run`` picks uvloop when it is installed, so the
    # in-process sidecar tests run on it too (``.ci/run`` does both loops).

    def pytest_asyncio_loop_factories(
        config: pytest.Config, item: pytest.Item
    ) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
        import uvloop

        return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
async def mock() -> AsyncIterator[MockServer]:
    server = await start_mock()
    yield server
    await server.close()


@pytest.fixture
async def start_sidecar() -> AsyncIterator[StartSidecar]:
    """Start sidecars on free loopback ports; all are closed after the test."""
    async with sidecars() as start:
        yield start


@pytest.fixture
async def serve_upstream() -> AsyncIterator[ServeUpstream]:
    """``await start(app, **options)``: the app on a free loopback port, its base URL.

    ``options`` are :func:`upstreams.serving`'s; every app started is stopped after the test.
    """
    async with contextlib.AsyncExitStack() as started:

        async def start(app: web.Application, **runner_options: Any) -> str:
            return await started.enter_async_context(serving(app, **runner_options))

        yield start


@pytest.fixture
async def receiver(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """A real OTLP receiver (otlp_receiver.py) for the faces' exporters; skipped without otel."""
    pytest.importorskip("opentelemetry.sdk")
    from otlp_receiver import Receiver

    served = Receiver()
    async with serving(served.app) as url:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        yield served
