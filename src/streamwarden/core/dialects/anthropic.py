"""Anthropic Messages streaming.

Named events: ``message_start``, ``content_block_start``,
``content_block_delta`` (``text_delta``, ``input_json_delta``,
``thinking_delta``), ``content_block_stop``, ``message_delta`` (cumulative
``usage.output_tokens``), ``message_stop``, plus ``ping`` and ``error``.

anthropic-python dispatches on the event name alone: it raises
``APIStatusError`` for ``event: error`` and skips events without a name, so
a bare ``data: {"error": ...}`` would be ignored. The synthesized error is
therefore a named ``error`` event in the API's own error envelope.

Tool calls (:mod:`streamwarden.core.toolcalls`): a ``content_block_start`` whose
block is a ``tool_use`` (or ``server_tool_use``, ``mcp_tool_use``) opens one,
by block index; its ``input_json_delta`` fragments are its arguments (none
at all: ``{}``); its ``content_block_stop`` closes it.
"""

from __future__ import annotations

from typing import Any

from streamwarden.core.dialects.base import (
    MAIN_TEXT,
    NOTHING,
    TERMINAL,
    UPSTREAM_ERROR,
    Dialect,
    Observation,
    TextPlace,
    as_int,
    dump_json,
    load_json,
    sse_block,
)
from streamwarden.core.sse import Event
from streamwarden.core.toolcalls import arguments_step, close_step, open_step

_DELTA_TEXT = {
    "text_delta": "text",
    "input_json_delta": "partial_json",
    "thinking_delta": "thinking",
}
_ERROR_TYPES = {"upstream_timeout": "timeout_error", "shutting_down": "overloaded_error"}


class Anthropic(Dialect):
    __slots__ = ()

    name = "anthropic"
    tool_marks = ('"tool_use"', '"server_tool_use"', "input_json_delta")
    terminal_event = "event: message_stop"

    def inspect(self, event: Event) -> Observation:
        kind = event.event
        obj = None
        if kind == "message":
            obj = load_json(event.data)
            if not isinstance(obj, dict):
                return NOTHING
            kind = str(obj.get("type", ""))
        if kind == "content_block_delta":
            obj = obj if obj is not None else load_json(event.data)
            delta = obj.get("delta") if isinstance(obj, dict) else None
            if isinstance(delta, dict):
                field = _DELTA_TEXT.get(str(delta.get("type")))
                text = delta.get(field) if field else None
                if isinstance(text, str) and text:
                    if field != "partial_json":
                        return Observation(text=text)
                    assert isinstance(obj, dict)
                    steps = [arguments_step(_block(obj), text)]
                    return Observation(text=text, tools=True, calls=steps)
            return NOTHING
        if kind == "content_block_start" or kind == "content_block_stop":
            obj = obj if obj is not None else load_json(event.data)
            return _block_edge(kind, obj)
        if kind == "message_stop":
            return TERMINAL
        if kind == "message_delta" or kind == "message_start":
            obj = obj if obj is not None else load_json(event.data)
            if not isinstance(obj, dict):
                return NOTHING
            holder = obj if kind == "message_delta" else obj.get("message")
            usage = holder.get("usage") if isinstance(holder, dict) else None
            if not isinstance(usage, dict):
                return NOTHING
            tokens = as_int(usage.get("output_tokens"))
            prompt = as_int(usage.get("input_tokens"))
            if tokens is None and prompt is None:
                return NOTHING
            return Observation(output_tokens=tokens, input_tokens=prompt)
        if kind == "error":
            return UPSTREAM_ERROR
        return NOTHING

    def error_event(self, code: str, message: str) -> bytes:
        error = {"type": _ERROR_TYPES.get(code, "api_error"), "code": code, "message": message}
        return sse_block(dump_json({"type": "error", "error": error}), event="error")

    def text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[TextPlace]:
        if not isinstance(root, dict):
            return []
        kind = event.event if event.event != "message" else str(root.get("type", ""))
        delta = root.get("delta") if kind == "content_block_delta" else None
        if not isinstance(delta, dict):
            return []
        kind = str(delta.get("type"))
        field = _DELTA_TEXT.get(kind)
        if field is None or (kind == "input_json_delta" and not tool_arguments):
            return []
        if not isinstance(delta.get(field), str):
            return []
        # A tool call's input is a text of its own, by its block: blocks may interleave.
        text = ("tool_call", _block(root)) if kind == "input_json_delta" else MAIN_TEXT
        return [(delta, field, text)]

    @classmethod
    def sniff(cls, event: Event) -> bool:
        return event.event == "message_start"


def _block(obj: dict[str, Any]) -> int:
    """A content block's index (-1 when it has none: still one key)."""
    index = obj.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else -1


def _block_edge(kind: str, obj: Any) -> Observation:
    """A block starts or stops: a tool call's, it opens or closes."""
    if not isinstance(obj, dict):
        return NOTHING
    if kind == "content_block_stop":
        return Observation(calls=[close_step(_block(obj))])
    block = obj.get("content_block")
    if not isinstance(block, dict) or not str(block.get("type")).endswith("tool_use"):
        return NOTHING
    return Observation(calls=[open_step(_block(obj), block.get("id"), block.get("name"))])
