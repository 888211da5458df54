"""Dialects against recorded-style provider streams: detection, content, usage, terminal, errors."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import pytest

from locations import STREAMS
from streamwarden.core.dialects import detect, sniff, stream_framing
from streamwarden.core.dialects.gemini import Gemini
from streamwarden.core.dialects.tgi import TGI
from streamwarden.core.filters import FilterRule, FilterSet, compile_filters
from streamwarden.core.relay import ErrorCode, Limits, Relay
from streamwarden.core.sse import Event, LineFramer, SSEDecoder, SSEFramer
from streamwarden.pipeline.transforms import with_transforms

MANIFEST: dict[str, dict[str, Any]] = json.loads((STREAMS / "manifest.json").read_text())
LIMITS = Limits(
    keepalive_interval=15.0,
    upstream_idle_timeout=60.0,
    max_stream_duration=1800.0,
    max_event_bytes=1 << 20,
)


def fixture(name: str) -> bytes:
    return (STREAMS / name).read_bytes()


def relay_for(name: str, setting: str = "auto", filters: FilterSet | None = None) -> Relay:
    entry = MANIFEST[name]
    return with_transforms(
        Relay(
            LIMITS,
            started_at=0.0,
            now=0.0,
            path=entry["request_path"],
            content_type=entry["content_type"],
            headers=entry["headers"],
            dialect=setting,
        ),
        filters=filters,
    )


def observed(name: str) -> tuple[str, int, int | None, bool]:
    """Text, content events, last usage and terminal, as the fixture's dialect sees them."""
    entry = MANIFEST[name]
    detection = detect(
        "auto",
        path=entry["request_path"],
        content_type=entry["content_type"],
        headers=entry["headers"],
    )
    dialect = detection.dialect
    framer = SSEFramer() if entry["framing"] == "sse" else LineFramer()
    frames = framer.feed(fixture(name)) + framer.close()
    text, events, usage, terminal, first = "", 0, None, False, True
    for frame in frames:
        if frame.event is None:
            continue
        if first and detection.provisional:
            dialect = sniff(frame.event, dialect)
        first = False
        seen = dialect.inspect(frame.event)
        if seen.text:
            text += seen.text
            events += 1
        if seen.output_tokens is not None:
            usage = seen.output_tokens
        terminal = terminal or seen.terminal
    assert dialect.name == entry["dialect"]
    return text, events, usage, terminal


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_each_fixture_is_detected_as_its_dialect(name: str) -> None:
    entry = MANIFEST[name]
    framing = stream_framing(entry["content_type"], entry["headers"])
    assert framing == entry["framing"]
    relay = relay_for(name)
    relay.feed(fixture(name), 1.0)
    assert relay.dialect == entry["dialect"]


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_content_text_and_tool_arguments_are_extracted(name: str) -> None:
    entry = MANIFEST[name]
    text, events, _, _ = observed(name)
    if entry["dialect"] == "generic":
        # Every data event of an unknown stream is its content.
        decoded = SSEDecoder().feed(fixture(name))
        assert text == "".join(e.data for e in decoded)
        return
    expected = entry["text"] + entry["tool_args"] + entry.get("thinking", "")
    # Fragments of text, thinking and tool arguments may interleave across
    # blocks; Gemini re-serialises whole args objects (spacing differs).
    assert Counter(text.replace(" ", "")) == Counter(expected.replace(" ", ""))
    assert events == entry["content_events"] + entry.get("thinking_events", 0)
    position = 0
    for char in entry["text"]:  # the answer text appears in order
        position = text.index(char, position) + 1


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_usage_and_terminal_event_are_recognised(name: str) -> None:
    entry = MANIFEST[name]
    _, _, usage, terminal = observed(name)
    assert usage == entry["output_tokens"]
    assert terminal == entry["terminal"]


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_whole_fixture_relays_unchanged_and_completes(name: str) -> None:
    data = fixture(name)
    relay = relay_for(name)
    out = b"".join(relay.feed(data[i : i + 7], 1.0 + i / 1e4) for i in range(0, len(data), 7))
    out += relay.upstream_eof(2.0)
    assert out == data
    assert relay.end_state == "completed"
    entry = MANIFEST[name]
    if entry["output_tokens"] is not None:
        assert relay.meter.tokens_generated == entry["output_tokens"]
        assert relay.meter.tokens_delivered == relay.meter.tokens_generated
        assert relay.meter.tokens_method == "usage"


