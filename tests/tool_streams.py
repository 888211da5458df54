"""Tool-call streams of every dialect, as the mock upstream renders them, and where each call lies.

The tool-call tests (unit, property and through the faces) share these:
the frames of a stream whose answer is one tool call, which frame first
names the call to a client (``opens``) and which one closes it
(``closes``), and the byte offset at which a relay has each frame whole
(a frame ending in CRLF CRLF is dispatched at its second CR).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sse_reference import reference_decode
from streamwarden.core.filters import FilterSet
from streamwarden.core.relay import Limits, Relay
from streamwarden.core.sse import Event
from streamwarden.pipeline.transforms import with_transforms
from streamwarden.tools.mock.formats import WIRE_FORMATS, Answer, Frame
from streamwarden.tools.mock.tokens import TOOL_NAME, tool_call_fragments

LIMITS = Limits(
    keepalive_interval=0.0,
    upstream_idle_timeout=5.0,
    max_stream_duration=0.0,
    max_event_bytes=1 << 20,
)
REQUEST_ID = "tools-1"


def _has(mark: bytes) -> Callable[[bytes], bool]:
    return lambda data: mark in data


@dataclass(frozen=True)
class ToolStream:
    """One dialect's tool-call stream, and how to find its call in it."""

    name: str
    wire: str
    path: str
    opens: Callable[[bytes], bool]
    closes: Callable[[bytes], bool]
    #: The call's id as a client sees it ("" when the format has none).
    id_prefix: tuple[str, int] | None
    stream_arguments: bool = False
    #: Where the mock upstream serves it (and an app in front of it).
    mock_path: str = ""

    @property
    def whole(self) -> bool:
        """The call arrives whole, in one event (Gemini's functionCall)."""
        return self.name == "gemini"

    @property
    def lines(self) -> bool:
        return not WIRE_FORMATS[self.wire].is_sse

    def answer(self, tokens: int, broken_after: int | None = None) -> Answer:
        pieces = tuple(tool_call_fragments(tokens))
        answer = Answer(
            REQUEST_ID,
            "m",
            pieces,
            3,
            0,
            tool_call=True,
            stream_arguments=self.stream_arguments,
        )
        if broken_after is None:
            return answer
        return replace(answer, pieces=pieces[:broken_after], broken_call=True)

    def frames(self, tokens: int, broken_after: int | None = None) -> list[Frame]:
        return WIRE_FORMATS[self.wire].frames(self.answer(tokens, broken_after))

    def call_id(self, request_id: str = REQUEST_ID) -> str:
        """The call's id in the mock's answer to ``request_id`` ("" where the format has none)."""
        if self.id_prefix is None:
            return ""
        prefix, length = self.id_prefix
        return replace(self.answer(1), request_id=request_id).ident(prefix, length)

    def headers(self) -> dict[str, str]:
        return {k.lower(): v for k, v in WIRE_FORMATS[self.wire].stream_headers().items()}

    def request_body(self) -> dict[str, Any]:
        if self.stream_arguments:
            calling = {"streamFunctionCallArguments": True}
            return {"toolConfig": {"functionCallingConfig": calling}}
        return {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}

    def relay(self, limits: Limits = LIMITS, filters: FilterSet | None = None) -> Relay:
        headers = self.headers()
        return with_transforms(
            Relay(
                limits,
                started_at=0.0,
                now=0.0,
                path=self.path,
                content_type=headers["content-type"],
                headers=headers,
            ),
            filters=filters,
        )

    def decode(self, raw: bytes) -> list[Event]:
        """The whole events (or lines) in ``raw``, as a client reads them."""
        if self.lines:
            return [Event("message", line.decode()) for line in raw.split(b"\n")[:-1] if line]
        return reference_decode(raw)[0]


STREAMS = [
    ToolStream(
        "openai-chat",
        "openai-chat",
        "/v1/chat/completions",
        _has(b'"tool_calls"'),
        _has(b'"finish_reason":"tool_calls"'),
        ("call_", 24),
        mock_path="/v1/chat/completions",
    ),
    ToolStream(
        "openai-responses",
        "openai-responses",
        "/v1/responses",
        _has(b"response.output_item.added"),
        _has(b"response.function_call_arguments.done"),
        ("call_", 24),
        mock_path="/v1/responses",
    ),
    ToolStream(
        "anthropic",
        "anthropic",
        "/v1/messages",
        _has(b"content_block_start"),
        _has(b"content_block_stop"),
        ("toolu_01", 22),
        mock_path="/v1/messages",
    ),
    ToolStream(
        "gemini",
        "gemini",
        "/v1beta/models/g:streamGenerateContent",
        _has(b'"functionCall"'),
        _has(b'"functionCall"'),
        None,
        mock_path="/v1beta/models/g:streamGenerateContent?alt=sse",
    ),
    ToolStream(
        "gemini-streamed",
        "gemini",
        "/v1beta/models/g:streamGenerateContent",
        _has(b'"functionCall"'),
        _has(b'"functionCall": {}'),
        None,
        stream_arguments=True,
        mock_path="/v1beta/models/g:streamGenerateContent?alt=sse",
    ),
    ToolStream(
        "cohere",
        "cohere",
        "/v2/chat",
        _has(b"tool-call-start"),
        _has(b"tool-call-end"),
        (f"{TOOL_NAME}_", 12),
        mock_path="/v2/chat",
    ),
    ToolStream(
        "vercel-ui",
        "vercel-ui-stream",
        "/api/chat",
        _has(b"tool-input-start"),
        _has(b"tool-input-available"),
        ("call_", 24),
        mock_path="/vercel/ui-stream",
    ),
    ToolStream(
        "vercel-data",
        "vercel-data-stream",
        "/api/chat",
        lambda data: data.startswith(b"b:"),
        lambda data: data.startswith(b"9:"),
        ("call_", 24),
        mock_path="/vercel/data-stream",
    ),
]
BY_NAME = {stream.name: stream for stream in STREAMS}


