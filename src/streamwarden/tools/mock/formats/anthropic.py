"""Anthropic's Messages API stream: named events, ``message_stop`` is terminal.

The stream opens with ``message_start`` (the message envelope with empty
content and ``output_tokens: 1``, as the API reports it at that point), then
``content_block_start``, one ``ping``, a ``content_block_delta`` per token
(``text_delta``, or ``input_json_delta`` fragments for a ``tool_use``
block), ``content_block_stop``, ``message_delta`` with the stop reason and
the cumulative ``usage.output_tokens``, and ``message_stop``. Payloads are
compact JSON, except the ping, which the API sends as ``{"type": "ping"}``.
Errors are ``{"type": "error", "error": {type, message}, "request_id"}``
with the API's error type for each status.
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

from streamwarden.tools.mock.formats.base import (
    Answer,
    Frame,
    FrameRole,
    JSONObject,
    WireFormat,
    call_arguments,
    compact_json,
    sse_block,
)
from streamwarden.tools.mock.tokens import TOOL_NAME

__all__ = ["AnthropicMessages"]

_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


class AnthropicMessages(WireFormat):
    """``POST /v1/messages``."""

    name: ClassVar[str] = "anthropic"
    dialect: ClassVar[str] = "anthropic"
    content_type: ClassVar[str] = "text/event-stream; charset=utf-8"
    default_model: ClassVar[str] = "claude-sonnet-4-5-20250929"
    supports_tool_call: ClassVar[bool] = True

    def stream_headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type, "Cache-Control": "no-cache"}

    def preamble(self, answer: Answer) -> list[Frame]:
        envelope = self._message(answer, [], stop_reason=None, output_tokens=1)
        if answer.tool_call:
            block: JSONObject = {
                "type": "tool_use",
                "id": answer.ident("toolu_01", 22),
                "name": TOOL_NAME,
                "input": {},
            }
        else:
            block = {"type": "text", "text": ""}
        start_block = {"type": "content_block_start", "index": 0, "content_block": block}
        return [
            Frame(self._event({"type": "message_start", "message": envelope}), FrameRole.PREAMBLE),
            Frame(self._event(start_block), FrameRole.PREAMBLE),
            # The API's ping is the one payload it does not send compact.
            Frame(sse_block('{"type": "ping"}', event="ping"), FrameRole.PREAMBLE),
        ]

    def token(self, answer: Answer, index: int, piece: str) -> Frame:
        if answer.tool_call:
            delta = {"type": "input_json_delta", "partial_json": piece}
        else:
            delta = {"type": "text_delta", "text": piece}
        event = {"type": "content_block_delta", "index": 0, "delta": delta}
        return Frame(self._event(event), FrameRole.TOKEN, tokens=1)

    def closing(self, answer: Answer) -> list[Frame]:
        message_delta = {
            "type": "message_delta",
            "delta": {"stop_reason": self._stop_reason(answer), "stop_sequence": None},
            "usage": {"output_tokens": answer.completion_tokens},
        }
        return [
            Frame(self._event({"type": "content_block_stop", "index": 0}), FrameRole.EPILOGUE),
            Frame(self._event(message_delta), FrameRole.USAGE),
            Frame(self._event({"type": "message_stop"}), FrameRole.TERMINAL),
        ]

    def reply(self, answer: Answer) -> bytes:
        content: list[JSONObject]
        if answer.tool_call:
            arguments: Any = call_arguments(answer)
            content = [
                {
                    "type": "tool_use",
                    "id": answer.ident("toolu_01", 22),
                    "name": TOOL_NAME,
                    "input": arguments,
                }
            ]
        else:
            content = [{"type": "text", "text": answer.text}]
        body = self._message(
            answer,
            content,
            stop_reason=self._stop_reason(answer),
            output_tokens=answer.completion_tokens,
        )
        return compact_json(body).encode()

    def error(self, status: int, message: str) -> bytes:
        kind = _ERROR_TYPES.get(status, "api_error")
        body = {
            "type": "error",
            "error": {"type": kind, "message": message},
            "request_id": "req_011" + _suffix(message, status),
        }
        return compact_json(body).encode()

    @staticmethod
    def _event(payload: JSONObject) -> bytes:
        return sse_block(compact_json(payload), event=str(payload["type"]))

    @staticmethod
    def _stop_reason(answer: Answer) -> str:
        return "tool_use" if answer.tool_call else "end_turn"

    @staticmethod
    def _message(
        answer: Answer,
        content: list[JSONObject],
        *,
        stop_reason: str | None,
        output_tokens: int,
    ) -> JSONObject:
        return {
            "id": answer.ident("msg_01", 22),
            "type": "message",
            "role": "assistant",
            "model": answer.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {
                "input_tokens": answer.prompt_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": output_tokens,
            },
        }


def _suffix(message: str, status: int) -> str:
    # Errors have no Answer to derive an id from; the message names the mock's
    # request id, so hashing it gives a stable, distinct suffix.
    return hashlib.sha256(f"{status}\0{message}".encode()).hexdigest()[:21]
