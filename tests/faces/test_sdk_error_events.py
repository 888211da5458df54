"""The official SDKs end silently on a broken stream, and raise their own error on ours.

Two parts:

- Replays: a tiny local server replays recorded provider streams cut
  before their terminal event, to the real clients: first as is (the
  problem: the SDK ends without a word), then with the relay's synthesized
  error event appended (the SDK raises, carrying the code). For Gemini the
  replay also shows why the error object must be Google's own shape.
- The matrix: each SDK reads a streamed answer from the mock upstream, for
  each fault the mock can inject (cut at an event boundary, cut inside an
  event, silence, one giant event, a TCP reset). Directly from the mock
  the SDK ends silently, hangs, swallows the giant event, or fails without
  a reason; through a real in-process sidecar it raises the SDK's own
  error class, with the machine code where that SDK shows errors.

The SDKs: openai (Chat Completions and Responses), anthropic, google-genai
(Gemini), ollama (NDJSON), cohere (v2 chat), huggingface_hub (TGI's
``/generate_stream``), mistralai (OpenAI-like chunks) and the Vercel AI
SDK's UI message stream reader, run with Node when it and the ``ai``
package are installed (``npm ci --prefix tests/js``). The Vercel data
stream protocol (AI SDK 4) has no reader left in the current SDK, so it is
not in the matrix.

cohere's SDK raises on no event, so there the rule is the broken body's: a
stream that ends in our error ends the client's body abnormally too, and the
SDK raises its transport's error, after handing over the ``message-end``
whose ``delta.error`` carries our code.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import cohere
import httpx
import huggingface_hub
import mistralai.client
import ollama
import openai
import pytest
from aiohttp import web
from google import genai
from google.genai import types as genai_types
from huggingface_hub import errors as hf_errors
from mistralai.client import errors as mistral_errors

from locations import STREAMS
from middleware_apps import relaying, serve_in_process
from sidecars import StartSidecar
from streamwarden.core.relay import Limits, Relay
from streamwarden.core.sse import SSEFramer
from streamwarden.middleware import StreamWardenMiddleware
from streamwarden.tools.mock import MockServer, mock_text
from upstreams import ServeUpstream
from vercel_reader import (
    VercelStreamError,
    raise_if_failed,
    read_ui_stream,
    sdk_param,
)

LIMITS = Limits(15.0, 60.0, 1800.0, 1 << 20)

# google-genai subclasses aiohttp's ClientSession, which aiohttp warns about.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Inheritance class AiohttpClientSession:DeprecationWarning"
)

Replay = Callable[[bytes], str]


@pytest.fixture
async def replay(serve_upstream: ServeUpstream) -> Replay:
    """Serve the most recently set bytes as an event stream on every POST."""
    body = {"bytes": b""}

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(body["bytes"])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    url = await serve_upstream(app)

    def set_bytes(data: bytes) -> str:
        body["bytes"] = data
        return url

    return set_bytes


def cut_before_terminal(name: str, path: str) -> bytes:
    """The recorded stream ``name`` up to (without) its terminal event."""
    framer = SSEFramer()
    relay = Relay(
        LIMITS, started_at=0, now=0, path=path, content_type="text/event-stream", headers={}
    )
    kept = b""
    for frame in framer.feed((STREAMS / name).read_bytes()):
        relay.feed(frame.raw, 1.0)
        if relay._terminal_seen:
            return kept
        kept += frame.raw
    raise AssertionError("fixture has no terminal event")


def through_relay(data: bytes, path: str) -> bytes:
    relay = Relay(
        LIMITS, started_at=0, now=0, path=path, content_type="text/event-stream", headers={}
    )
    return relay.feed(data, 1.0) + relay.upstream_eof(2.0)


# -- the SDK readers ------------------------------------------------------------------
# Each reads one streamed answer, appending its text to ``got`` as it arrives
# (so a test can see what came before an error), and returns the whole text.

Reader = Callable[[str, dict[str, str], list[str]], Awaitable[str]]


async def openai_chat_text(base_url: str, headers: dict[str, str], got: list[str]) -> str:
    async with openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="test", max_retries=0, default_headers=headers
    ) as client:
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for chunk in stream:
            got.extend(choice.delta.content or "" for choice in chunk.choices)
    return "".join(got)


async def openai_responses_text(base_url: str, headers: dict[str, str], got: list[str]) -> str:
    async with openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="test", max_retries=0, default_headers=headers
    ) as client:
        stream = await client.responses.create(model="gpt-4.1-mini", input="hi", stream=True)
        async for event in stream:
            if event.type == "response.output_text.delta":
                got.append(event.delta)
    return "".join(got)


async def anthropic_text(base_url: str, headers: dict[str, str], got: list[str]) -> str:
    async with anthropic.AsyncAnthropic(
        base_url=base_url, api_key="test", max_retries=0, default_headers=headers
    ) as client:
        stream = await client.messages.create(
            model="claude-sonnet-4-20250514",
            max_tokens=100,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
        )
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                got.append(event.delta.text)
    return "".join(got)


async def gemini_text(base_url: str, headers: dict[str, str], got: list[str]) -> str:
    options = genai_types.HttpOptions(base_url=base_url, headers=headers)
    client = genai.Client(api_key="test", http_options=options).aio
    try:
        stream = await client.models.generate_content_stream(
            model="gemini-2.5-flash", contents="hi"
        )
        async for chunk in stream:
            got.append(chunk.text or "")
    finally:
        await client.aclose()
    return "".join(got)


async def ollama_text(base_url: str, headers: dict[str, str], got: list[str]) -> str:
    client = ollama.AsyncClient(host=base_url, headers=headers)
    try:
        stream = await client.chat(
            model="llama3.2", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for part in stream:
            got.append(part.message.content or "")
    finally:
        await client.close()
    return "".join(got)


async def cohere_text(base_url: str, headers: dict[str, str], got: list[str]) -> str:
    failure = None  # what the last message-end said went wrong
    async with httpx.AsyncClient(timeout=300) as http:  # the SDK's default timeout
        client = cohere.AsyncClientV2(base_url=base_url, api_key="test", httpx_client=http)
        options: Any = {"additional_headers": headers, "max_retries": 0}
        try:
            stream = client.chat_stream(
                model="command-a-03-2025",
                messages=[{"role": "user", "content": "hi"}],
                request_options=options,
            )
            async for event in stream:
                if event.type == "content-delta" and event.delta and event.delta.message:
                    content = event.delta.message.content
                    got.append(content.text or "" if content else "")
                elif event.type == "message-end" and event.delta and event.delta.error:
                    failure = event.delta.error
        except Exception as exc:
            # A caller sees both: the event that said why, then the SDK's error.
            if failure is not None:
                exc.add_note(f"message-end error: {failure}")
            raise
    return "".join(got)


async def tgi_text(base_url: str, headers: dict[str, str], got: list[str]) -> str:
    client = huggingface_hub.AsyncInferenceClient(
        base_url=base_url + "/generate_stream", headers=headers
    )
    try:
        async for output in await client.text_generation("hi", stream=True, details=True):
            if not output.token.special:
                got.append(output.token.text)
    finally:
        await client.close()
    return "".join(got)


async def mistral_text(base_url: str, headers: dict[str, str], got: list[str]) -> str:
    async with mistralai.client.Mistral(api_key="test", server_url=base_url) as client:
        stream = await client.chat.stream_async(
            model="mistral-small-latest",
            messages=[{"role": "user", "content": "hi"}],
            http_headers=headers,
        )
        async for event in stream:
            got.extend(str(choice.delta.content or "") for choice in event.data.choices)
    return "".join(got)


async def vercel_ui_text(base_url: str, headers: dict[str, str], got: list[str]) -> str:
    result = await read_ui_stream(base_url + "/vercel/ui-stream", headers)
    got.append(result["text"])
    raise_if_failed(result)
    return str(result["text"])


# -- how each SDK shows our code ----------------------------------------------------

_CODE_AT_END = re.compile(r"\((\w+)\)$")


def openai_code(exc: BaseException) -> str | None:
    if isinstance(exc, openai.APIError) and exc.code is not None:
        assert f"({exc.code})" in exc.message
        return str(exc.code)
    return None


def anthropic_code(exc: BaseException) -> str | None:
    if isinstance(exc, anthropic.APIStatusError) and isinstance(exc.body, dict):
        assert exc.status_code == 200  # raised from the stream, not from a status
        error = exc.body.get("error")
        if isinstance(error, dict) and "code" in error:
            assert f"({error['code']})" in str(exc)
            return str(error["code"])
    return None


def gemini_code(exc: BaseException) -> str | None:
    if not isinstance(exc, genai.errors.APIError) or not isinstance(exc.details, dict):
        return None
    # google-genai's own fields: an integer status, its name, the message...
    assert isinstance(exc.code, int) and exc.code >= 500
    assert exc.status in ("INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED")
    match = _CODE_AT_END.search(exc.message or "")
    # ...and the code in the ErrorInfo detail of the error object it keeps.
    (info,) = exc.details["error"]["details"]
    assert info["domain"] == "streamwarden"
    assert match is not None and match.group(1) == info["metadata"]["code"]
    return str(info["metadata"]["code"])


def ollama_code(exc: BaseException) -> str | None:
    # The ollama client keeps only the error string of an {"error": ...} line.
    if isinstance(exc, ollama.ResponseError):
        match = _CODE_AT_END.search(exc.error)
        return match.group(1) if match else None
    return None


def cohere_code(exc: BaseException) -> str | None:
    # The SDK raises its transport's error on a broken body (EventSource.iter_sse
    # re-raises it); the code came before it, in the message-end it yielded.
    if isinstance(exc, httpx.TransportError):
        for note in getattr(exc, "__notes__", ()):
            match = _CODE_AT_END.search(note)
            if note.startswith("message-end error: ") and match:
                return match.group(1)
    return None


#: The huggingface_hub class each of our codes raises (the tgi dialect's
#: error_type for it: incomplete_generation for a cut, generation otherwise).
TGI_CLASSES: dict[str, type[Exception]] = {
    "stream_truncated": hf_errors.IncompleteGenerationError,
    "upstream_error": hf_errors.GenerationError,
    "upstream_timeout": hf_errors.GenerationError,
    "event_too_large": hf_errors.GenerationError,
}


def tgi_code(exc: BaseException) -> str | None:
    # huggingface_hub raises a TextGenerationError subclass chosen by the
    # event's error_type, with its "error" string as the message.
    if isinstance(exc, hf_errors.TextGenerationError):
        match = _CODE_AT_END.search(str(exc))
        if match is not None:
            assert type(exc) is TGI_CLASSES[match.group(1)], repr(exc)
            return match.group(1)
    return None


def mistral_code(exc: BaseException) -> str | None:
    # mistralai validates every event as a CompletionChunk (its chat stream
    # has no error event): ours is not one, so it raises its own
    # ResponseValidationError, a MistralError of the 200 answer, whose body is
    # the event it read. (A half event is not JSON: no code in it.)
    if not isinstance(exc, mistral_errors.ResponseValidationError) or exc.status_code != 200:
        return None
    data = json.loads(exc.body).get("data")
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return None
    assert str(error["message"]).endswith(f"({error['code']})")
    return str(error["code"])


def vercel_code(exc: BaseException) -> str | None:
    # readUIMessageStream raises a plain Error with the error part's text.
    if isinstance(exc, VercelStreamError) and exc.name == "Error":
        match = _CODE_AT_END.search(exc.message)
        return match.group(1) if match else None
    return None


@dataclass(frozen=True)
class SDK:
    name: str
    read: Reader
    code_of: Callable[[BaseException], str | None]
    # What reading an answer cut inside an event does without streamwarden.
    mid_event_without_us: str  # "silent" or "raises without a code"


SDKS = [
    SDK("openai-chat", openai_chat_text, openai_code, "silent"),
    SDK("openai-responses", openai_responses_text, openai_code, "silent"),
    SDK("anthropic", anthropic_text, anthropic_code, "silent"),
    # Both parse the half event left at the end: UnknownApiResponseError,
    # json.JSONDecodeError.
    SDK("google-genai", gemini_text, gemini_code, "raises without a code"),
    SDK("ollama", ollama_text, ollama_code, "raises without a code"),
    SDK("cohere", cohere_text, cohere_code, "silent"),
    # Both read the half event left at the end: json.JSONDecodeError, and
    # mistralai's ResponseValidationError of a string that is no chunk.
    SDK("huggingface_hub", tgi_text, tgi_code, "raises without a code"),
    SDK("mistralai", mistral_text, mistral_code, "raises without a code"),
    SDK("vercel-ai", vercel_ui_text, vercel_code, "silent"),
]


def test_the_docs_name_every_sdk_of_the_matrix_and_the_class_each_raises() -> None:
    """docs/reference/errors.md's SDK table (``SDK_ERRORS``) is this matrix's."""
    import importlib

    from streamwarden.tools.reference import SDK_ERRORS

    assert set(SDK_ERRORS) == {sdk.name for sdk in SDKS}
    for name, (raised, _) in SDK_ERRORS.items():
        if name == "vercel-ai":
            continue  # JavaScript's Error, thrown by readUIMessageStream (vercel_reader.py)
        module, _, attribute = raised.rpartition(".")
        assert issubclass(getattr(importlib.import_module(module), attribute), Exception), raised


def sdk_params() -> list[Any]:
    return [sdk_param(sdk, sdk.name) for sdk in SDKS]


# -- replays --------------------------------------------------------------------------


async def test_openai_chat_sdk_ends_silently_on_truncation_and_raises_on_our_error(
    replay: Replay,
) -> None:
    cut = cut_before_terminal("openai_chat_text.sse", "/v1/chat/completions")
    # The problem: the SDK returns a shorter answer without any error.
    text = await openai_chat_text(replay(cut), {}, [])
    assert text  # it got the truncated answer and no exception
    # Through the relay: the same bytes plus the synthesized error event.
    with pytest.raises(openai.APIError) as caught:
        await openai_chat_text(replay(through_relay(cut, "/v1/chat/completions")), {}, [])
    assert caught.value.code == "stream_truncated"
    assert "stream_truncated" in caught.value.message


async def test_openai_responses_sdk_raises_on_our_error(replay: Replay) -> None:
    cut = cut_before_terminal("openai_responses_text.sse", "/v1/responses")
    assert await openai_responses_text(replay(cut), {}, [])  # silent without us
    with pytest.raises(openai.APIError) as caught:
        await openai_responses_text(replay(through_relay(cut, "/v1/responses")), {}, [])
    assert caught.value.code == "stream_truncated"


async def test_anthropic_sdk_ends_silently_on_truncation_and_raises_on_our_error(
    replay: Replay,
) -> None:
    cut = cut_before_terminal("anthropic_text.sse", "/v1/messages")
    assert await anthropic_text(replay(cut), {}, [])
    with pytest.raises(anthropic.APIStatusError) as caught:
        await anthropic_text(replay(through_relay(cut, "/v1/messages")), {}, [])
    assert caught.value.status_code == 200
    assert "stream_truncated" in str(caught.value)
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["error"]["code"] == "stream_truncated"


async def test_anthropic_sdk_ignores_an_unnamed_error_payload(replay: Replay) -> None:
    """Why the anthropic dialect names its error event: a bare data error is skipped."""
    cut = cut_before_terminal("anthropic_text.sse", "/v1/messages")
    bare = cut + b'data: {"type":"error","error":{"type":"api_error","message":"x"}}\n\n'
    assert await anthropic_text(replay(bare), {}, [])


GEMINI_PATH = "/v1beta/models/gemini-2.5-flash:streamGenerateContent"


async def test_google_genai_ends_silently_on_truncation_and_raises_api_error_on_ours(
    replay: Replay,
) -> None:
    cut = cut_before_terminal("gemini_text.sse", GEMINI_PATH)
    assert await gemini_text(replay(cut), {}, [])  # the problem: silent
    with pytest.raises(genai.errors.APIError) as caught:
        await gemini_text(replay(through_relay(cut, GEMINI_PATH)), {}, [])
    assert isinstance(caught.value, genai.errors.ServerError)
    assert (caught.value.code, caught.value.status) == (500, "INTERNAL")
    assert gemini_code(caught.value) == "stream_truncated"


async def test_google_genai_crashes_on_an_error_whose_code_is_a_string(replay: Replay) -> None:
    """Why the Gemini error's ``code`` is the integer status: google-genai compares it."""
    cut = cut_before_terminal("gemini_text.sse", GEMINI_PATH)
    string_code = (
        b'data: {"error":{"code":"stream_truncated","message":"streamwarden: cut'
        b' (stream_truncated)","status":"INTERNAL"}}\n\n'
    )
    with pytest.raises(TypeError):
        await gemini_text(replay(cut + string_code), {}, [])


