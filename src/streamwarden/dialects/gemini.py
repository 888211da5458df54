"""Google Gemini ``streamGenerateContent`` with ``alt=sse``.

Unnamed events whose data is a ``GenerateContentResponse``: text in
``candidates[].content.parts[].text``, tool calls as whole ``functionCall``
parts, cumulative ``usageMetadata.candidatesTokenCount``. The last chunk
carries a ``finishReason``; there is no separate terminal event, so that
chunk is the terminal one. Errors use Google's ``{"error": {...}}``
envelope, with our machine code as its ``code``.
"""

from __future__ import annotations

from typing import Any

from streamwarden.dialects.base import (
    NOTHING,
    UPSTREAM_ERROR,
    Dialect,
    Observation,
    as_int,
    dump_json,
    load_json,
    sse_block,
)
from streamwarden.sse import Event

_STATUS = {"upstream_timeout": "DEADLINE_EXCEEDED", "shutting_down": "UNAVAILABLE"}


class Gemini(Dialect):
    __slots__ = ()

    name = "gemini"
    terminal_event = "a chunk with finishReason"

    def inspect(self, event: Event) -> Observation:
        obj = load_json(event.data)
        if not isinstance(obj, dict):
            return NOTHING
        if obj.get("error"):
            return UPSTREAM_ERROR
        text, finished = _candidates(obj.get("candidates"))
        usage = obj.get("usageMetadata")
        tokens = as_int(usage.get("candidatesTokenCount")) if isinstance(usage, dict) else None
        if not text and tokens is None and not finished:
            return NOTHING
        return Observation(text=text, output_tokens=tokens, terminal=finished)

    def error_event(self, code: str, message: str) -> bytes:
        error = {"code": code, "message": message, "status": _STATUS.get(code, "INTERNAL")}
        return sse_block(dump_json({"error": error}))

    @classmethod
    def sniff(cls, event: Event) -> bool:
        if event.event != "message":
            return False
        obj = load_json(event.data)
        return isinstance(obj, dict) and ("candidates" in obj or "usageMetadata" in obj)


def _candidates(candidates: Any) -> tuple[str, bool]:
    if not isinstance(candidates, list):
        return "", False
    parts_text: list[str] = []
    finished = False
    for candidate in candidates:
        if not isinstance(candidate, dict):
            continue
        if candidate.get("finishReason"):
            finished = True
        content = candidate.get("content")
        parts = content.get("parts") if isinstance(content, dict) else None
        if not isinstance(parts, list):
            continue
        for part in parts:
            if not isinstance(part, dict):
                continue
            text = part.get("text")
            if isinstance(text, str):
                parts_text.append(text)
            call = part.get("functionCall")
            if isinstance(call, dict) and "args" in call:
                parts_text.append(dump_json(call["args"]))
    return "".join(parts_text), finished
