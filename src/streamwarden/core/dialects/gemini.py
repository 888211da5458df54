"""Google Gemini ``streamGenerateContent`` with ``alt=sse``.

Unnamed events whose data is a ``GenerateContentResponse``: text in
``candidates[].content.parts[].text``, tool calls as whole ``functionCall``
parts (counted as text for tokens; output filters that read tool arguments
read their ``args`` object as its compact JSON), cumulative
``usageMetadata.candidatesTokenCount``. The last chunk
carries a ``finishReason``; there is no separate terminal event, so that
chunk is the terminal one.

Tool calls (:mod:`streamwarden.core.toolcalls`). The Gemini API sends each
``functionCall`` part whole, its ``args`` an object, inside one event; the
relay forwards only whole events, so no client is ever handed part of one.
"A cut inside a call" therefore means, for Gemini:

- a cut inside the event that carries a ``functionCall`` part (the dropped,
  unfinished event visibly holds one): the client gets none of the call,
  and the error names it (``tool_call_truncated``, its name and the bytes
  of the event that came);
- Vertex AI's streamed arguments (``streamFunctionCallArguments``): a
  ``functionCall`` with ``willContinue: true`` opens a call on its
  candidate, its ``partialArgs`` follow in later parts, and the part
  without ``willContinue`` closes it; a stream that ends between them is
  cut inside the call. A candidate whose ``finishReason`` comes while its
  call still said ``willContinue`` closed it unfinished: ``tool_call_invalid``.

A whole ``functionCall`` whose ``args`` is there but not an object is
``tool_call_invalid`` too (no ``args``: a function without parameters).
Its ``args`` (and a part's ``partialArgs``) are measured before they are
written again as JSON (for their bytes, and as text for the tokens): past
``max_tool_arguments_depth`` the call is ``tool_call_too_large``, and a value
past :data:`~streamwarden.core.toolcalls.DEEPEST` is never written at all
(``json.dumps`` recurses: a thousand levels crashed it).

The synthesized error is Google's own error object, as the API streams it
when it fails mid-answer: ``{"error": {"code": <HTTP status>, "message":
..., "status": <google.rpc.Code name>, "details": [...]}}``. ``code`` must
be an integer: google-genai compares it with 400 and 500 to choose between
``ClientError`` and ``ServerError`` (a string made it raise ``TypeError``
instead, losing the answer's reason), and it only looks for an error in a
chunk whose JSON starts with ``{"error":``. Our machine code is in the
message, ``"... (stream_truncated)"``, and in a ``google.rpc.ErrorInfo``
detail: ``reason`` in Google's upper-case form (``STREAM_TRUNCATED``, as
ErrorInfo requires ``[A-Z][A-Z0-9_]+[A-Z0-9]``), ``domain``
``streamwarden``, and the code itself as ``metadata.code``.

Each code gets a status and the HTTP status Google pairs with it, so a
client that maps either one gets the same answer:

================== ==== =================== =====================================
machine code       code status              why
================== ==== =================== =====================================
stream_truncated   500  INTERNAL            the upstream broke its own protocol:
                                            it ended without a finishReason
upstream_error     503  UNAVAILABLE         the connection broke: transient,
                                            worth a retry
upstream_timeout   504  DEADLINE_EXCEEDED   the upstream went silent too long
duration_exceeded  504  DEADLINE_EXCEEDED   the stream's own deadline ran out
event_too_large    500  INTERNAL            the upstream sent what the proxy
                                            refuses; not RESOURCE_EXHAUSTED
                                            (429), which clients retry with
                                            backoff for the same refusal, and
                                            not a 4xx, which blames the request
shutting_down      503  UNAVAILABLE         the proxy is draining: retry
                                            elsewhere
resume_expired     404  NOT_FOUND           a resume named a stream that is
                                            unknown, expired, or not the
                                            caller's
resume_gap         500  DATA_LOSS           the events after a resume's
                                            position were evicted
resume_unavailable 503  UNAVAILABLE         the resume store is down: retry
content_blocked    400  FAILED_PRECONDITION an output filter stopped the answer:
                                            the same request would be stopped
                                            again, so not a retryable 5xx
tool_call_*        500  INTERNAL            the upstream broke a tool call (cut
                                            inside it, closed it unfinished) or
                                            sent one over the proxy's limit
(any other)        500  INTERNAL
================== ==== =================== =====================================
"""

from __future__ import annotations

import re
from typing import Any

