"""Hugging Face Text Generation Inference (TGI): ``/generate_stream``.

Unnamed events (TGI writes ``data:`` with no space), one generated token
each: ``{"index", "token": {id, text, logprob, special}, "top_tokens"?,
"generated_text": null, "details": null}``. ``index`` counts the tokens
generated so far (the provider's own running count). The last event
carries the last token again with the whole ``generated_text`` and, when
the request asked for ``details``, ``details`` (``finish_reason``,
``generated_tokens``, ``seed``, ``input_length``): that event is the
terminal one, and there is no other. A special token (the end-of-sequence
token) is generated but is no text: ``generated_text`` leaves it out, and so
do the token estimate and the output filters. TGI's router sends an error
as an event ``{"error": ..., "error_type": ...}`` and ends the stream; a
stream whose generation stopped before its last event ends with
``error_type`` ``incomplete_generation``.

Output filters read each token's text as the stream's text, and the final
``generated_text`` as a whole text on its own (:meth:`TGI.repeats_text`), so
that it says what the redacted tokens said. A rewritten token drops the
``top_tokens`` beside it, which may spell it.

``huggingface_hub`` (``InferenceClient.text_generation(stream=True)``,
``huggingface_hub/inference/_common.py``: ``_format_text_generation_stream_output``)
raises on any event whose JSON has a non-null ``error``, choosing the class
by ``error_type`` (``_parse_text_generation_error``): ``incomplete_generation``
is ``IncompleteGenerationError``, ``generation`` ``GenerationError``,
``overloaded`` ``OverloadedError``, ``validation`` ``ValidationError``, any
other ``UnknownError``. The synthesized error is TGI's own event, with the
``error_type`` TGI would give that failure (``_ERROR_TYPES``) and our code in
a ``code`` field beside them and at the end of the message. TGI has no tool
calls on this route (its ``/v1/chat/completions`` is ``openai-chat``).
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
    Place,
    TextPlace,
    as_int,
    dump_json,
    load_json,
    sse_block,
    token_place,
)
from streamwarden.core.sse import Event

#: TGI's ``error_type`` for each of our codes (``InferError::error_type`` in
#: TGI's router; ``huggingface_hub`` maps each to its class). A stream that
#: ended before its last event is TGI's own ``incomplete_generation``; a
#: draining proxy or an unreachable store asks for a retry elsewhere, as an
#: overloaded model does; a resume that names no stream of the caller's is
#: the request's fault. Every other failure happened during generation.
_ERROR_TYPES = {
    "stream_truncated": "incomplete_generation",
    "tool_call_truncated": "incomplete_generation",
    "shutting_down": "overloaded",
    "resume_unavailable": "overloaded",
    "resume_expired": "validation",
}


class TGI(Dialect):
    __slots__ = ()

    name = "tgi"
    terminal_event = 'the event with "generated_text"'

    def inspect(self, event: Event) -> Observation:
        data = event.data
        if data.startswith("[DONE]"):
            # Not TGI's own, but huggingface_hub ends its stream on it too:
            # for a server that copies TGI and adds it, the answer is over.
            return TERMINAL
        obj = load_json(data)
        if not isinstance(obj, dict):
            return NOTHING
        if obj.get("error") is not None:  # huggingface_hub's own test
            return UPSTREAM_ERROR
        token = _read_token(obj)
        text: str = token["text"] if token is not None else ""
        tokens = as_int(obj.get("index"))
        prompt = None
        details = obj.get("details")
        terminal = details is not None or obj.get("generated_text") is not None
        if isinstance(details, dict):
            generated = as_int(details.get("generated_tokens"))
            if generated is not None:
                tokens = generated
            prompt = as_int(details.get("input_length"))
        if not text and tokens is None and not terminal:
            return NOTHING
        return Observation(text, tokens, prompt, terminal=terminal)

    def error_event(self, code: str, message: str) -> bytes:
        error_type = _ERROR_TYPES.get(code, "generation")
        return sse_block(dump_json({"error": message, "error_type": error_type, "code": code}))

    def text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[TextPlace]:
        # The same text as inspect reads.
        token = _read_token(root) if isinstance(root, dict) else None
        if token is None:
            return []
        return [(*token_place(token, "text", root, "top_tokens"), MAIN_TEXT)]

    def repeats_text(self, event: Event) -> bool:
        # Only the last event has a generated_text that is not null.
        data = event.data
        return '"generated_text"' in data and '"generated_text":null' not in data

    def whole_text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[Place]:
        if isinstance(root, dict) and isinstance(root.get("generated_text"), str):
            return [(root, "generated_text")]
        return []

    @classmethod
    def sniff(cls, event: Event) -> bool:
        data = event.data
        if event.event != "message" or '"token"' not in data:
            return False
        obj = load_json(data)
        return (
            isinstance(obj, dict) and isinstance(obj.get("token"), dict) and "generated_text" in obj
        )


def _read_token(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The event's token if a reader reads its text: a string, and not a special token
    (the end-of-sequence token is counted, but is no text)."""
    token = obj.get("token")
    if isinstance(token, dict) and not token.get("special") and isinstance(token.get("text"), str):
        return token
    return None
