"""Tool calls followed from their first byte to their close: whole, or named broken.

An agent runs a tool when its call's arguments are complete. A stream cut
inside a call's arguments, or a call closed with arguments that are not
JSON, must never pass as a call a client may run. Each dialect reads, in
the events it already parses, the *steps* of its tool calls
(:class:`ToolStep`: a call opens, its arguments grow, it closes) and hands
them to the relay in its :class:`~streamwarden.core.dialects.base.Observation`;
a :class:`ToolCalls` per stream (made at the first step: a stream without
tool calls has none) follows them, with no I/O:

- a call is *open* from the first step that names it to the step that
  closes it; a stream that ends while one is open (truncated, broken,
  silent, over a limit, the client gone) ends it ``truncated``, and the
  relay's error event then says ``tool_call_truncated`` and names it;
- at its close a call's arguments (the fragments received, or the whole
  arguments the closing event repeats) must be a JSON object: otherwise it
  is ``invalid``, and the relay writes ``tool_call_invalid`` *in place of*
  the closing event, so that nothing after it reaches the client. Empty
  arguments are no arguments (``{}``): Anthropic streams none for a tool
  without parameters;
- what is held stays bounded by ``max_tool_arguments_bytes``, whatever the
  input: the arguments of every open call together, each open call
  counting :data:`CALL_OVERHEAD` bytes more for its bookkeeping (so a flood
  of calls with empty arguments is bounded too), and the key, id and name
  it is kept by (the upstream chooses them: a 256 KiB ``toolCallId`` costs
  256 KiB). A call's fragments are joined as they pile up (past
  :data:`FRAGMENTS`), so that thousands of one-byte fragments hold about
  their bytes, not a string object each. Past it the call is
  ``too_large`` (``tool_call_too_large``). A closed call keeps no
  arguments; the first :data:`LISTED` calls are kept for the stream's
  record (id, name, end state, bytes), the others only counted;
- a call's arguments nest at most ``max_tool_arguments_depth`` levels of
  objects and arrays: deeper, it is ``too_large`` too (the same code, a
  message that says depth). The depth is measured before anything parses
  or writes the arguments again (:func:`nests_deeper` on their text,
  :func:`value_depth` on a value an event carried whole, which stops at
  :data:`DEEPEST`), so no recursion, ours or a JSON library's, ever meets
  an upstream's nesting;
- what one event costs does not grow with the calls open: the calls are
  kept by scope as well, so a finish (of a choice, a candidate) reaches
  only the calls it closes.

A cut names the calls it broke (:meth:`ToolCalls.cut_calls`): the open
calls whose arguments so far are not a whole object. One whose arguments
are whole, waiting only for its close, is named only when no other is
broken (the cut still kept its close from it).

Ids and names come from the upstream: they are cut to :data:`LABEL_CHARS`
printable characters before they go into a message, a log line or a span.
Arguments never leave this module.
"""

from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate, islice
from typing import Any, Final

__all__ = [
    "CALL_OVERHEAD",
    "COMPLETE",
    "DEEPEST",
    "DEPTH",
    "FRAGMENTS",
    "INVALID",
    "LISTED",
    "TOO_LARGE",
    "TRUNCATED",
    "ToolCall",
    "ToolCalls",
    "ToolStep",
    "arguments_step",
    "close_step",
    "finish_step",
    "is_arguments",
    "label",
    "nests_deeper",
    "open_step",
    "size_step",
    "starts_calls",
    "utf8_size",
    "value_depth",
    "whole_step",
]

#: End states of a call (the ``end_state`` label of ``streamwarden_tool_calls_total``).
COMPLETE: Final = "complete"
TRUNCATED: Final = "truncated"
INVALID: Final = "invalid"
TOO_LARGE: Final = "too_large"

#: What an open call costs against ``max_tool_arguments_bytes`` besides its arguments.
CALL_OVERHEAD: Final = 256
#: The calls a stream's record names; later ones are only counted.
LISTED: Final = 16
#: The longest id or name kept (in characters).
LABEL_CHARS: Final = 64
#: The fragments a call holds apart before the newest are joined.
FRAGMENTS: Final = 32
#: The default ``max_tool_arguments_depth``: levels of objects and arrays in
#: a call's arguments. Tool schemas nest a handful; the SDKs' own parsers
#: stop far deeper (Python's at about 1,000, with the stack it has left).
DEPTH: Final = 128
#: The most ``max_tool_arguments_depth`` may be: a value this deep is still
#: parsed and written by ``json`` (which recurses) with room to spare on any
#: stack a face runs it on. :func:`value_depth` stops counting past it.
DEEPEST: Final = 512

