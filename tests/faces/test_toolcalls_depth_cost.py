"""Tool calls against an upstream that nests deep, opens thousands, or runs calls side by side.

Each case is first read directly (a real aiohttp upstream, no streamwarden),
then through the sidecar and through the middleware (an app streaming the
same bytes), with httpx:

- **Depth.** A Gemini ``functionCall`` whose ``args`` nest a thousand deep
  used to crash the serializer: the stream stopped with no error event and
  no chunked end, and was logged ``client_cancelled``. Now the call is
  refused before anything writes it again (``max_tool_arguments_depth``,
  ``tool_call_too_large``, end state ``limit_exceeded``), in its dialect's
  error event, and the body ends cleanly. Arguments streamed as text (an
  OpenAI call) are held to the same depth, which a setting raises.
- **Cost.** With thousands of calls open on one choice, each
  ``finish_reason`` of another choice used to walk them all. The relay
  (which both faces run) takes a flood of such events with a hundred
  thousand calls open within a CPU budget that only a walk of them all
  could exceed: a bound for a hang, not a speed claim (the speed is
  ``bench/``'s).
- **Cuts.** With parallel OpenAI calls open, a cut used to name the first
  call even when its arguments were whole; it names every call it broke.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest
from aiohttp import web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from middleware_apps import serve_in_process
from sidecars import StartSidecar
from sse_reference import reference_decode
from streamwarden.core.meter import EndState
from streamwarden.core.sse import Event
from streamwarden.middleware import StreamWardenMiddleware
from tool_streams import BY_NAME, LIMITS, error_of
from upstreams import ServeUpstream
from waiting import wait_for

SSE = {"Content-Type": "text/event-stream"}
CHAT_PATH = "/v1/chat/completions"
GEMINI_PATH = "/v1beta/models/g:streamGenerateContent?alt=sse"
CHAT = BY_NAME["openai-chat"]
GEMINI = BY_NAME["gemini"]


def sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


def nested(levels: int) -> str:
    """A JSON object ``levels`` deep, written by hand (``json.dumps`` would recurse)."""
    return '{"a":' * (levels - 1) + '{"b":1}' + "}" * (levels - 1)


# -- the upstream and the app: both stream the bytes staged for a path -----------------


@dataclass
class Stage:
    bodies: dict[str, bytes] = field(default_factory=dict)

    def body(self, path: str) -> bytes:
        return self.bodies[path]

    def pieces(self, path: str, size: int = 16 * 1024) -> list[bytes]:
        body = self.body(path)
        return [body[at : at + size] for at in range(0, len(body), size)]


@pytest.fixture
async def stage(serve_upstream: ServeUpstream) -> tuple[Stage, str]:
    """A real upstream: every POST gets the bytes staged for its path, then a clean end."""
    staged = Stage()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers=SSE)
        await response.prepare(request)
        for piece in staged.pieces(request.path_qs):
            await response.write(piece)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    return staged, await serve_upstream(app)


def guarded_app(staged: Stage, **settings: Any) -> StreamWardenMiddleware:
    """An app streaming the staged bytes itself, behind the middleware."""

    async def answer(request: Request) -> StreamingResponse:
        await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")

        async def body() -> AsyncIterator[bytes]:
            for piece in staged.pieces(path):
                yield piece

        return StreamingResponse(body(), headers=SSE)

    app = Starlette(routes=[Route("/{tail:path}", answer, methods=["POST"])])
    return StreamWardenMiddleware(app, keepalive_interval=0, **settings)


@dataclass
class Read:
    events: list[Event]
    #: The body ended as HTTP/1.1 says (its chunked terminator came).
    ended_cleanly: bool


async def read(base: str, path: str) -> Read:
    raw = b""
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", base + path, json={"stream": True}) as response,
    ):
        assert response.status_code == 200
        try:
            async for chunk in response.aiter_raw():
                raw += chunk
        except httpx.RemoteProtocolError:
            return Read(reference_decode(raw)[0], False)
    return Read(reference_decode(raw)[0], True)


# -- depth ---------------------------------------------------------------------------------


def gemini_stream(args: str) -> bytes:
    def chunk(parts: str, finish: str = "") -> bytes:
        end = f',"finishReason":"{finish}"' if finish else ""
        return sse(f'{{"candidates":[{{"content":{{"role":"model","parts":[{parts}]}}{end}}}]}}')

    call = f'{{"functionCall":{{"name":"lookup","args":{args}}}}}'
    return chunk('{"text":"Looking it up."}') + chunk(call) + chunk('{"text":""}', "STOP")


async def a_deep_gemini_call_ends_in_its_error_event(direct: str, guarded: str, path: str) -> None:
    # Directly: the call passes whole, a thousand levels deep; a Python client
    # parsing it hits its own recursion limit.
    plain = await read(direct, path)
    assert plain.ended_cleanly and len(plain.events) == 3
    with pytest.raises(RecursionError):
        json.loads(plain.events[1].data)
    # Through streamwarden: the text, then Google's error object in place of
    # the call, and the body's proper end.
    through = await read(guarded, path)
    assert through.ended_cleanly, "the stream stopped without its chunked end"
    assert [e.data for e in through.events[:1]] == [plain.events[0].data]
    assert len(through.events) == 2, [e.data[:80] for e in through.events]
    code, message = error_of(GEMINI, through.events[1])
    assert code == "tool_call_too_large", message
    assert "(lookup)" in message and "128 levels (max_tool_arguments_depth)" in message


async def test_the_sidecar_ends_a_gemini_call_a_thousand_deep_with_its_error_event(
    stage: tuple[Stage, str], start_sidecar: StartSidecar
) -> None:
    staged, upstream = stage
    staged.bodies[GEMINI_PATH] = gemini_stream(nested(1000))
    sidecar = await start_sidecar(upstream)
    await a_deep_gemini_call_ends_in_its_error_event(upstream, sidecar.proxy_url, GEMINI_PATH)
    await wait_for(lambda: len(sidecar.tracker.finished) == 1)
    (record,) = sidecar.tracker.finished
    assert record.meter.end_state is EndState.LIMIT_EXCEEDED  # not client_cancelled
    (call,) = record.meter.as_record()["tool_calls"]
    assert (call["name"], call["end_state"]) == ("lookup", "too_large")


async def test_the_middleware_ends_a_gemini_call_a_thousand_deep_with_its_error_event(
    stage: tuple[Stage, str],
) -> None:
    staged, upstream = stage
    staged.bodies[GEMINI_PATH] = gemini_stream(nested(1000))
    guarded = guarded_app(staged)
    async with serve_in_process(guarded) as base:
        await a_deep_gemini_call_ends_in_its_error_event(upstream, base, GEMINI_PATH)
        await wait_for(lambda: len(guarded.streams.finished) == 1)
    assert guarded.streams.finished[0].meter.end_state is EndState.LIMIT_EXCEEDED


def chat_chunk(calls: list[dict[str, Any]] | None = None, finish: str | None = None) -> bytes:
    delta = {"tool_calls": calls} if calls else {}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return sse(json.dumps({"choices": [choice]}))


def chat_call(index: int, arguments: str, call_id: str = "", name: str = "") -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id:
        call |= {"id": call_id, "type": "function"}
        call["function"]["name"] = name
    return call


def chat_call_of(arguments: str) -> bytes:
    """One OpenAI call whose arguments stream in pieces, closed by its finish_reason."""
    pieces = [arguments[at : at + 500] for at in range(0, len(arguments), 500)]
    return (
        chat_chunk([chat_call(0, "", "call_deep", "lookup")])
        + b"".join(chat_chunk([chat_call(0, piece)]) for piece in pieces)
        + chat_chunk(finish="tool_calls")
        + b"data: [DONE]\n\n"
    )


async def test_arguments_streamed_as_text_are_held_to_max_tool_arguments_depth(
    stage: tuple[Stage, str], start_sidecar: StartSidecar
) -> None:
    staged, upstream = stage
    staged.bodies[CHAT_PATH] = chat_call_of(nested(200))
    # Directly: 200 levels are a whole JSON object, as a client parses it.
    plain = await read(upstream, CHAT_PATH)
    assert json.loads("".join(_chat_arguments(plain.events)))["a"]
    loose = await start_sidecar(upstream, max_tool_arguments_depth=256)
    guarded = guarded_app(staged)
    async with serve_in_process(guarded) as base:
        for face in ((await start_sidecar(upstream)).proxy_url, base):
            through = await read(face, CHAT_PATH)
            code, message = error_of(CHAT, through.events[-1])
            assert code == "tool_call_too_large", message
            assert "call_deep (lookup)" in message and "128 levels" in message, message
            # In place of the close: the client never holds a finished call.
            # In place of the finish that closes the call, and [DONE] after it.
            assert [e.data for e in through.events[:-1]] == [e.data for e in plain.events[:-2]]
    # A route that allows 256 levels passes it as it came.
    assert [e.data for e in (await read(loose.proxy_url, CHAT_PATH)).events] == [
        e.data for e in plain.events
    ]


def _chat_arguments(events: list[Event]) -> list[str]:
    return [
        call["function"].get("arguments", "")
        for event in events
        if event.data.startswith("{")
        for choice in json.loads(event.data)["choices"]
        for call in choice["delta"].get("tool_calls") or ()
    ]


# -- depth, in the relay of every dialect --------------------------------------------------


def responses_event(kind: str, body: str) -> bytes:
    return f'event: {kind}\ndata: {{"type":"{kind}",{body}}}\n\n'.encode()


def cohere_event(kind: str, body: str) -> bytes:
    return f'event: {kind}\ndata: {{"type":"{kind}",{body}}}\n\n'.encode()


def ui_part(body: str) -> bytes:
    return f"data: {{{body}}}\n\n".encode()


DEEP = nested(300)
ITEM = '"output_index":0,"item":{"type":"function_call","id":"fc_1","call_id":"call_deep",'
DEEP_CALLS: dict[str, bytes] = {
    "openai-chat": chat_call_of(DEEP),
    "openai-responses": responses_event("response.output_item.added", ITEM + '"name":"lookup"}')
    + responses_event(
        "response.function_call_arguments.delta", f'"output_index":0,"delta":{json.dumps(DEEP)}'
    )
    + responses_event(
        "response.function_call_arguments.done", f'"output_index":0,"arguments":{json.dumps(DEEP)}'
    ),
    "anthropic": b"event: content_block_start\ndata: "
    + b'{"type":"content_block_start","index":0,"content_block":'
    + b'{"type":"tool_use","id":"call_deep","name":"lookup","input":{}}}\n\n'
    + b"event: content_block_delta\ndata: "
    + b'{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta",'
    + f'"partial_json":{json.dumps(DEEP)}}}}}\n\n'.encode()
    + b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
    "gemini": gemini_stream(DEEP),
    "cohere": cohere_event(
        "tool-call-start",
        '"index":0,"delta":{"message":{"tool_calls":{"id":"call_deep","type":"function",'
        '"function":{"name":"lookup","arguments":""}}}}',
    )
    + cohere_event(
        "tool-call-delta",
        '"index":0,"delta":{"message":{"tool_calls":{"function":{"arguments":'
        f"{json.dumps(DEEP)}}}}}}}}}",
    )
    + cohere_event("tool-call-end", '"index":0'),
    # Vertex's streamed arguments: a piece whose value nests past the limit.
    "gemini-streamed": sse(
        '{"candidates":[{"content":{"role":"model","parts":[{"functionCall":'
        '{"name":"lookup","willContinue":true,"partialArgs":'
        f'[{{"jsonPath":"$.q","structValue":{DEEP}}}]}}}}]}}}}]}}'
    ),
    "vercel-ui": ui_part('"type":"tool-input-start","toolCallId":"call_deep","toolName":"lookup"')
    + ui_part(
        f'"type":"tool-input-available","toolCallId":"call_deep","toolName":"lookup","input":{DEEP}'
    ),
    "vercel-data": b'b:{"toolCallId":"call_deep","toolName":"lookup"}\n'
    + f'9:{{"toolCallId":"call_deep","toolName":"lookup","args":{DEEP}}}\n'.encode(),
}


@pytest.mark.parametrize("name", sorted(DEEP_CALLS))
def test_every_dialect_refuses_arguments_nested_past_the_limit(name: str) -> None:
    stream = BY_NAME[name]
    relay = stream.relay()
    out = relay.feed(DEEP_CALLS[name], 1.0)
    code, message = error_of(stream, stream.decode(out)[-1])
    assert code == "tool_call_too_large" and "(lookup)" in message, message
    assert "nest deeper than 128 levels" in message, message
    assert relay.end_state is EndState.LIMIT_EXCEEDED
    # Allowed deeper (as far as json itself parses and writes with room to spare), it passes.
    relay = stream.relay(replace(LIMITS, max_tool_arguments_depth=512))
    out = relay.feed(DEEP_CALLS[name], 1.0)
    assert b"tool_call_" not in out, name


def test_a_recursion_no_measure_foresaw_still_ends_the_stream_with_its_error_event() -> None:
    """The net under the measures: with the stack nearly spent, writing a Gemini call's
    ``args`` (300 levels: measured, allowed by the ceiling) recurses past the limit."""
    relay = GEMINI.relay()
    depth = len(_frames())
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 150)
    try:
        out = relay.feed(gemini_stream(DEEP), 1.0)
    finally:
        sys.setrecursionlimit(limit)
    code, message = error_of(GEMINI, GEMINI.decode(out)[-1])
    assert code == "event_too_large" and "nested deeper" in message, message
    assert relay.end_state is EndState.LIMIT_EXCEEDED


def _frames() -> list[Any]:
    frame = sys._getframe()
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back  # type: ignore[assignment]
    return frames


# -- cost ----------------------------------------------------------------------------------

OPEN = 100_000
FINISHES = 50_000
#: CPU seconds the flood may take, as a bound that fails a quadratic relay
#: rather than a speed claim: walking the open calls at each finish is
#: 5 * 10^9 steps (minutes, compiled); a finish that touches only its own
#: choice's calls takes a second or two, from source too.
BUDGET = 60.0


class OverBudget(Exception):
    """The flood took more CPU than any relay whose finish ignores other calls would."""


def chat_event(index: int, body: dict[str, Any]) -> bytes:
    return sse(json.dumps({"choices": [{"index": index, **body}]}, separators=(",", ":")))


def test_a_finish_costs_the_same_whatever_the_calls_open_on_another_choice() -> None:
    """Calls opened on choice 1, then a flood of choice 0's finish_reason events.

    Fed one event at a time, so that the CPU timer's signal is seen between
    two (a compiled relay sees none inside a call).
    """
    # Each open call's held state counts against the bound: room for all of them.
    relay = CHAT.relay(replace(LIMITS, max_tool_arguments_bytes=1 << 30))
    opened = [
        chat_event(1, {"delta": {"tool_calls": [chat_call(n, "", f"c{n}", "f")]}})
        for n in range(OPEN)
    ]
    finish = chat_event(0, {"delta": {}, "finish_reason": "stop"})

    def over_budget(signum: int, frame: object) -> None:
        raise OverBudget(f"{OPEN} calls open: {FINISHES} finishes took over {BUDGET} s of CPU")

    previous = signal.signal(signal.SIGPROF, over_budget)
    signal.setitimer(signal.ITIMER_PROF, BUDGET)
    written = 0
    try:
        for event in opened:
            written += len(relay.feed(event, 1.0))
        for _ in range(FINISHES):
            written += len(relay.feed(finish, 1.0))
        last = relay.feed(b"data: [DONE]\n\n", 1.0)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
    assert last == b"data: [DONE]\n\n"
    assert written == sum(map(len, opened)) + FINISHES * len(finish)


# -- cuts ----------------------------------------------------------------------------------

# Three calls side by side: the first's arguments whole, the other two cut.
PARALLEL = (
    chat_chunk([chat_call(0, "", "call_a", "first")])
    + chat_chunk([chat_call(0, '{"city": "Paris"}')])
    + chat_chunk([chat_call(1, "", "call_b", "second")])
    + chat_chunk([chat_call(1, '{"city": "Lo')])
    + chat_chunk([chat_call(2, "", "call_c", "third")])
    + chat_chunk([chat_call(2, '{"ci')])
)


async def a_cut_names_the_calls_it_broke(direct: str, guarded: str) -> None:
    # Directly: the stream just ends; the client holds one whole call and two halves.
    plain = await read(direct, CHAT_PATH)
    assert plain.ended_cleanly and _chat_arguments(plain.events)[1::2] == [
        '{"city": "Paris"}',
        '{"city": "Lo',
        '{"ci',
    ]
    through = await read(guarded, CHAT_PATH)
    code, message = error_of(CHAT, through.events[-1])
    assert code == "tool_call_truncated", message
    assert "inside 2 tool calls: tool call call_b (second), with 12 bytes" in message, message
    assert "tool call call_c (third), with 4 bytes" in message, message
    assert "call_a" not in message and "(first)" not in message, message


async def test_the_sidecar_names_every_call_a_cut_broke_and_no_whole_one(
    stage: tuple[Stage, str], start_sidecar: StartSidecar
) -> None:
    staged, upstream = stage
    staged.bodies[CHAT_PATH] = PARALLEL
    sidecar = await start_sidecar(upstream)
    await a_cut_names_the_calls_it_broke(upstream, sidecar.proxy_url)
    await wait_for(lambda: len(sidecar.tracker.finished) == 1)
    assert sidecar.tracker.finished[0].meter.end_state is EndState.UPSTREAM_TRUNCATED


async def test_the_middleware_names_every_call_a_cut_broke_and_no_whole_one(
    stage: tuple[Stage, str],
) -> None:
    staged, upstream = stage
    staged.bodies[CHAT_PATH] = PARALLEL
    guarded = guarded_app(staged)
    async with serve_in_process(guarded) as base:
        await a_cut_names_the_calls_it_broke(upstream, base)


def test_a_cut_with_only_whole_calls_open_names_them_all() -> None:
    """No call's arguments are broken: the cut kept the close from each, so each is named."""
    data = chat_chunk([chat_call(0, '{"q": 1}', "call_a", "first")]) + chat_chunk(
        [chat_call(1, '{"q": 2}', "call_b", "second")]
    )
    relay = CHAT.relay()
    out = relay.feed(data, 1.0) + relay.upstream_eof(2.0)
    code, message = error_of(CHAT, CHAT.decode(out)[-1])
    assert code == "tool_call_truncated" and "inside 2 tool calls" in message, message
    assert "call_a (first)" in message and "call_b (second)" in message, message


def test_a_cut_names_the_first_16_calls_it_broke_and_counts_the_rest() -> None:
    data = b"".join(chat_chunk([chat_call(n, '{"q', f"call_{n}", "f")]) for n in range(40))
    relay = CHAT.relay()
    out = relay.feed(data, 1.0) + relay.upstream_eof(2.0)
    _, message = error_of(CHAT, CHAT.decode(out)[-1])
    assert "inside 40 tool calls" in message and "; and 24 more" in message, message
    assert "call_15 (f)" in message and "call_16 (f)" not in message, message
