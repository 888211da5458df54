"""Streaming output filters: find what must never reach a reader, across events, with no I/O.

A route's ``output_filters`` (literal strings, regular expressions of a
bounded match length, the built-in ``secrets`` and ``cards`` sets) are
compiled once into a :class:`FilterSet`. Each stream gets a
:class:`Holdback`, which the relay feeds, event by event, with the text the
dialect extracts from it. The technique is the one inference engines use
for stop sequences: the text is one string across events and reads, and
only a suffix that could still be the start of a match is held back; the
moment it is proven harmless (the next character rules the match out) it
is released, and at the end of the stream whatever is left is decided on
the text as it stands. A hold-back is therefore bounded by the longest
pattern (``max_length`` characters), and nothing waits when no prefix is
pending.

What is held is whole events, never part of one: an event whose text ends
in a possible prefix waits, with every event after it, until the prefix is
resolved; then they leave in their order, each unchanged except where a
match lies in its text. So every byte of the stream around a match, text
and framing alike, is the upstream's own, and no client ever sees an event
cut in two. A redacted match becomes ``[redacted]`` in the event where it
begins; its characters in later events are removed. A ``block`` match
releases the events before the one it begins in and ends the stream.

Matching is done by the ``regex`` module, whose partial matches say
exactly whether the end of the text could begin a match. A cheap prefilter
(the standard library's ``re``, on the first characters every match of the
built-in and literal patterns begins with) skips that search for text that
cannot begin any of them, which is nearly all of it.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Final, Generic, Literal, TypeVar

import regex

__all__ = [
    "BUILTIN_SETS",
    "MAIN_TEXT",
    "MAX_MATCH_LENGTH",
    "REDACTED",
    "FilterError",
    "FilterRule",
    "FilterSet",
    "FilterStats",
    "Holdback",
    "Released",
    "TextKey",
    "WholeText",
    "apply_cuts",
    "compile_filters",
    "luhn_valid",
]

#: What a redacted match is replaced by.
REDACTED = "[redacted]"
#: The longest match any filter may span, in characters: the bound of a hold-back.
MAX_MATCH_LENGTH = 4096
#: Characters kept before the undecided text, for look-behinds (``\b``, ``(?<!...)``).
_CONTEXT = 32
#: Hold-back times kept per stream for the histogram; a stream holding more often
#: still counts its bytes, and its first holds stand for the rest.
_MAX_HOLD_SAMPLES = 10_000

Action = Literal["redact", "block"]


class FilterError(ValueError):
    """A filter cannot be compiled; the message says why, for the config error."""


@dataclass(frozen=True, slots=True)
class FilterRule:
    """One configured filter, as the config gives it (validated by :func:`compile_filters`)."""

    kind: Literal["builtin", "literal", "regex"]
    #: The built-in set's name, the literal text, or the pattern.
    value: str
    action: Action
    #: The name in metrics and logs (never the literal or pattern itself).
    name: str
    #: The longest match, for a regex whose own length is unbounded.
    max_length: int | None = None


@dataclass(frozen=True, slots=True)
class _Pattern:
    """One pattern of a filter: what the regex module searches for."""

    source: str
    #: Every match of ``source`` begins with one of these strings (``None``:
    #: not known, as for a configured regex)...
    heads: tuple[str, ...] | None
    #: ...not preceded by a character of this class (a ``re`` character set).
    not_after: str | None = None
    #: A check on the matched text (Luhn for card numbers).
    luhn: bool = False


# Token shapes are matched only where they begin a word: "tasks-" is not "sk-",
# nor is "my_sk-". The marks markdown puts before a word (_emphasis_, __strong__,
# *, ~~strike~~, `code`) do not make it part of one, so "_sk-" begins a key:
# a run of them (up to eight) counts as a word start when nothing of a word
# is before it. (A longer run counts anyway: that redacts more, never less.)
_WORD_CHARS = "[A-Za-z0-9-]"
_MARKS = "[_*~`]"
_WORD_START = f"(?<!{_WORD_CHARS})(?<!{_WORD_CHARS}{_MARKS}{{0,7}}_)"


def _token(heads: Sequence[str], body: str) -> _Pattern:
    alternatives = "|".join(re.escape(h) for h in heads)
    # The prefilter's look-behind is the first of the two: it lets through
    # no less than the pattern does.
    return _Pattern(f"{_WORD_START}(?:{alternatives}){body}", tuple(heads), _WORD_CHARS)


#: The built-in sets. Each pattern is bounded (at most a few hundred characters).
BUILTIN_SETS: dict[str, tuple[_Pattern, ...]] = {
    "secrets": (
        # OpenAI (sk-, sk-proj-, sk-svcacct-), Anthropic (sk-ant-...), DeepSeek and others.
        _token(["sk-"], r"[A-Za-z0-9_-]{20,200}(?![A-Za-z0-9_-])"),
        # AWS access key ids (long-term and temporary).
        _token(["AKIA", "ASIA"], r"[0-9A-Z]{16}(?![0-9A-Za-z])"),
        # GitHub tokens: classic (ghp_, gho_, ghu_, ghs_, ghr_) and fine-grained.
        _token(["ghp_", "gho_", "ghu_", "ghs_", "ghr_"], r"[A-Za-z0-9]{36,251}(?![A-Za-z0-9])"),
        _token(["github_pat_"], r"[A-Za-z0-9_]{22,244}(?![A-Za-z0-9_])"),
        # Slack tokens.
        _token(
            ["xoxa-", "xoxb-", "xoxp-", "xoxo-", "xoxr-", "xoxs-"],
            r"[A-Za-z0-9-]{10,200}(?![A-Za-z0-9-])",
        ),
        # Google API keys.
        _token(["AIza"], r"[0-9A-Za-z_-]{35}(?![0-9A-Za-z_-])"),
        # Stripe secret and restricted keys.
        _token(
            ["sk_live_", "sk_test_", "rk_live_", "rk_test_"],
            r"[0-9A-Za-z]{16,200}(?![0-9A-Za-z])",
        ),
        # PEM private key headers (RSA, EC, DSA, OPENSSH, ENCRYPTED, PKCS#8).
        _Pattern(r"-----BEGIN (?:[A-Z0-9]{1,12} ){0,2}PRIVATE KEY-----", ("-----BEGIN ",)),
    ),
    "cards": (
        # 13 to 19 digits, optionally grouped by single spaces or dashes, Luhn-checked.
        _Pattern(
            r"(?<![0-9])[0-9](?:[ -]?[0-9]){12,18}(?![0-9])",
            tuple("0123456789"),
            "[0-9]",
            luhn=True,
        ),
    ),
}


def luhn_valid(text: str) -> bool:
    """Whether the digits of ``text`` pass the Luhn check (card numbers)."""
    total = 0
    for i, char in enumerate(reversed([c for c in text if c.isdigit()])):
        digit = ord(char) - 48
        if i % 2:
            digit *= 2
            if digit > 9:
                digit -= 9
        total += digit
    return total % 10 == 0


def _regex_width(pattern: str) -> int | None:
    """The longest text ``pattern`` can match, or ``None`` if unbounded or unknown."""
    try:
        from re import _parser  # type: ignore[attr-defined]

        hi = int(_parser.parse(pattern).getwidth()[1])
    except Exception:  # syntax only the regex module knows: no derived bound
        return None
    return hi if hi <= MAX_MATCH_LENGTH else None


@dataclass(frozen=True, slots=True)
class _Compiled:
    """The patterns of every filter, and the prefilter in front of them."""

    prefilter: re.Pattern[str] | None
    luhn_rules: frozenset[int]
    #: Every pattern on its own, with its rule (see :func:`_candidates`).
    alone: tuple[tuple[Any, int], ...]
    #: How far past a match's end any pattern's look-ahead reads.
    reach: int


@dataclass(frozen=True, slots=True)
class WholeText:
    """What the filters decide of a complete text, read in one go."""

    #: ``(start, end, replacement)`` in the text, in order.
    cuts: tuple[tuple[int, int, str], ...]
    #: The filter of the first match, if one matched.
    matched: FilterRule | None
    #: The filter that blocks the text, if one does.
    blocked: FilterRule | None


class FilterSet:
    """A route's compiled output filters, shared by all its streams."""

    __slots__ = ("_compiled", "max_length", "rules", "tool_arguments")

    def __init__(
        self,
        rules: Sequence[FilterRule],
        tool_arguments: bool,
        patterns: list[tuple[int, _Pattern]],
    ) -> None:
        self.rules: tuple[FilterRule, ...] = tuple(rules)
        #: Also filter tool-call arguments (not only the answer's text).
        self.tool_arguments = tool_arguments
        lengths = [_pattern_length(rules[i], p) for i, p in patterns]
        #: The longest match of any filter: no hold-back is longer.
        self.max_length = max(lengths, default=0)
        self._compiled = _combine(patterns)

    def holdback(self, max_held_bytes: int) -> Holdback[Any]:
        """A new per-stream matcher, holding at most ``max_held_bytes`` of events."""
        return Holdback(self, max_held_bytes)

    def whole(self, text: str) -> WholeText:
        """Decide a complete ``text`` as it stands, with a matcher of its own.

        For texts that are not more of a stream's text (a summary repeating an
        answer, an event the dialect reads no text from): the stream's own
        matcher never sees them.
        """
        matcher: Holdback[None] = Holdback(self, 1)
        released = matcher.push(None, text, 0, 0.0)
        if released is None:  # no match and no prefix: nothing to cut
            return _NOTHING_MATCHED
        released += matcher.close(0.0)
        cuts = released[0].cuts if released and matcher.blocked is None else _NO_CUTS
        return WholeText(cuts, matcher.first_match, matcher.blocked)


