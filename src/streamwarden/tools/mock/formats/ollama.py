"""Ollama's newline-delimited JSON streams: ``/api/chat`` and ``/api/generate``.

Ollama streams by default (only ``"stream": false`` asks for one object);
the body is ``application/x-ndjson``, one JSON object per line, one token per
line, and the final line has ``"done": true``, ``done_reason`` and the
metrics (``eval_count`` is the number of generated tokens, durations are in
nanoseconds). The server is written in Go, whose encoder emits compact JSON
with raw UTF-8 but escapes ``<``, ``>``, ``&``, U+2028 and U+2029; the mock
does the same. Errors are ``{"error": "..."}``.
"""

from __future__ import annotations

import datetime
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from streamwarden.tools.mock.formats.base import (
    Answer,
    Frame,
    FrameRole,
    JSONObject,
    WireFormat,
    compact_json,
)

__all__ = ["OllamaChat", "OllamaGenerate"]

_GO_ESCAPES = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}


def _go_json(value: Any) -> str:
    # These characters can only occur inside JSON strings, so replacing them
    # in the serialized text is the same as Go escaping them in each string.
    text = compact_json(value)
    for raw, escaped in _GO_ESCAPES.items():
        text = text.replace(raw, escaped)
    return text


def _timestamp(unix: int) -> str:
    moment = datetime.datetime.fromtimestamp(unix, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.000000000Z")


class _OllamaFormat(WireFormat):
    content_type: ClassVar[str] = "application/x-ndjson"
    is_sse: ClassVar[bool] = False
    default_model: ClassVar[str] = "llama3.2"
    dialect: ClassVar[str] = "ndjson"

    def wants_stream(self, body: Mapping[str, Any], path: str) -> bool:
        return body.get("stream") is not False

    def preamble(self, answer: Answer) -> list[Frame]:
        return []

    def token(self, answer: Answer, index: int, piece: str) -> Frame:
        line: JSONObject = {"model": answer.model, "created_at": _timestamp(answer.created)}
        line.update(self._content(piece))
        line["done"] = False
        return Frame(self._line(line), FrameRole.TOKEN, tokens=1)

    def closing(self, answer: Answer) -> list[Frame]:
        return [Frame(self._line(self._final(answer, "")), FrameRole.TERMINAL)]

    def reply(self, answer: Answer) -> bytes:
        return _go_json(self._final(answer, answer.text)).encode()

    def error(self, status: int, message: str) -> bytes:
        return _go_json({"error": message}).encode()

    @abstractmethod
    def _content(self, text: str) -> JSONObject:
        """The member(s) that carry ``text`` in this endpoint's objects."""

    @staticmethod
    def _line(obj: JSONObject) -> bytes:
        return (_go_json(obj) + "\n").encode()

    def _final(self, answer: Answer, text: str) -> JSONObject:
        eval_ns = int(answer.generation_seconds() * 1e9) - int(answer.ttft * 1e9)
        prompt_ns = int(answer.ttft * 1e9)
        final: JSONObject = {"model": answer.model, "created_at": _timestamp(answer.created)}
        final.update(self._content(text))
        final.update(
            {
                "done_reason": "stop",
                "done": True,
                "total_duration": prompt_ns + eval_ns + 1_000_000,
                "load_duration": 1_000_000,
                "prompt_eval_count": answer.prompt_tokens,
                "prompt_eval_duration": prompt_ns,
                "eval_count": answer.completion_tokens,
                "eval_duration": eval_ns,
            }
        )
        return final


class OllamaChat(_OllamaFormat):
    """``POST /api/chat``: each line carries ``message.content``."""

    name: ClassVar[str] = "ollama-chat"

    def _content(self, text: str) -> JSONObject:
        return {"message": {"role": "assistant", "content": text}}


class OllamaGenerate(_OllamaFormat):
    """``POST /api/generate``: each line carries ``response``."""

    name: ClassVar[str] = "ollama-generate"

    def _content(self, text: str) -> JSONObject:
        return {"response": text}