from streamwarden.core.dialects.base import (
    MAIN_TEXT,
    NOTHING,
    UPSTREAM_ERROR,
    ArgumentsText,
    Dialect,
    Observation,
    TextPlace,
    as_int,
    dump_json,
    load_json,
    sse_block,
    token_place,
)
from streamwarden.core.filters import TextKey
from streamwarden.core.sse import Event
from streamwarden.core.toolcalls import (
    DEEPEST,
    LABEL_CHARS,
    ToolStep,
    finish_step,
    open_step,
    size_step,
    utf8_size,
    value_depth,
    whole_step,
)

# The table in the module docstring: machine code -> (HTTP status, google.rpc.Code).
_STATUS: dict[str, tuple[int, str]] = {
    "stream_truncated": (500, "INTERNAL"),
    "upstream_error": (503, "UNAVAILABLE"),
    "upstream_timeout": (504, "DEADLINE_EXCEEDED"),
    "duration_exceeded": (504, "DEADLINE_EXCEEDED"),
    "event_too_large": (500, "INTERNAL"),
    "shutting_down": (503, "UNAVAILABLE"),
    "resume_expired": (404, "NOT_FOUND"),
    "resume_gap": (500, "DATA_LOSS"),
    "resume_unavailable": (503, "UNAVAILABLE"),
    "content_blocked": (400, "FAILED_PRECONDITION"),
    "tool_call_truncated": (500, "INTERNAL"),
    "tool_call_invalid": (500, "INTERNAL"),
    "tool_call_too_large": (500, "INTERNAL"),
}
_OTHER = (500, "INTERNAL")
ERROR_DOMAIN = "streamwarden"


class Gemini(Dialect):
    __slots__ = ()

    name = "gemini"
    tool_marks = ('"functionCall"',)
    terminal_event = "a chunk with finishReason"

    def inspect(self, event: Event) -> Observation:
        obj = load_json(event.data)
        if not isinstance(obj, dict):
            return NOTHING
        if obj.get("error"):
            return UPSTREAM_ERROR
        text, finished, tools, calls = _candidates(obj.get("candidates"))
        usage = obj.get("usageMetadata")
        tokens = prompt = None
        if isinstance(usage, dict):
            tokens = as_int(usage.get("candidatesTokenCount"))
            prompt = as_int(usage.get("promptTokenCount"))
        if not text and tokens is None and prompt is None and not finished and calls is None:
            return NOTHING
        return Observation(text, tokens, prompt, terminal=finished, tools=tools, calls=calls)

    def error_event(self, code: str, message: str) -> bytes:
        http_status, status = _STATUS.get(code, _OTHER)
        info = {
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": code.upper(),
            "domain": ERROR_DOMAIN,
            "metadata": {"code": code},
        }
        error = {"code": http_status, "message": message, "status": status, "details": [info]}
        return sse_block(dump_json({"error": error}))

    def text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[TextPlace]:
        # The same as _candidates, in the same order: text parts, and with
        # tool_arguments a functionCall's args, whole in the part, read as the
        # compact JSON its tokens were counted by (see ArgumentsText).
        candidates = root.get("candidates") if isinstance(root, dict) else None
        places: list[TextPlace] = []
        for position, candidate in enumerate(candidates if isinstance(candidates, list) else ()):
            content = candidate.get("content") if isinstance(candidate, dict) else None
            parts = content.get("parts") if isinstance(content, dict) else None
            # Each candidate's text is a text of its own (candidateCount > 1):
            # one read across interleaved candidates would miss a key split
            # between two of another's parts.
            scope = _scope(candidate, position) if isinstance(candidate, dict) else position
            key: TextKey = MAIN_TEXT if scope == 0 else ("candidate", scope)
            for part in parts if isinstance(parts, list) else ():
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    # The candidate's logprobsResult spells its tokens: they go with a rewrite.
                    place = token_place(part, "text", candidate, "logprobsResult")
                    places.append((*place, key))
                call = part.get("functionCall") if isinstance(part, dict) else None
                if tool_arguments and isinstance(call, dict) and "args" in call:
                    places.append((ArgumentsText(call), "args", MAIN_TEXT))
        return places

    @classmethod
    def sniff(cls, event: Event) -> bool:
        if event.event != "message":
            return False
        obj = load_json(event.data)
        return isinstance(obj, dict) and ("candidates" in obj or "usageMetadata" in obj)

    calls_arrive_whole = True

    def call_in_cut(self, block: bytes) -> tuple[str, str, int] | None:
        start = block.find(b'"functionCall"')
        if start < 0:
            return None
        rest = block[start:]
        call_id, name = _own_labels(rest)
        return call_id, name, len(rest)


