"""The Vercel AI SDK's two stream protocols, as a custom backend must speak them.

The data stream protocol (AI SDK 4, header ``x-vercel-ai-data-stream: v1``)
is line-based: ``TYPE:JSON\\n``. The mock writes ``f:`` (step start with the
message id), one ``0:"token"`` text part per token, ``e:`` (step finish with
``finishReason``, ``usage`` and ``isContinued``) and ``d:`` (message finish),
which is terminal. The UI message stream protocol (AI SDK 5, header
``x-vercel-ai-ui-message-stream: v1``) is SSE with one JSON chunk per
``data:`` line: ``start``, ``start-step``, ``text-start``, a ``text-delta``
per token, ``text-end``, ``finish-step``, ``finish``, then ``data: [DONE]``.
Its chunks are validated strictly by the SDK, so the usage rides in
``finish.messageMetadata`` (the field the protocol leaves to the app), never
in an extra member. Both always stream; the error body is plain JSON.

A tool call: in the data stream ``b:`` (its start), a ``c:`` argument delta
per fragment, ``9:`` (the call whole) and a ``tool-calls`` finish; in the UI
message stream ``tool-input-start``, a ``tool-input-delta`` per fragment and
``tool-input-available`` with the input whole.
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
    call_arguments,
    compact_json,
    sse_block,
)
from streamwarden.tools.mock.tokens import TOOL_NAME

__all__ = ["VercelDataStream", "VercelUIStream"]


class _VercelFormat(WireFormat):
    dialect: ClassVar[str] = "vercel-ai"
    default_model: ClassVar[str] = "gpt-4o-mini"
    replies_whole: ClassVar[bool] = False
    supports_tool_call: ClassVar[bool] = True

    def wants_stream(self, body: Mapping[str, Any], path: str) -> bool:
        return True

    def reply(self, answer: Answer) -> None:
        return None

    def error(self, status: int, message: str) -> bytes:
        return compact_json({"error": message}).encode()


class VercelDataStream(_VercelFormat):
    """``POST /vercel/data-stream``: AI SDK data stream protocol v1."""

    name: ClassVar[str] = "vercel-data-stream"
    content_type: ClassVar[str] = "text/plain; charset=utf-8"
    is_sse: ClassVar[bool] = False

    def stream_headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type, "x-vercel-ai-data-stream": "v1"}

    def preamble(self, answer: Answer) -> list[Frame]:
        start = {"messageId": answer.ident("msg-", 24)}
        frames = [Frame(self._part("f", start), FrameRole.PREAMBLE)]
        if answer.tool_call:
            call = {"toolCallId": answer.ident("call_"), "toolName": TOOL_NAME}
            frames.append(Frame(self._part("b", call), FrameRole.PREAMBLE))
        return frames

    def token(self, answer: Answer, index: int, piece: str) -> Frame:
        if answer.tool_call:
            delta = {"toolCallId": answer.ident("call_"), "argsTextDelta": piece}
            return Frame(self._part("c", delta), FrameRole.TOKEN, tokens=1)
        return Frame(self._part("0", piece), FrameRole.TOKEN, tokens=1)

    def closing(self, answer: Answer) -> list[Frame]:
        usage = {"promptTokens": answer.prompt_tokens, "completionTokens": answer.completion_tokens}
        finish = "tool-calls" if answer.tool_call else "stop"
        step = {"finishReason": finish, "usage": usage, "isContinued": False}
        frames = []
        if answer.tool_call:
            call = {
                "toolCallId": answer.ident("call_"),
                "toolName": TOOL_NAME,
                "args": call_arguments(answer),
            }
            frames.append(Frame(self._part("9", call), FrameRole.EPILOGUE))
        return [
            *frames,
            Frame(self._part("e", step), FrameRole.USAGE),
            Frame(self._part("d", {"finishReason": finish, "usage": usage}), FrameRole.TERMINAL),
        ]

    @staticmethod
    def _part(code: str, value: Any) -> bytes:
        return f"{code}:{compact_json(value)}\n".encode()


class VercelUIStream(_VercelFormat):
    """``POST /vercel/ui-stream``: AI SDK 5 UI message stream protocol v1."""

    name: ClassVar[str] = "vercel-ui-stream"
    content_type: ClassVar[str] = "text/event-stream"

    def stream_headers(self) -> dict[str, str]:
        return {
            "Content-Type": self.content_type,
            "Cache-Control": "no-cache",
            "x-vercel-ai-ui-message-stream": "v1",
            "x-accel-buffering": "no",
        }

    def preamble(self, answer: Answer) -> list[Frame]:
        opening: JSONObject = {"type": "text-start", "id": answer.ident("txt-", 24)}
        if answer.tool_call:
            opening = {
                "type": "tool-input-start",
                "toolCallId": answer.ident("call_"),
                "toolName": TOOL_NAME,
            }
        chunks: list[JSONObject] = [
            {"type": "start", "messageId": answer.ident("msg-", 24)},
            {"type": "start-step"},
            opening,
        ]
        return [Frame(self._chunk(chunk), FrameRole.PREAMBLE) for chunk in chunks]

    def token(self, answer: Answer, index: int, piece: str) -> Frame:
        chunk = {"type": "text-delta", "id": answer.ident("txt-", 24), "delta": piece}
        if answer.tool_call:
            chunk = {
                "type": "tool-input-delta",
                "toolCallId": answer.ident("call_"),
                "inputTextDelta": piece,
            }
        return Frame(self._chunk(chunk), FrameRole.TOKEN, tokens=1)

    def closing(self, answer: Answer) -> list[Frame]:
        usage = {
            "inputTokens": answer.prompt_tokens,
            "outputTokens": answer.completion_tokens,
            "totalTokens": answer.prompt_tokens + answer.completion_tokens,
        }
        finish = {"type": "finish", "messageMetadata": {"usage": usage}}
        closed: JSONObject = {"type": "text-end", "id": answer.ident("txt-", 24)}
        if answer.tool_call:
            closed = {
                "type": "tool-input-available",
                "toolCallId": answer.ident("call_"),
                "toolName": TOOL_NAME,
                "input": call_arguments(answer),
            }
        return [
            Frame(self._chunk(closed), FrameRole.EPILOGUE),
            Frame(self._chunk({"type": "finish-step"}), FrameRole.EPILOGUE),
            Frame(self._chunk(finish), FrameRole.USAGE),
            Frame(sse_block("[DONE]"), FrameRole.TERMINAL),
        ]

    @staticmethod
    def _chunk(chunk: JSONObject) -> bytes:
        return sse_block(compact_json(chunk))