def _pattern_length(rule: FilterRule, pattern: _Pattern) -> int:
    if rule.kind == "literal":
        return len(rule.value)
    width = _regex_width(_standard_form(pattern.source) or pattern.source)
    if rule.max_length is not None:
        return rule.max_length if width is None else min(width, rule.max_length)
    if width is None:  # compile_filters rejected this already
        raise FilterError("unbounded")
    return width


def _combine(patterns: list[tuple[int, _Pattern]]) -> _Compiled:
    # The prefilter: per first character (and look-behind), what may follow it.
    heads: dict[tuple[str, str | None], set[str]] = {}
    all_headed = True
    luhn: set[int] = set()
    alone_patterns: list[tuple[Any, int]] = []
    for rule, pattern in patterns:
        if pattern.luhn:
            luhn.add(rule)
        if pattern.heads is None:
            all_headed = False
        else:
            for head in pattern.heads:
                heads.setdefault((head[0], pattern.not_after), set()).update(_continuations(head))
        # Each on its own: its groups keep their numbers, its inline flags apply
        # to it alone, and a partial match of it is never hidden behind another's.
        alone_patterns.append((regex.compile(pattern.source), rule))
    prefilter = re.compile(_prefilter(heads)) if all_headed and heads else None
    reach = max(
        (_lookahead_width(_standard_form(p.source) or p.source) for _, p in patterns), default=0
    )
    return _Compiled(prefilter, frozenset(luhn), tuple(alone_patterns), reach)


