"""OpenAI's two streaming wire formats: Chat Completions and the Responses API.

Chat Completions streams ``data: {chat.completion.chunk}`` events, one token
per chunk, a chunk carrying ``finish_reason``, an optional usage chunk (empty
``choices``) when the request sets ``stream_options.include_usage``, and ends
with ``data: [DONE]``. With ``include_usage`` every chunk also carries
``"usage":null``, as the real API does. The Responses API streams named
events (``event:`` lines) whose payloads repeat the event type and carry a
``sequence_number`` that counts from 0 across the whole stream; it has no
``[DONE]``: ``response.completed`` is terminal and carries the usage. A tool
call is a ``function_call`` output item: ``response.output_item.added``, a
``response.function_call_arguments.delta`` per fragment, then
``response.function_call_arguments.done`` and ``response.output_item.done``
with the whole arguments.

Both formats use compact JSON with raw UTF-8 in the stream. Error bodies are
the API's ``{"error": {message, type, param, code}}`` object, which OpenAI
serves indented by four spaces.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

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

__all__ = ["OpenAIChat", "OpenAIResponses", "openai_error"]

# (type, code) per status, as the API reports them; anything else is a server error.
_ERROR_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "unsupported_country_region_territory"),
    404: ("invalid_request_error", "model_not_found"),
    429: ("requests", "rate_limit_exceeded"),
}


def openai_error(status: int, message: str) -> bytes:
    """An OpenAI error body for ``status``."""
    kind, code = _ERROR_KINDS.get(status, ("server_error", None))
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return (json.dumps(body, ensure_ascii=False, indent=4) + "\n").encode()


class OpenAIChat(WireFormat):
    """``POST /v1/chat/completions``."""

    name: ClassVar[str] = "openai-chat"
    dialect: ClassVar[str] = "openai-chat"
    content_type: ClassVar[str] = "text/event-stream; charset=utf-8"
    default_model: ClassVar[str] = "gpt-4o-mini-2024-07-18"
    supports_tool_call: ClassVar[bool] = True

    def preamble(self, answer: Answer) -> list[Frame]:
        if answer.tool_call:
            call = {
                "index": 0,
                "id": answer.ident("call_"),
                "type": "function",
                "function": {"name": TOOL_NAME, "arguments": ""},
            }
            delta: JSONObject = {
                "role": "assistant",
                "content": None,
                "tool_calls": [call],
                "refusal": None,
            }
        else:
            delta = {"role": "assistant", "content": "", "refusal": None}
        return [Frame(self._chunk(answer, delta), FrameRole.PREAMBLE)]

    def token(self, answer: Answer, index: int, piece: str) -> Frame:
        if answer.tool_call:
            delta: JSONObject = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        else:
            delta = {"content": piece}
        return Frame(self._chunk(answer, delta), FrameRole.TOKEN, tokens=1)

    def closing(self, answer: Answer) -> list[Frame]:
        finish = "tool_calls" if answer.tool_call else "stop"
        frames = [Frame(self._chunk(answer, {}, finish), FrameRole.EPILOGUE)]
        if answer.include_usage:
            usage_chunk = self._envelope(answer)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = self._usage(answer)
            frames.append(Frame(sse_block(compact_json(usage_chunk)), FrameRole.USAGE))
        frames.append(Frame(sse_block("[DONE]"), FrameRole.TERMINAL))
        return frames

    def reply(self, answer: Answer) -> bytes:
        message: JSONObject = {"role": "assistant"}
        if answer.tool_call:
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": answer.ident("call_"),
                    "type": "function",
                    "function": {"name": TOOL_NAME, "arguments": answer.text},
                }
            ]
        else:
            message["content"] = answer.text
        message["refusal"] = None
        message["annotations"] = []
        body = {
            "id": answer.ident("chatcmpl-", 29),
            "object": "chat.completion",
            "created": answer.created,
            "model": answer.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "tool_calls" if answer.tool_call else "stop",
                }
            ],
            "usage": self._usage(answer),
            "service_tier": "default",
            "system_fingerprint": answer.ident("fp_", 10),
        }
        return (json.dumps(body, ensure_ascii=False, indent=2) + "\n").encode()

    def error(self, status: int, message: str) -> bytes:
        return openai_error(status, message)

    def _envelope(self, answer: Answer) -> JSONObject:
        return {
            "id": answer.ident("chatcmpl-", 29),
            "object": "chat.completion.chunk",
            "created": answer.created,
            "model": answer.model,
            "service_tier": "default",
            "system_fingerprint": answer.ident("fp_", 10),
        }

    def _chunk(self, answer: Answer, delta: JSONObject, finish: str | None = None) -> bytes:
        chunk = self._envelope(answer)
        chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        if answer.include_usage:
            chunk["usage"] = None
        return sse_block(compact_json(chunk))

    @staticmethod
    def _usage(answer: Answer) -> JSONObject:
        return {
            "prompt_tokens": answer.prompt_tokens,
            "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }


class OpenAIResponses(WireFormat):
    """``POST /v1/responses``."""

    name: ClassVar[str] = "openai-responses"
    dialect: ClassVar[str] = "openai-responses"
    content_type: ClassVar[str] = "text/event-stream; charset=utf-8"
    default_model: ClassVar[str] = "gpt-4.1-2025-04-14"
    supports_tool_call: ClassVar[bool] = True

    # The preamble events come first, so token ``i`` has sequence number 4 + i
    # (3 + i for a tool call, whose item has no content part).
    _PREAMBLE_EVENTS: ClassVar[int] = 4

    def preamble(self, answer: Answer) -> list[Frame]:
        events: list[tuple[str, JSONObject]] = [
            ("response.created", {"response": self._response(answer, "in_progress")}),
            ("response.in_progress", {"response": self._response(answer, "in_progress")}),
        ]
        if answer.tool_call:
            item = self._call_item(answer, "in_progress", "")
            events.append(("response.output_item.added", {"output_index": 0, "item": item}))
        else:
            item = self._item(answer, "in_progress", [])
            events.append(("response.output_item.added", {"output_index": 0, "item": item}))
            fields = {
                "item_id": answer.ident("msg_", 48),
                "output_index": 0,
                "content_index": 0,
                "part": self._part(""),
            }
            events.append(("response.content_part.added", fields))
        return [
            Frame(self._event(name, seq, fields), FrameRole.PREAMBLE)
            for seq, (name, fields) in enumerate(events)
        ]

    def token(self, answer: Answer, index: int, piece: str) -> Frame:
        seq = self._first_token(answer) + index
        if answer.tool_call:
            fields: JSONObject = {
                "item_id": answer.ident("fc_", 48),
                "output_index": 0,
                "delta": piece,
            }
            name = "response.function_call_arguments.delta"
            return Frame(self._event(name, seq, fields), FrameRole.TOKEN, 1)
        fields = {
            "item_id": answer.ident("msg_", 48),
            "output_index": 0,
            "content_index": 0,
            "delta": piece,
            "logprobs": [],
        }
        return Frame(self._event("response.output_text.delta", seq, fields), FrameRole.TOKEN, 1)

    def _first_token(self, answer: Answer) -> int:
        return self._PREAMBLE_EVENTS - 1 if answer.tool_call else self._PREAMBLE_EVENTS

    def closing(self, answer: Answer) -> list[Frame]:
        if answer.tool_call:
            return self._call_closing(answer)
        item_id = answer.ident("msg_", 48)
        text = answer.text
        seq = self._PREAMBLE_EVENTS + answer.completion_tokens
        epilogue: list[tuple[str, JSONObject]] = [
            (
                "response.output_text.done",
                {
                    "item_id": item_id,
                    "output_index": 0,
                    "content_index": 0,
                    "text": text,
                    "logprobs": [],
                },
            ),
            (
                "response.content_part.done",
                {
                    "item_id": item_id,
                    "output_index": 0,
                    "content_index": 0,
                    "part": self._part(text),
                },
            ),
            (
                "response.output_item.done",
                {"output_index": 0, "item": self._item(answer, "completed", [self._part(text)])},
            ),
        ]
        frames = [
            Frame(self._event(name, seq + offset, fields), FrameRole.EPILOGUE)
            for offset, (name, fields) in enumerate(epilogue)
        ]
        completed = {"response": self._response(answer, "completed", final=True)}
        frames.append(
            Frame(
                self._event("response.completed", seq + len(epilogue), completed),
                FrameRole.TERMINAL,
            )
        )
        return frames

    def _call_closing(self, answer: Answer) -> list[Frame]:
        seq = self._first_token(answer) + answer.completion_tokens
        done = {
            "item_id": answer.ident("fc_", 48),
            "output_index": 0,
            "arguments": answer.text,
        }
        item = self._call_item(answer, "completed", answer.text)
        completed = {"response": self._response(answer, "completed", final=True)}
        events: list[tuple[str, JSONObject, FrameRole]] = [
            ("response.function_call_arguments.done", done, FrameRole.EPILOGUE),
            ("response.output_item.done", {"output_index": 0, "item": item}, FrameRole.EPILOGUE),
            ("response.completed", completed, FrameRole.TERMINAL),
        ]
        return [
            Frame(self._event(name, seq + offset, fields), role)
            for offset, (name, fields, role) in enumerate(events)
        ]

    def reply(self, answer: Answer) -> bytes:
        body = self._response(answer, "completed", final=True)
        return (json.dumps(body, ensure_ascii=False, indent=2) + "\n").encode()

    def error(self, status: int, message: str) -> bytes:
        return openai_error(status, message)

    @staticmethod
    def _event(name: str, seq: int, fields: JSONObject) -> bytes:
        payload: JSONObject = {"type": name, "sequence_number": seq, **fields}
        return sse_block(compact_json(payload), event=name)

    @staticmethod
    def _part(text: str) -> JSONObject:
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}

    @staticmethod
    def _item(answer: Answer, status: str, content: list[JSONObject]) -> JSONObject:
        return {
            "id": answer.ident("msg_", 48),
            "type": "message",
            "status": status,
            "content": content,
            "role": "assistant",
        }

    @staticmethod
    def _call_item(answer: Answer, status: str, arguments: str) -> JSONObject:
        return {
            "id": answer.ident("fc_", 48),
            "type": "function_call",
            "status": status,
            "arguments": arguments,
            "call_id": answer.ident("call_"),
            "name": TOOL_NAME,
        }

    def _response(self, answer: Answer, status: str, *, final: bool = False) -> JSONObject:
        output: list[Any] = []
        usage: JSONObject | None = None
        if final and answer.tool_call:
            output = [self._call_item(answer, "completed", answer.text)]
        elif final:
            output = [self._item(answer, "completed", [self._part(answer.text)])]
        if final:
            usage = {
                "input_tokens": answer.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": answer.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": answer.prompt_tokens + answer.completion_tokens,
            }
        return {
            "id": answer.ident("resp_", 48),
            "object": "response",
            "created_at": answer.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "max_output_tokens": None,
            "model": answer.model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": True,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "metadata": {},
        }
