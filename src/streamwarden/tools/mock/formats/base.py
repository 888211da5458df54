"""The frame model shared by every wire format of the mock, with no I/O.

A streamed answer is a list of :class:`Frame` objects: the exact bytes of one
event (or one line, for line-based formats), what part of the stream it is
(:class:`FrameRole`), and how many generated tokens it carries. The server
replays the list with the configured pacing and cuts it where a fault says
so; keeping the formats pure means a fault such as ``truncate`` works the
same way for every dialect, and a test can build the expected bytes without
a socket. :class:`Answer` holds everything a format needs to render one
answer; it is computed once per request, so identifiers and timestamps agree
across all the frames of a stream.
"""

from __future__ import annotations

import enum
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "Answer",
    "Frame",
    "FrameRole",
    "JSONObject",
    "WireFormat",
    "call_arguments",
    "compact_json",
    "sse_block",
]

JSONObject = dict[str, Any]
"""A JSON object as built by the formats (values are JSON-compatible)."""


class FrameRole(enum.Enum):
    """Where a frame sits in a stream; faults cut streams by role."""

    PREAMBLE = "preamble"
    """Before the first token: ``message_start``, ``response.created``, ..."""
    TOKEN = "token"
    """Carries exactly one generated token."""
    EPILOGUE = "epilogue"
    """After the last token, before usage and the terminal event."""
    USAGE = "usage"
    """Reports the generated-token count, before the terminal event."""
    TERMINAL = "terminal"
    """The dialect's terminal event (``data: [DONE]``, ``message_stop``, ...)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One event (or line) of a streamed answer, as it goes on the wire."""

    data: bytes
    """The exact bytes, framing and line ends included."""
    role: FrameRole
    """What part of the stream this frame is."""
    tokens: int = 0
    """How many generated tokens the frame carries (0 or 1; a Gemini function
    call, which arrives whole in one event, carries all of its arguments')."""


@dataclass(frozen=True, slots=True)
class Answer:
    """Everything needed to render one answer in any wire format."""

    request_id: str
    """The mock's request id; identifiers in the answer are derived from it."""
    model: str
    """The model name echoed in the answer."""
    pieces: tuple[str, ...]
    """Token texts, or tool-call argument fragments when ``tool_call`` is set."""
    prompt_tokens: int
    """The prompt size reported in usage fields."""
    created: int
    """Unix time (seconds) of the answer, as providers report it."""
    tool_call: bool = False
    """Answer with one tool call whose arguments are ``pieces``."""
    stream_arguments: bool = False
    """Gemini only: stream the call's arguments in ``partialArgs`` parts (Vertex
    AI's ``streamFunctionCallArguments``) instead of one whole ``functionCall``."""
    broken_call: bool = False
    """The call's arguments were cut short (``broken-tool-call``): ``pieces`` are
    a prefix, not JSON, and the formats close the call anyway, repeating them
    as text where the format repeats them (a Gemini stream of ``partialArgs``
    leaves out the part that would close the call)."""
    include_usage: bool = False
    """OpenAI chat only: the client asked for ``stream_options.include_usage``."""
    tokens_per_second: float = 0.0
    """The generation pace, for formats that report durations (0 = unpaced)."""
    ttft: float = 0.0
    """Seconds before the first token, for formats that report durations."""

    @property
    def completion_tokens(self) -> int:
        """The number of generated tokens (one per piece)."""
        return len(self.pieces)

    @property
    def text(self) -> str:
        """The whole answer text (or the whole tool-call arguments string)."""
        return "".join(self.pieces)

    def ident(self, prefix: str, length: int = 24) -> str:
        """Return a provider-style identifier that is stable for this request."""
        digest = hashlib.sha256(f"{prefix}\0{self.request_id}".encode()).hexdigest()
        while len(digest) < length:
            digest += hashlib.sha256(digest.encode()).hexdigest()
        return prefix + digest[:length]

    def generation_seconds(self) -> float:
        """How long generating the whole answer takes at the configured pace."""
        gaps = self.completion_tokens / self.tokens_per_second if self.tokens_per_second else 0.0
        return self.ttft + gaps


