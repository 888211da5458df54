"""Output filters read every text a reader reads, decoded, each text on its own.

The first round of filters read the answer's content; a key still reached
the client whole where the text lay elsewhere, or was written otherwise:

- in a spoken answer's transcript (Chat Completions' ``delta.audio.transcript``,
  the Responses API's ``response.audio.transcript.delta``), split across
  events or written with ``\\u`` escapes;
- in a generic stream whose JSON writes the key with ``\\u`` escapes;
- right after markdown's ``_`` (``_sk-..._``, emphasis), which the start-of-key
  rule took for a word character;
- in the arguments of one tool call whose fragments interleave with
  another call's: the calls are two texts, a reader (an SDK) assembles each
  by its index, but the filters read them as one.

Each case first shows the key reaching the reader (no filters, or
streamwarden as it was), then its absence through the core, the sidecar
with a real upstream, and the middleware in a Starlette app under uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from filter_streams import BLOCK, REDACT, SECRET, compact_json, relay, run, split_secret
from middleware_apps import serve_in_process
from sidecars import StartSidecar
from streamwarden.core.filters import REDACTED, FilterRule, compile_filters
from streamwarden.core.meter import EndState
from streamwarden.core.sse import SSEDecoder
from streamwarden.middleware import StreamWardenMiddleware
from upstreams import ServeUpstream
from waiting import wait_for

TEXT = f"Your key is {SECRET} and nothing else."
PIECES = split_secret(TEXT, SECRET, 3)
BODY = SECRET[8:]  # what must never be read, whole or in part


def escaped(text: str) -> str:
    """``text`` as a JSON string's inside, every character a ``\\u`` escape."""
    return "".join(f"\\u{ord(c):04x}" for c in text)


def _pieces_of_body_in(text: str) -> list[str]:
    """The six-character pieces of the key's body that ``text`` holds."""
    return [BODY[i : i + 6] for i in range(len(BODY) - 5) if BODY[i : i + 6] in text]


def _sse(data: str, kind: str | None = None) -> str:
    return (f"event: {kind}\n" if kind else "") + f"data: {data}\n\n"


# -- the streams, as their providers write them ----------------------------------------


def chat_transcript(pieces: list[str], escape: bool = False) -> bytes:
    """A spoken Chat Completions answer: its transcript in ``delta.audio.transcript``."""
    out = []
    for p in pieces:
        said = escaped(p) if escape else p
        audio = '{"id":"au_1","data":"UklGRg==","transcript":"' + said + '"}'
        out.append(_sse('{"id":"c1","choices":[{"index":0,"delta":{"audio":' + audio + "}}]}"))
    return ("".join(out) + _sse("[DONE]")).encode()


def responses_transcript(pieces: list[str], escape: bool = False) -> bytes:
    """A spoken Responses answer: ``response.audio.transcript.delta`` events."""
    kind = "response.audio.transcript.delta"
    out = [
        _sse(
            compact_json({"type": "response.created", "response": {"id": "r1"}}), "response.created"
        )
    ]
    for p in pieces:
        said = escaped(p) if escape else p
        out.append(_sse('{"type":"' + kind + '","delta":"' + said + '"}', kind))
    done = {"type": "response.completed", "response": {"id": "r1", "status": "completed"}}
    out.append(_sse(compact_json(done), "response.completed"))
    return "".join(out).encode()


def generic_escaped(pieces: list[str]) -> bytes:
    """A generic stream of JSON events whose writer escapes every non-space character."""
    out = []
    for p in pieces:
        out.append(_sse('{"text":"' + "".join(c if c == " " else escaped(c) for c in p) + '"}'))
    return "".join(out).encode()


def chat_content(pieces: list[str]) -> bytes:
    out = [
        _sse(compact_json({"id": "c1", "choices": [{"index": 0, "delta": {"content": p}}]}))
        for p in pieces
    ]
    return ("".join(out) + _sse("[DONE]")).encode()


CALLS = [
    {"index": 0, "id": "call_a", "type": "function", "function": {"name": "save", "arguments": ""}},
    {"index": 1, "id": "call_b", "type": "function", "function": {"name": "log", "arguments": ""}},
]


