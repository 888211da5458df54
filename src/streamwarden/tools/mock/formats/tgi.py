"""Hugging Face Text Generation Inference: ``/generate_stream`` (and ``/generate``).

TGI's router (axum) writes each event as ``data:`` with no space, compact
JSON, one generated token per event: ``{"index": n, "token": {"id",
"text", "logprob", "special"}, "generated_text": null, "details": null}``,
``index`` counting from 1. The last event carries the last token with the
whole ``generated_text`` and ``details`` (``finish_reason``,
``generated_tokens``, ``seed``, ``input_length``); there is no other
terminal event, so the mock's last token frame is its terminal frame. The
mock always sends ``details``, as TGI does when the request asks for them
(``huggingface_hub`` does with ``details=True``), and ends with
``finish_reason: "length"``, as a generation that reached ``max_new_tokens``
exactly does. ``/generate`` answers whole unless the body says
``"stream": true``. Errors are TGI's ``{"error": ..., "error_type": ...}``.
"""

from __future__ import annotations

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

__all__ = ["TGIGenerateStream"]

# TGI's error_type for the statuses its router answers with (router/src/server.rs).
_ERROR_TYPES: dict[int, str] = {
    422: "validation",
    424: "generation",
    429: "overloaded",
}


class TGIGenerateStream(WireFormat):
    """``POST /generate_stream`` (streams) and ``POST /generate`` (whole)."""

    name: ClassVar[str] = "tgi"
    dialect: ClassVar[str] = "tgi"
    content_type: ClassVar[str] = "text/event-stream"
    default_model: ClassVar[str] = "tgi"

    def wants_stream(self, body: Mapping[str, Any], path: str) -> bool:
        return path.rstrip("/").endswith("/generate_stream") or body.get("stream") is True

    def frames(self, answer: Answer) -> list[Frame]:
        frames = super().frames(answer)
        if not answer.pieces:  # TGI generates at least one token: an empty one, here
            frames.append(Frame(self._event(answer, 0, ""), FrameRole.TERMINAL))
        return frames

    def preamble(self, answer: Answer) -> list[Frame]:
        return []

    def token(self, answer: Answer, index: int, piece: str) -> Frame:
        last = index == answer.completion_tokens - 1
        role = FrameRole.TERMINAL if last else FrameRole.TOKEN
        return Frame(self._event(answer, index, piece), role, tokens=1)

    def closing(self, answer: Answer) -> list[Frame]:
        return []  # the last token's event is the terminal one

    def reply(self, answer: Answer) -> bytes:
        body = {"generated_text": answer.text, "details": self._details(answer)}
        return compact_json(body).encode()

    def error(self, status: int, message: str) -> bytes:
        body = {"error": message, "error_type": _ERROR_TYPES.get(status, "generation")}
        return compact_json(body).encode()

    def _event(self, answer: Answer, index: int, piece: str) -> bytes:
        last = index >= answer.completion_tokens - 1
        event: JSONObject = {
            "index": index + 1,
            "token": {"id": 1000 + index, "text": piece, "logprob": -0.25, "special": False},
            "generated_text": answer.text if last else None,
            "details": self._details(answer) if last else None,
        }
        return f"data:{compact_json(event)}\n\n".encode()

    @staticmethod
    def _details(answer: Answer) -> JSONObject:
        return {
            "finish_reason": "length",
            "generated_tokens": max(answer.completion_tokens, 1),
            "seed": None,
            "input_length": answer.prompt_tokens,
        }