async def test_cohere_sdk_raises_on_no_event_and_hands_over_our_message_end(
    replay: Replay,
) -> None:
    """Why the cohere dialect's cut also breaks the body: no event makes its SDK raise.

    An ``error`` event is skipped (its type is none of the SDK's); our
    ``message-end`` is handed over with the code, and the SDK ends quietly
    all the same when the body ends cleanly after it.
    """
    cut = cut_before_terminal("cohere_text.sse", "/v2/chat")
    assert await cohere_text(replay(cut), {}, [])  # the problem: silent
    error = b'event: error\ndata: {"type":"error","error":{"message":"x (stream_truncated)"}}\n\n'
    assert await cohere_text(replay(cut + error), {}, [])
    ours = through_relay(cut, "/v2/chat")
    assert ours.endswith(b'(stream_truncated)"}}\n\n')
    assert await cohere_text(replay(ours), {}, [])


# -- the matrix: every SDK, every fault, directly and through the sidecar --------------

TOKENS = 6
FULL_ANSWER = mock_text(TOKENS)
FAST = {"x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": str(TOKENS)}
GIANT = 1 << 20
SIDECAR = {"upstream_idle_timeout": "300ms", "max_event_bytes": "64KiB"}
# How long a direct read of a silent upstream is given: three times what the
# sidecar needs to give up on it.
HANG = 1.0