def _continuations(head: str) -> list[str]:
    """What may follow a head's first character: the rest of it, or any part of it at the end."""
    rest = [re.escape(head[1:])]
    return rest + [re.escape(head[1:i]) + r"\Z" for i in range(1, len(head))]


def _prefilter(heads: dict[tuple[str, str | None], set[str]]) -> str:
    """One ``re`` pattern whose every branch starts with a plain character.

    So the engine skips along the text looking for those characters only:
    the look-behind comes after the first character (``s(?<![...]s)``), not
    before it, where it would be tried at every position.
    """
    branches: list[str] = []
    for (first, not_after), follows in sorted(heads.items(), key=lambda kv: str(kv[0])):
        char = re.escape(first)
        guard = f"(?<!{not_after}{char})" if not_after else ""
        options = "|".join(sorted(follows, key=lambda f: (-len(f), f)))
        branches.append(f"{char}{guard}(?:{options})")
    return "|".join(branches)


@lru_cache(maxsize=64)
def compile_filters(rules: tuple[FilterRule, ...], tool_arguments: bool) -> FilterSet | None:
    """Compile a route's filters (``None`` for none), or raise :class:`FilterError`.

    Cached: a route's filters are compiled once, not per request.
    """
    if not rules:
        return None
    patterns: list[tuple[int, _Pattern]] = []
    for index, rule in enumerate(rules):
        if rule.kind == "builtin":
            found = BUILTIN_SETS.get(rule.value)
            if found is None:
                names = ", ".join(BUILTIN_SETS)
                raise FilterError(f"{_shown(rule.value)} is not a built-in set (one of {names})")
            patterns.extend((index, p) for p in found)
        elif rule.kind == "literal":
            if not rule.value:
                raise FilterError("an empty literal matches everywhere")
            if len(rule.value) > MAX_MATCH_LENGTH:
                raise FilterError(f"a literal is at most {MAX_MATCH_LENGTH} characters")
            patterns.append((index, _Pattern(regex.escape(rule.value), (rule.value[:6],))))
        else:
            patterns.append((index, _check_regex(rule)))
    return FilterSet(rules, tool_arguments, patterns)


def _shown(value: str) -> str:
    """A pattern or literal as an error message quotes it: as written, cut if long."""
    return f"`{value}`" if len(value) <= 60 else f"`{value[:57]}...`"


# Unicode properties (\p{L}, \P{Lu}, \pL) are the regex module's, and harmless on a
# stream: they match one character. Each stands as one plain class for the checks.
_PROPERTY = regex.compile(r"\\[pP](?:\{[^}]*\}|[A-Za-z])")
# Flags that make the regex module search differently (backwards, fuzzily, for
# the best or the longest match): where a match lies would depend on the cuts.
_SEARCH_FLAGS = regex.REVERSE | regex.BESTMATCH | regex.ENHANCEMATCH | regex.POSIX
# A fuzzy constraint ({e<=1}, {i,d}, {s<2}): re reads it as literal text, regex does not.
_FUZZY = re.compile(r"\{\s*[eids]\s*(?:[<=,}+*]|\d)")


