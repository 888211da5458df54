"""A stream cut inside a tool call's arguments: the SDKs hand back half a call, or raise naming it.

An agent runs a tool once its call's arguments are complete. Each recorded
tool-call stream (``tests/fixtures/streams``) is cut right after an event
carrying part of a call's arguments, and read by the official SDK:

- directly (a replay server, no streamwarden) the SDK ends without a word
  and hands back the call with partial arguments, not valid JSON;
- through the sidecar (in front of that replay server) and through the
  middleware (an app streaming the same bytes), the SDK raises its own
  error, whose message has the code ``tool_call_truncated`` and the call's
  id and name.

The SDKs: openai (Chat Completions, Responses), anthropic, google-genai
(Vertex's streamed function-call arguments, ``partialArgs`` with
``willContinue``) and the Vercel AI SDK's UI message stream reader under
Node (``npm ci --prefix tests/js``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web
from google import genai
from google.genai import types as genai_types
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from locations import FIXTURES
from middleware_apps import serve_in_process
from sidecars import sidecars
from streamwarden.core.sse import SSEFramer
from streamwarden.middleware import StreamWardenMiddleware
from upstreams import ServeUpstream
from vercel_reader import (
    VercelStreamError,
    raise_if_failed,
    read_ui_stream,
    sdk_param,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Inheritance class AiohttpClientSession:DeprecationWarning"
)


@dataclass
class Call:
    """A tool call as the SDK handed it back."""

    id: str | None
    name: str | None
    arguments: str


Reader = Callable[[str], Awaitable[list[Call]]]


# -- the readers: each returns the calls the SDK assembled -----------------------------


async def openai_chat_calls(base_url: str) -> list[Call]:
    calls: dict[int, Call] = {}
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="t", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for chunk in stream:
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or ():
                    call = calls.setdefault(delta.index, Call(None, None, ""))
                    call.id = delta.id or call.id
                    if delta.function is not None:
                        call.name = delta.function.name or call.name
                        call.arguments += delta.function.arguments or ""
    return list(calls.values())


async def openai_responses_calls(base_url: str) -> list[Call]:
    calls: dict[str, Call] = {}
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="t", max_retries=0) as client:
        stream = await client.responses.create(model="gpt-4.1-mini", input="hi", stream=True)
        async for event in stream:
            if event.type == "response.output_item.added" and event.item.type == "function_call":
                calls[str(event.item.id)] = Call(event.item.call_id, event.item.name, "")
            elif event.type == "response.function_call_arguments.delta":
                calls[event.item_id].arguments += event.delta
    return list(calls.values())


async def anthropic_calls(base_url: str) -> list[Call]:
    calls: dict[int, Call] = {}
    async with anthropic.AsyncAnthropic(base_url=base_url, api_key="t", max_retries=0) as client:
        stream = await client.messages.create(
            model="claude-sonnet-4-20250514",
            max_tokens=100,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
        )
        async for event in stream:
            if event.type == "content_block_start" and event.content_block.type == "tool_use":
                calls[event.index] = Call(event.content_block.id, event.content_block.name, "")
            elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                calls[event.index].arguments += event.delta.partial_json
    return list(calls.values())


async def gemini_calls(base_url: str) -> list[Call]:
    """Vertex streams a call's arguments as ``partialArgs``; the SDK hands each part on."""
    options = genai_types.HttpOptions(base_url=base_url)
    client = genai.Client(api_key="t", http_options=options).aio
    calls: list[Call] = []
    try:
        stream = await client.models.generate_content_stream(
            model="gemini-3-pro-preview", contents="hi"
        )
        async for chunk in stream:
            for part in chunk.function_calls or ():
                if part.name is not None or not calls:
                    calls.append(Call(part.id, part.name, ""))
                pieces = (arg.string_value or "" for arg in part.partial_args or ())
                calls[-1].arguments += "".join(pieces)
    finally:
        await client.aclose()
    return calls


async def vercel_calls(base_url: str) -> list[Call]:
    result = await read_ui_stream(base_url + "/api/chat", {})
    raise_if_failed(result)
    # Only the parts still "input-streaming": the SDK never saw their input whole.
    return [
        Call(tool["toolCallId"], None, json.dumps(tool.get("input"), ensure_ascii=False))
        for tool in result["tools"]
        if tool["state"] == "input-streaming"
    ]


# -- the streams, cut inside a call ------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    #: Below tests/fixtures: a recording (streams/) or a stream written by hand (tool_calls/).
    fixture: str
    reader: Reader
    #: Is this event a piece of a call's arguments?
    carries_arguments: Callable[[dict[str, Any]], bool]
    #: The call the cut falls inside: its id and name.
    call_id: str
    call_name: str
    #: The SDK's own error class on our error event.
    error: type[BaseException] | tuple[type[BaseException], ...]
    #: How the upstream labels the stream, besides its Content-Type.
    headers: tuple[tuple[str, str], ...] = ()
    #: The stream is cut after this many events of arguments.
    cut_after: int = 2


def _chat_args(data: dict[str, Any]) -> bool:
    return any(
        (call.get("function") or {}).get("arguments")
        for choice in data.get("choices") or ()
        for call in (choice.get("delta") or {}).get("tool_calls") or ()
    )


