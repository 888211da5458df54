"""OpenAI Responses API streaming.

Every event has an ``event:`` name equal to its data's ``type``:
``response.created``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.audio.transcript.delta``
(a spoken answer's text), ... The stream ends with one of
``response.completed``, ``response.failed`` or ``response.incomplete``; the
first and last carry ``response.usage.output_tokens``. A provider-side
failure is ``response.failed`` or an ``error`` event. After its deltas,
a text is sent again whole, in the ``*.done`` events, the output item and
the final response: output filters read those as whole texts. A text the
filters rewrite loses the ``logprobs`` beside it, which spell its tokens.

Tool calls (:mod:`streamwarden.core.toolcalls`), by ``output_index``: a
``function_call`` (or ``custom_tool_call``) output item opens one in
``response.output_item.added``; ``response.function_call_arguments.delta``
fragments are its arguments (a custom tool's input is free text: only
counted); ``response.function_call_arguments.done`` (``*.custom_tool_call_input.done``)
closes it, its ``arguments`` checked, and ``response.output_item.done``
closes it if those did not.

openai-python raises ``APIError`` only when the data has a truthy ``error``
object, so the synthesized ``event: error`` carries one beside the Responses
API's own flat ``code`` and ``message`` fields.
"""

from __future__ import annotations

from typing import Any

from streamwarden.core.dialects.base import (
    MAIN_TEXT,
    NOTHING,
    UPSTREAM_ERROR,
    Dialect,
    Observation,
    Place,
    TextPlace,
    as_int,
    dump_json,
    load_json,
    sse_block,
    token_place,
)
from streamwarden.core.sse import Event
from streamwarden.core.toolcalls import (
    ToolStep,
    arguments_step,
    close_step,
    open_step,
    size_step,
    utf8_size,
)

_TEXT_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        # A spoken answer's transcript, as it is said.
        "response.audio.transcript.delta",
    }
)
_TOOL_DELTAS = frozenset(
    {"response.function_call_arguments.delta", "response.custom_tool_call_input.delta"}
)
_ENDINGS = frozenset({"response.completed", "response.incomplete", "response.failed"})

# The events that carry a text again, whole, after its deltas: the field, and
# whether it is tool-call arguments.
_DONE_TEXTS = {
    "response.output_text.done": ("text", False),
    "response.refusal.done": ("refusal", False),
    "response.reasoning_text.done": ("text", False),
    "response.reasoning_summary_text.done": ("text", False),
    "response.function_call_arguments.done": ("arguments", True),
    "response.custom_tool_call_input.done": ("input", True),
}
# A content or summary part (``part``), an output item (``item``), the response
# (``response.output``): normally empty when added, whole when done.
_PART_EVENTS = frozenset(
    {
        "response.content_part.added",
        "response.content_part.done",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_part.done",
    }
)
_ITEM_EVENTS = frozenset({"response.output_item.added", "response.output_item.done"})
_RESPONSE_EVENTS = _ENDINGS | {"response.created", "response.in_progress", "response.queued"}
_REPEATS = frozenset(_DONE_TEXTS) | _PART_EVENTS | _ITEM_EVENTS | _RESPONSE_EVENTS
# The tool-call arguments of an output item, by its type (as the deltas stream them).
_ITEM_ARGUMENTS = {"function_call": "arguments", "custom_tool_call": "input"}
# The events that open or close a tool call (besides its deltas).
_CALL_EDGES = _ITEM_EVENTS | {
    "response.function_call_arguments.done",
    "response.custom_tool_call_input.done",
}