FAULTS = {
    "truncate": "stream_truncated",
    "truncate-mid": "stream_truncated",
    "stall": "upstream_timeout",
    "giant-event": "event_too_large",
    "reset": "upstream_error",
}


def fault_headers(fault: str) -> dict[str, str]:
    return {**FAST, "x-mock-fault": fault, "x-mock-size": str(GIANT)}


async def outcome(sdk: SDK, base_url: str, fault: str) -> tuple[str, BaseException | None]:
    """Read one answer; return the text that arrived and what was raised, if anything."""
    got: list[str] = []
    try:
        await sdk.read(base_url, fault_headers(fault), got)
    except Exception as exc:  # what the SDK raised is the point
        return "".join(got), exc
    return "".join(got), None


@pytest.mark.parametrize("sdk", sdk_params())
async def test_without_streamwarden_each_sdk_reads_a_whole_answer(
    mock: MockServer, sdk: SDK
) -> None:
    got: list[str] = []
    assert await sdk.read(mock.url, FAST, got) == FULL_ANSWER


@pytest.mark.parametrize("sdk", sdk_params())
async def test_through_streamwarden_each_sdk_reads_the_same_whole_answer(
    mock: MockServer, start_sidecar: StartSidecar, sdk: SDK
) -> None:
    sidecar = await start_sidecar(mock.url, **SIDECAR)
    assert await sdk.read(sidecar.proxy_url, FAST, []) == FULL_ANSWER