def _without_terminal(name: str) -> bytes:
    """The fixture cut just before its terminal event (a clean truncation)."""
    entry = MANIFEST[name]
    data = fixture(name)
    framer = SSEFramer() if entry["framing"] == "sse" else LineFramer()
    frames = framer.feed(data) + framer.close()
    relay = relay_for(name)
    kept = b""
    for frame in frames:
        relay.feed(frame.raw, 1.0)
        if relay._terminal_seen:
            return kept
        kept += frame.raw
    raise AssertionError("no terminal event")


TERMINATED = sorted(n for n, e in MANIFEST.items() if e["terminal"])


@pytest.mark.parametrize("name", TERMINATED)
def test_truncated_stream_gets_the_dialects_error_event(name: str) -> None:
    entry = MANIFEST[name]
    cut = _without_terminal(name)
    relay = relay_for(name)
    out = relay.feed(cut, 1.0) + relay.upstream_eof(2.0)
    assert out.startswith(cut)
    error = out[len(cut) :]
    assert relay.end_state == "upstream_truncated"
    assert relay.meter.error_code == "stream_truncated"
    assert b"stream_truncated" in error
    framer = SSEFramer() if entry["framing"] == "sse" else LineFramer()
    frames = framer.feed(error) + framer.close()
    events = [f.event for f in frames if f.event is not None]
    assert len(events) == 1
    # The error is recognised as an in-band upstream error by its own dialect.
    dialect = detect(
        entry["dialect"],
        path=entry["request_path"],
        content_type=entry["content_type"],
        headers=entry["headers"],
    ).dialect
    assert dialect.inspect(events[0]).error


ERROR_SHAPES = {
    "openai-chat": lambda e: (
        e.event == "message" and json.loads(e.data)["error"]["code"] == "stream_truncated"
    ),
    "openai-responses": lambda e: (
        e.event == "error" and json.loads(e.data)["error"]["code"] == "stream_truncated"
    ),
    "anthropic": lambda e: (
        e.event == "error"
        and json.loads(e.data)["type"] == "error"
        and json.loads(e.data)["error"]["code"] == "stream_truncated"
    ),
    "gemini": lambda e: (
        json.loads(e.data)["error"]["code"] == 500
        and json.loads(e.data)["error"]["details"][0]["metadata"]["code"] == "stream_truncated"
    ),
    "generic": lambda e: (
        e.event == "error" and json.loads(e.data)["error"]["code"] == "stream_truncated"
    ),
    # cohere's SDK raises on no event: the message-end it hands over says why.
    "cohere": lambda e: (
        e.event == "message-end"
        and json.loads(e.data)["type"] == "message-end"
        and json.loads(e.data)["delta"]["finish_reason"] == "ERROR"
        and json.loads(e.data)["delta"]["error"].endswith("(stream_truncated)")
    ),
    "tgi": lambda e: (
        e.event == "message"
        and json.loads(e.data)["error_type"] == "incomplete_generation"
        and json.loads(e.data)["code"] == "stream_truncated"
    ),
}


@pytest.mark.parametrize("dialect", sorted(ERROR_SHAPES))
def test_error_event_names_its_code_in_a_machine_field_and_in_its_message(dialect: str) -> None:
    relay = Relay(
        LIMITS,
        started_at=0.0,
        now=0.0,
        path="/x",
        content_type="text/event-stream",
        headers={},
        dialect=dialect,
    )
    out = relay.upstream_eof(1.0) if dialect != "generic" else relay.upstream_failed(1.0)
    (event,) = SSEDecoder().feed(out)
    code = "stream_truncated" if dialect != "generic" else "upstream_error"
    if dialect == "generic":
        assert json.loads(event.data)["error"]["code"] == code
    else:
        assert ERROR_SHAPES[dialect](event)
    assert f"({code})" in event.data


