"""OpenAI Chat Completions streaming (and every server that copies it: vLLM, TGI, llama.cpp).

Events carry no ``event:`` field; each ``data:`` is a ``chat.completion.chunk``
whose ``choices[].delta`` holds content, reasoning or tool-call argument
fragments. The stream ends with ``data: [DONE]``. Usage arrives in a last
chunk with empty ``choices`` when the client asked for
``stream_options.include_usage`` (some servers send it on every chunk).
The legacy Completions stream (``choices[].text``) is the same format.

Tool calls (:mod:`streamwarden.core.toolcalls`): ``delta.tool_calls[]`` entries,
by choice and ``index`` (the id and name on the first, argument fragments
after; calls of one choice may interleave), and the legacy
``delta.function_call``. A choice's calls close when its ``finish_reason``
arrives (whatever it is: ``length`` cut mid-arguments is a broken call), or
with ``[DONE]``; a call also ends where another ``id`` takes its ``index``
(some servers number every call 0).

openai-python raises ``APIError`` on any event whose JSON data has a truthy
``error`` object, so that is the shape of the synthesized error.
"""

from __future__ import annotations

from typing import Any

from streamwarden.core.dialects.base import (
    NOTHING,
    TERMINAL,
    UPSTREAM_ERROR,
    Dialect,
    Observation,
    Place,
    as_int,
    dump_json,
    load_json,
    sse_block,
    token_place,
)
from streamwarden.core.sse import Event
from streamwarden.core.toolcalls import ToolStep, arguments_step, finish_step, open_step

_DELTA_TEXT_FIELDS = frozenset({"content", "reasoning_content", "reasoning", "refusal"})


class OpenAIChat(Dialect):
    __slots__ = ()

    name = "openai-chat"
    tool_marks = ('"tool_calls"', '"function_call"')
    terminal_event = "data: [DONE]"

    def inspect(self, event: Event) -> Observation:
        data = event.data
        if data.startswith("[DONE]"):
            return TERMINAL
        obj = load_json(data)
        if not isinstance(obj, dict):
            return NOTHING
        if obj.get("error"):
            return UPSTREAM_ERROR
        choices = obj.get("choices")
        text, tools, calls = _choices_text(choices)
        usage = obj.get("usage")
        tokens = prompt = None
        if isinstance(usage, dict):
            tokens = as_int(usage.get("completion_tokens"))
            prompt = as_int(usage.get("prompt_tokens"))
        # The usage chunk has "choices": [] (with a count or not): the one a
        # client that did not ask for usage must not see.
        usage_only = choices == [] and isinstance(usage, dict)
        if not text and tokens is None and prompt is None and not usage_only and calls is None:
            return NOTHING
        return Observation(text, tokens, prompt, usage_only=usage_only, tools=tools, calls=calls)

    def error_event(self, code: str, message: str) -> bytes:
        error = {"message": message, "type": "stream_error", "code": code, "param": None}
        return sse_block(dump_json({"error": error}))

    def text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[Place]:
        # The same fields as _choices_text, in the same order. A choice's
        # logprobs spell its tokens: a rewritten text takes them along.
        choices = root.get("choices") if isinstance(root, dict) else None
        if not isinstance(choices, list):
            return []
        places: list[Place] = []
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                for field, value in delta.items():
                    if field in _DELTA_TEXT_FIELDS and isinstance(value, str):
                        places.append(token_place(delta, field, choice))
                calls = delta.get("tool_calls")
                if tool_arguments and isinstance(calls, list):
                    for call in calls:
                        function = call.get("function") if isinstance(call, dict) else None
                        if isinstance(function, dict) and isinstance(
                            function.get("arguments"), str
                        ):
                            places.append(token_place(function, "arguments", choice))
            if isinstance(choice.get("text"), str):
                places.append(token_place(choice, "text", choice))
        return places

    @classmethod
    def sniff(cls, event: Event) -> bool:
        if event.event != "message":
            return False
        obj = load_json(event.data)
        return isinstance(obj, dict) and "choices" in obj


def _choices_text(choices: Any) -> tuple[str, bool, list[ToolStep] | None]:
    """The text of the choices, whether tool-call arguments are part of it, and the calls' steps."""
    if not isinstance(choices, list):
        return "", False, None
    parts: list[str] = []
    tools = False
    steps: list[ToolStep] | None = None
    for position, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            # A delta has one or two keys: look at those, not at every name.
            for field, value in delta.items():
                if field in _DELTA_TEXT_FIELDS and isinstance(value, str):
                    parts.append(value)
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                before = len(parts)
                steps = _call_steps(calls, _index(choice, position), parts, steps)
                tools = tools or len(parts) > before
            legacy = delta.get("function_call")
            if isinstance(legacy, dict):
                steps = _call_steps([legacy], _index(choice, position), None, steps, -1)
        text = choice.get("text")  # legacy Completions
        if isinstance(text, str):
            parts.append(text)
        if choice.get("finish_reason"):
            steps = steps if steps is not None else []
            steps.append(finish_step(_index(choice, position)))
    return (parts[0] if len(parts) == 1 else "".join(parts)), tools, steps


def _index(holder: dict[str, Any], position: int) -> int:
    """A choice's or a call's ``index``, or its place in the list when it has none."""
    index = holder.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else position


def _call_steps(
    calls: list[Any],
    choice: int,
    parts: list[str] | None,
    steps: list[ToolStep] | None,
    legacy: int | None = None,
) -> list[ToolStep] | None:
    """The steps of one delta's tool calls (their arguments appended to ``parts``, if given)."""
    for position, call in enumerate(calls):
        if not isinstance(call, dict):
            continue
        function = call.get("function") if legacy is None else call
        if not isinstance(function, dict):
            continue
        key = (choice, _index(call, position) if legacy is None else legacy)
        steps = steps if steps is not None else []
        call_id = call.get("id")
        name = function.get("name")
        if call_id or name:
            steps.append(open_step(key, call_id, name, choice))
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            if parts is not None:
                parts.append(arguments)
            if arguments:
                steps.append(arguments_step(key, arguments, choice))
    return steps
