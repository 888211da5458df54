"""The text the simulated model "generates", as a deterministic list of tokens.

Every answer of the mock is a prefix of one endless, fixed token sequence, so
a test can compute exactly what a client should have received for any number
of tokens (``mock_text(n)``) without talking to the mock. The vocabulary is
chosen to exercise the places where streaming proxies go wrong: multi-byte
UTF-8 (two-, three- and four-byte characters), characters that JSON must
escape (a double quote, newlines), and whitespace-only tokens. Tool-call mode
reuses the same tokens as the fragments of a JSON arguments string.
"""

from __future__ import annotations

import json

__all__ = ["TOOL_NAME", "mock_text", "mock_tokens", "tool_call_arguments", "tool_call_fragments"]

# One token per entry; the sequence repeats. Leading spaces are part of the
# token, as in BPE vocabularies, so the concatenation reads as prose.
_VOCABULARY: tuple[str, ...] = (
    "Streams",
    " should",
    " stay",
    " alive",
    " and",
    " honest",
    ":",
    " a",
    " naïve",
    " proxy",
    " buffers",
    " every",
    " byte",
    ",",
    " while",
    " a",
    " café",
    " in",
    " 日本",
    "語",
    " serves",
    " tokens",
    " one",
    " by",
    " one",
    " 😀",
    ".",
    "\n\n",
    "Señor",
    " Ωmega",
    " says",
    ' "',
    "größer",
    '"',
    " is",
    " not",
    " always",
    " better",
    " —",
    " 🚀",
    "\n",
)

TOOL_NAME = "lookup"
"""The name of the function the mock calls in tool-call mode."""


def mock_tokens(count: int) -> list[str]:
    """Return the first ``count`` tokens of the mock's answer text."""
    if count < 0:
        raise ValueError("count must not be negative")
    size = len(_VOCABULARY)
    return [_VOCABULARY[i % size] for i in range(count)]


def mock_text(count: int) -> str:
    """Return the answer text made of the first ``count`` tokens."""
    return "".join(mock_tokens(count))


def tool_call_fragments(count: int) -> list[str]:
    """Return ``count`` fragments whose concatenation is a JSON arguments object.

    The object is ``{"query": <mock_text(count)>}``; each fragment carries one
    token (JSON-escaped), the first also the opening and the last the closing
    of the object, so that a fragment count equals a token count exactly.
    With ``count == 0`` there are no fragments (and no arguments).
    """
    escaped = [json.dumps(token, ensure_ascii=False)[1:-1] for token in mock_tokens(count)]
    if not escaped:
        return []
    escaped[0] = '{"query": "' + escaped[0]
    escaped[-1] = escaped[-1] + '"}'
    return escaped


def tool_call_arguments(count: int) -> str:
    """Return the complete arguments string that ``tool_call_fragments`` spell out."""
    return "".join(tool_call_fragments(count))
