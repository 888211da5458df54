"""What every dialect provides, and the small value it hands the relay per event.

A dialect is one wire format of streamed LLM output. Given a decoded event
it says whether the event carries content (and which text, for the token
estimate), whether the provider reported its usage, whether the event is
the stream's terminal event, and whether the provider itself reported an
error in-band. It also writes the error event that the format's own clients
treat as an error, for the endings the relay synthesizes, and, for output
filters, says where an event's text lies in its data so that the text can be
read and replaced with everything else of the event left as it was.

Dialects are instantiated once per stream, so a format whose terminal event
is optional (NDJSON) can learn from the stream which variant it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal

from streamwarden.core.dialects.raw import RawText as RawText
from streamwarden.core.filters import MAIN_TEXT as MAIN_TEXT
from streamwarden.core.filters import REDACTED, TextKey
from streamwarden.core.sse import Event
from streamwarden.core.toolcalls import ToolStep

#: How a stream is cut into events: SSE blocks, single lines, or the
#: messages of a transport that frames them itself (a WebSocket's: each
#: message is one event, its data).
Framing = Literal["sse", "lines", "messages"]


# Its own __init__, for the cost of building one per event (see sse.Event);
# the shared ones below are never changed.
@dataclass(init=False, slots=True)
class Observation:
    """What one event means to the relay.

    ``text`` is the content the event carries for a reader (answer text,
    reasoning text, tool-call argument fragments), used to estimate tokens
    when the provider reports none. ``output_tokens`` is the provider's own
    count of generated tokens so far, when the event carries it, and
    ``input_tokens`` its count of the prompt's.
    """

    text: str
    output_tokens: int | None
    #: The provider's count of the prompt's tokens, when the event carries it.
    input_tokens: int | None
    terminal: bool
    error: bool
    #: The event only reports usage (OpenAI's ``"choices": []`` chunk): the
    #: one a client that did not ask for usage must not see.
    usage_only: bool
    #: Part of ``text`` is not the stream's main text (tool-call arguments,
    #: another choice's or candidate's text when a request asked for several):
    #: output filters read such an event themselves (:meth:`Dialect.filter_texts`),
    #: each call's arguments and each other choice's text a text of its own;
    #: for any other event ``text`` is exactly the text they read, in the
    #: same order, all of it the stream's main text.
    tools: bool
    #: What the event says of tool calls (one opens, its arguments grow, it
    #: closes), in order, for the relay's :class:`~streamwarden.core.toolcalls.ToolCalls`;
    #: ``None``: nothing (most events).
    calls: list[ToolStep] | None

    def __init__(
        self,
        text: str = "",
        output_tokens: int | None = None,
        input_tokens: int | None = None,
        terminal: bool = False,
        error: bool = False,
        usage_only: bool = False,
        tools: bool = False,
        calls: list[ToolStep] | None = None,
    ) -> None:
        self.text = text
        self.output_tokens = output_tokens
        self.input_tokens = input_tokens
        self.terminal = terminal
        self.error = error
        self.usage_only = usage_only
        self.tools = tools
        self.calls = calls


#: The observation for events that mean nothing to the relay (pings,
#: lifecycle events, unparsable data). Shared, so the hot path allocates
#: nothing for them.
NOTHING: Final = Observation()
TERMINAL: Final = Observation(terminal=True)
UPSTREAM_ERROR: Final = Observation(error=True)


#: A place of text in an event's decoded data: ``container[key]`` is the string.
Place = tuple[Any, Any]
#: A place of text, and which of the stream's texts its string continues
#: (:data:`~streamwarden.core.filters.MAIN_TEXT`, or one tool call's arguments).
TextPlace = tuple[Any, Any, TextKey]


class WithTokens:
    """A text place whose rewrite takes the token log-probabilities beside it along.

    Some events carry, beside a text, its tokens (OpenAI's ``logprobs``,
    Gemini's ``logprobsResult``: each token's text, and the likeliest
    alternatives'). A redacted text whose tokens stayed would still spell
    what was cut, so when the text changes the holder's token lists are
    emptied: the simplest rewrite that carries nothing of the match. Texts
    left unchanged keep theirs.
    """

    __slots__ = ("_container", "_field", "_holder")

    def __init__(self, container: Any, holder: dict[str, Any], field: str) -> None:
        self._container = container
        self._holder = holder
        self._field = field

    def __getitem__(self, key: Any) -> Any:
        return self._container[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        if value != self._container[key]:
            tokens = self._holder.get(self._field)
            if isinstance(tokens, list):  # Responses: the list of tokens
                self._holder[self._field] = []
            elif isinstance(tokens, dict):  # lists by kind (content, refusal; chosen, top)
                for kind, found in tokens.items():
                    if isinstance(found, list):
                        tokens[kind] = []
        self._container[key] = value


def token_place(container: Any, key: Any, holder: dict[str, Any], field: str = "logprobs") -> Place:
    """``container[key]``, as a place that drops ``holder[field]``'s tokens when rewritten."""
    if holder.get(field):
        return (WithTokens(container, holder, field), key)
    return (container, key)


class Dialect:
    """Base class: one subclass per wire format."""

    __slots__ = ("expects_terminal",)

    #: The dialect's name in configuration, metrics and logs.
    name: ClassVar[str] = "generic"
    #: How the stream is cut into frames: SSE blocks or single lines.
    framing: ClassVar[Framing] = "sse"
    #: Human-readable name of the terminal event, for error messages.
    terminal_event: ClassVar[str] = "its terminal event"
    #: Whether the format's official clients raise on :meth:`error_event`.
    #: Where they do not (a format whose clients skip events they do not
    #: know, or an unknown format), a stream that ends in an error also ends
    #: the client's body abnormally (no terminating chunk: the connection is
    #: closed), as a broken upstream does directly: a failure is never less
    #: visible through streamwarden than without it.
    error_event_raises: ClassVar[bool] = True

    def __init__(self) -> None:
        #: Whether a clean end of stream without the terminal event is a
        #: truncation. False for formats with no terminal event.
        self.expects_terminal = True

    def inspect(self, event: Event) -> Observation:
        """Classify one decoded event."""
        raise NotImplementedError

    #: Tool calls arrive whole, in one event (Gemini's ``functionCall``): a
    #: cut inside that event is a cut inside the call (:meth:`call_in_cut`).
    calls_arrive_whole: ClassVar[bool] = False

    def call_in_cut(self, block: bytes) -> tuple[str, str, int] | None:
        """The tool call (id, name, bytes of it received) in an event the stream was cut inside.

        Only for a dialect whose :attr:`calls_arrive_whole`; ``block`` is
        the unfinished event's raw bytes.
        """
        return None

    def error_event(self, code: str, message: str) -> bytes:
        """The bytes of an error event that this format's clients raise on."""
        raise NotImplementedError

    @classmethod
    def sniff(cls, event: Event) -> bool:
        """Whether the first data event of an unknown stream looks like this format."""
        return False

    # -- output filters: one walker per format finds the places of text ------

    def text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[TextPlace]:
        """Where the text a reader sees lies in ``root`` (the event's data as loaded).

        Each place says which of the stream's texts it continues: the main
        text, or the arguments of one tool call (its fragments may
        interleave with another call's). Tool-call argument fragments are
        included with ``tool_arguments``. The default: the whole data is
        the main text.
        """
        if isinstance(root, RawText | DecodedJSON) and root[0]:
            return [(root, 0, MAIN_TEXT)]
        return []

    def reads_own_texts(self, event: Event) -> bool:
        """Whether the filters must read ``event`` with :meth:`filter_texts` though
        :attr:`Observation.tools` is false: its observed text is not the text they read."""
        return False

    def load_data(self, event: Event, loads: Callable[[str], Any] | None = None) -> Any:
        """The event's data as the text walker reads it (JSON by default)."""
        obj = (loads or load_json)(event.data)
        return obj if obj is not None else RawText([event.data])

    def dump_data(self, event: Event, root: Any) -> str:
        """The event's data again, from ``root`` as :meth:`load_data` gave it."""
        if isinstance(root, RawText):
            return root[0]
        return dump_json(root.value if isinstance(root, DecodedJSON) else root)

    def filter_text(self, event: Event, tool_arguments: bool) -> list[str]:
        """The event's text parts, in order, for the output filters (none: no text)."""
        root = self.load_data(event)
        return [c[k] for c, k, _ in self.text_places(root, event, tool_arguments)]

    def filter_texts(self, event: Event, tool_arguments: bool) -> list[tuple[TextKey, str]]:
        """As :meth:`filter_text`, each part with the text it continues."""
        root = self.load_data(event)
        return [(text, c[k]) for c, k, text in self.text_places(root, event, tool_arguments)]

    # Some formats send, after a text's deltas, the whole text again in a
    # summary event (the Responses API's ``*.done`` events and its final
    # response). Such a text is complete, not more of the stream's text: the
    # filters read each one on its own, in one go, and it is rewritten with
    # what they decide, so that it says what the redacted deltas said.

    def repeats_text(self, event: Event) -> bool:
        """Whether ``event`` may carry a whole text again (a cheap check, by its name)."""
        return False

    #: Marks, in an event's raw data, of tool-call arguments: text that output
    #: filters read only with ``output_filter_tool_arguments``.
    tool_marks: ClassVar[tuple[str, ...]] = ()

    def carries_tool_arguments(self, event: Event) -> bool:
        """Whether ``event`` may hold tool-call arguments (a cheap check on its raw data).

        An event the dialect reads no text from is still searched by the
        filters (it may hold text a client shows), except for the tool
        arguments they were not asked to read.
        """
        data = event.data
        return any(mark in data for mark in self.tool_marks)

    def whole_text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[Place]:
        """Where ``root`` (the data of an event that :meth:`repeats_text`) holds whole texts."""
        return []

    def whole_texts(self, event: Event, tool_arguments: bool) -> tuple[Any, list[Place]]:
        """The event's data, for :meth:`dump_data`, and the places of its whole texts.

        Parsed with the standard library, which keeps every number exactly as
        it was, since the data is dumped again when a text changes.
        """
        root = self.load_data(event, _load_json_stdlib)
        return root, self.whole_text_places(root, event, tool_arguments)

    def rewrite_text(self, event: Event, tool_arguments: bool, parts: list[str]) -> str:
        """The event's data with its text parts replaced by ``parts``, all else unchanged.

        Parsed again with the standard library, which keeps every number
        exactly as it was (see :func:`_load_json_fast`).
        """
        root = self.load_data(event, _load_json_stdlib)
        for (container, key, _), part in zip(
            self.text_places(root, event, tool_arguments), parts, strict=True
        ):
            container[key] = part
        return self.dump_data(event, root)


class ArgumentsText:
    """Tool arguments given as an object, as the filters read them: their compact JSON text.

    A rewrite with what the filters left is parsed back when it is JSON
    that dumps to exactly that text (a match within strings: each becomes
    ``[redacted]`` where the match was); any other rewrite (a match in a
    number, or across the JSON's own punctuation) replaces the whole
    arguments with the string ``[redacted]``: nothing of the match can be
    left in a value, a key or a number that way.
    """

    __slots__ = ("_holder",)

    def __init__(self, holder: dict[str, Any]) -> None:
        self._holder = holder

    def __getitem__(self, field: str) -> str:
        return dump_json(self._holder[field])

    def __setitem__(self, field: str, text: str) -> None:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            value = REDACTED
        else:
            if dump_json(value) != text:
                value = REDACTED
        self._holder[field] = value


class DecodedJSON:
    """Data that is JSON written with escapes, read as its text: ``root[0]``.

    A reader sees what the JSON says, not how it is written: ``\\u0073k-``
    is ``sk-``, ``\\/`` is ``/``. So the filters read such data as its
    compact JSON with no escape but those JSON needs (quotes, backslashes,
    control characters): keys, numbers and strings alike, in their order,
    the way the raw data reads when it has no escape. A rewrite with what
    the filters left is taken back when it is JSON that is written exactly
    so (a match within a string); any other (across the JSON's own
    punctuation, in a number) raises ``ValueError``: the event cannot be
    written again, and the stream fails closed.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __getitem__(self, key: int) -> str:
        return dump_json(self.value)

    def __setitem__(self, key: int, text: str) -> None:
        try:
            value = json.loads(text)
        except RecursionError:
            raise ValueError("nested too deep to read back") from None
        if dump_json(value) != text:
            raise ValueError("a cut across the JSON's own punctuation")
        self.value = value


def read_as_text(data: str, loads: Callable[[str], Any] | None = None) -> RawText | DecodedJSON:
    """Data that is its own text (no format the dialect knows): as it is, or as JSON decoded.

    Only data with an escape in it is parsed: any other reads the same
    either way, and is left as it came.
    """
    if "\\" in data and data.lstrip()[:1] in ("{", "[", '"'):
        value = (loads or _load_json_stdlib)(data)
        if value is not None:
            return DecodedJSON(value)
    return RawText([data])


def _load_json_stdlib(data: str) -> Any:
    """Parse an event's JSON data, or return ``None`` when it is not JSON."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # nested deeper than the parser goes: not readable
        return None


def _load_json_fast(data: str) -> Any:
    """As :func:`_load_json_stdlib`, with orjson first.

    Parsing each event's JSON is the largest share of the relay's own cost
    per event, and orjson does it in about a third of the time. What orjson
    refuses and ``json`` accepts (``NaN``, lone surrogates) goes to
    ``json``. The two differ on one thing: orjson reads an integer past 64
    bits as a float, where ``json`` keeps it exact. No field a dialect reads
    is a number that large (a token count past 2**63 is not a count:
    :func:`as_int` takes it from neither), so the observations are the same.
    A scan for long digit runs to send such text to ``json`` cost 2 µs per
    event, more than orjson's whole parse, and every stream whose ids carry
    a nanosecond timestamp paid for the slow path too.
    """
    try:
        return _orjson_loads(data)
    except ValueError:
        return _load_json_stdlib(data)


try:  # the ``fast`` extra
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover - depends on what is installed
    load_json = _load_json_stdlib
else:
    load_json = _load_json_fast


def dump_json(value: object) -> str:
    """Compact JSON that keeps non-ASCII text readable, as providers send it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sse_block(data: str, event: str | None = None) -> bytes:
    """One SSE block with a single-line data field (``data`` must not contain newlines)."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {data}\n\n".encode()


#: Counts past this are not counts (and orjson would read them as floats).
_MAX_COUNT = 2**63 - 1


def as_int(value: object) -> int | None:
    """``value`` if it is an integer token count (bools excluded), else ``None``."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT:
        return value
    return None