class OpenAIResponses(Dialect):
    __slots__ = ()

    name = "openai-responses"
    tool_marks = ("function_call", "custom_tool_call", "mcp_call", "_tool_call")
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
            if kind not in _TOOL_DELTAS:
                return Observation(text=delta)
            assert isinstance(obj, dict)
            key = _call_key(obj, obj.get("item_id"))
            if kind == "response.function_call_arguments.delta":
                step = arguments_step(key, delta)
            else:  # a custom tool's input: free text, not JSON
                step = size_step(key, utf8_size(delta))
            return Observation(text=delta, tools=True, calls=[step])
        if kind in _CALL_EDGES:
            return _call_edge(kind, obj, event.data)
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

    def text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[TextPlace]:
        if not isinstance(root, dict):
            return []
        kind = event.event if event.event != "message" else str(root.get("type", ""))
        if kind not in _TEXT_DELTAS or (kind in _TOOL_DELTAS and not tool_arguments):
            return []
        if not isinstance(root.get("delta"), str):
            return []
        # A call's arguments are a text of their own: calls may interleave.
        text = MAIN_TEXT
        if kind in _TOOL_DELTAS:
            text = ("tool_call", _call_key(root, root.get("item_id")))
        return [(*token_place(root, "delta", root), text)]

    def repeats_text(self, event: Event) -> bool:
        kind = event.event
        if kind == "message":
            obj = load_json(event.data)
            kind = str(obj.get("type", "")) if isinstance(obj, dict) else ""
        return kind in _REPEATS

    def whole_text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[Place]:
        if not isinstance(root, dict):
            return []
        kind = event.event if event.event != "message" else str(root.get("type", ""))
        done = _DONE_TEXTS.get(kind)
        if done is not None:
            field, tools = done
            if tools and not tool_arguments:
                return []
            return [token_place(root, field, root)] if isinstance(root.get(field), str) else []
        places: list[Place] = []
        if kind in _PART_EVENTS:
            _part_places(root.get("part"), places)
        elif kind in _ITEM_EVENTS:
            _item_places(root.get("item"), tool_arguments, places)
        elif kind in _RESPONSE_EVENTS:
            response = root.get("response")
            output = response.get("output") if isinstance(response, dict) else None
            if isinstance(output, list):
                for item in output:
                    _item_places(item, tool_arguments, places)
        return places

    @classmethod
    def sniff(cls, event: Event) -> bool:
        return event.event.startswith("response.")


def _call_key(obj: dict[str, Any], item_id: Any) -> object:
    """Which call an event is about: its output index (its item's id if it has none)."""
    index = obj.get("output_index")
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    return item_id if isinstance(item_id, str) else -1


def _call_edge(kind: str, obj: Any, data: str) -> Observation:
    """An output item added or done, or a call's arguments done: a call opens or closes."""
    if obj is None:
        if kind in _ITEM_EVENTS and "_call" not in data:
            return NOTHING  # a message's or a reasoning's item: not parsed for nothing
        obj = load_json(data)
    if not isinstance(obj, dict):
        return NOTHING
    steps: list[ToolStep]
    if kind == "response.function_call_arguments.done":
        arguments = obj.get("arguments")
        text = arguments if isinstance(arguments, str) else None
        key = _call_key(obj, obj.get("item_id"))
        steps = [close_step(key, text, whole=True, name=obj.get("name"))]
    elif kind == "response.custom_tool_call_input.done":
        key = _call_key(obj, obj.get("item_id"))
        steps = [close_step(key, verdict=True, whole=True)]
    else:
        item = obj.get("item")
        kind_of_item = item.get("type") if isinstance(item, dict) else None
        if not isinstance(item, dict) or kind_of_item not in _ITEM_ARGUMENTS:
            return NOTHING
        key = _call_key(obj, item.get("id"))
        call_id = item.get("call_id") or item.get("id")
        if kind == "response.output_item.added":
            steps = [open_step(key, call_id, item.get("name"))]
        elif kind_of_item == "function_call":
            arguments = item.get("arguments")
            text = arguments if isinstance(arguments, str) else None
            steps = [close_step(key, text, call_id=call_id, name=item.get("name"))]
        else:
            steps = [close_step(key, verdict=True, call_id=call_id, name=item.get("name"))]
    return Observation(calls=steps)


def _part_places(part: Any, places: list[Place]) -> None:
    """A content part's text (``output_text``, ``reasoning_text``, ``summary_text``), refusal,
    or a spoken answer's transcript (``output_audio``)."""
    if isinstance(part, dict):
        for field in ("text", "refusal", "transcript"):
            if isinstance(part.get(field), str):
                places.append(token_place(part, field, part))


def _item_places(item: Any, tool_arguments: bool, places: list[Place]) -> None:
    """An output item's texts: a message's content, a reasoning's summary and content."""
    if not isinstance(item, dict):
        return
    for field in ("content", "summary"):
        parts = item.get(field)
        if isinstance(parts, list):
            for part in parts:
                _part_places(part, places)
    arguments = _ITEM_ARGUMENTS.get(str(item.get("type"))) if tool_arguments else None
    if arguments is not None and isinstance(item.get(arguments), str):
        places.append((item, arguments))
