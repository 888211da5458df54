"""Google Gemini's ``streamGenerateContent?alt=sse`` stream.

Each event is ``data: {GenerateContentResponse}`` terminated by CRLF line
ends (``\\r\\n\\r\\n``), as the Gemini and Vertex endpoints send them, which
also keeps a relay's CRLF handling honest. The JSON uses Google's spacing
(``", "`` between members is ``","``, but ``": "`` after names). One token
per chunk; the last chunk carries ``finishReason: "STOP"`` and the complete
``usageMetadata`` with ``candidatesTokenCount``. The model comes from the
path (``/v1beta/models/{model}:streamGenerateContent``). Without
``alt=sse`` the real API streams a JSON array instead, which the mock does
not simulate, so it answers 400 there. Errors are Google's
``{"error": {code, message, status}}``.

A tool call is, as the Gemini API sends it, one ``functionCall`` part with
its ``args`` whole, in the last chunk beside ``finishReason``. A request
whose ``toolConfig.functionCallingConfig.streamFunctionCallArguments`` is
true (Vertex AI) gets them streamed instead: one part per fragment with
``partialArgs`` (``$.query``, the token's text) and ``willContinue: true``,
then a part without ``willContinue`` that closes the call, in the last chunk.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from streamwarden.tools.mock.formats.base import (
    Answer,
    Frame,
    FrameRole,
    JSONObject,
    WireFormat,
    call_arguments,
)
from streamwarden.tools.mock.tokens import TOOL_NAME

__all__ = ["GeminiStream"]

_STATUS_NAMES: dict[int, str] = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def _google_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ": "))


class GeminiStream(WireFormat):
    """``POST /v1beta/models/{model}:streamGenerateContent`` (and ``:generateContent``)."""

    name: ClassVar[str] = "gemini"
    dialect: ClassVar[str] = "gemini"
    content_type: ClassVar[str] = "text/event-stream"
    line_end: ClassVar[str] = "\r\n"
    default_model: ClassVar[str] = "gemini-2.5-flash"
    supports_tool_call: ClassVar[bool] = True

    def wants_stream(self, body: Mapping[str, Any], path: str) -> bool:
        # Gemini streams by method, not by a body flag.
        return path.endswith(":streamGenerateContent")

    def request_problem(self, path: str, query: Mapping[str, str]) -> str | None:
        if self.wants_stream({}, path) and query.get("alt") != "sse":
            return "the mock streams Gemini answers only as server-sent events: add ?alt=sse"
        return None

    def model_for(self, body: Mapping[str, Any], path: str) -> str:
        last = path.rsplit("/", 1)[-1]
        model = last.split(":", 1)[0]
        return model if ":" in last and model else self.default_model

    def frames(self, answer: Answer) -> list[Frame]:
        if answer.tool_call and not answer.stream_arguments:
            # The whole call in one chunk: every token of its arguments, and the end.
            part = {"functionCall": {"name": TOOL_NAME, "args": call_arguments(answer)}}
            chunk = self._chunk(answer, part, self._final_usage(answer), finished=True)
            return [Frame(self._sse(chunk), FrameRole.TERMINAL, tokens=answer.completion_tokens)]
        return super().frames(answer)

    def preamble(self, answer: Answer) -> list[Frame]:
        return []

    def token(self, answer: Answer, index: int, piece: str) -> Frame:
        usage = {
            "promptTokenCount": answer.prompt_tokens,
            "totalTokenCount": answer.prompt_tokens,
        }
        part: JSONObject
        if answer.tool_call:
            call: JSONObject = {"name": TOOL_NAME} if index == 0 else {}
            value = _token_text(piece, index, answer.completion_tokens)
            partial = {"jsonPath": "$.query", "stringValue": value, "willContinue": True}
            call.update({"partialArgs": [partial], "willContinue": True})
            part = {"functionCall": call}
        else:
            part = {"text": piece}
        chunk = self._chunk(answer, part, usage, finished=False)
        return Frame(self._sse(chunk), FrameRole.TOKEN, tokens=1)

    def closing(self, answer: Answer) -> list[Frame]:
        part: JSONObject | None = {"text": ""}
        if answer.tool_call:
            # The part that ends a streamed call; a broken call never gets it.
            part = None if answer.broken_call else {"functionCall": {}}
        chunk = self._chunk(answer, part, self._final_usage(answer), finished=True)
        return [Frame(self._sse(chunk), FrameRole.TERMINAL)]

    def reply(self, answer: Answer) -> bytes:
        part: JSONObject = {"text": answer.text}
        if answer.tool_call:
            part = {"functionCall": {"name": TOOL_NAME, "args": call_arguments(answer)}}
        body = self._chunk(answer, part, self._final_usage(answer), finished=True)
        return (json.dumps(body, ensure_ascii=False, indent=2) + "\n").encode()

    def error(self, status: int, message: str) -> bytes:
        body = {
            "error": {
                "code": status,
                "message": message,
                "status": _STATUS_NAMES.get(status, "UNKNOWN"),
            }
        }
        return (json.dumps(body, ensure_ascii=False, indent=2) + "\n").encode()

    def _sse(self, chunk: JSONObject) -> bytes:
        return f"data: {_google_json(chunk)}\r\n\r\n".encode()

    @staticmethod
    def _final_usage(answer: Answer) -> JSONObject:
        return {
            "promptTokenCount": answer.prompt_tokens,
            "candidatesTokenCount": answer.completion_tokens,
            "totalTokenCount": answer.prompt_tokens + answer.completion_tokens,
        }

    @staticmethod
    def _chunk(
        answer: Answer, part: JSONObject | None, usage: JSONObject, *, finished: bool
    ) -> JSONObject:
        parts = [] if part is None else [part]
        candidate: JSONObject = {"content": {"parts": parts, "role": "model"}}
        if finished:
            candidate["finishReason"] = "STOP"
        candidate["index"] = 0
        return {
            "candidates": [candidate],
            "usageMetadata": usage,
            "modelVersion": answer.model,
            "responseId": answer.ident("", 22),
        }


def _token_text(piece: str, index: int, count: int) -> str:
    """The token a fragment of the JSON arguments ``{"query": "..."}`` spells, unescaped."""
    if index == 0:
        piece = piece.removeprefix('{"query": "')
    if index == count - 1:
        piece = piece.removesuffix('"}')
    text = json.loads(f'"{piece}"')
    assert isinstance(text, str)
    return text