def _standard_form(pattern: str) -> str | None:
    """``pattern`` as Python's ``re`` reads it (properties as one class), or ``None``."""
    plain = _PROPERTY.sub("[a]", pattern)
    try:
        re.compile(plain)
    except (re.error, OverflowError, RecursionError):
        return None
    return plain


def _check_regex(rule: FilterRule) -> _Pattern:
    try:
        compiled = regex.compile(rule.value)
    except regex.error as exc:
        raise FilterError(f"{_shown(rule.value)} is not a regular expression: {exc}") from None
    fuzzy = _FUZZY.search(rule.value) is not None
    if fuzzy or _standard_form(rule.value) is None or compiled.flags & _SEARCH_FLAGS:
        raise FilterError(
            f"{_shown(rule.value)} uses syntax only the regex module has (beyond \\p{{...}}:"
            " \\K, fuzzy matching, reverse or best-match searches), whose matches a stream"
            " cut into events cannot decide the same way"
        )
    if compiled.search("") is not None:
        raise FilterError(f"{_shown(rule.value)} matches empty text, so it would match everywhere")
    if rule.max_length is not None:
        if not 1 <= rule.max_length <= MAX_MATCH_LENGTH:
            raise FilterError(f"max_length must be between 1 and {MAX_MATCH_LENGTH}")
    elif _regex_width(_standard_form(rule.value) or rule.value) is None:
        raise FilterError(
            f"{_shown(rule.value)} has no bounded match length (at most {MAX_MATCH_LENGTH}):"
            " write {m,n} instead of +, * or {m,}, or give max_length"
        )
    problem = _streaming_problem(_standard_form(rule.value) or rule.value)
    if problem is not None:
        raise FilterError(f"{_shown(rule.value)} {problem}")
    return _Pattern(rule.value, None)


# Anchors mean nothing in a text that arrives in pieces: the matcher sees a
# window of it, whose edges are not the answer's start or end.
_ANCHORS = frozenset(
    {
        "AT_BEGINNING",
        "AT_BEGINNING_LINE",
        "AT_BEGINNING_STRING",
        "AT_END",
        "AT_END_LINE",
        "AT_END_STRING",
    }
)


def _lookahead_width(pattern: str) -> int:
    """The most characters a look-ahead of ``pattern`` reads past where it stands."""
    try:
        from re import _parser  # type: ignore[attr-defined]

        parsed = _parser.parse(pattern)
    except Exception:  # only the regex module parses it: refused by _streaming_problem
        return 0

    def walk(items: Any) -> int:
        widest = 0
        for op, arg in items:
            name = str(op)
            if name in ("ASSERT", "ASSERT_NOT"):
                direction, sub = arg
                if direction > 0:
                    widest = max(widest, min(int(sub.getwidth()[1]), MAX_MATCH_LENGTH))
                widest = max(widest, walk(sub))
            elif name == "SUBPATTERN":
                widest = max(widest, walk(arg[-1]))
            elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                widest = max(widest, walk(arg[2]))
            elif name == "BRANCH":
                widest = max([widest, *(walk(b) for b in arg[1])])
            elif name == "ATOMIC_GROUP":
                widest = max(widest, walk(arg))
        return widest

    return walk(parsed)


def _streaming_problem(pattern: str) -> str | None:
    """Why ``pattern`` cannot be matched on a stream's window, or ``None``.

    The window keeps ``_CONTEXT`` characters before the undecided text, so a
    look-behind may look that far back, no further.
    """
    try:
        from re import _parser  # type: ignore[attr-defined]

        parsed = _parser.parse(pattern)
    except Exception:  # _check_regex refused what re cannot read
        return None

    def walk(items: Any) -> str | None:
        for op, arg in items:
            name = str(op)
            if name == "AT" and str(arg) in _ANCHORS:
                return (
                    "anchors to the start or end of the text (^, $, \\A, \\Z),"
                    " which a stream's window of it does not see"
                )
            if name in ("ASSERT", "ASSERT_NOT"):
                direction, sub = arg
                if direction < 0 and int(sub.getwidth()[1]) > _CONTEXT:
                    return f"has a look-behind longer than {_CONTEXT} characters"
                found = walk(sub)
            elif name in ("SUBPATTERN",):
                found = walk(arg[-1])
            elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                found = walk(arg[2])
            elif name == "BRANCH":
                found = next((f for f in (walk(b) for b in arg[1]) if f), None)
            elif name == "ATOMIC_GROUP":
                found = walk(arg)
            else:
                found = None
            if found:
                return found
        return None

    return walk(parsed)


# -- the per-stream matcher ----------------------------------------------------