# What a step does.
_OPEN: Final = 0
_ARGUMENTS: Final = 1
_CLOSE: Final = 2
_FINISH: Final = 3


class ToolStep:
    """One thing an event says about a tool call; made by the dialects' helpers below."""

    __slots__ = (
        "action",
        "call_id",
        "depth",
        "key",
        "name",
        "reported",
        "scope",
        "size",
        "text",
        "verdict",
        "whole",
    )

    def __init__(
        self,
        action: int,
        key: object,
        *,
        scope: int = 0,
        call_id: str = "",
        name: str = "",
        text: str | None = None,
        size: int = 0,
        verdict: bool | None = None,
        whole: bool = False,
        reported: bool = False,
        depth: int = 0,
    ) -> None:
        self.action = action
        #: Which call, in the dialect's terms (an index, an id): hashable.
        self.key = key
        #: What closes it with others: a choice, a candidate (``finish_step``).
        self.scope = scope
        self.call_id = call_id
        self.name = name
        #: Arguments: a fragment (``arguments_step``), or the whole arguments
        #: the closing event repeats (``close_step``), to check instead.
        self.text = text
        #: Bytes of arguments counted without being held (``size_step``).
        self.size = size
        #: At a close: the dialect already knows (``True``: whole; ``False``: broken).
        self.verdict = verdict
        #: A close of a call never opened is a call whole in one event.
        self.whole = whole
        #: The upstream itself told the client the call is broken (the Vercel
        #: AI SDK's ``tool-input-error``): recorded ``invalid``, and the stream
        #: goes on, since the client knows.
        self.reported = reported
        #: Levels of arguments the event carried as a value (:func:`value_depth`);
        #: arguments given as text are measured here, at the close.
        self.depth = depth


def open_step(key: object, call_id: Any, name: Any, scope: int = 0) -> ToolStep:
    """A call opens (or, already open, is named)."""
    return ToolStep(_OPEN, key, scope=scope, call_id=label(call_id), name=label(name))


def arguments_step(key: object, fragment: str, scope: int = 0) -> ToolStep:
    """More of a call's arguments, held to be checked at its close (it opens if it must)."""
    return ToolStep(_ARGUMENTS, key, scope=scope, text=fragment, size=utf8_size(fragment))


def size_step(key: object, size: int, scope: int = 0, depth: int = 0) -> ToolStep:
    """More of a call's arguments, only counted: the dialect checks them itself
    (``depth``: how deep the value that carried them nests)."""
    return ToolStep(_ARGUMENTS, key, scope=scope, size=size, depth=depth)


def close_step(
    key: object,
    arguments: str | None = None,
    *,
    verdict: bool | None = None,
    whole: bool = False,
    reported: bool = False,
    call_id: Any = None,
    name: Any = None,
    size: int | None = None,
    depth: int = 0,
) -> ToolStep:
    """A call closes: its ``arguments`` repeated whole (checked instead of the
    fragments), or the dialect's ``verdict`` (on a value ``depth`` levels deep);
    ``whole``: a call never opened is recorded as one complete in this event
    (else the close is ignored)."""
    if size is None:
        size = utf8_size(arguments) if arguments is not None else 0
    return ToolStep(
        _CLOSE,
        key,
        call_id=label(call_id),
        name=label(name),
        text=arguments,
        size=size,
        verdict=False if reported else verdict,
        whole=whole,
        reported=reported,
        depth=depth,
    )


def whole_step(
    key: object, call_id: Any, name: Any, valid: bool, size: int = 0, depth: int = 0
) -> ToolStep:
    """A call whole in one event (Gemini's ``functionCall``, ``size`` bytes of arguments
    ``depth`` levels deep): opened and closed at once, or the end of one whose
    arguments streamed."""
    return close_step(
        key, verdict=valid, whole=True, call_id=call_id, name=name, size=size, depth=depth
    )


def finish_step(scope: int) -> ToolStep:
    """Every call of ``scope`` (a choice, a candidate) closes: it finished."""
    return ToolStep(_FINISH, None, scope=scope)


def starts_calls(steps: list[ToolStep]) -> bool:
    """Whether ``steps`` may begin a call: else, on a stream with none yet, they say nothing.

    (A text block's stop, a choice's finish: most streams have no tool calls.)
    """
    return any(step.action == _OPEN or step.action == _ARGUMENTS or step.whole for step in steps)


