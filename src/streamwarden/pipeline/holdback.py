"""The output filters' transform: events held back while a match may start, redacted or blocked.

On a route with ``output_filters`` every event goes through a
:class:`~streamwarden.core.filters.Holdback` on its way out: an event whose
text could begin a match waits (whole, with the events behind it) until
the match is ruled out or made, and a redacted event is re-serialised by
its dialect with only its text changed. Keep-alives still go out between
whole events, and the journal and the meter see the events as the client
gets them, when it gets them. A summary event that repeats whole texts
(the Responses API's ``*.done`` events) has each of them filtered on its
own, in one piece, never as more of the stream's text. A ``block`` match,
an event the filters changed that cannot be written again (hostile data),
or a hold-back grown past ``max_event_bytes`` ends the stream
``content_blocked`` (:attr:`FilterHoldback.stop`).

The matcher is the core's (:mod:`streamwarden.core.filters`); this module is
only how one stream's events go through it.
"""

from __future__ import annotations

from streamwarden.core.dialects import NOTHING, Observation
from streamwarden.core.dialects.base import DecodedJSON, read_as_text
from streamwarden.core.endings import ErrorCode
from streamwarden.core.filters import FilterRule, FilterSet, Released, apply_cuts
from streamwarden.core.relay import Relay
from streamwarden.core.sse import Event, Frame, with_data
from streamwarden.core.transform import Passing, Stop

__all__ = ["FilterHoldback"]

#: An event in the hold-back: its frame, what the dialect read in it, and the
#: text parts the filters read (``None``: the dialect's own text, read again
#: only to redact).
_Waiting = tuple[Frame, Observation, list[str] | None]

#: What re-serialising hostile data may raise (a lone surrogate, nesting too deep).
_UNWRITABLE = (ValueError, UnicodeError, RecursionError)


