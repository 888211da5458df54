"""Cohere's v2 chat stream: named events whose data repeats the name as ``type``.

The stream opens with ``message-start`` (the message id, the assistant's
empty message), then ``content-start``, a ``content-delta`` per token (the
text at ``delta.message.content.text``) and ``content-end``; for a tool call,
``tool-call-start`` (the call's id and name, empty arguments), a
``tool-call-delta`` per argument fragment and ``tool-call-end``. The last
event, ``message-end``, carries the finish reason (``COMPLETE``,
``TOOL_CALL``) and the usage, billed and counted. Payloads are compact JSON
with raw UTF-8; there is no ``[DONE]``. Errors are ``{"id", "message"}``.
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

from streamwarden.tools.mock.formats.base import (
    Answer,
    Frame,
    FrameRole,
    JSONObject,
    WireFormat,
    compact_json,
    sse_block,
)
from streamwarden.tools.mock.tokens import TOOL_NAME

__all__ = ["CohereChat"]


def _uuid(seed: str) -> str:
    """A stable UUID-shaped id (Cohere's message and error ids are UUIDs)."""
    hexes = hashlib.sha256(seed.encode()).hexdigest()
    return "-".join((hexes[:8], hexes[8:12], hexes[12:16], hexes[16:20], hexes[20:32]))


class CohereChat(WireFormat):
    """``POST /v2/chat``."""

    name: ClassVar[str] = "cohere"
    dialect: ClassVar[str] = "cohere"
    content_type: ClassVar[str] = "text/event-stream"
    default_model: ClassVar[str] = "command-a-03-2025"
    supports_tool_call: ClassVar[bool] = True

    def stream_headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type, "Cache-Control": "no-cache"}

    @staticmethod
    def call_id(answer: Answer) -> str:
        """The tool call's id: Cohere's are the tool's name and a random suffix."""
        return answer.ident(f"{TOOL_NAME}_", 12)

    def preamble(self, answer: Answer) -> list[Frame]:
        message = {
            "role": "assistant",
            "content": [],
            "tool_plan": "",
            "tool_calls": [],
            "citations": [],
        }
        start = {
            "id": _uuid(f"msg\0{answer.request_id}"),
            "type": "message-start",
            "delta": {"message": message},
        }
        if answer.tool_call:
            call = {
                "id": self.call_id(answer),
                "type": "function",
                "function": {"name": TOOL_NAME, "arguments": ""},
            }
            opened = {
                "type": "tool-call-start",
                "index": 0,
                "delta": {"message": {"tool_calls": call}},
            }
        else:
            content = {"content": {"type": "text", "text": ""}}
            opened = {"type": "content-start", "index": 0, "delta": {"message": content}}
        return [Frame(_event(start), FrameRole.PREAMBLE), Frame(_event(opened), FrameRole.PREAMBLE)]

    def token(self, answer: Answer, index: int, piece: str) -> Frame:
        event: JSONObject
        if answer.tool_call:
            call = {"function": {"arguments": piece}}
            event = {
                "type": "tool-call-delta",
                "index": 0,
                "delta": {"message": {"tool_calls": call}},
            }
        else:
            content = {"content": {"text": piece}}
            event = {"type": "content-delta", "index": 0, "delta": {"message": content}}
        return Frame(_event(event), FrameRole.TOKEN, tokens=1)

    def closing(self, answer: Answer) -> list[Frame]:
        closed = {"type": "tool-call-end" if answer.tool_call else "content-end", "index": 0}
        end = {
            "type": "message-end",
            "delta": {"finish_reason": self._finish(answer), "usage": self._usage(answer)},
        }
        return [Frame(_event(closed), FrameRole.EPILOGUE), Frame(_event(end), FrameRole.TERMINAL)]

    def reply(self, answer: Answer) -> bytes:
        message: JSONObject = {"role": "assistant"}
        if answer.tool_call:
            message["tool_plan"] = ""
            message["tool_calls"] = [
                {
                    "id": self.call_id(answer),
                    "type": "function",
                    "function": {"name": TOOL_NAME, "arguments": answer.text},
                }
            ]
        else:
            message["content"] = [{"type": "text", "text": answer.text}]
        body = {
            "id": _uuid(f"msg\0{answer.request_id}"),
            "message": message,
            "finish_reason": self._finish(answer),
            "usage": self._usage(answer),
        }
        return compact_json(body).encode()

    def error(self, status: int, message: str) -> bytes:
        # No Answer to derive an id from: the message names the mock's request id.
        return compact_json({"id": _uuid(f"{status}\0{message}"), "message": message}).encode()

    @staticmethod
    def _finish(answer: Answer) -> str:
        return "TOOL_CALL" if answer.tool_call else "COMPLETE"

    @staticmethod
    def _usage(answer: Answer) -> JSONObject:
        counts = {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens}
        return {"billed_units": dict(counts), "tokens": dict(counts), "cached_tokens": 0}


def _event(payload: JSONObject) -> bytes:
    return sse_block(compact_json(payload), event=str(payload["type"]))
