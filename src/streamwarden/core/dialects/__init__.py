"""The wire formats of streamed LLM output, and how a stream is recognised.

One module per format; this module holds the registry and the detection
rules, in this order:

1. A configured dialect (anything but ``auto``) is used as is.
2. Response headers decide when they can: the Vercel AI stream headers, and
   ``application/x-ndjson``.
3. A WebSocket's messages (framing ``messages``) carry a stream in one known
   format, the Responses API's, on its path (``/responses``) or where the
   dialect is set to it; any other WebSocket is ``generic`` (no stream to
   read: its messages are only relayed). Not provisional: each message
   names its own ``type``.
4. Otherwise the request path gives a first guess (``/chat/completions``,
   ``/responses``, ``/messages``, ``:streamGenerateContent``, ``/v2/chat``,
   ``/generate_stream``), which the first data event can overrule when it
   clearly belongs to another known format: many apps serve a provider's
   stream on a path of their own.
5. A stream that matches nothing is ``generic``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from streamwarden.core.dialects.anthropic import Anthropic
from streamwarden.core.dialects.base import NOTHING, Dialect, Framing, Observation
from streamwarden.core.dialects.cohere import Cohere
from streamwarden.core.dialects.gemini import Gemini
from streamwarden.core.dialects.generic import Generic
from streamwarden.core.dialects.ndjson import NDJSON
from streamwarden.core.dialects.openai_chat import OpenAIChat
from streamwarden.core.dialects.openai_responses import OpenAIResponses
from streamwarden.core.dialects.tgi import TGI
from streamwarden.core.dialects.vercel_ai import (
    DATA_STREAM_HEADER,
    UI_MESSAGE_STREAM_HEADER,
    VercelDataStream,
    VercelUIMessageStream,
)
from streamwarden.core.sse import Event

__all__ = [
    "DIALECT_NAMES",
    "NOTHING",
    "Detection",
    "Dialect",
    "Framing",
    "Observation",
    "asks_for_stream",
    "detect",
    "media_type",
    "sniff",
    "stream_framing",
]

#: Every name accepted for the ``dialect`` setting.
DIALECT_NAMES = (
    "auto",
    "openai-chat",
    "openai-responses",
    "anthropic",
    "gemini",
    "cohere",
    "vercel-ai",
    "ndjson",
    "generic",
    "tgi",
)

SSE_MEDIA_TYPE = "text/event-stream"
NDJSON_MEDIA_TYPE = "application/x-ndjson"

_BY_NAME: dict[str, type[Dialect]] = {
    "openai-chat": OpenAIChat,
    "openai-responses": OpenAIResponses,
    "anthropic": Anthropic,
    "gemini": Gemini,
    "cohere": Cohere,
    "ndjson": NDJSON,
    "generic": Generic,
    "tgi": TGI,
}

_BY_PATH: tuple[tuple[re.Pattern[str], type[Dialect]], ...] = (
    (re.compile(r"/(chat/)?completions/?$"), OpenAIChat),
    (re.compile(r"/responses(/[^/]+)?/?$"), OpenAIResponses),
    (re.compile(r"/messages/?$"), Anthropic),
    (re.compile(r":streamGenerateContent$"), Gemini),
    (re.compile(r"/v2/chat/?$"), Cohere),
    (re.compile(r"/generate_stream/?$"), TGI),
)

# Checked in order on the first data event of a stream whose dialect is a guess.
_SNIFFERS: tuple[type[Dialect], ...] = (
    OpenAIResponses,
    Anthropic,
    OpenAIChat,
    Gemini,
    Cohere,
    TGI,
)


@dataclass(frozen=True, slots=True)
class Detection:
    """The dialect chosen for a stream, and whether the first event may overrule it."""

    dialect: Dialect
    provisional: bool


def media_type(content_type: str | None) -> str:
    """The bare, lower-cased media type of a ``Content-Type`` value (parameters dropped)."""
    if not content_type:
        return ""
    return content_type.split(";", 1)[0].strip().lower()


def stream_framing(
    content_type: str | None,
    headers: Mapping[str, str],
    extra_media_types: frozenset[str] = frozenset(),
) -> Framing | None:
    """How a response is framed if it is a stream, or ``None`` if it is not one.

    ``headers`` must be case-insensitive (aiohttp's and Starlette's are) or
    use lower-case names.
    """
    kind = media_type(content_type)
    if DATA_STREAM_HEADER in headers:
        return "lines"
    if kind == SSE_MEDIA_TYPE or UI_MESSAGE_STREAM_HEADER in headers:
        return "sse"
    if kind == NDJSON_MEDIA_TYPE:
        return "lines"
    if kind in extra_media_types:
        return "sse"
    return None


def detect(
    setting: str,
    *,
    path: str,
    content_type: str | None,
    headers: Mapping[str, str],
    framing: Framing | None = None,
) -> Detection:
    """Choose the dialect of a stream from the setting, the response headers and the path."""
    framing = framing or stream_framing(content_type, headers) or "sse"
    if framing == "messages":
        return Detection(_over_messages(setting, path)(), provisional=False)
    if (
        setting == "vercel-ai"
        or DATA_STREAM_HEADER in headers
        or (setting == "auto" and UI_MESSAGE_STREAM_HEADER in headers)
    ):
        chosen: Dialect = VercelDataStream() if framing == "lines" else VercelUIMessageStream()
        return Detection(chosen, provisional=False)
    if setting != "auto":
        return Detection(_BY_NAME[setting](), provisional=False)
    if framing == "lines":
        return Detection(NDJSON(), provisional=False)
    for pattern, cls in _BY_PATH:
        if pattern.search(path):
            return Detection(cls(), provisional=True)
    return Detection(Generic(), provisional=True)


#: The formats that stream over a WebSocket's messages.
_OVER_MESSAGES: tuple[type[Dialect], ...] = (OpenAIResponses,)


def _over_messages(setting: str, path: str) -> type[Dialect]:
    """The format of a WebSocket's messages: one that streams over them, or ``generic``."""
    if setting != "auto":
        chosen = _BY_NAME.get(setting, Generic)
        return chosen if chosen in _OVER_MESSAGES else Generic
    for pattern, cls in _BY_PATH:
        if cls in _OVER_MESSAGES and pattern.search(path):
            return cls
    return Generic


_STREAM_FLAG = re.compile(rb'"stream"\s*:\s*true')


def asks_for_stream(accept: str | None, query: str, body_start: bytes) -> bool:
    """Whether a request asks for a streamed answer.

    By ``Accept: text/event-stream``, Gemini's ``alt=sse``, or the
    ``"stream": true`` that OpenAI- and Anthropic-style APIs put in the JSON
    body (looked for in the first bytes of the body only).
    """
    if accept is not None and SSE_MEDIA_TYPE in accept.lower():
        return True
    if "alt=sse" in query:
        return True
    return _STREAM_FLAG.search(body_start) is not None


def sniff(event: Event, current: Dialect) -> Dialect:
    """The dialect the first data event reveals, or ``current`` if it reveals none."""
    if current.sniff(event):
        return current
    for cls in _SNIFFERS:
        if cls.sniff(event):
            return cls()
    return current
