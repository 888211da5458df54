"""Vercel AI SDK streams, in their two wire forms.

- The data stream protocol (AI SDK 4, header ``x-vercel-ai-data-stream:
  v1``): one ``TYPE:JSON`` record per line. ``0:`` text, ``g:`` reasoning,
  ``c:`` tool-call argument deltas, ``d:`` finish message with usage (the
  terminal record), ``3:`` an error string.
- The UI message stream (AI SDK 5, header ``x-vercel-ai-ui-message-stream:
  v1``): SSE ``data:`` objects with a ``type`` (``text-delta``,
  ``tool-input-delta``, ``finish``, ``error`` ...) closed by
  ``data: [DONE]``.

Tool calls (:mod:`streamwarden.core.toolcalls`), by ``toolCallId``: in the data
stream, ``b:`` opens one, ``c:`` deltas are its arguments, ``9:`` (the
call whole) closes it; in the UI message stream, ``tool-input-start``,
``tool-input-delta`` and ``tool-input-available``. A ``9:`` or
``tool-input-available`` with no call open is a call sent whole. The SDK's
own ``tool-input-error`` (it found the input invalid, and says so) closes
the call as ``invalid`` and goes on to the client as it came. The close
is judged on the whole input it carries (``9:``'s ``args``,
``tool-input-available``'s ``input``), which is what the client runs (the
SDK parses, and may repair, the deltas itself): an object, or broken; only
a close without one leaves the verdict to the deltas.

The SDK's stream parsers validate each part strictly, so the synthesized
errors use exactly the documented error parts and carry the machine code
inside the message text.
"""

from __future__ import annotations

from typing import Any

from streamwarden.core.dialects.base import (
    MAIN_TEXT,
    NOTHING,
    TERMINAL,
    UPSTREAM_ERROR,
    ArgumentsText,
    Dialect,
    Observation,
    Place,
    TextPlace,
    as_int,
    dump_json,
    load_json,
    sse_block,
)
from streamwarden.core.sse import Event
from streamwarden.core.toolcalls import arguments_step, close_step, open_step, value_depth

DATA_STREAM_HEADER = "x-vercel-ai-data-stream"
UI_MESSAGE_STREAM_HEADER = "x-vercel-ai-ui-message-stream"

_UI_TEXT_FIELDS = {
    "text-delta": "delta",
    "reasoning-delta": "delta",
    "tool-input-delta": "inputTextDelta",
}


class VercelDataStream(Dialect):
    __slots__ = ()

    name = "vercel-ai"

    def carries_tool_arguments(self, event: Event) -> bool:
        # Tool call parts: 9: (whole call), b: (call start), c: (argument delta), a: (result).
        return event.data[:2] in ("9:", "b:", "c:", "a:")

    framing = "lines"
    terminal_event = "a d: finish line"

    def inspect(self, event: Event) -> Observation:
        line = event.data
        kind, sep, payload = line.partition(":")
        if not sep:
            return NOTHING
        if kind in ("0", "g"):
            value = load_json(payload)
            return Observation(text=value) if isinstance(value, str) and value else NOTHING
        if kind == "c":
            value = load_json(payload)
            delta = value.get("argsTextDelta") if isinstance(value, dict) else None
            if not isinstance(delta, str) or not delta:
                return NOTHING
            assert isinstance(value, dict)
            steps = [arguments_step(_call_key(value), delta)]
            return Observation(text=delta, tools=True, calls=steps)
        if kind == "b" or kind == "9":
            value = load_json(payload)
            if not isinstance(value, dict):
                return NOTHING
            key = _call_key(value)
            name = value.get("toolName")
            if kind == "b":
                return Observation(calls=[open_step(key, key, name)])
            verdict, depth = _whole_input(value, "args")
            step = close_step(key, verdict=verdict, whole=True, call_id=key, name=name, depth=depth)
            return Observation(calls=[step])
        if kind == "d":
            value = load_json(payload)
            usage = value.get("usage") if isinstance(value, dict) else None
            tokens = prompt = None
            if isinstance(usage, dict):
                tokens = as_int(usage.get("completionTokens"))
                prompt = as_int(usage.get("promptTokens"))
            return Observation(output_tokens=tokens, input_tokens=prompt, terminal=True)
        if kind == "3":
            return UPSTREAM_ERROR
        return NOTHING

    def error_event(self, code: str, message: str) -> bytes:
        return f"3:{dump_json(message)}\n".encode()

    # A record is loaded as [type, value]: the text is the value, or its argsTextDelta.
    def load_data(self, event: Event, loads: Any = None) -> Any:
        kind, sep, payload = event.data.partition(":")
        return [kind, (loads or load_json)(payload)] if sep else [kind, None]

    def dump_data(self, event: Event, root: Any) -> str:
        return f"{root[0]}:{dump_json(root[1])}"

    def text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[TextPlace]:
        kind, value = root
        if kind in ("0", "g") and isinstance(value, str):
            return [(root, 1, MAIN_TEXT)]
        if kind == "c" and tool_arguments and isinstance(value, dict):
            if not isinstance(value.get("argsTextDelta"), str):
                return []
            return [(value, "argsTextDelta", ("tool_call", _call_key(value)))]
        return []

    # The 9: tool call repeats, whole, the arguments the c: deltas streamed.
    def repeats_text(self, event: Event) -> bool:
        return event.data.startswith("9:")

    def whole_text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[Place]:
        kind, value = root
        if kind != "9" or not tool_arguments or not isinstance(value, dict):
            return []
        return _argument_places(value, "args")


