"""Output filters where a dialect carries text beside the text: token logprobs, whole tool input.

The Vercel AI SDK streams send a tool call's input again, whole, as an
object, after the deltas streamed it as JSON text: the filters must read it
the way the deltas had it, keys and numbers included. OpenAI's streams may
carry each token's text again in ``logprobs``: a redacted text must not
keep them. Each case first shows what the client gets without filters.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from aiohttp import web

from filter_streams import BLOCK, LIMITS, REDACT, SECRET, compact_json, run, split_secret
from sidecars import StartSidecar
from streamwarden.core.filters import REDACTED, FilterRule, compile_filters
from streamwarden.core.meter import EndState
from streamwarden.core.relay import Relay
from streamwarden.core.sse import SSEDecoder
from streamwarden.pipeline.transforms import with_transforms
from upstreams import ServeUpstream

CARD = "4111111111111111"  # Luhn-valid, as a JSON number would write it
CARDS = (FilterRule("builtin", "cards", "redact", "cards"),)
BOTH = (*REDACT, *CARDS)


def _pieces_in(out: bytes, secret: str) -> list[str]:
    """The six-character pieces of ``secret`` that ``out`` holds anywhere."""
    text = out.decode()
    return [secret[i : i + 6] for i in range(len(secret) - 5) if secret[i : i + 6] in text]


def _relay(headers: dict[str, str], content_type: str, path: str, rules: Any, tools: bool) -> Relay:
    return with_transforms(
        Relay(
            LIMITS,
            started_at=0.0,
            now=0.0,
            path=path,
            content_type=content_type,
            headers=headers,
        ),
        filters=compile_filters(rules, tools),
    )


# -- Vercel AI SDK: the whole tool input ------------------------------------------------


def _data_stream(args: Any, deltas: str | None = None) -> bytes:
    """AI SDK 4: the c: deltas stream ``args`` as JSON text in three pieces, then 9: repeats it."""
    text = compact_json(args) if deltas is None else deltas
    third = len(text) // 3
    pieces = [text[:third], text[third : 2 * third], text[2 * third :]]
    out = ['b:{"toolCallId":"t1","toolName":"pay"}\n']
    out += [f"c:{compact_json({'toolCallId': 't1', 'argsTextDelta': p})}\n" for p in pieces]
    out.append(f"9:{compact_json({'toolCallId': 't1', 'toolName': 'pay', 'args': args})}\n")
    out.append('d:{"finishReason":"tool-calls","usage":{"completionTokens":3}}\n')
    return "".join(out).encode()


def _data_relay(rules: Any, tools: bool = True) -> Relay:
    return _relay({"x-vercel-ai-data-stream": "v1"}, "text/plain", "/api/chat", rules, tools)


def _ui_stream(tool_input: Any, kind: str = '"tool-input-available"') -> bytes:
    """AI SDK 5: tool-input-delta parts stream the input as JSON text, then ``kind`` repeats it."""
    text = compact_json(tool_input)
    half = len(text) // 2
    out = [{"type": "start"}, {"type": "tool-input-start", "toolCallId": "t1", "toolName": "x"}]
    for piece in (text[:half], text[half:]):
        out.append({"type": "tool-input-delta", "toolCallId": "t1", "inputTextDelta": piece})
    lines = [f"data: {compact_json(part)}\n\n" for part in out]
    whole = compact_json({"type": "tool-input-available", "toolCallId": "t1", "input": tool_input})
    whole = whole.replace('"tool-input-available"', kind)
    lines.append(f"data: {whole}\n\n")
    lines.append('data: {"type":"finish"}\n\ndata: [DONE]\n\n')
    return "".join(lines).encode()


def _ui_relay(rules: Any, tools: bool = True) -> Relay:
    headers = {"x-vercel-ai-ui-message-stream": "v1"}
    return _relay(headers, "text/event-stream", "/api/chat", rules, tools)


def _whole_args(out: bytes) -> Any:
    for line in out.decode().splitlines():
        if line.startswith("9:"):
            return json.loads(line[2:])["args"]
        if line.startswith("data: {") and '"input":' in line:
            return json.loads(line[6:])["input"]
    raise AssertionError("no whole tool input in the stream")


def test_a_card_as_a_json_number_in_the_whole_args_is_redacted() -> None:
    stream = _data_stream({"card": int(CARD), "note": "ok"})
    assert _pieces_in(run(_data_relay(()), [stream]), CARD)  # without filters it goes out
    r = _data_relay(CARDS)
    out = run(r, [stream])
    assert r.end_state is EndState.COMPLETED
    assert _pieces_in(out, CARD) == []  # neither in the deltas nor in the 9: call
    # A match in a number leaves no JSON to parse back: the whole args go.
    assert _whole_args(out) == REDACTED


def test_a_key_as_an_object_key_in_the_whole_args_is_redacted() -> None:
    stream = _data_stream({SECRET: 1, "city": "Zürich"})
    assert _pieces_in(run(_data_relay(()), [stream]), SECRET[8:])
    out = run(_data_relay(REDACT), [stream])
    assert _pieces_in(out, SECRET[8:]) == []
    # Within a string (here an object's key): the args stay an object, the key redacted.
    assert _whole_args(out) == {REDACTED: 1, "city": "Zürich"}


def test_a_key_in_a_string_value_keeps_the_rest_of_the_whole_args() -> None:
    args = {"body": f"naïve {SECRET} café", "n": 4111, "nested": [{"k": SECRET}]}
    out = run(_data_relay(BOTH), [_data_stream(args)])
    assert _pieces_in(out, SECRET[8:]) == []
    assert _whole_args(out) == {
        "body": f"naïve {REDACTED} café",
        "n": 4111,
        "nested": [{"k": REDACTED}],
    }


def test_whole_args_only_the_call_carries_are_blocked_or_redacted_and_unread_without_tools() -> (
    None
):
    stream = _data_stream({"card": int(CARD)}, deltas='{"card":0}')
    blocked = _data_relay((FilterRule("builtin", "cards", "block", "cards"),))
    out = run(blocked, [stream])
    assert blocked.end_state is EndState.BLOCKED and _pieces_in(out, CARD) == []
    assert _pieces_in(run(_data_relay(CARDS), [stream]), CARD) == []
    # Tool arguments are not read unless asked: the stream passes as it came.
    assert run(_data_relay(CARDS, tools=False), [stream]) == stream


@pytest.mark.parametrize(
    "kind",
    [
        '"tool-input-available"',
        '"tool-input-error"',
        '"tool-input-\\u0061vailable"',  # the same type, one letter escaped
    ],
)
def test_a_ui_stream_whole_input_that_says_inputtextdelta_is_still_filtered(kind: str) -> None:
    # A string "inputTextDelta" in the input once made the part look like a delta.
    stream = _ui_stream({"note": "inputTextDelta", "k": SECRET}, kind)
    assert _pieces_in(run(_ui_relay(()), [stream]), SECRET[8:])
    r = _ui_relay(REDACT)
    out = run(r, [stream])
    assert r.end_state is EndState.COMPLETED
    assert _pieces_in(out, SECRET[8:]) == []
    assert _whole_args(out) == {"note": "inputTextDelta", "k": REDACTED}
    blocked = _ui_relay(BLOCK)
    out = run(blocked, [stream])
    assert blocked.end_state is EndState.BLOCKED and _pieces_in(out, SECRET[8:]) == []


def test_a_ui_stream_part_whose_type_is_not_a_string_passes_untouched() -> None:
    odd = b'data: {"type":["tool-input-available"],"input":{"k":"input-available"}}\n\n'
    stream = _ui_stream({"city": "Tokyo"})
    stream = stream.replace(b"data: [DONE]", odd + b"data: [DONE]")
    assert run(_ui_relay(REDACT), [stream]) == stream


# -- OpenAI: token logprobs beside a redacted text --------------------------------------

TEXT = f"Your key is {SECRET} and nothing else."


def _token(text: str) -> dict[str, Any]:
    entry = {"token": text, "bytes": list(text.encode()), "logprob": -0.25}
    return {**entry, "top_logprobs": [entry]}


def _responses(pieces: list[str]) -> bytes:
    """Responses deltas with their tokens' logprobs, then the done text with all of them."""

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {compact_json({'type': kind, **data})}\n\n"

    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    out = [event("response.created", response={"id": "r1", "output": []})]
    out += [
        event("response.output_text.delta", **where, delta=p, logprobs=[_token(p)]) for p in pieces
    ]
    tokens = [_token(p) for p in pieces]
    out.append(event("response.output_text.done", **where, text="".join(pieces), logprobs=tokens))
    part = {"type": "output_text", "annotations": [], "text": "".join(pieces), "logprobs": tokens}
    out.append(event("response.content_part.done", **where, part=part))
    done = {"id": "r1", "status": "completed", "output": [], "usage": {"output_tokens": 3}}
    out.append(event("response.completed", response=done))
    return "".join(out).encode()