@dataclass(frozen=True)
class Layout:
    """Where a stream's frames are whole, and which of them hold the call."""

    data: bytes
    #: The offset at which each frame is whole (dispatched).
    ready: list[int]
    starts: list[int]
    opened: int
    closed: int
    terminal: int

    def whole_frames(self, cut: int) -> int:
        """How many frames the first ``cut`` bytes hold whole."""
        return sum(1 for at in self.ready if at <= cut)


def layout(stream: ToolStream, frames: list[Frame]) -> Layout:
    ready: list[int] = []
    starts: list[int] = []
    at = 0
    for frame in frames:
        starts.append(at)
        at += len(frame.data)
        ready.append(at - 1 if frame.data.endswith(b"\r\n\r\n") else at)
    opened = next(i for i, f in enumerate(frames) if stream.opens(f.data))
    # A call that is never closed (a broken Gemini stream of partialArgs) ends at the terminal.
    closed = next(
        (i for i, f in enumerate(frames) if i >= opened and stream.closes(f.data)), len(frames) - 1
    )
    return Layout(b"".join(f.data for f in frames), ready, starts, opened, closed, len(frames) - 1)


def inside_call(stream: ToolStream, shape: Layout, cut: int) -> bool:
    """Whether a stream cut after ``cut`` bytes is cut inside its call.

    From the whole event that first names the call to a client until the
    event that closes it is whole; and for Gemini, whose calls arrive whole,
    inside an event once its bytes so far show a ``functionCall``.
    """
    whole = shape.whole_frames(cut)
    unfinished = shape.data[shape.starts[whole] : cut] if whole < len(shape.starts) else b""
    if stream.wire == "gemini" and b'"functionCall"' in unfinished:
        return True
    return not stream.whole and shape.opened < whole <= shape.closed


def error_of(stream: ToolStream, event: Event) -> tuple[str, str]:
    """The code and the message of a synthesized error event, in any dialect."""
    if stream.lines:
        assert event.data.startswith("3:"), event.data
        message = json.loads(event.data[2:])
        code = message.rsplit("(", 1)[1].rstrip(")")
        return code, message
    obj = json.loads(event.data)
    if "errorText" in obj:  # the Vercel UI message stream
        message = obj["errorText"]
        return message.rsplit("(", 1)[1].rstrip(")"), message
    if obj.get("type") == "message-end":  # Cohere's: a failed generation's end
        message = obj["delta"]["error"]
        return message.rsplit("(", 1)[1].rstrip(")"), message
    error = obj["error"]
    if isinstance(error.get("code"), int):  # Google's: the code in its details
        return error["details"][0]["metadata"]["code"], error["message"]
    return error["code"], error["message"]


def names_the_call(stream: ToolStream, message: str, request_id: str = REQUEST_ID) -> bool:
    return f"({TOOL_NAME})" in message and stream.call_id(request_id) in message


def arguments_in(stream: ToolStream, events: list[Event]) -> str:
    """The call's arguments as a client that reads the stream itself accumulates them.

    (For Gemini's streamed arguments: the text of ``$.query`` so far; for a
    whole Gemini call: its ``args`` as JSON.)
    """
    got: list[str] = []
    for event in events:
        data = event.data
        if stream.lines:
            if data.startswith("c:"):
                got.append(json.loads(data[2:])["argsTextDelta"])
            continue
        obj = json.loads(data) if data.startswith("{") else None
        if not isinstance(obj, dict):
            continue
        if stream.name == "openai-chat":
            for choice in obj.get("choices") or []:
                for call in choice["delta"].get("tool_calls") or []:
                    got.append(call["function"].get("arguments", ""))
        elif obj.get("type") in ("response.function_call_arguments.delta", "tool-input-delta"):
            got.append(obj.get("delta", obj.get("inputTextDelta", "")))
        elif obj.get("type") == "content_block_delta":
            got.append(obj["delta"].get("partial_json", ""))
        elif obj.get("type") in ("tool-call-start", "tool-call-delta"):
            got.append(obj["delta"]["message"]["tool_calls"]["function"].get("arguments", ""))
        elif "candidates" in obj:
            for part in obj["candidates"][0]["content"]["parts"]:
                call = part.get("functionCall") or {}
                got += [p["stringValue"] for p in call.get("partialArgs", [])]
                if "args" in call:  # an object; cut short, the text it got to
                    value = call["args"]
                    got.append(value if isinstance(value, str) else json.dumps(value))
    return "".join(got)