# google.rpc.Code names and the HTTP status Google's APIs answer with for each
# (google/rpc/code.proto), for the ones a synthesized error may use.
GOOGLE_HTTP_STATUS = {
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "RESOURCE_EXHAUSTED": 429,
    "DATA_LOSS": 500,
    "UNKNOWN": 500,
    "NOT_FOUND": 404,
    "FAILED_PRECONDITION": 400,
}
GEMINI_STATUS = {
    ErrorCode.STREAM_TRUNCATED: "INTERNAL",
    ErrorCode.UPSTREAM_ERROR: "UNAVAILABLE",
    ErrorCode.UPSTREAM_TIMEOUT: "DEADLINE_EXCEEDED",
    ErrorCode.DURATION_EXCEEDED: "DEADLINE_EXCEEDED",
    ErrorCode.EVENT_TOO_LARGE: "INTERNAL",
    ErrorCode.SHUTTING_DOWN: "UNAVAILABLE",
    ErrorCode.RESUME_EXPIRED: "NOT_FOUND",
    ErrorCode.RESUME_GAP: "DATA_LOSS",
    ErrorCode.RESUME_UNAVAILABLE: "UNAVAILABLE",
    ErrorCode.CONTENT_BLOCKED: "FAILED_PRECONDITION",
    ErrorCode.TOOL_CALL_TRUNCATED: "INTERNAL",
    ErrorCode.TOOL_CALL_INVALID: "INTERNAL",
    ErrorCode.TOOL_CALL_TOO_LARGE: "INTERNAL",
}


@pytest.mark.parametrize("code", list(ErrorCode), ids=[c.value for c in ErrorCode])
def test_gemini_error_is_googles_error_object_with_our_code_in_message_and_details(
    code: ErrorCode,
) -> None:
    gemini = Gemini()
    (event,) = SSEDecoder().feed(gemini.error_event(code, f"streamwarden: it broke ({code})"))
    obj = json.loads(event.data)
    # google-genai only looks for errors in chunks whose JSON starts with {"error":.
    assert event.data.startswith('{"error":')
    assert list(obj) == ["error"]
    error = obj["error"]
    # An integer HTTP status, paired with its status name as Google pairs them.
    assert type(error["code"]) is int
    assert error["status"] == GEMINI_STATUS[code]
    assert error["code"] == GOOGLE_HTTP_STATUS[error["status"]]
    assert error["message"].endswith(f"({code})")
    (info,) = error["details"]
    assert info == {
        "@type": "type.googleapis.com/google.rpc.ErrorInfo",
        "reason": code.upper(),
        "domain": "streamwarden",
        "metadata": {"code": code.value},
    }
    assert re.fullmatch(r"[A-Z][A-Z0-9_]+[A-Z0-9]", info["reason"])  # ErrorInfo's rule
    assert gemini.inspect(event).error  # and it reads back as an upstream error


def test_detection_prefers_headers_over_path() -> None:
    detection = detect(
        "auto",
        path="/v1/chat/completions",
        content_type="application/x-ndjson",
        headers={},
    )
    assert detection.dialect.name == "ndjson"
    assert not detection.provisional


def test_first_event_overrules_a_path_guess() -> None:
    relay = Relay(
        LIMITS,
        started_at=0.0,
        now=0.0,
        path="/api/stream",
        content_type="text/event-stream",
        headers={},
    )
    assert relay.dialect == "generic"
    relay.feed(b'event: message_start\ndata: {"type":"message_start"}\n\n', 1.0)
    assert relay.dialect == "anthropic"


def test_configured_dialect_is_not_overruled() -> None:
    detection = detect(
        "openai-chat", path="/v1/messages", content_type="text/event-stream", headers={}
    )
    assert detection.dialect.name == "openai-chat"
    assert not detection.provisional
    assert sniff(Event("message_start", "{}"), detection.dialect).name == "anthropic"


def test_ndjson_without_done_key_is_not_truncated_at_eof() -> None:
    relay = Relay(
        LIMITS,
        started_at=0.0,
        now=0.0,
        path="/logs",
        content_type="application/x-ndjson",
        headers={},
    )
    relay.feed(b'{"line": 1}\n{"line": 2}\n', 1.0)
    assert relay.upstream_eof(2.0) == b""
    assert relay.end_state == "completed"


def test_ollama_shaped_ndjson_without_done_is_truncated() -> None:
    relay = Relay(
        LIMITS,
        started_at=0.0,
        now=0.0,
        path="/api/chat",
        content_type="application/x-ndjson",
        headers={},
    )
    relay.feed(b'{"message":{"role":"assistant","content":"Hi"},"done":false}\n', 1.0)
    out = relay.upstream_eof(2.0)
    assert json.loads(out)["code"] == "stream_truncated"
    assert relay.end_state == "upstream_truncated"