def _chat(pieces: list[str]) -> bytes:
    """Chat Completions chunks, each with its token's logprobs."""

    def chunk(p: str) -> str:
        logprobs = {"content": [_token(p)], "refusal": None}
        choice = {"index": 0, "delta": {"content": p}, "logprobs": logprobs}
        return f"data: {compact_json({'id': 'c1', 'choices': [choice]})}\n\n"

    return ("".join(chunk(p) for p in pieces) + "data: [DONE]\n\n").encode()


def _bytes_pieces_in(out: bytes, secret: str) -> list[str]:
    """The six-character pieces of ``secret`` any ``bytes`` list in ``out`` spells."""
    spelled = ""
    for event in SSEDecoder().feed(out):
        if event.data.startswith("{"):
            for found in _byte_lists(json.loads(event.data)):
                spelled += bytes(found).decode(errors="replace") + "\0"
    return _pieces_in(spelled.encode(), secret)


def _byte_lists(node: Any) -> list[list[int]]:
    found: list[list[int]] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("bytes"), list):
                found.append(item["bytes"])
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return found


def _gemini(pieces: list[str]) -> bytes:
    """Gemini chunks, each candidate with its token's logprobsResult."""

    def chunk(p: str, last: bool) -> str:
        chosen = {"token": p, "logProbability": -0.25}
        result = {"topCandidates": [{"candidates": [chosen]}], "chosenCandidates": [chosen]}
        candidate: dict[str, Any] = {"content": {"parts": [{"text": p}], "role": "model"}}
        candidate["logprobsResult"] = result
        if last:
            candidate["finishReason"] = "STOP"
        return f"data: {compact_json({'candidates': [candidate]})}\r\n\r\n"

    return "".join(chunk(p, i == len(pieces) - 1) for i, p in enumerate(pieces)).encode()