@dataclass(slots=True)
class Match:
    """A decided match, in offsets of the stream's filtered text."""

    start: int
    end: int
    rule: int


@dataclass(slots=True)
class FilterStats:
    """What a stream's filters did, for the metrics."""

    #: Matches by (filter name, action).
    matches: dict[tuple[str, str], int] = field(default_factory=dict)
    #: Raw bytes of the events that had to wait for a prefix to resolve.
    held_bytes: int = 0
    #: Seconds each held event waited (the first ``_MAX_HOLD_SAMPLES``).
    hold_times: list[float] = field(default_factory=list)


T = TypeVar("T")


@dataclass(slots=True)
class Released(Generic[T]):
    """An event leaving the hold-back, with the cuts to make in its text.

    ``cuts`` are ``(start, end, replacement)`` in the event's own text, in order.
    """

    item: T
    cuts: tuple[tuple[int, int, str], ...]


_NO_CUTS: tuple[tuple[int, int, str], ...] = ()
_NOTHING_MATCHED = WholeText(_NO_CUTS, None, None)


#: Which of a stream's texts a piece of text continues: :data:`MAIN_TEXT`, or
#: a key of the dialect's (one tool call's arguments, one JSON field).
TextKey = Hashable
#: The stream's main text: the answer as a reader reads it, every text field
#: of it in the order the events carry them.
MAIN_TEXT: Final[TextKey] = None
#: Texts a stream keeps with nothing undecided in them before the idle ones
#: are let go (a hostile stream may open a call per event). A text let go
#: loses its context only: a key then begins at its next text's start, which
#: can redact more, never less.
_MAX_IDLE_TEXTS = 256


@dataclass(slots=True)
class _Text:
    """One of a stream's texts, as far as the matcher still needs it.

    ``buf`` is the undecided text and a little context before it: ``buf[0]``
    is at offset ``base`` of the text; text before ``safe`` is decided.
    """

    buf: str = ""
    base: int = 0
    safe: int = 0
    #: Decided matches whose events have not all left yet.
    matches: list[Match] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.base + len(self.buf)


#: Where an event's text lies: in which text, from, to, and where in the
#: concatenation of the event's parts it begins (for its cuts).
_Span = tuple[_Text, int, int, int]


@dataclass(slots=True)
class _Held(Generic[T]):
    item: T
    spans: tuple[_Span, ...]
    size: int
    arrived: float
    held: bool


_NO_SPANS: tuple[_Span, ...] = ()


