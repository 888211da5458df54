"""OpenAI Chat Completions streaming (and every server that copies it: vLLM, TGI, llama.cpp).

Events carry no ``event:`` field; each ``data:`` is a ``chat.completion.chunk``
whose ``choices[].delta`` holds content, reasoning or tool-call argument
fragments. The stream ends with ``data: [DONE]``. Usage arrives in a last
chunk with empty ``choices`` when the client asked for
``stream_options.include_usage`` (some servers send it on every chunk).
The legacy Completions stream (``choices[].text``) is the same format.

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
        text, tools = _choices_text(choices)
        usage = obj.get("usage")
        tokens = prompt = None
        if isinstance(usage, dict):
            tokens = as_int(usage.get("completion_tokens"))
            prompt = as_int(usage.get("prompt_tokens"))
        # The usage chunk has "choices": [] (with a count or not): the one a
        # client that did not ask for usage must not see.
        usage_only = choices == [] and isinstance(usage, dict)
        if not text and tokens is None and prompt is None and not usage_only:
            return NOTHING
        return Observation(text, tokens, prompt, usage_only=usage_only, tools=tools)

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


def _choices_text(choices: Any) -> tuple[str, bool]:
    """The text of the choices, and whether tool-call arguments are part of it."""
    if not isinstance(choices, list):
        return "", False
    parts: list[str] = []
    tools = False
    for choice in choices:
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
                for call in calls:
                    function = call.get("function") if isinstance(call, dict) else None
                    if isinstance(function, dict):
                        arguments = function.get("arguments")
                        if isinstance(arguments, str):
                            parts.append(arguments)
                            tools = True
        text = choice.get("text")  # legacy Completions
        if isinstance(text, str):
            parts.append(text)
    return (parts[0] if len(parts) == 1 else "".join(parts)), tools