@pytest.mark.parametrize("dialect", ["openai-responses", "openai-chat", "gemini"])
def test_logprobs_beside_a_redacted_text_do_not_spell_the_key(dialect: str) -> None:
    pieces = split_secret(TEXT, SECRET, 3)
    if dialect == "openai-responses":
        stream, path = _responses(pieces), "/v1/responses"
    elif dialect == "openai-chat":
        stream, path = _chat(pieces), "/v1/chat/completions"
    else:
        stream, path = _gemini(pieces), "/v1beta/models/g:streamGenerateContent"
    plain = run(_relay({}, "text/event-stream", path, (), False), [stream])
    assert _pieces_in(plain, SECRET[8:])
    assert dialect == "gemini" or _bytes_pieces_in(plain, SECRET[8:])  # Gemini sends no bytes
    r = _relay({}, "text/event-stream", path, REDACT, False)
    out = run(r, [stream])
    assert r.end_state is EndState.COMPLETED
    assert _pieces_in(out, SECRET[8:]) == [] and _bytes_pieces_in(out, SECRET[8:]) == []
    # Only the events whose text was rewritten lost their tokens: the others are as they came.
    sent, got = SSEDecoder().feed(stream), SSEDecoder().feed(out)
    assert [a.data == b.data for b, a in zip(sent, got, strict=True)].count(False) >= 3
    for before, after in zip(sent, got, strict=True):
        if after.data != before.data:
            assert '"token"' not in after.data and '"bytes"' not in after.data


def _tgi(pieces: list[str]) -> bytes:
    """TGI events, each token with its ``top_tokens`` (the chosen one among them)."""

    def event(index: int, text: str) -> str:
        last = index == len(pieces) - 1
        token = {"id": index, "text": text, "logprob": -0.25, "special": False}
        data = {
            "index": index + 1,
            "token": token,
            "top_tokens": [token, {**token, "id": 7, "text": " the"}],
            "generated_text": "".join(pieces) if last else None,
            "details": {"finish_reason": "length", "generated_tokens": len(pieces)}
            if last
            else None,
        }
        return f"data:{compact_json(data)}\n\n"

    return "".join(event(i, p) for i, p in enumerate(pieces)).encode()