def label(value: Any) -> str:
    """An upstream's id or name as it may be shown: printable, at most :data:`LABEL_CHARS`."""
    if not isinstance(value, str) or not value:
        return ""
    text = value[:LABEL_CHARS]
    if text.isascii() and text.isprintable():
        return text
    # Lone surrogates (the stdlib parser lets them through) cannot be encoded.
    text = text.encode("utf-8", "replace").decode("utf-8")
    return "".join(c for c in text if c.isprintable())


def utf8_size(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (a lone surrogate counts as the 3 it takes escaped)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class ToolCall:
    """One call as followed: who it is, how many bytes of arguments came, how it ended."""

    __slots__ = ("call_id", "cost", "end_state", "name", "nested", "parts", "scope", "size")

    def __init__(self, call_id: str, name: str, scope: int) -> None:
        self.call_id = call_id
        self.name = name
        self.scope = scope
        #: Bytes of arguments received.
        self.size = 0
        #: Bytes held for it besides its arguments: its bookkeeping, key, id and name.
        self.cost = CALL_OVERHEAD + len(call_id) + len(name)
        #: The fragments held until the close (``None`` once closed).
        self.parts: list[str] | None = []
        #: ``None`` while open; :data:`COMPLETE`, :data:`INVALID`, ...
        self.end_state: str | None = None
        #: :data:`TOO_LARGE` for its depth (``max_tool_arguments_depth``), not its bytes.
        self.nested = False

    def describe(self) -> str:
        """The call as a message names it: ``tool call call_1 (lookup)``."""
        return f"tool call {self.call_id or '(no id)'} ({self.name or 'unnamed'})"

    def as_record(self) -> dict[str, Any]:
        """For the stream's log line and ``/streams``: never the arguments."""
        return {
            "id": self.call_id,
            "name": self.name,
            "end_state": self.end_state or TRUNCATED,
            "arguments_bytes": self.size,
        }


class ToolCalls:
    """The tool calls of one stream (see the module docstring)."""

    __slots__ = ("_counts", "_depth", "_held", "_limit", "_open", "_scopes", "listed")

    def __init__(self, limit: int, depth: int = DEPTH) -> None:
        self._limit = limit
        self._depth = depth
        self._open: dict[object, ToolCall] = {}
        #: The open calls again, by scope: what a finish closes, found without
        #: looking at the calls of other scopes (thousands may be open).
        self._scopes: dict[int, dict[object, ToolCall]] = {}
        #: Bytes held against the limit: open calls' arguments and overhead.
        self._held = 0
        self._counts: dict[str, int] = {}
        #: The first :data:`LISTED` calls, in the order they opened.
        self.listed: list[ToolCall] = []

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def depth(self) -> int:
        return self._depth

    def follow(self, steps: list[ToolStep]) -> ToolCall | None:
        """Take one event's steps, in order; the call it broke (invalid, too large), if any."""
        for step in steps:
            action = step.action
            if action == _ARGUMENTS:
                broken = self._arguments(step)
            elif action == _OPEN:
                broken = self._opened(step)
            elif action == _CLOSE:
                broken = self._closed(step)
            else:
                broken = self._finished(step.scope)
            if broken is not None:
                return broken
        return None

    def finish_all(self) -> ToolCall | None:
        """The stream's terminal event: every open call closes with it."""
        for key in list(self._open):
            broken = self._close(key)
            if broken is not None:
                return broken
        return None

    def cut_calls(self) -> list[ToolCall]:
        """The calls a cut now breaks: the open ones whose arguments so far are not whole.

        When every open call's arguments are whole (only their close was to
        come), the cut kept the close from them all: they are the ones. Run
        once, at the end of a stream: it reads the arguments held.
        """
        calls = list(self._open.values())
        broken = [call for call in calls if not self._whole_so_far(call)]
        return broken or calls

    @property
    def open_calls(self) -> list[ToolCall]:
        return list(self._open.values())

    def first_open(self, count: int) -> list[ToolCall]:
        """The first ``count`` calls still open (a stream may hold thousands)."""
        return list(islice(self._open.values(), count))

    @property
    def open_count(self) -> int:
        return len(self._open)

    def cut_whole(self, call_id: str, name: str, size: int) -> ToolCall:
        """A call the stream was cut inside of before it reached the relay whole (Gemini)."""
        call = self._new(label(call_id), label(name), 0)
        call.size = size
        self._end(call, TRUNCATED)
        return call

    def counts(self) -> dict[str, int]:
        """Calls by end state; one still open counts as :data:`TRUNCATED` (the stream ended)."""
        counts = dict(self._counts)
        if self._open:
            counts[TRUNCATED] = counts.get(TRUNCATED, 0) + len(self._open)
        return counts

    def record(self) -> list[dict[str, Any]]:
        return [call.as_record() for call in self.listed]

    # -- steps ---------------------------------------------------------------

    def _new(self, call_id: str, name: str, scope: int) -> ToolCall:
        call = ToolCall(call_id, name, scope)
        if len(self.listed) < LISTED:
            self.listed.append(call)
        return call

    def _keep(self, key: object, call: ToolCall) -> None:
        """An open call, held: by key, and by scope."""
        self._open[key] = call
        scope = self._scopes.get(call.scope)
        if scope is None:
            self._scopes[call.scope] = {key: call}
        else:
            scope[key] = call
        self._held += call.cost

    def _drop(self, key: object) -> ToolCall:
        """An open call no longer held (closed, or over the limit)."""
        call = self._open.pop(key)
        scope = self._scopes[call.scope]
        del scope[key]
        if not scope:
            del self._scopes[call.scope]
        self._held -= call.cost + call.size
        return call

    def _opened(self, step: ToolStep) -> ToolCall | None:
        call = self._open.get(step.key)
        if call is not None and step.call_id and call.call_id and step.call_id != call.call_id:
            # Another call in the same place (a server that numbers every call 0):
            # the one before it ended there.
            broken = self._close(step.key)
            if broken is not None:
                return broken
            call = None
        if call is None:
            call = self._new(step.call_id, step.name, step.scope)
            call.cost += _key_cost(step.key)
            self._keep(step.key, call)
            return self._over(step.key, call)
        # Named again (some servers repeat the id and name on every delta).
        self._name(call, step)
        return self._over(step.key, call)

    def _name(self, call: ToolCall, step: ToolStep) -> None:
        """An open call gets the id and name it did not have yet: they are held too."""
        if step.call_id and not call.call_id:
            call.call_id = step.call_id
            call.cost += len(step.call_id)
            self._held += len(step.call_id)
        if step.name and not call.name:
            call.name = step.name
            call.cost += len(step.name)
            self._held += len(step.name)

    def _arguments(self, step: ToolStep) -> ToolCall | None:
        call = self._open.get(step.key)
        if call is None:  # arguments before (or without) a step that names the call
            broken = self._opened(step)
            if broken is not None:
                return broken
            call = self._open[step.key]
        call.size += step.size
        self._held += step.size
        parts = call.parts
        if step.text is None:
            call.parts = None  # counted only: the dialect judges them at the close
        elif parts is not None:
            parts.append(step.text)
            if len(parts) > FRAGMENTS:
                _fold(parts)
        if step.depth > self._depth:  # a value nested past the limit: refused now
            self._drop(step.key)
            return self._too_deep(call)
        return self._over(step.key, call)

    def _closed(self, step: ToolStep) -> ToolCall | None:
        key = step.key
        call = self._open.get(key)
        if call is None:
            if not step.whole:
                return None  # closed already, or never a call (a text block's stop)
            call = self._new(step.call_id, step.name, 0)
            call.size = step.size
            if step.size > self._limit:
                return self._end(call, TOO_LARGE)
        else:
            self._name(call, step)
            self._drop(key)
            if step.text is not None and step.size > self._limit:
                return self._end(call, TOO_LARGE)
        if step.depth > self._depth and not step.reported:
            return self._too_deep(call)
        broken = self._check(call, step.text, step.verdict)
        return None if step.reported else broken

    def _finished(self, scope: int) -> ToolCall | None:
        calls = self._scopes.get(scope)
        if calls is None:
            return None  # no call open there: nothing else is looked at
        for key in list(calls):
            broken = self._close(key)
            if broken is not None:
                return broken
        return None

    def _close(self, key: object) -> ToolCall | None:
        """A call closes with the stream's end or its scope's: its fragments decide."""
        return self._check(self._drop(key), None, None)

    def _check(
        self, call: ToolCall, arguments: str | None, verdict: bool | None
    ) -> ToolCall | None:
        if verdict is None:
            parts = call.parts
            if arguments is None and parts is None:
                # Its fragments were only counted, for the dialect to judge at
                # a close of its own, and none came: it never said it was whole.
                return self._end(call, INVALID)
            if arguments is None:
                assert parts is not None
                arguments = parts[0] if len(parts) == 1 else "".join(parts)
            if nests_deeper(arguments, self._depth):
                return self._too_deep(call)
            verdict = is_arguments(arguments)
        return self._end(call, COMPLETE if verdict else INVALID)

    def _whole_so_far(self, call: ToolCall) -> bool:
        """Whether an open call's arguments so far are a whole object (none is not)."""
        parts = call.parts
        if not parts:
            return False  # none yet, or only counted: nothing says they are whole
        arguments = parts[0] if len(parts) == 1 else "".join(parts)
        if arguments.isspace() or nests_deeper(arguments, self._depth):
            return False
        return is_arguments(arguments)

    def _end(self, call: ToolCall, state: str) -> ToolCall | None:
        call.parts = None
        call.end_state = state
        self._counts[state] = self._counts.get(state, 0) + 1
        return None if state == COMPLETE else call

    def _too_deep(self, call: ToolCall) -> ToolCall | None:
        call.nested = True
        return self._end(call, TOO_LARGE)

    def _over(self, key: object, call: ToolCall) -> ToolCall | None:
        if self._held <= self._limit:
            return None
        # The call that went over ends here, and the stream with it: what the
        # other open calls hold goes with the relay.
        self._drop(key)
        return self._end(call, TOO_LARGE)


def _key_cost(key: object) -> int:
    """What keeping a call's key costs: an upstream's id is as long as it likes."""
    if isinstance(key, str):
        return len(key)
    if isinstance(key, int):
        return key.bit_length() >> 3  # a JSON integer may have thousands of digits
    if isinstance(key, tuple):
        return sum(_key_cost(part) for part in key)
    return 0


def _fold(parts: list[str]) -> None:
    """Join the newest fragments while the one before is no more than twice as long.

    The lengths then fall by half from the oldest to the newest: a few dozen
    strings at most, and each byte copied a few times over, however small
    the fragments.
    """
    while len(parts) > 1 and len(parts[-2]) <= 2 * len(parts[-1]):
        last = parts.pop()
        parts[-1] += last


def _no_constants(name: str) -> Any:
    raise ValueError(name)  # NaN and Infinity: no JSON a client's parser takes


def is_arguments(text: str) -> bool:
    """Whether ``text`` is a call's whole arguments: a JSON object, or nothing at all.

    (Its depth is :func:`nests_deeper`'s to judge, first: the parser recurses.)
    """
    if not text or text.isspace():
        return True
    try:
        value = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError):  # nested past the parser: not checkable, not whole
        return False
    return isinstance(value, dict)