@pytest.mark.parametrize("sdk", sdk_params())
async def test_without_streamwarden_a_cut_stream_is_a_silently_short_answer(
    mock: MockServer, sdk: SDK
) -> None:
    text, raised = await outcome(sdk, mock.url, "truncate")
    assert raised is None
    assert FULL_ANSWER.startswith(text) and len(text) < len(FULL_ANSWER)


@pytest.mark.parametrize("sdk", sdk_params())
async def test_without_streamwarden_a_stream_cut_inside_an_event_gives_no_reason(
    mock: MockServer, sdk: SDK
) -> None:
    text, raised = await outcome(sdk, mock.url, "truncate-mid")
    assert FULL_ANSWER.startswith(text) and len(text) < len(FULL_ANSWER)
    if sdk.mid_event_without_us == "silent":
        assert raised is None
    else:
        assert raised is not None and sdk.code_of(raised) is None


@pytest.mark.parametrize("sdk", sdk_params())
async def test_without_streamwarden_a_silent_upstream_hangs_the_sdk(
    mock: MockServer, sdk: SDK
) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(HANG):
            await outcome(sdk, mock.url, "stall")


@pytest.mark.parametrize("sdk", sdk_params())
async def test_without_streamwarden_a_giant_event_reaches_the_sdk_whole(
    mock: MockServer, sdk: SDK
) -> None:
    text, raised = await outcome(sdk, mock.url, "giant-event")
    assert raised is None
    assert len(text) > GIANT // 2