def test_tgi_top_tokens_beside_a_redacted_token_and_the_whole_text_do_not_spell_the_key() -> None:
    stream = _tgi(split_secret(TEXT, SECRET, 3))
    plain = run(_relay({}, "text/event-stream", "/generate_stream", (), False), [stream])
    top = [t["text"] for e in SSEDecoder().feed(plain) for t in json.loads(e.data)["top_tokens"]]
    assert _pieces_in("".join(top).encode(), SECRET[8:])  # the tokens spell it...
    assert SECRET in SSEDecoder().feed(plain)[-1].data  # ...and the last event has it whole
    r = _relay({}, "text/event-stream", "/generate_stream", REDACT, False)
    out = run(r, [stream])
    assert r.end_state is EndState.COMPLETED
    assert _pieces_in(out, SECRET[8:]) == []
    got = [json.loads(e.data) for e in SSEDecoder().feed(out)]
    assert got[-1]["generated_text"] == "".join(e["token"]["text"] for e in got)
    assert REDACTED in got[-1]["generated_text"]
    sent = [json.loads(e.data) for e in SSEDecoder().feed(stream)]
    for before, after in zip(sent, got, strict=True):  # only rewritten tokens lost theirs
        assert after["top_tokens"] == (
            [] if after["token"] != before["token"] else before["top_tokens"]
        )


# -- through the sidecar, read by the openai SDK ----------------------------------------

PIECES = split_secret(TEXT, SECRET, 3)


def _events(stream: bytes) -> list[bytes]:
    return [block + b"\n\n" for block in stream.split(b"\n\n") if block]


@pytest.fixture
async def token_upstream(serve_upstream: ServeUpstream) -> str:
    """Serves the chat and Responses streams with logprobs, one event per write."""

    async def serve(request: web.Request) -> web.StreamResponse:
        await request.read()
        stream = _chat(PIECES) if request.path.endswith("/completions") else _responses(PIECES)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in _events(stream):
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", serve)
    app.router.add_post("/v1/responses", serve)
    return await serve_upstream(app)


async def _sdk_tokens(base: str) -> tuple[str, str]:
    """The chat and Responses answers' texts and tokens, as the openai SDK gives them."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k")
    said = tokens = ""
    async with client:
        chat = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "key?"}], stream=True, logprobs=True
        )
        async for chunk in chat:
            for choice in chunk.choices:
                said += choice.delta.content or ""
                for token in (choice.logprobs.content or []) if choice.logprobs else []:
                    tokens += token.token + bytes(token.bytes or []).decode() + "\0"
                    tokens += "".join(top.token + "\0" for top in token.top_logprobs)
        answer = await client.responses.create(model="m", input="key?", stream=True)
        async for event in answer:
            if event.type == "response.output_text.delta":
                said += event.delta
                for logprob in event.logprobs or []:
                    tokens += logprob.token + "\0"
            elif event.type == "response.output_text.done":
                said += event.text
                tokens += "".join(logprob.token + "\0" for logprob in event.logprobs or [])
    return said, tokens


async def test_the_sdk_reads_no_token_of_the_key_through_the_sidecar(
    token_upstream: str, start_sidecar: StartSidecar
) -> None:
    # The problem: the key's tokens are in the logprobs, whatever the text says.
    said, tokens = await _sdk_tokens(token_upstream)
    assert _pieces_in(said.encode(), SECRET[8:]) and _pieces_in(tokens.encode(), SECRET[8:])
    sidecar = await start_sidecar(
        token_upstream, output_filters=[{"builtin": "secrets", "action": "redact"}]
    )
    said, tokens = await _sdk_tokens(sidecar.proxy_url)
    assert REDACTED in said and _pieces_in(said.encode(), SECRET[8:]) == []
    assert _pieces_in(tokens.encode(), SECRET[8:]) == []
    assert tokens  # the events the filters left alone keep their tokens


# -- Cohere: logprobs and citations repeat the answer's text -------------------------------


def _cohere(pieces: list[str], cited: str) -> bytes:
    """A v2 chat stream with each chunk's logprobs (its text again) and a citation of ``cited``."""

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {compact_json({'type': kind, **data})}\n\n"

    out = [event("message-start", id="m1", delta={"message": {"role": "assistant"}})]
    for p in pieces:
        logprobs = {"text": p, "token_ids": [7, 9], "logprobs": [-0.25, -0.5]}
        content = {"message": {"content": {"text": p}}}
        out.append(event("content-delta", index=0, delta=content, logprobs=logprobs))
    citation = {"start": 0, "end": len(cited), "text": cited, "sources": [], "type": "TEXT_CONTENT"}
    out.append(event("citation-start", index=0, delta={"message": {"citations": citation}}))
    out.append(event("citation-end", index=0))
    out.append(event("message-end", delta={"finish_reason": "COMPLETE"}))
    return "".join(out).encode()