def chat_interleaved_calls(key_call: list[str], other_call: list[str]) -> bytes:
    """Two tool calls of one choice, their argument fragments taking turns."""

    def chunk(calls: list[dict[str, Any]], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": {"tool_calls": calls}, "finish_reason": finish}
        return _sse(compact_json({"id": "c1", "choices": [choice]}))

    out = [chunk([CALLS[0]]), chunk([CALLS[1]])]
    for mine, theirs in zip(key_call, other_call, strict=True):
        out.append(chunk([{"index": 0, "function": {"arguments": mine}}]))
        out.append(chunk([{"index": 1, "function": {"arguments": theirs}}]))
    out.append(
        _sse(
            compact_json(
                {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
            )
        )
    )
    return ("".join(out) + _sse("[DONE]")).encode()


def anthropic_interleaved_calls(key_call: list[str], other_call: list[str]) -> bytes:
    def block(kind: str, data: dict[str, Any]) -> str:
        return _sse(compact_json({"type": kind, **data}), kind)

    out = [block("message_start", {"message": {"id": "m1", "usage": {"output_tokens": 1}}})]
    for index, name in ((0, "save"), (1, "log")):
        tool = {"type": "tool_use", "id": f"tu_{index}", "name": name, "input": {}}
        out.append(block("content_block_start", {"index": index, "content_block": tool}))
    for mine, theirs in zip(key_call, other_call, strict=True):
        for index, piece in ((0, mine), (1, theirs)):
            delta = {"type": "input_json_delta", "partial_json": piece}
            out.append(block("content_block_delta", {"index": index, "delta": delta}))
    out += [block("content_block_stop", {"index": 0}), block("content_block_stop", {"index": 1})]
    out.append(block("message_stop", {}))
    return "".join(out).encode()


def responses_interleaved_calls(key_call: list[str], other_call: list[str]) -> bytes:
    def event(kind: str, **data: Any) -> str:
        return _sse(compact_json({"type": kind, **data}), kind)

    out = [event("response.created", response={"id": "r1", "output": []})]
    for index, name in ((0, "save"), (1, "log")):
        item = {"type": "function_call", "id": f"fc_{index}", "call_id": f"call_{index}"}
        out.append(
            event(
                "response.output_item.added",
                output_index=index,
                item={**item, "name": name, "arguments": ""},
            )
        )
    kind = "response.function_call_arguments.delta"
    for mine, theirs in zip(key_call, other_call, strict=True):
        out.append(event(kind, item_id="fc_0", output_index=0, delta=mine))
        out.append(event(kind, item_id="fc_1", output_index=1, delta=theirs))
    done = {"id": "r1", "status": "completed", "output": [], "usage": {"output_tokens": 3}}
    out.append(event("response.completed", response=done))
    return "".join(out).encode()


KEY_ARGS = split_secret('{"key":"' + SECRET + '"}', SECRET, 3)
OTHER_ARGS = ['{"line":', '"sk-', "", "saved", '"}'][: len(KEY_ARGS)]
OTHER_ARGS += [""] * (len(KEY_ARGS) - len(OTHER_ARGS))


# -- what a reader assembles -------------------------------------------------------------


def _events(stream: bytes) -> list[Any]:
    return [e for e in SSEDecoder().feed(stream) if e.data != "[DONE]"]


def chat_transcript_read(stream: bytes) -> str:
    out = ""
    for e in _events(stream):
        for choice in json.loads(e.data).get("choices", []):
            out += ((choice.get("delta") or {}).get("audio") or {}).get("transcript", "")
    return out


def responses_deltas_read(stream: bytes) -> str:
    return "".join(json.loads(e.data).get("delta", "") for e in _events(stream))


def generic_read(stream: bytes) -> str:
    return "".join(json.loads(e.data)["text"] for e in _events(stream))


def chat_content_read(stream: bytes) -> str:
    out = ""
    for e in _events(stream):
        for choice in json.loads(e.data).get("choices", []):
            out += (choice.get("delta") or {}).get("content") or ""
    return out


def calls_read(stream: bytes) -> dict[int, str]:
    """Each call's arguments, assembled by its index as an SDK does (any of the three APIs)."""
    calls: dict[int, str] = {}
    for e in _events(stream):
        data = json.loads(e.data)
        if data.get("type") == "content_block_delta":
            calls[data["index"]] = calls.get(data["index"], "") + data["delta"]["partial_json"]
        elif data.get("type") == "response.function_call_arguments.delta":
            index = data["output_index"]
            calls[index] = calls.get(index, "") + data["delta"]
        for choice in data.get("choices", []):
            for call in (choice.get("delta") or {}).get("tool_calls") or []:
                piece = call.get("function", {}).get("arguments", "")
                calls[call["index"]] = calls.get(call["index"], "") + piece
    return calls


def _holding_the_key(pieces: list[str]) -> int:
    """How many of ``pieces`` hold a character of the key."""
    start = "".join(pieces).index(SECRET)
    end, offset, count = start + len(SECRET), 0, 0
    for piece in pieces:
        count += offset < end and offset + len(piece) > start
        offset += len(piece)
    return count


def _only_the_keys_events_changed(stream: bytes, out: bytes, pieces: list[str]) -> None:
    """The events a piece of the key is in changed, and stayed JSON; every other is as it came."""
    sent, got = SSEDecoder().feed(stream), SSEDecoder().feed(out)
    assert [e.event for e in got] == [e.event for e in sent]
    changed = [after.data for before, after in zip(sent, got, strict=True) if after != before]
    assert len(changed) == _holding_the_key(pieces)
    for data in changed:
        json.loads(data)
        assert _pieces_of_body_in(data) == []


# -- the core: each dialect's texts ----------------------------------------------------------

CHAT = "openai-chat"


@pytest.mark.parametrize("escape", [False, True], ids=["split", "split-and-escaped"])
def test_a_key_in_a_chat_audio_transcript_is_redacted(escape: bool) -> None:
    stream = chat_transcript(PIECES, escape)
    assert SECRET in chat_transcript_read(run(relay(CHAT), [stream]))  # the problem
    r = relay(CHAT, REDACT)
    out = run(r, [stream])
    assert r.end_state is EndState.COMPLETED
    said = chat_transcript_read(out)
    assert _pieces_of_body_in(said) == [] and said == TEXT.replace(SECRET, REDACTED)
    _only_the_keys_events_changed(stream, out, PIECES)
    blocked = relay(CHAT, BLOCK)
    out = run(blocked, [stream])
    assert blocked.end_state is EndState.BLOCKED
    assert _pieces_of_body_in(chat_transcript_read(out.rsplit(b'data: {"error"', 1)[0])) == []


@pytest.mark.parametrize("escape", [False, True], ids=["split", "split-and-escaped"])
def test_a_key_in_a_responses_audio_transcript_is_redacted(escape: bool) -> None:
    stream = responses_transcript(PIECES, escape)
    assert SECRET in responses_deltas_read(run(relay("openai-responses"), [stream]))
    r = relay("openai-responses", REDACT)
    out = run(r, [stream])
    assert r.end_state is EndState.COMPLETED
    said = responses_deltas_read(out)
    assert _pieces_of_body_in(said) == [] and said == TEXT.replace(SECRET, REDACTED)
    _only_the_keys_events_changed(stream, out, PIECES)


def test_a_key_written_with_escapes_in_a_generic_streams_json_is_redacted() -> None:
    whole = generic_escaped([TEXT])
    assert SECRET.encode() not in whole and generic_read(whole) == TEXT  # what a reader reads
    r = relay("generic", REDACT)
    out = run(r, [whole])
    assert r.end_state is EndState.COMPLETED
    assert generic_read(out) == TEXT.replace(SECRET, REDACTED)
    blocked = relay("generic", BLOCK)
    out = run(blocked, [whole])
    assert blocked.end_state is EndState.BLOCKED and _pieces_of_body_in(out.decode()) == []


def test_a_cut_a_generic_events_json_cannot_take_back_fails_closed() -> None:
    # A literal across the JSON's own punctuation: no JSON says what is left.
    stream = _sse('{"a":"\\u0041","b":"x"}').encode()
    rules = (FilterRule("literal", '","b', "redact", "punct"),)
    r = relay("generic", rules)
    out = run(r, [stream])
    assert r.end_state is EndState.BLOCKED and b'"b":"x"' not in out


@pytest.mark.parametrize("marks", ["_", "__", "*_", "~~_"])
def test_a_key_right_after_markdown_marks_is_redacted(marks: str) -> None:
    text = f"Use {marks}{SECRET}{marks[::-1]} now."
    assert SECRET in chat_content_read(run(relay(CHAT), [chat_content([text])]))
    r = relay(CHAT, REDACT)
    out = run(r, [chat_content(split_secret(text, SECRET, 3))])
    assert _pieces_of_body_in(chat_content_read(out)) == []
    assert chat_content_read(out).startswith(f"Use {marks}{REDACTED}")


@pytest.mark.parametrize("word", ["my_", "tasks-", "A_b_"])
def test_a_key_shape_inside_a_word_is_still_no_key(word: str) -> None:
    text = f"see {word}{SECRET} ok"
    assert chat_content_read(run(relay(CHAT, REDACT), [chat_content([text])])) == text


INTERLEAVED = {
    "openai-chat": chat_interleaved_calls,
    "anthropic": anthropic_interleaved_calls,
    "openai-responses": responses_interleaved_calls,
}


@pytest.mark.parametrize("dialect", sorted(INTERLEAVED))
def test_a_key_split_across_one_tool_calls_fragments_is_redacted_though_another_call_interleaves(
    dialect: str,
) -> None:
    stream = INTERLEAVED[dialect](KEY_ARGS, OTHER_ARGS)
    plain = run(relay(dialect), [stream])
    assert SECRET in calls_read(plain)[0]  # what an SDK assembles: the key
    r = relay(dialect, REDACT, tools=True)
    out = run(r, [stream])
    assert r.end_state is EndState.COMPLETED
    calls = calls_read(out)
    assert json.loads(calls[0]) == {"key": REDACTED}
    assert calls[1] == "".join(OTHER_ARGS)  # the other call is untouched
    _only_the_keys_events_changed(stream, out, KEY_ARGS)
    # The same key split across one call's fragments, no other call between them.
    alone = INTERLEAVED[dialect](KEY_ARGS, [""] * len(KEY_ARGS))
    assert json.loads(calls_read(run(relay(dialect, REDACT, tools=True), [alone]))[0]) == {
        "key": REDACTED
    }
    blocked = relay(dialect, BLOCK, tools=True)
    out = run(blocked, [stream])
    assert blocked.end_state is EndState.BLOCKED and SECRET[8:20].encode() not in out


def test_a_key_in_a_gemini_function_calls_args_is_redacted_when_tool_arguments_are_read() -> None:
    call = {"name": "save", "args": {"note": f"naïve {SECRET}", "n": 4}}
    candidate = {"content": {"parts": [{"functionCall": call}], "role": "model"}}
    stream = _sse(compact_json({"candidates": [{**candidate, "finishReason": "STOP"}]})).encode()
    assert run(relay("gemini", REDACT), [stream]) == stream  # not read unless asked
    r = relay("gemini", REDACT, tools=True)
    out = run(r, [stream])
    assert r.end_state is EndState.COMPLETED and SECRET[8:20].encode() not in out
    args = json.loads(_events(out)[0].data)["candidates"][0]["content"]["parts"][0]
    assert args["functionCall"]["args"] == {"note": f"naïve {REDACTED}", "n": 4}


def test_a_key_across_two_calls_fragments_is_no_key_of_either() -> None:
    # "sk-" ends one call's arguments, the rest starts the other's: a reader
    # reads two texts, neither of which holds a key.
    stream = chat_interleaved_calls(['{"a":"sk-', '"}'], ['{"b":"' + SECRET[3:], '"}'])
    assert run(relay(CHAT, REDACT, tools=True), [stream]) == stream


def test_a_stream_that_opens_a_call_per_event_keeps_a_bounded_number_of_texts() -> None:
    filters = compile_filters(REDACT, True)
    assert filters is not None
    holdback = filters.holdback(1 << 20)
    for call in range(5000):
        # Each call's arguments end in a possible key: its text waits, then is decided.
        assert holdback.push_texts(call, [(("tool_call", 0, call), '{"a":"sk-')], 10, 0.0) == []
        released = holdback.push_texts(call, [(("tool_call", 0, call), '"}')], 10, 0.0)
        assert released is not None and len(released) == 2
    assert not holdback.holding and len(holdback._texts) <= 2 * 256


# -- through the sidecar, with a real upstream, and through the middleware ----------------

STREAMS = {
    "/v1/chat/completions": chat_interleaved_calls(KEY_ARGS, OTHER_ARGS),
    "/md/v1/chat/completions": chat_content(split_secret(f"Key: _{SECRET}_", SECRET, 3)),
    "/v1/chat/audio/completions": chat_transcript(PIECES, escape=True),
    "/v1/responses": responses_transcript(PIECES, escape=True),
    "/events": generic_escaped([TEXT]),  # a generic stream names no field: the key whole
}
REDACTING = [{"builtin": "secrets", "action": "redact"}]


async def _serve_aiohttp(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for block in STREAMS[request.path].split(b"\n\n")[:-1]:
        await response.write(block + b"\n\n")  # one event per write
    await response.write_eof()
    return response


@pytest.fixture
async def upstream(serve_upstream: ServeUpstream) -> str:
    app = web.Application()
    for path in STREAMS:
        app.router.add_post(path, _serve_aiohttp)
    return await serve_upstream(app)


def _starlette_app() -> Starlette:
    def serving(path: str) -> Any:
        async def endpoint(request: Request) -> StreamingResponse:
            async def body() -> AsyncIterator[bytes]:
                for block in STREAMS[path].split(b"\n\n")[:-1]:
                    yield block + b"\n\n"
                    await asyncio.sleep(0)  # one event per send, as a provider's SDK loop does

            return StreamingResponse(body(), media_type="text/event-stream")

        return endpoint

    return Starlette(routes=[Route(p, serving(p), methods=["POST"]) for p in STREAMS])


async def what_readers_read(base: str) -> dict[str, Any]:
    """What the SDK (tool calls, markdown, spoken Responses) and a plain client read."""
    read: dict[str, Any] = {}
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k")
    ask: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "?"}]}
    async with client:
        calls: dict[int, str] = {}
        async for chunk in await client.chat.completions.create(**ask, stream=True):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    args = call.function.arguments if call.function else ""
                    calls[call.index] = calls.get(call.index, "") + (args or "")
        read["calls"] = calls
        markdown = client.with_options(base_url=base + "/md/v1")
        text = ""
        async for chunk in await markdown.chat.completions.create(**ask, stream=True):
            text += "".join(c.delta.content or "" for c in chunk.choices)
        read["markdown"] = text
        said = ""
        async for event in await client.responses.create(model="m", input="?", stream=True):
            if event.type == "response.audio.transcript.delta":
                said += event.delta
        read["responses-audio"] = said
    async with httpx.AsyncClient(timeout=10) as http:
        audio = await http.post(base + "/v1/chat/audio/completions", json=ask)
        read["chat-audio"] = chat_transcript_read(audio.content)
        read["generic"] = generic_read((await http.post(base + "/events", json={})).content)
    return read