def test_vercel_data_stream_error_is_an_error_part() -> None:
    entry = MANIFEST["vercel_data_stream.txt"]
    relay = Relay(
        LIMITS,
        started_at=0.0,
        now=0.0,
        path="/api/chat",
        content_type=entry["content_type"],
        headers=entry["headers"],
    )
    assert relay.feed(b'0:"Hel"\n0:"lo', 1.0) == b'0:"Hel"\n'  # the cut line is held
    out = relay.upstream_eof(2.0)
    assert out.startswith(b'3:"streamwarden:')
    assert out.endswith(b'(stream_truncated)"\n')


# The provider's count of the prompt's tokens, each as its own API sends it
# (OpenAI's usage chunk, Anthropic's message_start, the Responses API's
# response.completed, Gemini's usageMetadata, Ollama's done line, both Vercel
# streams' finish), for the OpenTelemetry span's gen_ai.usage.input_tokens.
_PROMPT_COUNTS = [
    (
        "/v1/chat/completions",
        "text/event-stream",
        {},
        b'data: {"choices":[],"usage":{"prompt_tokens":17,"completion_tokens":5}}\n\n',
    ),
    (
        "/v1/messages",
        "text/event-stream",
        {},
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"m",'
        b'"usage":{"input_tokens":17,"output_tokens":1}}}\n\n',
    ),
    (
        "/v1/responses",
        "text/event-stream",
        {},
        b'event: response.completed\ndata: {"type":"response.completed","response":'
        b'{"usage":{"input_tokens":17,"output_tokens":5}}}\n\n',
    ),
    (
        "/v1beta/models/gemini-2.0-flash:streamGenerateContent",
        "text/event-stream",
        {},
        b'data: {"candidates":[{"content":{"parts":[{"text":"hi"}]},"finishReason":"STOP"}],'
        b'"usageMetadata":{"promptTokenCount":17,"candidatesTokenCount":5}}\n\n',
    ),
    (
        "/api/chat",
        "application/x-ndjson",
        {},
        b'{"message":{"content":""},"done":true,"prompt_eval_count":17,"eval_count":5}\n',
    ),
    (
        "/v2/chat",
        "text/event-stream",
        {},
        b'event: message-end\ndata: {"type":"message-end","delta":{"finish_reason":"COMPLETE",'
        b'"usage":{"billed_units":{"input_tokens":3,"output_tokens":5},'
        b'"tokens":{"input_tokens":17,"output_tokens":5}}}}\n\n',
    ),
    (
        "/api/chat",
        "text/plain",
        {"x-vercel-ai-data-stream": "v1"},
        b'd:{"finishReason":"stop","usage":{"promptTokens":17,"completionTokens":5}}\n',
    ),
    (
        "/api/chat",
        "text/event-stream",
        {"x-vercel-ai-ui-message-stream": "v1"},
        b'data: {"type":"finish","messageMetadata":{"usage":{"inputTokens":17,'
        b'"outputTokens":5}}}\n\n',
    ),
]


@pytest.mark.parametrize(
    ("path", "content_type", "headers", "event"),
    _PROMPT_COUNTS,
    ids=[
        "openai-chat",
        "anthropic",
        "openai-responses",
        "gemini",
        "ndjson",
        "cohere",
        "vercel",
        "vercel-ui",
    ],
)
def test_the_providers_prompt_token_count_is_read(
    path: str, content_type: str, headers: dict[str, str], event: bytes
) -> None:
    relay = Relay(
        Limits(15.0, 60.0, 1800.0, 8 << 20),
        started_at=0.0,
        now=0.0,
        path=path,
        content_type=content_type,
        headers=headers,
    )
    assert relay.feed(event, 1.0) == event
    assert relay.meter.input_tokens == 17
    assert relay.meter.usage_tokens == 5 or relay.meter.usage_tokens == 1  # message_start's 1


@pytest.mark.parametrize("name", sorted(MANIFEST))
@pytest.mark.parametrize("filtered", [False, True])
def test_data_nested_past_the_json_parsers_depth_is_passed_on_not_raised(
    name: str, filtered: bool
) -> None:
    # orjson refuses it (ValueError) and the standard library's parser, tried next,
    # raised RecursionError out of the relay: one hostile event broke the stream.
    entry = MANIFEST[name]
    nested = "[" * 100_000 + "]" * 100_000
    if entry["framing"] == "lines":
        event = (f"0:{nested}\n" if name.startswith("vercel") else f"{nested}\n").encode()
    else:
        event = f"data: {nested}\n\n".encode()
    rules = (FilterRule("builtin", "secrets", "redact", "secrets"),)
    relay = relay_for(name, filters=compile_filters(rules, True) if filtered else None)
    assert relay.feed(event, 1.0) == event
    assert not relay.done


