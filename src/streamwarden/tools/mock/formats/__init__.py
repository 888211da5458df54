"""The wire formats the mock speaks, and which one a request path selects.

Each provider's format lives in its own module (:mod:`.openai`,
:mod:`.anthropic`, :mod:`.gemini`, :mod:`.cohere`, :mod:`.ollama`,
:mod:`.vercel`, :mod:`.tgi`, :mod:`.generic`) and renders streamed answers,
whole replies and error bodies with no I/O. This module holds the registry
of format names (the values of ``--dialect``) and the one rule that maps a
request path to a format, so the server's routing and the CLI agree.
"""

from __future__ import annotations

from streamwarden.tools.mock.formats.anthropic import AnthropicMessages
from streamwarden.tools.mock.formats.base import (
    Answer,
    Frame,
    FrameRole,
    WireFormat,
    compact_json,
    sse_block,
)
from streamwarden.tools.mock.formats.cohere import CohereChat
from streamwarden.tools.mock.formats.gemini import GeminiStream
from streamwarden.tools.mock.formats.generic import GenericSSE
from streamwarden.tools.mock.formats.ollama import OllamaChat, OllamaGenerate
from streamwarden.tools.mock.formats.openai import OpenAIChat, OpenAIResponses
from streamwarden.tools.mock.formats.tgi import TGIGenerateStream
from streamwarden.tools.mock.formats.vercel import VercelDataStream, VercelUIStream

__all__ = [
    "DIALECT_ALIASES",
    "WIRE_FORMATS",
    "Answer",
    "Frame",
    "FrameRole",
    "WireFormat",
    "compact_json",
    "format_for_path",
    "sse_block",
    "wire_format",
]

WIRE_FORMATS: dict[str, WireFormat] = {
    fmt.name: fmt
    for fmt in (
        OpenAIChat(),
        OpenAIResponses(),
        AnthropicMessages(),
        GeminiStream(),
        CohereChat(),
        OllamaChat(),
        OllamaGenerate(),
        VercelDataStream(),
        VercelUIStream(),
        TGIGenerateStream(),
        GenericSSE(),
    )
}
"""Every format by its mock name."""

DIALECT_ALIASES: dict[str, str] = {"vercel-ai": "vercel-ui-stream", "ndjson": "ollama-chat"}
"""streamwarden dialect names that cover several formats, and the format they select."""

# Path endings that select a format, checked in order. Matching on the end
# lets a client put the mock under a prefix (``/openai/v1/chat/completions``).
_PATH_SUFFIXES: tuple[tuple[str, str], ...] = (
    ("/chat/completions", "openai-chat"),
    ("/responses", "openai-responses"),
    ("/messages", "anthropic"),
    (":streamGenerateContent", "gemini"),
    (":generateContent", "gemini"),
    ("/v2/chat", "cohere"),
    ("/api/chat", "ollama-chat"),
    ("/api/generate", "ollama-generate"),
    # After Ollama's /api/generate, which ends the same way.
    ("/generate_stream", "tgi"),
    ("/generate", "tgi"),
    ("/vercel/data-stream", "vercel-data-stream"),
    ("/vercel/ui-stream", "vercel-ui-stream"),
    ("/sse", "generic"),
)


def wire_format(name: str) -> WireFormat:
    """Return the format called ``name`` (a mock name or a dialect alias).

    Raises ``KeyError`` with the accepted names when there is none.
    """
    fmt = WIRE_FORMATS.get(DIALECT_ALIASES.get(name, name))
    if fmt is None:
        accepted = ", ".join([*WIRE_FORMATS, *DIALECT_ALIASES])
        raise KeyError(f"unknown dialect {name!r} (accepted: {accepted})")
    return fmt


def format_for_path(path: str) -> WireFormat | None:
    """Return the format a provider serves at ``path``, or ``None`` for other paths."""
    trimmed = path.rstrip("/")
    for suffix, name in _PATH_SUFFIXES:
        if trimmed.endswith(suffix):
            return WIRE_FORMATS[name]
    return None