class Holdback(Generic[T]):
    """One stream's filters: events in, in order; events out once their text is decided.

    A stream may carry several texts at once, that a reader assembles each
    on its own: the answer, and the arguments of each tool call, whose
    fragments interleave. Each is matched as one string across events, so
    a key split across a call's fragments is found whatever the other calls
    put between them (:meth:`push_texts`); the events still leave in their
    order, each once all of its text is decided.
    """

    __slots__ = (
        "_blocked_at",
        "_compiled",
        "_forget_at",
        "_found",
        "_held_size",
        "_items",
        "_main",
        "_max_held",
        "_max_length",
        "_set",
        "_texts",
        "blocked",
        "first_match",
        "overflow",
        "stats",
    )

    def __init__(self, filters: FilterSet, max_held_bytes: int) -> None:
        self._set = filters
        # Text waits for at most max_length characters, but the events behind
        # it (pings, comments, usage) have no such bound: their bytes do.
        self._max_held = max_held_bytes
        self._held_size = 0
        #: The events waiting grew past ``max_held_bytes``: the stream must end
        #: (releasing them would let a key split around the flood through).
        self.overflow = False
        self._compiled = filters._compiled
        # A match is decided once no longer one can start where it starts, and
        # its look-aheads have seen real text past its end.
        self._max_length = filters.max_length + filters._compiled.reach
        self._main = _Text()
        self._texts: dict[TextKey, _Text] = {MAIN_TEXT: self._main}
        #: How many texts make a look for idle ones to let go.
        self._forget_at = _MAX_IDLE_TEXTS
        #: Matches recorded so far, of every text (whether a push found one).
        self._found = 0
        self._items: list[_Held[T]] = []
        #: The rule of the ``block`` match that ended the stream, if one did.
        self.blocked: FilterRule | None = None
        #: The rule of the first match, of any action.
        self.first_match: FilterRule | None = None
        self._blocked_at: tuple[_Text, int] | None = None
        self.stats = FilterStats()

    @property
    def holding(self) -> bool:
        """Events are waiting for a possible match to resolve."""
        return bool(self._items)

    def push(self, item: T, text: str, size: int, now: float) -> list[Released[T]] | None:
        """One event arrived (``text``: what the filters read of it, maybe empty).

        ``text`` continues the stream's main text. ``None`` means this event
        leaves at once, unchanged: nothing waits before it and no match
        touches it (nearly every event). Otherwise the events that may
        leave now, in order (maybe none: a prefix is pending). After a
        ``block`` match nothing more is ever released.
        """
        if self.blocked is not None or self.overflow:
            return []
        items = self._items
        main = self._main
        if not items:
            if not text:
                return None
            # Nothing is undecided: only a head of some pattern in the new text
            # (the context before it counts for look-behinds) needs a closer look.
            prefilter = self._compiled.prefilter
            if prefilter is not None:
                old = main.buf
                buf = old + text
                if prefilter.search(buf, len(old)) is None:
                    kept = buf[-_CONTEXT:]
                    main.base += len(buf) - len(kept)
                    main.buf = kept
                    main.safe = main.base + len(kept)
                    return None
        spans = _NO_SPANS
        if text:
            found = self._found
            start = main.end
            main.buf += text
            self._scan(main, final=False)
            if not items and main.safe >= start + len(text) and self._found == found:
                return None
            spans = ((main, start, start + len(text), 0),)
        return self._wait(item, spans, size, now)

    def push_texts(
        self, item: T, texts: Sequence[tuple[TextKey, str]], size: int, now: float
    ) -> list[Released[T]] | None:
        """As :meth:`push`, for an event whose parts continue several texts, each by its key.

        The cuts of what leaves are offsets in the concatenation of the
        event's parts, in the order given.
        """
        if self.blocked is not None or self.overflow:
            return []
        found = self._found
        spans: list[_Span] = []
        at = 0
        decided = True
        for key, text in texts:
            if not text:
                continue
            kept = self._texts.get(key)
            if kept is None:
                if len(self._texts) >= self._forget_at:
                    self._forget_idle_texts()
                kept = self._texts[key] = _Text()
            start = kept.end
            kept.buf += text
            self._scan(kept, final=False)
            end = start + len(text)
            spans.append((kept, start, end, at))
            decided = decided and kept.safe >= end
            at += len(text)
        if not self._items and decided and self._found == found:
            return None
        return self._wait(item, tuple(spans), size, now)

    def close(self, now: float) -> list[Released[T]]:
        """The text ended (the terminal event, the end of the stream): decide the rest.

        The texts so far are decided as they stand and every waiting event
        leaves. Text pushed afterwards (an upstream that goes on after its
        terminal event) is still filtered, as a new run of text.
        """
        if self.blocked is not None or self.overflow:
            return []
        for text in list(self._texts.values()):
            self._scan(text, final=True)
            if self.blocked is not None:
                break
        return self._release(now)

    # -- internals -------------------------------------------------------------

    def _wait(self, item: T, spans: tuple[_Span, ...], size: int, now: float) -> list[Released[T]]:
        """Queue an event behind those waiting, and let go of what is decided."""
        items = self._items
        items.append(_Held(item, spans, size, now, False))
        self._held_size += size
        released = self._release(now)
        # Events leave from the front and arrive at the back, so only the one
        # just pushed can be unmarked: marking it alone keeps a push O(1) in
        # the events waiting (a flood of pings behind a prefix is not O(n²)).
        if items and not items[-1].held:
            newest = items[-1]
            newest.held = True
            self.stats.held_bytes += newest.size
        if self._held_size > self._max_held:
            self.overflow = True
            items.clear()
        return released

    def _scan(self, text: _Text, *, final: bool) -> None:
        buf = text.buf
        n = len(buf)
        pos = text.safe - text.base
        compiled = self._compiled
        prefilter = compiled.prefilter
        rules = self._set.rules
        bound = self._max_length
        # Each pattern's leftmost match from where it was last searched: reused
        # while the scan has not passed it, so a scan is one search per pattern
        # and per match, not per candidate (a text full of matches stays linear).
        found: dict[int, tuple[int, Any]] = {}
        while pos < n:
            if prefilter is not None:
                hint = prefilter.search(buf, pos)
                if hint is None:
                    pos = n
                    break
                pos = hint.start()
            candidates = _candidates(compiled, buf, pos, not final, found)
            if not candidates:
                pos = n
                break
            start = candidates[0][0].start()
            if start >= n:
                pos = n
                break
            decided = _decide(candidates, buf, start, n, final, bound, rules, compiled)
            if decided is None:
                pos = start  # could still begin, grow or change a match: wait for more text
                break
            if decided is _NO_MATCH:
                pos = start + 1  # nothing starts here after all (no card number, say)
                continue
            end, rule, closed = decided
            match = Match(text.base + start, text.base + end, rule)
            self._record(text, match, rules[rule], closed)
            if self.blocked is not None:
                pos = end
                break
            pos = end
        text.safe = text.base + pos
        keep = max(0, pos - _CONTEXT)
        if keep:
            text.buf = buf[keep:]
            text.base += keep

    def _record(self, text: _Text, match: Match, rule: FilterRule, closed: bool = False) -> None:
        """A decided match; ``closed``: it ran past its filter's length, so it blocks."""
        key = (rule.name, "block" if closed else rule.action)
        matches = self.stats.matches
        matches[key] = matches.get(key, 0) + 1
        text.matches.append(match)
        self._found += 1
        if self.first_match is None:
            self.first_match = rule
        if rule.action == "block" or closed:
            self.blocked = rule
            self._blocked_at = (text, match.start)

    def _release(self, now: float) -> list[Released[T]]:
        items = self._items
        blocked_at = self._blocked_at
        out: list[Released[T]] = []
        taken = 0
        stats = self.stats
        # How far each text's released events reach: its matches before that cut nothing more.
        reached: dict[int, tuple[_Text, int]] = {}
        for held in items:
            if not _decided(held.spans, blocked_at):
                break
            out.append(Released(held.item, _event_cuts(held.spans)))
            self._held_size -= held.size
            if held.held and len(stats.hold_times) < _MAX_HOLD_SAMPLES:
                stats.hold_times.append(now - held.arrived)
            for text, _, end, _ in held.spans:
                if text.matches:
                    reached[id(text)] = (text, end)
            taken += 1
        if taken:
            del items[:taken]
            for text, end in reached.values():
                text.matches = [m for m in text.matches if m.end > end]
        if blocked_at is not None:
            items.clear()
        return out

    def _forget_idle_texts(self) -> None:
        """Let go of the texts with nothing undecided and no match to cut (not the main one).

        The next look is when the texts kept have doubled: those still busy
        each hold an event back, so they are bounded by the bytes held, and
        a stream of them costs no look over all of them per new one.
        """
        self._texts = {
            key: text
            for key, text in self._texts.items()
            if key is MAIN_TEXT or text.matches or text.safe < text.end
        }
        self._forget_at = max(_MAX_IDLE_TEXTS, 2 * len(self._texts))