@pytest.mark.parametrize("sdk", sdk_params())
async def test_without_streamwarden_a_reset_is_an_error_without_a_reason(
    mock: MockServer, sdk: SDK
) -> None:
    _, raised = await outcome(sdk, mock.url, "reset")
    assert raised is not None
    assert sdk.code_of(raised) is None


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("sdk", sdk_params())
async def test_through_streamwarden_each_fault_raises_the_sdks_own_error_with_our_code(
    mock: MockServer, start_sidecar: StartSidecar, sdk: SDK, fault: str
) -> None:
    sidecar = await start_sidecar(mock.url, **SIDECAR)
    text, raised = await outcome(sdk, sidecar.proxy_url, fault)
    assert raised is not None, f"{sdk.name} ended silently on {fault}"
    assert sdk.code_of(raised) == FAULTS[fault], repr(raised)
    # What came before the failure was delivered, and nothing of the broken event.
    assert FULL_ANSWER.startswith(text) and len(text) < len(FULL_ANSWER)


async def test_cohere_an_upstream_reset_raises_through_streamwarden_as_it_does_directly(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    """Issue 38's case: the sidecar must not turn a broken body into a quiet end.

    Directly the SDK raises its transport's error on the reset; through the
    sidecar it once got our error event and a clean end, skipped the one and
    returned on the other.
    """
    cohere_sdk = next(sdk for sdk in SDKS if sdk.name == "cohere")
    text, raised = await outcome(cohere_sdk, mock.url, "reset")
    assert isinstance(raised, httpx.TransportError)
    sidecar = await start_sidecar(mock.url, **SIDECAR)
    through, raised = await outcome(cohere_sdk, sidecar.proxy_url, "reset")
    assert isinstance(raised, httpx.TransportError), "quieter through streamwarden"
    assert through == text  # the same text before the failure
    assert cohere_code(raised) == "upstream_error"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("sdk", [s for s in SDKS if s.name != "vercel-ai"], ids=lambda s: s.name)
async def test_through_the_middleware_each_sdk_raises_on_every_fault_and_reads_a_whole_answer(
    mock: MockServer, sdk: SDK
) -> None:
    """The middleware, in front of an app that streams its provider's answer on: as the sidecar.

    (The app's own read of a reset upstream raises mid-body: the middleware's
    upstream_error. The Vercel AI reader runs in Node against the sidecar only.)
    """
    guarded = StreamWardenMiddleware(relaying(mock.url), keepalive_interval=0, **SIDECAR)
    async with serve_in_process(guarded) as base:
        assert await sdk.read(base, FAST, []) == FULL_ANSWER
        for fault, code in FAULTS.items():
            text, raised = await outcome(sdk, base, fault)
            assert raised is not None, f"{sdk.name} silent on {fault}"
            assert sdk.code_of(raised) == code, repr(raised)
            assert FULL_ANSWER.startswith(text) and len(text) < len(FULL_ANSWER)
