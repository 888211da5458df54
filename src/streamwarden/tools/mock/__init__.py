"""A simulated LLM upstream that streams like the real providers and fails on request.

The mock serves the wire formats of OpenAI (Chat Completions and Responses),
Anthropic Messages, Gemini, Ollama, and the Vercel AI SDK's two stream
protocols, byte for byte as those services frame them, plus a generic event
stream, a request echo, a WebSocket echo and the Responses API over a
WebSocket (``/v1/responses`` upgraded; faults: a 1000 close half-way, a
vanishing without a close frame, silence, a giant message). Every request can be steered
(token count, pace, time to first token) and made to misbehave in the ways
streams break in production: truncation, silence, resets, broken chunked
encoding, giant events, garbage, error statuses. The mock records what it
actually sent for each request, so tests can compare a proxy's metering with
the ground truth. It is a product feature: users run it in their CI with
``streamwarden mock-upstream``, and every streamwarden integration test runs
against it.

Quick start::

    server = await start_mock()              # 127.0.0.1, a free port
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x")
    ...
    record = await server.stats.wait_ended("my-request-id")
    await server.close()

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/responses``,
``POST /v1/messages``, ``POST /v1beta/models/{model}:streamGenerateContent``
(``?alt=sse``) and ``:generateContent``, ``POST /api/chat``,
``POST /api/generate``, ``POST /vercel/data-stream``, ``POST /vercel/ui-stream``,
``POST /generate_stream`` and ``/generate`` (TGI), ``GET /sse``,
``ANY /echo/...``, ``GET /ws``, ``GET /_mock/stats``, ``POST /_mock/reset``;
any other path answers in the settings' dialect (streamed unless the JSON
body says ``"stream": false``).
The controls are described in :mod:`streamwarden.tools.mock.controls`, the faults
in :class:`Fault`.
"""

from __future__ import annotations

from streamwarden.tools.mock.cli import run_mock_cli
from streamwarden.tools.mock.controls import ControlError, Controls, MockSettings, parse_controls
from streamwarden.tools.mock.faults import Fault
from streamwarden.tools.mock.formats import DIALECT_ALIASES, WIRE_FORMATS
from streamwarden.tools.mock.server import MockServer, create_app, start_mock
from streamwarden.tools.mock.stats import MockStats, RequestRecord
from streamwarden.tools.mock.tokens import (
    TOOL_NAME,
    mock_text,
    mock_tokens,
    tool_call_arguments,
    tool_call_fragments,
)

__all__ = [
    "DIALECT_ALIASES",
    "TOOL_NAME",
    "WIRE_FORMATS",
    "ControlError",
    "Controls",
    "Fault",
    "MockServer",
    "MockSettings",
    "MockStats",
    "RequestRecord",
    "create_app",
    "mock_text",
    "mock_tokens",
    "parse_controls",
    "run_mock_cli",
    "start_mock",
    "tool_call_arguments",
    "tool_call_fragments",
]