# What an unfinished functionCall is read by: its strings (a key when a colon
# follows) and its brackets; the bytes between them are skipped.
_TOKEN = re.compile(rb'"((?:[^"\\]|\\.)*)"\s*(:?)|[{}\[\]]')
_OBJECT_START = re.compile(rb'"functionCall"\s*:\s*\{')
_LABELS = (b"id", b"name")


def _own_labels(rest: bytes) -> tuple[str, str]:
    """The id and name of the ``functionCall`` object ``rest`` starts with, as far as it came.

    Only its own keys: an ``id`` or a ``name`` inside its ``args`` is an
    argument, and arguments never leave the tracker. A label with an escape,
    or longer than a label, is left out.
    """
    opened = _OBJECT_START.match(rest)
    if opened is None:
        return "", ""
    found: dict[bytes, str] = {}
    depth = 1
    key: bytes | None = None
    for token in _TOKEN.finditer(rest, opened.end()):
        text = token.group(1)
        if text is None:  # a bracket
            depth += 1 if token.group(0) in (b"{", b"[") else -1
            key = None
            if depth == 0:
                break
        elif depth != 1:
            continue
        elif token.group(2):
            key = text
        else:
            if (
                key in _LABELS
                and key not in found
                and len(text) <= LABEL_CHARS
                and b"\\" not in text
            ):
                found[key] = text.decode("utf-8", "replace")
            key = None
    return found.get(b"id", ""), found.get(b"name", "")


def _candidates(candidates: Any) -> tuple[str, bool, bool, list[ToolStep] | None]:
    """The text, whether a candidate finished, whether a functionCall is in the text, the
    calls' steps."""
    if not isinstance(candidates, list):
        return "", False, False, None
    parts_text: list[str] = []
    finished = False
    tools = False
    steps: list[ToolStep] | None = None
    for position, candidate in enumerate(candidates):
        if not isinstance(candidate, dict):
            continue
        scope = _scope(candidate, position)
        content = candidate.get("content")
        parts = content.get("parts") if isinstance(content, dict) else None
        for part in parts if isinstance(parts, list) else ():
            if not isinstance(part, dict):
                continue
            text = part.get("text")
            if isinstance(text, str):
                parts_text.append(text)
                # Another candidate's text is not the main text: the filters read it keyed.
                tools = tools or (scope != 0 and bool(text))
            call = part.get("functionCall")
            if isinstance(call, dict):
                size = depth = 0
                if "args" in call:
                    args = call["args"]
                    depth = value_depth(args)
                    if depth <= DEEPEST:  # deeper, it is refused unwritten
                        arguments = dump_json(args)
                        parts_text.append(arguments)
                        size = utf8_size(arguments)
                    tools = True
                steps = steps if steps is not None else []
                _call_steps(call, scope, size, depth, steps)
        if candidate.get("finishReason"):
            finished = True
            steps = steps if steps is not None else []
            steps.append(finish_step(scope))
    return "".join(parts_text), finished, tools, steps


def _scope(candidate: dict[str, Any], position: int) -> int:
    """A candidate's ``index``, or its place in the list when it has none."""
    index = candidate.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else position


def _call_steps(
    call: dict[str, Any], scope: int, size: int, depth: int, steps: list[ToolStep]
) -> None:
    """A functionCall part: a whole call, or a part of one whose arguments stream (Vertex AI)."""
    call_id = call.get("id")
    name = call.get("name")
    partial = call.get("partialArgs")
    if call.get("willContinue") is True:
        steps.append(open_step(scope, call_id, name, scope))
        steps.append(_partial_step(scope, partial))
        return
    # The last part of a streamed call, or a call whole in this part: the same
    # step closes either (the relay knows whether one is open on the candidate).
    args = call.get("args")
    if partial is not None:
        steps.append(_partial_step(scope, partial))
    valid = args is None or isinstance(args, dict)
    steps.append(whole_step(scope, call_id, name, valid, size, depth))


def _partial_step(scope: int, partial: Any) -> ToolStep:
    """A part's streamed arguments (``partialArgs``), counted in bytes as JSON."""
    if not partial:
        return size_step(scope, 0, scope)
    if isinstance(partial, list) and len(partial) == 1 and isinstance(partial[0], dict):
        value = partial[0].get("stringValue")
        if isinstance(value, str):
            return size_step(scope, utf8_size(value), scope)
    # Each piece is a path and a value (an object, a list): measured before it is written.
    depth = value_depth(partial)
    size = utf8_size(dump_json(partial)) if depth <= DEEPEST else 0
    return size_step(scope, size, scope, depth)