class FilterHoldback:
    """One stream's output filters, as an :class:`~streamwarden.core.transform.EventTransform`."""

    __slots__ = ("_filters", "_holdback", "_max_held", "_relay", "_unwritable", "stop")

    def __init__(self, relay: Relay, filters: FilterSet, max_held_bytes: int) -> None:
        self._relay = relay
        self._filters = filters
        self._max_held = max_held_bytes
        self._holdback = filters.holdback(max_held_bytes)
        relay.meter.filters = self._holdback.stats
        #: An event the filters changed could not be written again (hostile
        #: data: a lone surrogate, nesting past the parser): fail closed.
        self._unwritable = False
        self.stop: Stop | None = None

    def event(self, frame: Frame, seen: Observation, now: float, out: list[Passing]) -> None:
        holdback = self._holdback
        event = frame.event
        if event is None:  # a comment or a stray line: it keeps its place
            if holdback.holding:
                self._take(holdback.push((frame, seen, None), "", len(frame.raw), now), out)
            else:
                out.append((frame, seen))
            self._check()
            return
        screened = self._screened(frame, event, seen)
        if not isinstance(screened, Frame):
            self._block(screened)  # None: it could not be written again
            return
        self._hold(screened, screened.event or event, seen, out, now)
        if seen.terminal:  # no more text comes: what waits is decided now
            self._take(holdback.close(now), out)
        self._check()

    def close(self, now: float, out: list[Passing]) -> None:
        holdback = self._holdback
        if self.stop is not None or not holdback.holding:
            return
        self._take(holdback.close(now), out)
        if holdback.blocked is not None or self._unwritable:
            self._block()

    def ending(self, error: bytes) -> bytes:
        return error

    # -- internals -------------------------------------------------------------

    def _check(self) -> None:
        holdback = self._holdback
        if holdback.blocked is not None or holdback.overflow or self._unwritable:
            self._block()

    def _screened(self, frame: Frame, event: Event, seen: Observation) -> Frame | FilterRule | None:
        """The event as it goes into the hold-back, or the rule of a ``block`` match in it.

        Before the hold-back looks at the stream's text, what it would not
        see is filtered here: a summary's whole texts, each on its own, and
        text the dialect does not read. ``None``: the event changed and
        could not be written again (hostile data): the stream fails closed.
        """
        filters = self._filters
        dialect = self._relay.rules
        if dialect.repeats_text(event):  # a summary with whole texts: filtered as wholes
            try:
                whole = self._whole_texts_filtered(frame, event)
            except _UNWRITABLE:
                self._unwritable = True
                return None
            if isinstance(whole, FilterRule):
                return whole
            frame = whole
            event = whole.event or event
        if (
            _reads_no_text(seen)
            and event.data
            and (filters.tool_arguments or not dialect.carries_tool_arguments(event))
        ):
            # Text the dialect does not read (a field it does not know, an
            # event type it does not expect, data it cannot parse) is still
            # text a client may show, as its JSON parser decodes it: a match
            # in it fails closed.
            unread = filters.whole(event.data)
            if unread.matched is None and "\\" in event.data:
                decoded = read_as_text(event.data)
                if isinstance(decoded, DecodedJSON):
                    unread = filters.whole(decoded[0])
            if unread.matched is not None:
                return unread.blocked or unread.matched
        return frame

    def _hold(
        self, frame: Frame, event: Event, seen: Observation, out: list[Passing], now: float
    ) -> None:
        """Put an event in the hold-back; append what leaves it to ``out``."""
        holdback = self._holdback
        dialect = self._relay.rules
        text = seen.text
        size = len(frame.raw)
        if seen.tools or dialect.reads_own_texts(event):
            # Tool-call arguments (each call's a text of its own), or data read
            # decoded: the filters read this event's texts themselves.
            keyed = dialect.filter_texts(event, self._filters.tool_arguments)
            parts = [part for _, part in keyed]
            released = holdback.push_texts((frame, seen, parts), keyed, size, now)
        else:  # the dialect's own text is what they read, all of the main text
            released = holdback.push((frame, seen, None), text, size, now)
        if released is None:  # nothing waits and nothing matched: out as it came
            out.append((frame, seen))
        else:
            self._take(released, out)

    def _whole_texts_filtered(self, frame: Frame, event: Event) -> Frame | FilterRule:
        """A summary event with each whole text it repeats filtered on its own.

        The frame as it came when no filter matches, the rewritten frame when
        one redacts, or the rule of a ``block`` match. A match here repeats
        one the deltas already had (counted there), except a block: the
        deltas never carried that text, or the stream would have ended.
        """
        filters = self._filters
        dialect = self._relay.rules
        root, places = dialect.whole_texts(event, filters.tool_arguments)
        changed = False
        for container, key in places:
            text = container[key]
            if not text:
                continue
            decided = filters.whole(text)
            if decided.blocked is not None:
                return decided.blocked
            if decided.cuts:
                container[key] = apply_cuts([text], decided.cuts)[0]
                changed = True
        if not changed:
            return frame
        data = dialect.dump_data(event, root)
        return Frame(self._rewritten(frame.raw, data), Event(event.event, data, event.id))

    def _take(self, released: list[Released[_Waiting]] | None, out: list[Passing]) -> None:
        """Append the events the hold-back let go to ``out``, redacted."""
        if not released:
            return
        for leaving in released:
            frame, seen, parts = leaving.item
            event = frame.event
            if event is not None and leaving.cuts:
                try:
                    frame = self._redacted(frame, event, parts, leaving.cuts)
                except _UNWRITABLE:
                    self._unwritable = True  # neither this event nor any after it
                    return
            out.append((frame, seen))

    def _redacted(
        self,
        frame: Frame,
        event: Event,
        parts: list[str] | None,
        cuts: tuple[tuple[int, int, str], ...],
    ) -> Frame:
        tools = self._filters.tool_arguments
        dialect = self._relay.rules
        if parts is None:  # the dialect's text was the filtered text: its parts, read again
            parts = dialect.filter_text(event, tools)
        data = dialect.rewrite_text(event, tools, apply_cuts(parts, cuts))
        return Frame(self._rewritten(frame.raw, data), event)

    def _rewritten(self, raw: bytes, data: str) -> bytes:
        """A frame's bytes with new data, in its stream's framing (a message's: the data)."""
        framing = self._relay.framing
        return with_data(raw, data, lines=framing == "lines", message=framing == "messages")

    def _block(self, rule: FilterRule | None = None) -> None:
        """End the stream ``content_blocked``: a block match (``rule``: in a whole text)."""
        if self.stop is not None:
            return
        holdback = self._holdback
        if rule is not None:
            matches = holdback.stats.matches
            key = (rule.name, rule.action)
            matches[key] = matches.get(key, 0) + 1
        else:
            rule = holdback.blocked
        if rule is not None:
            reason = f"an output filter ({rule.name}) blocked the answer"
        elif self._unwritable:
            reason = "an event the output filters changed could not be written again"
        else:  # overflow: fail closed rather than let a split match through
            reason = (
                "the events held back by the output filters, waiting for a possible match,"
                f" exceeded {self._max_held} bytes"
            )
        self.stop = (ErrorCode.CONTENT_BLOCKED, reason)


def _reads_no_text(seen: Observation) -> bool:
    """Whether the dialect read nothing of an event's text (the filters search it whole).

    An event it reads only tool-call steps in (a block's start or stop, a
    choice's finish) counts as one it reads nothing in, as it did before
    the dialects followed tool calls.
    """
    if seen is NOTHING:
        return True
    return (
        seen.calls is not None
        and not seen.text
        and seen.output_tokens is None
        and seen.input_tokens is None
        and not (seen.terminal or seen.error or seen.usage_only)
    )