class VercelUIMessageStream(Dialect):
    __slots__ = ()

    name = "vercel-ai"
    tool_marks = ('"tool-', "tool-input", "tool-output")
    terminal_event = "data: [DONE]"

    def inspect(self, event: Event) -> Observation:
        data = event.data
        if data.startswith("[DONE]"):
            return TERMINAL
        obj = load_json(data)
        if not isinstance(obj, dict):
            return NOTHING
        kind = obj.get("type")
        field = _UI_TEXT_FIELDS.get(kind) if isinstance(kind, str) else None
        if field is not None:
            text = obj.get(field)
            if not isinstance(text, str) or not text:
                return NOTHING
            if kind != "tool-input-delta":
                return Observation(text=text)
            steps = [arguments_step(_call_key(obj), text)]
            return Observation(text=text, tools=True, calls=steps)
        if isinstance(kind, str) and kind in _UI_CALL_EDGES:
            key = _call_key(obj)
            name = obj.get("toolName")
            if kind == "tool-input-start":
                return Observation(calls=[open_step(key, key, name)])
            reported = kind == "tool-input-error"
            verdict, depth = _whole_input(obj, "input")
            step = close_step(
                key,
                verdict=verdict,
                whole=True,
                reported=reported,
                call_id=key,
                name=name,
                depth=depth,
            )
            return Observation(calls=[step])
        if kind == "error":
            return UPSTREAM_ERROR
        if kind == "finish":
            metadata = obj.get("messageMetadata")
            usage = metadata.get("usage") if isinstance(metadata, dict) else None
            tokens = prompt = None
            if isinstance(usage, dict):
                tokens = as_int(usage.get("outputTokens", usage.get("completionTokens")))
                prompt = as_int(usage.get("inputTokens", usage.get("promptTokens")))
            if tokens is None and prompt is None:
                return NOTHING
            return Observation(output_tokens=tokens, input_tokens=prompt)
        return NOTHING

    def error_event(self, code: str, message: str) -> bytes:
        return sse_block(dump_json({"type": "error", "errorText": message}))

    def text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[TextPlace]:
        kind = root.get("type") if isinstance(root, dict) else None
        field = _UI_TEXT_FIELDS.get(kind) if isinstance(kind, str) else None
        if field is None or (kind == "tool-input-delta" and not tool_arguments):
            return []
        if not isinstance(root.get(field), str):
            return []
        # A call's input is a text of its own: calls may interleave.
        text = ("tool_call", _call_key(root)) if kind == "tool-input-delta" else MAIN_TEXT
        return [(root, field, text)]

    # tool-input-available (and tool-input-error) repeats, whole, the input
    # the tool-input-delta parts streamed. Decided by the parsed type: a look
    # at the text only rules out data that cannot spell it, which must write
    # it out ("input-...") or escape its letters (\u); most parts do neither.
    def repeats_text(self, event: Event) -> bool:
        data = event.data
        if "input-available" not in data and "input-error" not in data and "\\u" not in data:
            return False
        return _ui_whole_input(load_json(data))

    def whole_text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[Place]:
        if not tool_arguments or not _ui_whole_input(root):
            return []
        return _argument_places(root, "input")


_UI_WHOLE_INPUTS = frozenset({"tool-input-available", "tool-input-error"})
_UI_CALL_EDGES = _UI_WHOLE_INPUTS | {"tool-input-start"}


def _call_key(part: dict[str, Any]) -> str:
    """Which call a part is about: its ``toolCallId``."""
    call_id = part.get("toolCallId")
    return call_id if isinstance(call_id, str) else ""


def _whole_input(part: dict[str, Any], field: str) -> tuple[bool | None, int]:
    """The verdict on a call whose closing part carries its input whole: an object or not;
    and how deep the input nests.

    The SDK parsed (and may have repaired) the deltas itself: what the client
    runs is this input, not the deltas. Without one, the deltas decide.
    """
    value = part.get(field)
    if value is None:
        return None, 0
    return isinstance(value, dict), value_depth(value)


def _ui_whole_input(root: Any) -> bool:
    """Whether ``root`` is a UI message stream part that carries a tool's input whole."""
    kind = root.get("type") if isinstance(root, dict) else None
    return isinstance(kind, str) and kind in _UI_WHOLE_INPUTS


def _argument_places(holder: dict[str, Any], field: str) -> list[Place]:
    """The place of the whole tool arguments ``holder[field]``: text, or an object as JSON text.

    The deltas streamed the arguments as JSON text, so the filters read the
    parsed object the same way, whole: its compact JSON, where a key, a
    number or an object's key is text like any other (see :class:`ArgumentsText`).
    """
    value = holder.get(field)
    if isinstance(value, str):
        return [(holder, field)]
    return [(ArgumentsText(holder), field)] if value is not None else []