def _assert_the_key_is_read(read: dict[str, Any]) -> None:
    assert SECRET in read["calls"][0]
    assert SECRET in read["markdown"]
    assert SECRET in read["responses-audio"] and SECRET in read["chat-audio"]
    assert SECRET in read["generic"]


def _assert_no_key_is_read(read: dict[str, Any]) -> None:
    assert json.loads(read["calls"][0]) == {"key": REDACTED}
    assert read["calls"][1] == "".join(OTHER_ARGS)
    assert read["markdown"] == f"Key: _{REDACTED}"
    expected = TEXT.replace(SECRET, REDACTED)
    assert read["responses-audio"] == expected and read["chat-audio"] == expected
    assert read["generic"] == expected
    for text in (*read["calls"].values(), read["markdown"], read["generic"]):
        assert _pieces_of_body_in(text) == []


async def test_readers_read_no_key_of_any_text_through_the_sidecar(
    upstream: str, start_sidecar: StartSidecar
) -> None:
    # The problem: straight from the upstream, and through a sidecar that reads
    # only some texts, the readers read the key.
    _assert_the_key_is_read(await what_readers_read(upstream))
    sidecar = await start_sidecar(
        upstream, output_filters=REDACTING, output_filter_tool_arguments=True
    )
    _assert_no_key_is_read(await what_readers_read(sidecar.proxy_url))
    await wait_for(lambda: len(sidecar.tracker.finished) == len(STREAMS))
    assert {s.meter.end_state for s in sidecar.tracker.finished} == {EndState.COMPLETED}


@contextlib.asynccontextmanager
async def _guarded(**options: Any) -> AsyncIterator[str]:
    async with serve_in_process(StreamWardenMiddleware(_starlette_app(), **options)) as base:
        yield base


async def test_readers_read_no_key_of_any_text_through_the_middleware() -> None:
    async with serve_in_process(_starlette_app()) as base:
        _assert_the_key_is_read(await what_readers_read(base))
    async with _guarded(output_filters=REDACTING, output_filter_tool_arguments=True) as base:
        _assert_no_key_is_read(await what_readers_read(base))