def test_cohere_logprobs_and_citations_beside_a_redacted_text_do_not_spell_the_key() -> None:
    pieces = split_secret(TEXT, SECRET, 3)
    stream = _cohere(pieces, SECRET)
    plain = run(_relay({}, "text/event-stream", "/v2/chat", (), False), [stream])
    sent = SSEDecoder().feed(stream)
    # Without filters the key goes out three ways: the text, its logprobs, the citation.
    assert (
        plain == stream
        and SECRET in json.loads(sent[-3].data)["delta"]["message"]["citations"]["text"]
    )
    r = _relay({}, "text/event-stream", "/v2/chat", REDACT, False)
    out = run(r, [stream])
    assert r.end_state is EndState.COMPLETED
    assert _pieces_in(out, SECRET[8:]) == []
    got = SSEDecoder().feed(out)
    changed = [after for before, after in zip(sent, got, strict=True) if after.data != before.data]
    assert len(changed) >= 3
    for after in changed:  # a rewritten chunk keeps no logprobs; the citation says [redacted]
        obj = json.loads(after.data)
        if obj["type"] == "content-delta":
            assert obj["logprobs"] is None
        else:
            assert obj["delta"]["message"]["citations"]["text"] == REDACTED
    # The chunks left as they were keep theirs.
    assert json.loads(got[1].data)["logprobs"]["text"] == pieces[0]


# -- several choices (n > 1) or candidates (candidateCount > 1), interleaved ----------


def _two_choices(dialect: str, first: list[str], second: list[str]) -> bytes:
    """Choice (candidate) 0's and 1's deltas, interleaved one for one, then the end."""

    def chunk(index: int, text: str) -> str:
        if dialect == "openai-chat":
            body = {"id": "c1", "choices": [{"index": index, "delta": {"content": text}}]}
        else:
            parts = {"content": {"parts": [{"text": text}], "role": "model"}, "index": index}
            body = {"candidates": [parts]}
        return f"data: {compact_json(body)}\n\n"

    out = [chunk(i, t) for pair in zip(first, second, strict=True) for i, t in enumerate(pair)]
    if dialect == "openai-chat":
        out.append("data: [DONE]\n\n")
    else:
        done = [{"content": {"parts": [], "role": "model"}, "index": 0, "finishReason": "STOP"}]
        out.append(f"data: {compact_json({'candidates': done})}\n\n")
    return "".join(out).encode()


@pytest.mark.parametrize(
    ("dialect", "path"),
    [
        ("openai-chat", "/v1/chat/completions"),
        ("gemini", "/v1beta/models/g:streamGenerateContent"),
    ],
)
def test_a_key_in_the_second_choice_split_around_the_firsts_deltas_is_redacted(
    dialect: str, path: str
) -> None:
    # Read as one text, "sk-...", "ab", "cdef..." of choice 1 interleaved with
    # choice 0's words spell no key: each choice is a text of its own.
    second = split_secret(f"Key {SECRET} ok", SECRET, 4)
    first = [f"word{i} " for i in range(len(second))]
    stream = _two_choices(dialect, first, second)
    plain = run(_relay({}, "text/event-stream", path, (), False), [stream])
    assert _pieces_in(plain, SECRET[8:])  # without filters the key is there to read
    out = run(_relay({}, "text/event-stream", path, REDACT, False), [stream])
    assert _pieces_in(out, SECRET[8:]) == []
    assert REDACTED in out.decode() and "word2 " in out.decode()