def _decided(spans: tuple[_Span, ...], blocked_at: tuple[_Text, int] | None) -> bool:
    """Whether all of an event's text is decided.

    After a block, only the events before the one it begins in are: they
    still leave.
    """
    for text, _, end, _ in spans:
        limit = blocked_at[1] if blocked_at is not None and blocked_at[0] is text else text.safe
        if end > limit:
            return False
    return True


def _event_cuts(spans: tuple[_Span, ...]) -> tuple[tuple[int, int, str], ...]:
    """An event's cuts, in the concatenation of its parts, from the matches of each text."""
    if len(spans) == 1:
        text, start, end, _ = spans[0]
        return _cuts(start, end, text.matches)
    cuts: list[tuple[int, int, str]] = []
    for text, start, end, at in spans:
        for cut_start, cut_end, replacement in _cuts(start, end, text.matches):
            cuts.append((cut_start + at, cut_end + at, replacement))
    return tuple(cuts) if cuts else _NO_CUTS


def _card_end(buf: str, start: int, end: int) -> int:
    """Where the longest Luhn-valid card number in ``buf[start:end]`` from ``start`` ends; -1: none.

    The pattern takes the longest run of grouped digits, which may run on
    into a date or a count ("4111 1111 1111 1111 12/25"): the number is the
    longest prefix ending at a group's end that has 13 digits or more and
    passes the check.
    """
    digits = 0
    ends: list[int] = []
    for i in range(start, end):
        if buf[i].isdigit():
            digits += 1
            if digits >= 13 and (i + 1 == end or not buf[i + 1].isdigit()):
                ends.append(i + 1)
    for candidate in reversed(ends):
        if luhn_valid(buf[start:candidate]):
            return candidate
    return -1


#: What :func:`_decide` says when no match starts at the candidate after all.
_NO_MATCH: Any = object()


def _candidates(
    compiled: _Compiled, buf: str, pos: int, partial: bool, found: dict[int, tuple[int, Any]]
) -> list[tuple[Any, int]]:
    """Every pattern's match (whole or partial) at the earliest start from ``pos``.

    Each pattern is searched on its own: in one alternation, the regex module
    returns a later whole match of one branch before an earlier partial one
    of another, and the key that partial begins would never be looked at.
    """
    best: list[tuple[Any, int]] = []
    first = -1
    for index, (pattern, rule) in enumerate(compiled.alone):
        kept = found.get(index)
        if kept is not None and kept[0] <= pos and (kept[1] is None or kept[1].start() >= pos):
            m = kept[1]
        else:
            m = pattern.search(buf, pos, partial=partial)
            found[index] = (pos, m)
        if m is None:
            continue
        at = m.start()
        if first < 0 or at < first:
            first = at
            best = [(m, rule)]
        elif at == first:
            best.append((m, rule))
    return best


