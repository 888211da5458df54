"""Cohere v2 chat streaming (``POST /v2/chat`` with ``"stream": true``).

Every event has an ``event:`` name and a data ``type``, the same:
``message-start``, ``content-start``, ``content-delta`` (the text at
``delta.message.content.text``, a reasoning model's at ``.thinking``),
``content-end``, ``tool-plan-delta`` (``delta.message.tool_plan``),
``tool-call-start`` / ``tool-call-delta`` / ``tool-call-end``,
``citation-start`` / ``citation-end``, ``debug``, and ``message-end``: the
terminal event, its ``delta`` carrying ``finish_reason``, ``usage`` and, on a
failure, ``error``.

The cohere SDK reads the data's ``type`` alone (``parse_sse_obj`` in
cohere/core/pydantic_utilities.py parses the data and discriminates the
``V2ChatStreamResponse`` union on ``type``; the ``event:`` name is never
looked at), so this dialect reads the data's ``type`` too. The SDK skips,
with a logged warning, any event whose data it cannot build into one of its
types (``chat_stream`` in cohere/v2/raw_client.py), and it raises on no
event: the only in-band failure it knows is a ``message-end`` whose
``finish_reason`` is ``ERROR`` and whose ``delta.error`` says what went
wrong, which it hands to the caller like any other event. So the
synthesized error is that ``message-end`` (the code at the end of
``delta.error``: informative to anyone who reads the event), and
:attr:`error_event_raises` is false: the client's body then ends abnormally
as well, which the SDK raises on (``EventSource.iter_sse`` re-raises an
``httpx.TransportError`` of a stream it cannot resume).

Generated tokens are ``usage.tokens.output_tokens`` ("the number of tokens
produced by the model", cohere/types/usage_tokens.py), else the billed ones
(``usage.billed_units.output_tokens``); the prompt's likewise.

Tool calls (:mod:`streamwarden.core.toolcalls`), by the events' ``index``:
``tool-call-start`` opens one (``delta.message.tool_calls``: its ``id`` and
``function.name``), ``tool-call-delta`` fragments at
``delta.message.tool_calls.function.arguments`` are its arguments,
``tool-call-end`` closes it, and so does ``message-end``.
"""

from __future__ import annotations

from typing import Any