def _gemini_args(data: dict[str, Any]) -> bool:
    parts = data["candidates"][0]["content"]["parts"]
    return any((part.get("functionCall") or {}).get("partialArgs") for part in parts)


CASES = [
    Case(
        "openai-chat",
        "streams/openai_chat_tool_call.sse",
        openai_chat_calls,
        _chat_args,
        "call_NAOEQepNf1vySmGBVMB1zi6Z",
        "get_weather",
        openai.APIError,
    ),
    Case(
        "openai-responses",
        "streams/openai_responses_tool_call.sse",
        openai_responses_calls,
        lambda data: data.get("type") == "response.function_call_arguments.delta",
        "call_NDjd9LWJmYEvvpVNLnof7xRq",
        "save_note",
        openai.APIError,
    ),
    Case(
        "anthropic",
        "streams/anthropic_tool_use.sse",
        anthropic_calls,
        lambda data: (data.get("delta") or {}).get("partial_json") not in (None, ""),
        "toolu_01QIbOoLiGdR7Je3x8Wy23Es",
        "save_note",
        anthropic.APIStatusError,
    ),
    Case(
        "google-genai",
        "tool_calls/gemini_streamed_function_call.sse",
        gemini_calls,
        _gemini_args,
        "get_weather",  # Gemini's calls carry no id: the name stands for it
        "get_weather",
        genai.errors.APIError,
    ),
    Case(
        "vercel-ai",
        "streams/vercel_ui_message_stream.sse",
        vercel_calls,
        lambda data: data.get("type") == "tool-input-delta",
        "call_GxkOwUZVS9k94B3Tc2P1yGep",
        "getWeather",
        VercelStreamError,
        (("x-vercel-ai-ui-message-stream", "v1"),),
        cut_after=4,  # {"city":"東京 : the SDK's repair shows a value
    ),
]


def cut_inside_a_call(case: Case) -> bytes:
    """The fixture up to and with its ``cut_after``-th event of arguments: half a call."""
    kept = b""
    seen = 0
    for frame in SSEFramer().feed((FIXTURES / case.fixture).read_bytes()):
        kept += frame.raw
        event = frame.event
        if event is not None and event.data.startswith("{"):
            seen += case.carries_arguments(json.loads(event.data))
            if seen == case.cut_after:
                return kept
    raise AssertionError(f"{case.fixture} has too few events of arguments")


def case_params() -> list[Any]:
    return [sdk_param(case, case.name) for case in CASES]


# -- the three ways to the SDK --------------------------------------------------------


@dataclass
class Stage:
    """The bytes the upstream (or the app) sends next, and how they are labelled."""

    body: bytes = b""
    headers: dict[str, str] | None = None

    def set(self, case: Case) -> None:
        self.body = cut_inside_a_call(case)
        self.headers = {"Content-Type": "text/event-stream", **dict(case.headers)}


@pytest.fixture
async def stage(serve_upstream: ServeUpstream) -> tuple[Stage, str]:
    """A replay server: every POST gets the staged bytes, then the connection ends."""
    staged = Stage()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers=staged.headers)
        await response.prepare(request)
        await response.write(staged.body)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    return staged, await serve_upstream(app)


def middleware_app(staged: Stage) -> StreamWardenMiddleware:
    """An app streaming the staged bytes itself, one event at a time, behind the middleware."""

    async def answer(request: Request) -> StreamingResponse:
        await request.body()

        async def events() -> AsyncIterator[bytes]:
            for frame in SSEFramer().feed(staged.body):
                yield frame.raw

        return StreamingResponse(events(), headers=staged.headers)

    app = Starlette(routes=[Route("/{tail:path}", answer, methods=["POST"])])
    return StreamWardenMiddleware(app)


@pytest.mark.parametrize("case", case_params())
async def test_without_streamwarden_the_sdk_hands_back_half_a_call(
    stage: tuple[Stage, str], case: Case
) -> None:
    staged, upstream = stage
    staged.set(case)
    calls = await case.reader(upstream)  # no error: the stream just ended
    assert calls, "the SDK handed back no call at all"
    if case.name == "vercel-ai":
        # The SDK repairs the partial JSON itself, and keeps the part in its
        # "input-streaming" state (the reader returns only such parts).
        assert calls[-1].arguments == '{"city": "東京"}', calls
    else:
        with pytest.raises(ValueError):
            json.loads(calls[-1].arguments)


def _assert_names_the_call(case: Case, error: BaseException) -> None:
    text = str(error)
    assert "tool_call_truncated" in text, text
    assert case.call_id in text and case.call_name in text, text


@pytest.mark.parametrize("case", case_params())
async def test_through_the_sidecar_the_sdk_raises_naming_the_call(
    stage: tuple[Stage, str], case: Case
) -> None:
    staged, upstream = stage
    staged.set(case)
    async with sidecars() as start:
        sidecar = await start(upstream)
        with pytest.raises(case.error) as raised:
            await case.reader(sidecar.proxy_url)
    _assert_names_the_call(case, raised.value)


@pytest.mark.parametrize("case", case_params())
async def test_through_the_middleware_the_sdk_raises_naming_the_call(case: Case) -> None:
    staged = Stage()
    staged.set(case)
    async with serve_in_process(middleware_app(staged)) as base_url:
        with pytest.raises(case.error) as raised:
            await case.reader(base_url)
    _assert_names_the_call(case, raised.value)