# -- Cohere v2 chat ---------------------------------------------------------------------


def _cohere_relay(path: str = "/v2/chat") -> Relay:
    return Relay(
        LIMITS, started_at=0.0, now=0.0, path=path, content_type="text/event-stream", headers={}
    )


def test_cohere_is_read_by_its_datas_type_as_the_sdk_reads_it() -> None:
    # cohere's parse_sse_obj builds the event from the data alone: the event: name is not read.
    relay = _cohere_relay()
    relay.feed(b'event: content-delta\ndata: {"type":"message-end","delta":{}}\n\n', 1.0)
    assert relay.upstream_eof(2.0) == b""
    assert relay.end_state == "completed"
    relay = _cohere_relay()
    text = b'{"type":"content-delta","delta":{"message":{"content":{"text":"hi"}}}}'
    relay.feed(b"event: message-end\ndata: " + text + b"\n\n", 1.0)
    assert relay.meter.tokens_delivered == 1  # text, and no terminal event: a cut
    assert b"stream_truncated" in relay.upstream_eof(2.0)


@pytest.mark.parametrize("named", [True, False])
def test_cohere_is_recognised_by_its_first_event_on_a_path_of_its_own(named: bool) -> None:
    relay = _cohere_relay("/api/stream")
    assert relay.dialect == "generic"
    start = b'data: {"id":"m1","type":"message-start","delta":{"message":{"role":"assistant"}}}'
    relay.feed((b"event: message-start\n" if named else b"") + start + b"\n\n", 1.0)
    assert relay.dialect == "cohere"


@pytest.mark.parametrize(
    "delta",
    [{"finish_reason": "ERROR", "error": "overloaded"}, {"finish_reason": "TIMEOUT"}],
    ids=["error", "timeout"],
)
def test_cohere_generation_that_failed_upstream_is_an_upstream_error(
    delta: dict[str, str],
) -> None:
    relay = _cohere_relay()
    body = json.dumps({"type": "message-end", "delta": delta})
    relay.feed(f"event: message-end\ndata: {body}\n\n".encode(), 1.0)
    assert relay.upstream_eof(2.0) == b""  # its own message-end said it: nothing added
    assert relay.end_state == "upstream_error"


# -- TGI: huggingface_hub's error classes, detection off its path, running counts -------

#: The huggingface_hub class each code raises (TGI's error_type for it).
TGI_CLASSES = {
    ErrorCode.STREAM_TRUNCATED: "IncompleteGenerationError",
    ErrorCode.TOOL_CALL_TRUNCATED: "IncompleteGenerationError",
    ErrorCode.SHUTTING_DOWN: "OverloadedError",
    ErrorCode.RESUME_UNAVAILABLE: "OverloadedError",
    ErrorCode.RESUME_EXPIRED: "ValidationError",
}


@pytest.mark.parametrize("code", list(ErrorCode), ids=[c.value for c in ErrorCode])
def test_tgi_error_raises_huggingface_hubs_class_for_its_kind_with_our_code(
    code: ErrorCode,
) -> None:
    from huggingface_hub.inference._common import _format_text_generation_stream_output

    tgi = TGI()
    error = tgi.error_event(code, f"streamwarden: it broke ({code})")
    (event,) = SSEDecoder().feed(error)
    assert tgi.inspect(event).error  # it reads back as an upstream error
    # huggingface_hub reads the stream a line at a time, as this line.
    line = error.decode().split("\n")[0]
    with pytest.raises(Exception) as caught:
        _format_text_generation_stream_output(line, details=True)
    assert type(caught.value).__name__ == TGI_CLASSES.get(code, "GenerationError")
    assert str(caught.value) == f"streamwarden: it broke ({code})"


def _tgi_event(index: int, text: str, *, special: bool = False, last: bool = False) -> bytes:
    token = {"id": index, "text": text, "logprob": -0.5, "special": special}
    details = {"finish_reason": "eos_token", "generated_tokens": index, "seed": None}
    data = {
        "index": index,
        "token": token,
        "generated_text": "Hi there" if last else None,
        "details": details if last else None,
    }
    return f"data:{json.dumps(data)}\n\n".encode()


