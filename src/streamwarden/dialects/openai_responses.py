"""OpenAI Responses API streaming.

Every event has an ``event:`` name equal to its data's ``type``:
``response.created``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ... The stream ends with one of
``response.completed``, ``response.failed`` or ``response.incomplete``; the
first and last carry ``response.usage.output_tokens``. A provider-side
failure is ``response.failed`` or an ``error`` event.

openai-python raises ``APIError`` only when the data has a truthy ``error``
object, so the synthesized ``event: error`` carries one beside the Responses
API's own flat ``code`` and ``message`` fields.
"""

from __future__ import annotations

from typing import Any

from streamwarden.dialects.base import (
    NOTHING,
    UPSTREAM_ERROR,
    Dialect,
    Observation,
    Place,
    as_int,
    dump_json,
    load_json,
    sse_block,
)
from streamwarden.sse import Event

_TEXT_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
    }
)
_TOOL_DELTAS = frozenset(
    {"response.function_call_arguments.delta", "response.custom_tool_call_input.delta"}
)
_ENDINGS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class OpenAIResponses(Dialect):
    __slots__ = ()

    name = "openai-responses"
    terminal_event = "response.completed"

    def inspect(self, event: Event) -> Observation:
        kind = event.event
        obj = None
        if kind == "message":  # no event: line; fall back to the data's type
            obj = load_json(event.data)
            if not isinstance(obj, dict):
                return NOTHING
            kind = str(obj.get("type", ""))
        if kind in _TEXT_DELTAS:
            obj = obj if obj is not None else load_json(event.data)
            delta = obj.get("delta") if isinstance(obj, dict) else None
            if not isinstance(delta, str) or not delta:
                return NOTHING
            return Observation(text=delta, tools=kind in _TOOL_DELTAS)
        if kind in _ENDINGS:
            obj = obj if obj is not None else load_json(event.data)
            response = obj.get("response") if isinstance(obj, dict) else None
            usage = response.get("usage") if isinstance(response, dict) else None
            tokens = prompt = None
            if isinstance(usage, dict):
                tokens = as_int(usage.get("output_tokens"))
                prompt = as_int(usage.get("input_tokens"))
            failed = kind == "response.failed"
            return Observation("", tokens, prompt, terminal=True, error=failed)
        if kind == "error":
            return UPSTREAM_ERROR
        return NOTHING

    def error_event(self, code: str, message: str) -> bytes:
        error = {"type": "stream_error", "code": code, "message": message}
        payload = {"type": "error", "code": code, "message": message, "param": None, "error": error}
        return sse_block(dump_json(payload), event="error")

    def text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[Place]:
        if not isinstance(root, dict):
            return []
        kind = event.event if event.event != "message" else str(root.get("type", ""))
        if kind not in _TEXT_DELTAS or (kind in _TOOL_DELTAS and not tool_arguments):
            return []
        return [(root, "delta")] if isinstance(root.get("delta"), str) else []

    @classmethod
    def sniff(cls, event: Event) -> bool:
        return event.event.startswith("response.")
