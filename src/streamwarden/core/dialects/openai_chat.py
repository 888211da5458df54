"""OpenAI Chat Completions streaming (and every server that copies it: vLLM, TGI, llama.cpp).

Events carry no ``event:`` field; each ``data:`` is a ``chat.completion.chunk``
whose ``choices[].delta`` holds content, a refusal, reasoning, a spoken
answer's transcript (``audio.transcript``) or tool-call argument fragments.
The stream ends with ``data: [DONE]``. Usage arrives in a last
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

Mistral's API streams the same chunks, with two finish reasons of its own
(``mistralai``'s ``CompletionResponseStreamChoiceFinishReason`` and
``ChatCompletionChoice``): ``model_length``, the answer reached the model's
context length, is an ending like ``length`` (complete as the upstream
sent it, metered by the usage of its last chunk; a call it cuts is broken),
and ``error``, the generation failed, is the upstream's own in-band error:
the stream ends ``upstream_error``. Both arrive in a chunk with a finish
reason, which the plain-chunk scan never takes, so the check costs the
plain path nothing.

openai-python raises ``APIError`` on any event whose JSON data has a truthy
``error`` object, so that is the shape of the synthesized error. mistralai
has no error event in its chat stream: it validates every event as a chunk
(``mistralai/client/chat.py`` ``stream_async`` → ``unmarshal_json_response``),
so ours is one it cannot read and it raises ``ResponseValidationError``
(a ``MistralError``, the event in its ``body``): never silent, though not
an API error, and nothing else it reads can be one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

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
    token_place,
)
from streamwarden.core.filters import TextKey
from streamwarden.core.sse import Event
from streamwarden.core.toolcalls import ToolStep, arguments_step, finish_step, open_step

if TYPE_CHECKING:
    # A machine integer in the compiled build (a plain int otherwise): the
    # scan of a string's characters keeps its index unboxed.
    from mypy_extensions import i64

_DELTA_TEXT_FIELDS: Final = frozenset({"content", "reasoning_content", "reasoning", "refusal"})


class OpenAIChat(Dialect):
    __slots__ = ("_between", "_close", "_head", "_members", "_misses", "_skip", "_tail")

    def __init__(self) -> None:
        super().__init__()
        #: The last plain chunk up to its content, from the content's closing
        #: quote to the end, and from there to the choice's close (see
        #: :meth:`plain_text`): within a stream most chunks repeat them.
        self._head = ""
        self._tail = ""
        self._close = ""
        #: The members after the choices up to the last one's string value
        #: (OpenAI's ``obfuscation``, which changes chunk by chunk).
        self._members = ""
        #: The two above as one (``""`` while there are no such members): a
        #: chunk whose last value changes (``obfuscation``) is checked up to
        #: that value with one compare, not two.
        self._between = ""
        #: Chunks in a row not read the cheap way, and how many to leave to
        #: the parse before trying again: a stream whose chunks change
        #: where the cache looks pays for a failed try once in a while only.
        self._misses = 0
        self._skip = 0

    name = "openai-chat"
    tool_marks = ('"tool_calls"', '"function_call"')
    terminal_event = "data: [DONE]"

    def inspect(self, event: Event) -> Observation:
        data = event.data
        if data.startswith("[DONE]"):
            return TERMINAL
        text = self.plain_text(data)
        if text is not None:
            return Observation(text) if text else NOTHING
        return inspect_parsed(data)

    def plain_text(self, data: str) -> str | None:
        """The content of a chunk of the plain shape (``""``: none), or ``None``: parse it.

        What the stream's last plain chunk had before and after its content
        was checked then; a chunk that repeats it needs only its content
        checked (a stream's id, model and fingerprint stay the same; an
        OpenAI chunk's ``obfuscation`` at the end changes, and is checked).
        """
        head = self._head
        if head and data.startswith(head):
            start = len(head)
            cheap = True
        elif self._skip:
            self._skip -= 1
            return None
        else:
            cheap = False
            start = _plain_head(data)
            if start >= 0:
                self._head = data[:start]
        end = -1 if start < 0 else _string_end(data, start)
        if end >= 0 and not self._tail_plain(data, end):
            end = -1
        if end >= 0 and cheap:
            self._misses = 0
        else:
            self._misses += 1
            if self._misses >= 3:
                self._misses = 0
                self._skip = 63
        return None if end < 0 else data[start:end]

    def _tail_plain(self, data: str, end: int) -> bool:
        """From the content's closing quote at ``end`` on, the chunk is plain."""
        n = len(data)
        tail = self._tail
        if len(tail) == n - end and data.endswith(tail):
            return True
        # A close that matches as a prefix is the close: no close is the
        # prefix of another (each ends at the first "}]", and no tail holds
        # one), so _between stands for the two checks below.
        between = self._between
        if between and data[end : end + len(between)] == between:
            return _string_end(data, end + len(between)) == n - 2 and _char(data, n - 1, 0x7D)
        close = self._close
        if close and data[end : end + len(close)] == close:
            pos = end + len(close)
        else:
            pos = _choice_close(data, end)
            if pos < 0:
                return False
            close = self._close = data[end:pos]
        members = self._members
        if members and data[pos : pos + len(members)] == members:
            # Up to the last member's string value as before: that value, then the brace.
            self._between = close + members
            return _string_end(data, pos + len(members)) == n - 2 and _char(data, n - 1, 0x7D)
        if not _plain_members(data, pos):
            return False
        last = data.rfind('"', pos, n - 2) if _char(data, n - 2, 0x22) else -1
        members = self._members = data[pos : last + 1] if last >= 0 else ""
        self._between = close + members if members else ""
        self._tail = data[end:]
        return True

    def error_event(self, code: str, message: str) -> bytes:
        error = {"message": message, "type": "stream_error", "code": code, "param": None}
        return sse_block(dump_json({"error": error}))

    def text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[TextPlace]:
        # The same fields as _choices_text, in the same order. A choice's
        # logprobs spell its tokens: a rewritten text takes them along. Each
        # tool call's arguments are a text of their own (calls of one choice
        # may interleave), keyed as the call tracker keys the call.
        choices = root.get("choices") if isinstance(root, dict) else None
        if not isinstance(choices, list):
            return []
        places: list[TextPlace] = []
        for position, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            scope = _index(choice, position)
            # Each choice's text is a text of its own (n > 1): one read across
            # interleaved choices would miss a key split around another's delta.
            key: TextKey = MAIN_TEXT if scope == 0 else ("choice", scope)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                for field, value in delta.items():
                    if field in _DELTA_TEXT_FIELDS and isinstance(value, str):
                        places.append((*token_place(delta, field, choice), key))
                audio = delta.get("audio")
                if isinstance(audio, dict) and isinstance(audio.get("transcript"), str):
                    places.append((*token_place(audio, "transcript", choice), key))
                calls = delta.get("tool_calls")
                if tool_arguments and isinstance(calls, list):
                    for at, call in enumerate(calls):
                        function = call.get("function") if isinstance(call, dict) else None
                        if isinstance(function, dict) and isinstance(
                            function.get("arguments"), str
                        ):
                            assert isinstance(call, dict)
                            call_key = ("tool_call", scope, _index(call, at))
                            places.append((*token_place(function, "arguments", choice), call_key))
            if isinstance(choice.get("text"), str):
                places.append((*token_place(choice, "text", choice), key))
        return places

    @classmethod
    def sniff(cls, event: Event) -> bool:
        if event.event != "message":
            return False
        obj = load_json(event.data)
        return isinstance(obj, dict) and "choices" in obj


def inspect_parsed(data: str) -> Observation:
    """What a chunk means, read from its parsed JSON: the rule for every chunk."""
    obj = load_json(data)
    if not isinstance(obj, dict):
        return NOTHING
    if obj.get("error"):
        return UPSTREAM_ERROR
    choices = obj.get("choices")
    text, tools, calls, failed = _choices_text(choices)
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
    return Observation(
        text, tokens, prompt, error=failed, usage_only=usage_only, tools=tools, calls=calls
    )


# -- the plain chunk ----------------------------------------------------------
#
# Nearly every chunk of a stream is one shape: one choice whose delta is a
# piece of content, nothing else that means anything. Parsing its JSON (a
# dictionary per object, a string per value) was half of the sidecar's own
# instructions per event; :meth:`OpenAIChat.plain_text` reads that shape
# with a scan instead. It takes a chunk only when :func:`inspect_parsed`
# would read exactly that text from it: the JSON is valid (no whitespace,
# no escapes, no control characters, integers in JSON's own form), and its
# members are the plain ones below, ``choices`` once.
# Anything else, a legal chunk or not, goes to :func:`inspect_parsed`; the
# property test (``tests/core/test_openai_plain_chunk.py``) holds the two to the
# same observation.

#: What may follow a choice's delta (each at most once, in any order): nulls only.
_CHOICE_TAILS: Final = (',"logprobs":null', ',"finish_reason":null', ',"stop_reason":null')


def _plain_head(data: str) -> int:
    """Where the content's string starts, past ``{`` and plain members up to ``"content":"``.

    ``-1``: the chunk does not start as a plain chunk does.
    """
    if not _char(data, 0, 0x7B):  # {
        return -1
    pos = 1
    while True:
        after = _plain_member(data, pos)
        if after == _CHOICES:
            return _choice_head(data, pos + 10)
        if after < 0 or not _char(data, after, 0x2C):  # a comma
            return -1
        pos = after + 1


def _choice_close(data: str, end: int) -> int:
    """Past the choice's close after the content's quote at ``end``: ``}``, null tails, ``}]``."""
    pos = end + 1
    if not _char(data, pos, 0x7D):
        return -1
    pos += 1
    seen = 0  # the tails read so far, one bit each: each may come once, in any order
    while not _at(data, "}]", pos):
        for bit, tail in enumerate(_CHOICE_TAILS):
            if not seen & (1 << bit) and _at(data, tail, pos):
                seen |= 1 << bit
                pos += len(tail)
                break
        else:
            return -1
    return pos + 2


def _plain_members(data: str, pos: int) -> bool:
    """From ``pos`` (past the choices) on: plain members, then the closing ``}``."""
    n = len(data)
    while pos != n - 1:
        if not _char(data, pos, 0x2C):
            return False
        pos = _plain_member(data, pos + 1)
        if pos < 0:  # not plain, or "choices" twice (which counts is the parser's business)
            return False
    return _char(data, pos, 0x7D)


def _choice_head(data: str, pos: int) -> int:
    """Past ``[{"index":0,"delta":{`` and an optional ``"role":"assistant",`` to ``"content":"``."""
    # Choice 0 only: another choice's text (n > 1) is a text of its own,
    # which the parsed reading keys for the filters.
    if not _at(data, '[{"index":0,"delta":{', pos):
        return -1
    pos += 21
    if _at(data, '"role":"assistant",', pos):
        pos += 19
    return pos + 11 if _at(data, '"content":"', pos) else -1


#: :func:`_plain_member` found ``"choices":`` (its value starts 10 past the quote).
_CHOICES: Final = -2


def _plain_member(data: str, pos: int) -> int:
    """Past the member at ``pos`` (its name's quote) if it means nothing to the relay.

    ``-1``: it may mean something; :data:`_CHOICES`: it is the choices. The
    parsed reading looks at ``choices``, ``usage`` and ``error`` only: a
    null means nothing whoever's it is, and a string or an integer nothing
    but in those two. Names are compared in place, not cut out.
    """
    if _at(data, '"choices":', pos):
        return _CHOICES
    if _at(data, '"usage":', pos) or _at(data, '"error":', pos):
        # (both names are five letters: the value starts 8 past the quote)
        return pos + 12 if _at(data, "null", pos + 8) else -1
    if not _char(data, pos, 0x22):
        return -1
    end = _string_end(data, pos + 1)
    if end < 0 or not _char(data, end + 1, 0x3A):
        return -1
    pos = end + 2
    if _at(data, "null", pos):
        return pos + 4
    if _char(data, pos, 0x22):
        end = _string_end(data, pos + 1)
        return -1 if end < 0 else end + 1
    return _integer(data, pos)


def _string_end(data: str, start: int) -> int:
    """The closing quote of a JSON string with no escapes, its first character at ``start``.

    ``-1`` at a backslash (an escape: the parser decodes those) or a control
    character (JSON refuses them raw), or if the string never closes.
    """
    n: i64 = len(data)
    pos: i64 = start
    while pos < n:
        c: i64 = ord(data[pos])
        if c == 0x22:
            return pos
        if c < 0x20 or c == 0x5C:
            return -1
        pos += 1
    return -1


def _char(data: str, pos: int, code: int) -> bool:
    """The character at ``pos`` is ``code`` (read in place: ``data[pos]`` would be a new string)."""
    return pos < len(data) and ord(data[pos]) == code


def _at(data: str, literal: str, pos: int) -> bool:
    """``literal`` is at ``pos`` of ``data`` (``startswith`` at an offset is a method call,
    and ``find`` widens an ASCII literal for every wide string: both cost more)."""
    size = len(literal)
    if pos < 0 or pos + size > len(data):
        return False
    if size > 8:  # one copy and one compare beat a compare per character
        return data[pos : pos + size] == literal
    return all(ord(data[pos + i]) == ord(literal[i]) for i in range(size))


def _integer(data: str, pos: int) -> int:
    """Past the JSON integer at ``pos`` (``-1``: none); a fraction or exponent stops it short.

    At most 19 digits: a longer run is a number the parsers may refuse
    (``json`` past 4,300 digits, orjson past a double's range), which the
    parse must decide.
    """
    n = len(data)
    if pos < n and data[pos] == "-":
        pos += 1
    if pos >= n:
        return -1
    first = ord(data[pos])
    if first == 0x30:  # "0" stands alone
        return pos + 1
    if not 0x31 <= first <= 0x39:
        return -1
    last = min(n, pos + 19)
    pos += 1
    while pos < last and 0x30 <= ord(data[pos]) <= 0x39:
        pos += 1
    if pos < n and 0x30 <= ord(data[pos]) <= 0x39:
        return -1  # a twentieth digit
    return pos


def _choices_text(choices: Any) -> tuple[str, bool, list[ToolStep] | None, bool]:
    """The text of the choices, whether tool-call arguments are part of it, the calls' steps,
    and whether a choice finished with Mistral's ``error``."""
    if not isinstance(choices, list):
        return "", False, None, False
    parts: list[str] = []
    tools = False
    failed = False
    steps: list[ToolStep] | None = None
    for position, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        had = len(parts)
        delta = choice.get("delta")
        if isinstance(delta, dict):
            # A delta has one or two keys: look at those, not at every name.
            for field, value in delta.items():
                if field in _DELTA_TEXT_FIELDS and isinstance(value, str):
                    parts.append(value)
            audio = delta.get("audio")  # a spoken answer: its transcript is its text
            if isinstance(audio, dict):
                transcript = audio.get("transcript")
                if isinstance(transcript, str):
                    parts.append(transcript)
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
        if len(parts) > had and _index(choice, position) != 0:
            tools = True  # another choice's text (n > 1): the filters read it keyed
        reason = choice.get("finish_reason")
        if reason:
            steps = steps if steps is not None else []
            steps.append(finish_step(_index(choice, position)))
            failed = failed or reason == "error"
    return (parts[0] if len(parts) == 1 else "".join(parts)), tools, steps, failed


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