from streamwarden.core.dialects.base import (
    MAIN_TEXT,
    NOTHING,
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
from streamwarden.core.toolcalls import ToolStep, arguments_step, close_step, open_step

#: The finish reasons of a generation that failed (cohere/types/chat_finish_reason.py).
_FAILED = frozenset({"ERROR", "TIMEOUT"})
_TERMINAL = "message-end"


class Cohere(Dialect):
    __slots__ = ()

    name = "cohere"
    terminal_event = "event: message-end"
    tool_marks = ('"tool_calls"',)
    # cohere's SDK raises on no event (see the module docstring): a cut
    # also ends the client's body abnormally, as a broken upstream does.
    error_event_raises = False

    def inspect(self, event: Event) -> Observation:
        obj = load_json(event.data)
        if not isinstance(obj, dict):
            return NOTHING
        kind = obj.get("type")
        if kind == "content-delta":
            content = _message(obj).get("content")
            if not isinstance(content, dict):
                return NOTHING
            text = content.get("text")
            thinking = content.get("thinking")
            if isinstance(thinking, str) and thinking:  # a reasoning model's, in the same order
                text = text + thinking if isinstance(text, str) else thinking
            return Observation(text=text) if isinstance(text, str) and text else NOTHING
        if kind == "tool-plan-delta":
            plan = _message(obj).get("tool_plan")
            return Observation(text=plan) if isinstance(plan, str) and plan else NOTHING
        if kind == "tool-call-delta":
            function = _function(obj)
            arguments = function.get("arguments") if function is not None else None
            if not isinstance(arguments, str) or not arguments:
                return NOTHING
            steps = [arguments_step(_index(obj), arguments)]
            return Observation(text=arguments, tools=True, calls=steps)
        if kind == "tool-call-start":
            return _call_start(obj)
        if kind == "tool-call-end":
            return Observation(calls=[close_step(_index(obj))])
        if kind == _TERMINAL:
            return _message_end(obj)
        return NOTHING

    def error_event(self, code: str, message: str) -> bytes:
        # The event the SDK hands over as it is: the caller sees why, in the
        # field the SDK documents for it ("An error message if an error
        # occurred during the generation", cohere/types/chat_message_end_event_delta.py).
        payload = {"type": _TERMINAL, "delta": {"finish_reason": "ERROR", "error": message}}
        return sse_block(dump_json(payload), event=_TERMINAL)

    def text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[TextPlace]:
        if not isinstance(root, dict):
            return []
        kind = root.get("type")
        if kind == "content-delta" or kind == "tool-plan-delta":
            return [(*place, MAIN_TEXT) for place in _main_places(root, kind)]
        if tool_arguments and (kind == "tool-call-delta" or kind == "tool-call-start"):
            function = _function(root)
            if function is not None and isinstance(function.get("arguments"), str):
                # A call's arguments are a text of their own, by its index.
                return [(function, "arguments", ("tool_call", _index(root)))]
        return []

    # A citation repeats, whole, a piece of the answer's text (``citations.text``).

    def repeats_text(self, event: Event) -> bool:
        return '"citation-start"' in event.data

    def whole_text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[Place]:
        if not isinstance(root, dict) or root.get("type") != "citation-start":
            return []
        citation = _message(root).get("citations")
        if isinstance(citation, dict) and isinstance(citation.get("text"), str):
            return [(citation, "text")]
        return []

    @classmethod
    def sniff(cls, event: Event) -> bool:
        if event.event == "message-start":
            return True
        if event.event != "message" or '"message-start"' not in event.data:
            return False
        obj = load_json(event.data)
        return isinstance(obj, dict) and obj.get("type") == "message-start"


class _DropsLogprobs:
    """A text place whose rewrite drops the event's ``logprobs`` (cohere's ``LogprobItem``).

    They hold the chunk's text again and its token ids, which spell it: a
    redacted text whose logprobs stayed would still say what was cut.
    """

    __slots__ = ("_container", "_root")

    def __init__(self, container: dict[str, Any], root: dict[str, Any]) -> None:
        self._container = container
        self._root = root

    def __getitem__(self, key: str) -> Any:
        return self._container[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if value != self._container[key]:
            self._root["logprobs"] = None
        self._container[key] = value


def _message(obj: dict[str, Any]) -> dict[str, Any]:
    """An event's ``delta.message`` (empty when it has none)."""
    delta = obj.get("delta")
    message = delta.get("message") if isinstance(delta, dict) else None
    return message if isinstance(message, dict) else {}


def _main_places(obj: dict[str, Any], kind: object) -> list[Place]:
    """The answer's text in a ``content-delta`` (text, thinking) or ``tool-plan-delta``."""
    message = _message(obj)
    if kind == "tool-plan-delta":
        return [(message, "tool_plan")] if isinstance(message.get("tool_plan"), str) else []
    content = message.get("content")
    if not isinstance(content, dict):
        return []
    holder: Any = _DropsLogprobs(content, obj) if obj.get("logprobs") else content
    return [
        (holder, field) for field in ("text", "thinking") if isinstance(content.get(field), str)
    ]


def _function(obj: dict[str, Any]) -> dict[str, Any] | None:
    """A tool-call event's ``delta.message.tool_calls.function``."""
    call = _message(obj).get("tool_calls")
    function = call.get("function") if isinstance(call, dict) else None
    return function if isinstance(function, dict) else None


def _index(obj: dict[str, Any]) -> int:
    """A tool call's index (-1 when it has none: still one key)."""
    index = obj.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else -1


def _call_start(obj: dict[str, Any]) -> Observation:
    """A call opens, named; arguments it already carries are its first fragment."""
    call = _message(obj).get("tool_calls")
    if not isinstance(call, dict):
        return NOTHING
    function = call.get("function")
    function = function if isinstance(function, dict) else {}
    key = _index(obj)
    steps: list[ToolStep] = [open_step(key, call.get("id"), function.get("name"))]
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        steps.append(arguments_step(key, arguments))
        return Observation(text=arguments, tools=True, calls=steps)
    return Observation(calls=steps)


def _message_end(obj: dict[str, Any]) -> Observation:
    """The terminal event: the usage, and whether the generation failed."""
    delta = obj.get("delta")
    if not isinstance(delta, dict):
        return Observation(terminal=True)
    failed = delta.get("finish_reason") in _FAILED or bool(delta.get("error"))
    tokens = prompt = None
    usage = delta.get("usage")
    if isinstance(usage, dict):
        tokens = _count(usage, "output_tokens")
        prompt = _count(usage, "input_tokens")
    return Observation("", tokens, prompt, terminal=True, error=failed)


def _count(usage: dict[str, Any], field: str) -> int | None:
    """The model's own count (``tokens``), else the billed one (``billed_units``)."""
    for kind in ("tokens", "billed_units"):
        counts = usage.get(kind)
        if isinstance(counts, dict):
            count = as_int(counts.get(field))
            if count is not None:
                return count
    return None