# A JSON string, escapes and all (unrolled: no alternation per character), and
# what is neither an opening nor a closing bracket.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
# Brackets as steps of depth, one signed byte each: +1 opens, -1 (0xff) closes.
_DEPTH_STEPS = str.maketrans({"{": "\x01", "[": "\x01", "}": "\xff", "]": "\xff"})


def nests_deeper(text: str, limit: int) -> bool:
    """Whether the JSON ``text`` nests more than ``limit`` objects and arrays deep.

    No parse and no recursion: strings (whose brackets do not nest) are taken
    out, and the depth is the running sum of what is left, each bracket one
    step. Text with no more opening brackets than ``limit`` cannot be deeper,
    which two counts tell: most arguments stop there.
    """
    if text.count("{") + text.count("[") <= limit:
        return False
    brackets = _NOT_BRACKETS.sub("", _STRING.sub("", text))
    steps = array("b", brackets.translate(_DEPTH_STEPS).encode("latin-1"))
    return max(accumulate(steps), default=0) > limit


def value_depth(value: object, ceiling: int = DEEPEST) -> int:
    """Levels of objects and arrays in a parsed JSON ``value``, counted up to ``ceiling + 1``.

    Level by level, never by recursion: past ``ceiling`` it stops, and the
    value must not be written again (``json.dumps`` recurses).
    """
    depth = 0
    level: list[Any] = [value]
    while True:
        nested = [v for v in level if isinstance(v, dict | list)]
        if not nested:
            return depth
        depth += 1
        if depth > ceiling:
            return depth
        level = [
            item
            for holder in nested
            for item in (holder.values() if isinstance(holder, dict) else holder)
        ]
