"""Usage injection, with no I/O: ask an OpenAI-style upstream for exact usage, invisibly.

OpenAI's Chat Completions API (and vLLM, SGLang, llama.cpp's server...)
streams a token count only when the request asks for it with
``"stream_options": {"include_usage": true}``; otherwise the sidecar can
only estimate. With ``usage_injection: auto`` the sidecar adds that option
to a streaming request that did not ask for it (:func:`inject_usage`),
then takes back from the response what the option added
(:class:`TakeBack`), so that the client receives exactly the bytes it
would have received without it, while the meter gets the provider's own
count.

What the option adds, per the API: every chunk carries ``"usage": null``,
and one last chunk before ``[DONE]`` has ``"choices": []`` and the usage.
What it adds *to a given upstream* depends on what that upstream sends
when nobody asks: vLLM with ``--enable-force-include-usage`` and several
hosted APIs send the usage chunk on every stream, SGLang-style servers
write ``"usage": null`` on every chunk. Taking either back there would
delete bytes the client gets directly. So the sidecar never changes a
request before it has seen one unchanged request of the same kind (the
same upstream path and model, with or without ``stream_options``) that
asked for no usage answered whole (:class:`UsageHabits`,
:class:`HabitWatch`): a kind that volunteers usage is never injected
(the count comes anyway), and on the others only what the upstream does
not send by itself is taken back. Until one such stream has ended, and
again every :data:`HABIT_MEMORY` seconds (so that a redeployed upstream
is learned again), requests of that kind go unchanged, metered from the
provider's count if it volunteers one, else estimated.

Bodies that are not a JSON object, do not stream, already ask for usage,
or are larger than the configured bound are sent unchanged. An upstream
that refuses the option (old vLLM answers 400 naming ``stream_options``:
:func:`refuses_stream_options`) gets the request again as the client sent
it, and the face stops injecting there for a while.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from streamwarden.core.dialects.base import Observation
from streamwarden.core.sse import Frame

__all__ = [
    "HABIT_MEMORY",
    "HabitWatch",
    "TakeBack",
    "UsageHabit",
    "UsageHabits",
    "UsageRequest",
    "UsageRole",
    "inject_usage",
    "refuses_stream_options",
    "without_usage_null",
]

#: Seconds a learned habit is trusted; then one request goes unchanged again.
HABIT_MEMORY = 600.0
#: Upstream paths whose habit is remembered (the oldest is forgotten first):
#: a client naming endless paths only makes the sidecar learn again.
HABIT_PATHS = 256

# "usage": null with the comma that joined it to its neighbour (either
# side), whatever the spacing; only in chunks of a stream whose request the
# sidecar changed.
_USAGE_NULL = re.compile(rb',\s*"usage"\s*:\s*null(?=\s*[,}])|"usage"\s*:\s*null\s*,')
# The same field anywhere, to tell whether an upstream writes it unasked.
_ANY_USAGE_NULL = re.compile(rb'"usage"\s*:\s*null')


@dataclass(frozen=True, slots=True)
class UsageHabit:
    """What an upstream path sends on a stream whose request asked for no usage."""

    #: A usage count anyway (vLLM ``--enable-force-include-usage``, some hosted APIs).
    volunteers: bool
    #: ``"usage": null`` on its chunks anyway (servers that write every field).
    marks_null: bool
    #: Its events carry ``id:`` fields: an added usage chunk would take a
    #: number and shift every id after it, so the path is never injected.
    numbers_events: bool = False


@dataclass(frozen=True, slots=True)
class TakeBack:
    """What the relay takes back of the option the sidecar added to one request."""

    #: The ``"choices": []`` chunk with the count (the upstream sends none unasked).
    chunk: bool = True
    #: ``"usage": null`` on each chunk (the upstream does not write it unasked).
    nulls: bool = True


class HabitWatch:
    """One unchanged stream, read for its upstream's habit (fed by the relay).

    Conclusive on the first usage count (the key volunteers it) or at a
    clean terminal event (it did not). A stream cut before either, or one
    that carried an error (vLLM writes its error event, then ``[DONE]``,
    and no usage), teaches nothing.
    """

    __slots__ = ("_habits", "_ids", "_key", "_nulls", "settled")

    def __init__(self, habits: UsageHabits, key: HabitKey) -> None:
        self._habits = habits
        self._key = key
        self._nulls = False
        self._ids = False
        #: The habit is learned: nothing more to watch.
        self.settled = False

    def see(self, frame: Frame, seen: Observation, now: float) -> None:
        """One event as it came from the upstream, and what its dialect read in it."""
        raw = frame.raw
        if not self._nulls and b'"usage"' in raw and _ANY_USAGE_NULL.search(raw):
            self._nulls = True
        if frame.event is not None and frame.event.id is not None:
            self._ids = True  # the id persists: any event of a numbered stream has one
        if seen.error:
            self.settled = True  # an error's stream is no lesson in what a whole one sends
        elif seen.usage_only or seen.output_tokens is not None or seen.input_tokens is not None:
            self._settle(True, now)
        elif seen.terminal:
            self._settle(False, now)

    def _settle(self, volunteers: bool, now: float) -> None:
        self.settled = True
        habit = UsageHabit(volunteers, self._nulls, self._ids)
        self._habits.learn(self._key, habit, now)


#: How the relay treats usage on one stream: what to take back of an
#: injected option, a habit to watch for, or nothing.
UsageRole = TakeBack | HabitWatch | None


#: What a habit is learned for: the upstream path, the request's model (a
#: gateway serves many behind one path) and whether the request carried
#: ``stream_options`` at all (some servers force usage only where it does).
HabitKey = tuple[str, str, bool]


class UsageHabits:
    """Per habit key, what the upstream sends unasked, and so what injection may take back.

    Learning only ever goes towards leaving bytes alone: within the memory,
    a stream that shows more (a count, ``"usage": null``, ids) than what is
    known adds it, and one that shows less changes nothing, so no stream,
    a client's or a stale one, can make the sidecar take back what another
    stream's upstream sends by itself.
    """

    def __init__(self, memory: float = HABIT_MEMORY, paths: int = HABIT_PATHS) -> None:
        self._memory = memory
        self._paths = paths
        self._known: OrderedDict[HabitKey, tuple[UsageHabit, float]] = OrderedDict()

    def role(self, key: HabitKey, now: float) -> UsageRole:
        """For a request the sidecar could inject: take back this, watch, or leave it.

        ``None`` (send unchanged, nothing to take back): the path sends
        usage unasked, so the meter gets the count without the option, or
        numbers its events, so no event can be added without changing ids.
        """
        known = self._known.get(key)
        if known is None or now - known[1] >= self._memory:
            return HabitWatch(self, key)
        habit = known[0]
        if habit.volunteers or habit.numbers_events:
            return None
        return TakeBack(chunk=True, nulls=not habit.marks_null)

    def learn(self, key: HabitKey, habit: UsageHabit, now: float) -> None:
        known = self._known
        held = known.get(key)
        if held is not None and now - held[1] < self._memory:
            old = held[0]
            habit = UsageHabit(
                old.volunteers or habit.volunteers,
                old.marks_null or habit.marks_null,
                old.numbers_events or habit.numbers_events,
            )
            now = held[1]  # learned then: it is learned again from scratch in time
        known[key] = (habit, now)
        known.move_to_end(key)
        while len(known) > self._paths:
            known.popitem(last=False)


@dataclass(frozen=True, slots=True)
class UsageRequest:
    """A request body that may ask for usage in the client's place."""

    #: The body with ``stream_options.include_usage`` added.
    injected: bytes
    #: The request's model, and whether it carried ``stream_options``.
    model: str
    had_options: bool

    def key(self, path: str) -> HabitKey:
        return (path, self.model, self.had_options)


