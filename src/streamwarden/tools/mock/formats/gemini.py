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
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from streamwarden.tools.mock.formats.base import Answer, Frame, FrameRole, JSONObject, WireFormat

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

    def preamble(self, answer: Answer) -> list[Frame]:
        return []

    def token(self, answer: Answer, index: int, piece: str) -> Frame:
        usage = {
            "promptTokenCount": answer.prompt_tokens,
            "totalTokenCount": answer.prompt_tokens,
        }
        chunk = self._chunk(answer, piece, usage, finished=False)
        return Frame(self._sse(chunk), FrameRole.TOKEN, tokens=1)

    def closing(self, answer: Answer) -> list[Frame]:
        chunk = self._chunk(answer, "", self._final_usage(answer), finished=True)
        return [Frame(self._sse(chunk), FrameRole.TERMINAL)]

    def reply(self, answer: Answer) -> bytes:
        body = self._chunk(answer, answer.text, self._final_usage(answer), finished=True)
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
    def _chunk(answer: Answer, text: str, usage: JSONObject, *, finished: bool) -> JSONObject:
        candidate: JSONObject = {"content": {"parts": [{"text": text}], "role": "model"}}
        if finished:
            candidate["finishReason"] = "STOP"
        candidate["index"] = 0
        return {
            "candidates": [candidate],
            "usageMetadata": usage,
            "modelVersion": answer.model,
            "responseId": answer.ident("", 22),
        }