def call_arguments(answer: Answer) -> Any:
    """The tool call's arguments as an object, or, cut short, as the text they got to."""
    if answer.broken_call:
        return answer.text
    return json.loads(answer.text) if answer.text else {}


def compact_json(value: Any) -> str:
    """Serialize like the providers' streaming endpoints do: no spaces, raw UTF-8."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sse_block(data: str, event: str | None = None, line_end: str = "\n") -> bytes:
    """Frame one server-sent event: optional ``event:`` line, ``data:`` lines, blank line.

    Text with line breaks becomes one ``data:`` line per line, which is the
    only way SSE can carry them (a decoder joins the lines with ``\\n``).
    """
    lines = [] if event is None else [f"event: {event}"]
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return (line_end.join(lines) + line_end + line_end).encode()


class WireFormat(ABC):
    """One wire format: how a provider streams an answer, replies whole, and fails.

    Subclasses are stateless; one instance serves every request.
    """

    name: ClassVar[str]
    """The mock's name for the format (``--dialect`` accepts it)."""
    dialect: ClassVar[str]
    """The streamwarden dialect a relay should detect for this format."""
    content_type: ClassVar[str]
    """``Content-Type`` of a streamed answer."""
    is_sse: ClassVar[bool] = True
    """Whether the stream is server-sent events (comments and pings allowed)."""
    line_end: ClassVar[str] = "\n"
    """The line terminator the provider uses in its stream."""
    default_model: ClassVar[str]
    """The model reported when the request names none."""
    supports_tool_call: ClassVar[bool] = False
    """Whether the format can stream a tool call (``x-mock-tool-call``)."""
    replies_whole: ClassVar[bool] = True
    """Whether the provider can answer without streaming (``reply`` is not ``None``)."""
    reply_content_type: ClassVar[str] = "application/json"
    """``Content-Type`` of a whole (non-streamed) reply."""
    error_content_type: ClassVar[str] = "application/json"
    """``Content-Type`` of an error body."""

    def stream_headers(self) -> dict[str, str]:
        """Response headers of a streamed answer, ``Content-Type`` included."""
        return {"Content-Type": self.content_type}

    def wants_stream(self, body: Mapping[str, Any], path: str) -> bool:
        """Whether the request asks for a streamed answer (the provider's rule)."""
        return body.get("stream") is True

    def request_problem(self, path: str, query: Mapping[str, str]) -> str | None:
        """A reason the provider would refuse this request shape, or ``None``."""
        return None

    def model_for(self, body: Mapping[str, Any], path: str) -> str:
        """The model name to report: the request's, else the format's default."""
        model = body.get("model")
        return model if isinstance(model, str) and model else self.default_model

    def frames(self, answer: Answer) -> list[Frame]:
        """Render the whole streamed answer."""
        tokens = [self.token(answer, i, piece) for i, piece in enumerate(answer.pieces)]
        return [*self.preamble(answer), *tokens, *self.closing(answer)]

    def ping(self) -> bytes:
        """An SSE comment frame, written between events by ``keepalive-pings``."""
        return f": ping{self.line_end}{self.line_end}".encode()

    @abstractmethod
    def preamble(self, answer: Answer) -> list[Frame]:
        """The frames before the first token."""

    @abstractmethod
    def token(self, answer: Answer, index: int, piece: str) -> Frame:
        """The frame carrying token number ``index`` (0-based) with text ``piece``."""

    @abstractmethod
    def closing(self, answer: Answer) -> list[Frame]:
        """The frames after the last token, the terminal event last."""

    @abstractmethod
    def reply(self, answer: Answer) -> bytes | None:
        """The whole non-streamed reply body, or ``None`` if the format always streams."""

    @abstractmethod
    def error(self, status: int, message: str) -> bytes:
        """An error body shaped like the provider's, for HTTP ``status``."""