#: Longest model name a habit is kept for: a longer one is sent unchanged.
MAX_MODEL_NAME = 256


def usage_request(body: bytes) -> UsageRequest | None:
    """The body asking for ``include_usage``, or ``None`` if it is to be sent unchanged."""
    try:
        request: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict) or request.get("stream") is not True:
        return None
    model = request.get("model", "")
    if not isinstance(model, str) or len(model) > MAX_MODEL_NAME:
        return None
    options = request.get("stream_options")
    had_options = options is not None
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        return None  # the client's own odd value: not ours to fix
    if options.get("include_usage") is True:
        return None  # asked for by the client: it gets it, nothing to take back
    if set(options) - {"include_usage"}:
        # Another option (vLLM's continuous_usage_stats) would turn into a
        # count on every chunk once include_usage is set: not ours to take back.
        return None
    request["stream_options"] = {**options, "include_usage": True}
    injected = json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode()
    return UsageRequest(injected, model, had_options)


def inject_usage(body: bytes) -> bytes | None:
    """The body asking for ``include_usage``, or ``None`` if it is to be sent unchanged."""
    asked = usage_request(body)
    return None if asked is None else asked.injected


def without_usage_null(raw: bytes) -> bytes:
    """An event block without the ``"usage": null`` field the injected option added."""
    if b'"usage"' not in raw:
        return raw
    return _USAGE_NULL.sub(b"", raw, count=1)


def refuses_stream_options(status: int, body: bytes) -> bool:
    """The upstream's answer refuses the injected option (a 400 that names it)."""
    return status == 400 and b"stream_options" in body