def _decide(
    candidates: list[tuple[Any, int]],
    buf: str,
    start: int,
    n: int,
    final: bool,
    bound: int,
    rules: Sequence[FilterRule],
    compiled: _Compiled,
) -> tuple[int, int, bool] | Any | None:
    """What the matches at ``start`` come to: ``(end, rule, closed)``, or ``None`` (wait).

    :data:`_NO_MATCH` when none of them is a match after all.

    A ``block`` wins over a ``redact`` at the same start, else the longest
    match. Undecided while more text could change the answer: a partial
    match, a whole one that could still grow (an optional part, a longer
    token, a card number's next digits), unless the text ended or no match
    can be longer than the text seen from here. A partial match past that
    length (a configured regex whose ``max_length`` is too short) fails
    closed: it blocks, whatever its action.
    """
    undecided = not final and n - start <= bound
    partials = [rule for m, rule in candidates if m.partial]
    whole: list[tuple[int, int]] = []
    # More text may still make a longer match here (an optional part, a longer
    # token, a card number's next digits, which also change its check).
    pending = undecided and bool(partials)
    for m, rule in candidates:
        if m.partial:
            continue
        cards = rule in compiled.luhn_rules
        if undecided and (cards or rules[rule].action == "redact"):
            pending = True
        end = m.end()
        limit = rules[rule].max_length
        if limit is not None and end - start > limit:
            # Longer than its filter says a match can be: cut into events it
            # could not have been seen whole, so it fails closed either way.
            return end, rule, True
        if cards:
            end = _card_end(buf, start, end)
            if end < 0:
                continue
        whole.append((end, rule))
    return _winner(whole, partials, pending, undecided, n, rules, compiled)


def _winner(
    whole: list[tuple[int, int]],
    partials: list[int],
    pending: bool,
    undecided: bool,
    n: int,
    rules: Sequence[FilterRule],
    compiled: _Compiled,
) -> tuple[int, int, bool] | Any | None:
    """Which of the matches at one start wins (see :func:`_decide`): ``(end, rule, closed)``.

    ``whole`` are the whole matches as ``(end, rule)``, ``partials`` the
    rules still matching at the text's end, ``pending`` whether more text
    may still make a longer match.
    """
    blocks = [
        (end, rule)
        for end, rule in whole
        if rules[rule].action == "block" and rule not in compiled.luhn_rules
    ]
    if blocks:
        end, rule = max(blocks)
        if undecided and end + compiled.reach >= n:
            return None  # a look-ahead at the text's edge may still fail on what follows
        return end, rule, False
    if pending:
        return None
    if partials and not whole:
        # Past the longest a match can be and still open: a configured regex
        # whose max_length is too short. Fail closed.
        blocking = [rule for rule in partials if rules[rule].action == "block"]
        return n, (blocking or partials)[0], True
    if not whole:
        return _NO_MATCH
    blocking_cards = [(end, rule) for end, rule in whole if rules[rule].action == "block"]
    end, rule = max(blocking_cards or whole)
    return end, rule, False


def _cuts(start: int, end: int, matches: list[Match]) -> tuple[tuple[int, int, str], ...]:
    if start == end or not matches:
        return _NO_CUTS
    cuts: list[tuple[int, int, str]] = []
    for m in matches:
        if m.end <= start or m.start >= end:
            continue
        replacement = REDACTED if m.start >= start else ""
        cuts.append((max(m.start, start) - start, min(m.end, end) - start, replacement))
    return tuple(cuts) if cuts else _NO_CUTS


def apply_cuts(parts: Sequence[str], cuts: Sequence[tuple[int, int, str]]) -> list[str]:
    """The event's text parts with ``cuts`` (offsets in their concatenation) made.

    A cut that spans parts leaves its replacement in the part where it begins.
    The cuts are in order and do not overlap, so one pass over parts and cuts
    together does it (an event of thousands of parts, each with a match, is
    not parts × cuts).
    """
    out: list[str] = []
    offset = 0
    first = 0  # the first cut that may still reach this part or a later one
    for part in parts:
        end = offset + len(part)
        while first < len(cuts) and cuts[first][1] <= offset:
            first += 1
        pieces: list[str] = []
        cursor = offset
        index = first
        while index < len(cuts) and cuts[index][0] < end:
            cut_start, cut_end, replacement = cuts[index]
            if cut_end > offset:
                pieces.append(part[cursor - offset : max(cut_start, offset) - offset])
                if cut_start >= offset:
                    pieces.append(replacement)
                cursor = min(cut_end, end)
            index += 1
        pieces.append(part[cursor - offset :])
        out.append("".join(pieces))
        offset = end
    return out