TGI_STREAM = (
    _tgi_event(1, "Hi") + _tgi_event(2, " there") + _tgi_event(3, "</s>", special=True, last=True)
)


def test_tgi_is_detected_by_its_first_event_on_an_endpoints_root_path() -> None:
    # Inference Endpoints and huggingface_hub post to the model's URL itself.
    relay = Relay(
        LIMITS, started_at=0.0, now=0.0, path="/", content_type="text/event-stream", headers={}
    )
    assert relay.dialect == "generic"
    assert relay.feed(TGI_STREAM, 1.0) + relay.upstream_eof(2.0) == TGI_STREAM
    assert relay.dialect == "tgi" and relay.end_state == "completed"
    assert relay.meter.tokens_generated == 3 and relay.meter.tokens_method == "usage"


def test_a_cut_tgi_stream_is_truncated_and_metered_by_its_running_index() -> None:
    cut = _tgi_event(1, "Hi") + _tgi_event(2, " there")
    relay = Relay(
        LIMITS,
        started_at=0.0,
        now=0.0,
        path="/generate_stream",
        content_type="text/event-stream",
        headers={},
    )
    out = relay.feed(cut, 1.0) + relay.upstream_eof(2.0)
    assert relay.end_state == "upstream_truncated"
    (error,) = SSEDecoder().feed(out[len(cut) :])
    assert json.loads(error.data)["error_type"] == "incomplete_generation"
    # TGI's own count of the tokens so far: a lower bound the estimate cannot undercut.
    assert relay.meter.tokens_source == "provider_partial"
    assert relay.meter.tokens_generated == 2


def test_a_tgi_special_token_is_counted_but_is_no_text() -> None:
    (event,) = SSEDecoder().feed(_tgi_event(3, "</s>", special=True, last=True))
    seen = TGI().inspect(event)
    assert (seen.text, seen.output_tokens, seen.terminal) == ("", 3, True)
    assert TGI().filter_text(event, False) == []


def test_tgi_final_event_without_details_is_terminal_and_an_error_event_is_an_error() -> None:
    final = Event(
        "message",
        '{"index":2,"token":{"id":1,"text":"!","logprob":0,"special":false},'
        '"generated_text":"Hi!","details":null}',
    )
    seen = TGI().inspect(final)
    assert (seen.text, seen.output_tokens, seen.terminal) == ("!", 2, True)
    error = Event(
        "message", '{"error":"Request failed during generation: x","error_type":"generation"}'
    )
    assert TGI().inspect(error).error


# -- Mistral's finish reasons in openai-chat ---------------------------------------------


def _mistral(finish: str) -> bytes:
    """A Mistral chat stream (its own chunk shape: usage on the last choice's chunk)."""

    def chunk(content: str, reason: str | None, usage: dict[str, int] | None = None) -> bytes:
        data: dict[str, Any] = {
            "id": "cmpl-e5cc70bb28c444948073e77776eb30ef",
            "object": "chat.completion.chunk",
            "created": 1702256327,
            "model": "mistral-small-latest",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": reason}],
        }
        if usage is not None:
            data["usage"] = usage
        return f"data: {json.dumps(data)}\n\n".encode()

    usage = {"prompt_tokens": 9, "total_tokens": 12, "completion_tokens": 3}
    return chunk("Bon", None) + chunk("jour", None) + chunk("", finish, usage) + b"data: [DONE]\n\n"


def _mistral_relay() -> Relay:
    return Relay(
        LIMITS,
        started_at=0.0,
        now=0.0,
        path="/v1/chat/completions",
        content_type="text/event-stream",
        headers={},
    )


def test_mistrals_error_finish_reason_is_the_upstreams_own_error() -> None:
    stream = _mistral("error")
    relay = _mistral_relay()
    # Passed on as it came (the client reads the upstream's own finish reason),
    # and counted as what it is: not a completed answer.
    assert relay.feed(stream, 1.0) + relay.upstream_eof(2.0) == stream
    assert relay.end_state == "upstream_error"
    assert relay.meter.upstream_reported_error and relay.meter.error_code is None


def test_mistrals_model_length_is_an_answer_cut_by_length_and_metered_by_its_usage() -> None:
    stream = _mistral("model_length")
    relay = _mistral_relay()
    assert relay.feed(stream, 1.0) + relay.upstream_eof(2.0) == stream
    assert relay.end_state == "completed"
    assert (relay.meter.tokens_generated, relay.meter.tokens_source) == (3, "provider")
