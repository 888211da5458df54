"""Usage injection, with no I/O: ask an OpenAI-style upstream for exact usage, invisibly.

OpenAI's Chat Completions API (and vLLM, SGLang, llama.cpp's server...)
streams a token count only when the request asks for it with
``"stream_options": {"include_usage": true}``; otherwise the sidecar can
only estimate. With ``usage_injection: auto`` (off by default) the sidecar
adds that option to a streaming request that did not ask for it
(:func:`usage_request`), then takes back from the response what the
option added (:class:`TakeBack`), so that the client receives exactly the
bytes it would have received without it, while the meter gets the
provider's own count.

What the option adds, per the API: every chunk carries ``"usage": null``,
and one last chunk before ``[DONE]`` has ``"choices": []`` and the usage.
What it adds *to a given upstream* depends on what that upstream sends
when nobody asks: vLLM with ``--enable-force-include-usage`` and several
hosted APIs send the usage chunk on every stream, SGLang-style servers
write ``"usage": null`` on every chunk. Taking either back there would
delete bytes the client gets directly. So the sidecar never changes a
request before it has seen one unchanged request of the same kind answered
whole (:class:`UsageHabits`, :class:`HabitWatch`): a kind that volunteers
usage is never injected (the count comes anyway), and on the others only
what the upstream does not send by itself is taken back.

A kind is everything that could send a request to another backend, or
make one backend answer it otherwise: the request target (path and
query), the ``Host``, the model, and the credentials (a keyed digest of
:data:`~streamwarden.core.headers.CREDENTIAL_HEADERS` and the query's
credential parameters). A request without credentials is never injected,
so no unauthenticated client teaches anything to anyone. Learning only
goes towards leaving bytes alone, and a learned habit is never pushed out
by other kinds (a full table learns nothing new until a habit expires),
so no client can make the sidecar take back what another client's
upstream sends by itself. What the sidecar cannot see it assumes: that the
upstream answers two requests of one kind alike (no gateway that routes on
another header, no replicas with different flags behind one address);
that assumption is why injection is off unless a route asks for it.

Only a body the sidecar reads exactly as any JSON parser would is
changed: UTF-8, one JSON object, no duplicate member names, no ``NaN``,
``"stream": true``, and no ``stream_options`` member at all (a server
reads ``{}``, ``1`` or ``"true"`` there in its own way: vLLM takes an
empty object as asking for usage). The change is a splice, the member
added before the object's closing brace, so every other byte reaches the
upstream as the client wrote it. An upstream that refuses the option (old
vLLM answers 400 naming ``stream_options``: :func:`refuses_stream_options`,
which is not fooled by an error that quotes the request) gets the request
again as the client sent it, and that kind is left alone for a while.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from streamwarden.core.dialects.base import Observation
from streamwarden.core.sse import Frame

__all__ = [
    "HABIT_KINDS",
    "HABIT_KINDS_PER_CREDENTIAL",
    "HABIT_MEMORY",
    "INCLUDE_USAGE",
    "HabitKey",
    "HabitWatch",
    "TakeBack",
    "UsageHabit",
    "UsageHabits",
    "UsageRequest",
    "UsageRole",
    "refuses_stream_options",
    "usage_request",
    "without_usage_null",
]

#: Seconds a learned habit is trusted; then one request goes unchanged again.
HABIT_MEMORY = 600.0
#: Kinds whose habit is remembered. A full table learns no new kind (its
#: requests go unchanged) until a habit expires: a client naming endless
#: models cannot push out what was learned of another kind.
HABIT_KINDS = 4096
#: Kinds one set of credentials may hold of them: one authenticated client
#: naming endless models fills its own share, not the table everyone learns in.
HABIT_KINDS_PER_CREDENTIAL = 64
#: The member the sidecar adds, as it adds it: spliced in before the
#: request's closing brace.
INCLUDE_USAGE = b',"stream_options":{"include_usage":true}'

# "usage": null with the comma that joined it to its neighbour (either
# side), whatever the spacing; only in chunks of a stream whose request the
# sidecar changed.
_USAGE_NULL = re.compile(rb',\s*"usage"\s*:\s*null(?=\s*[,}])|"usage"\s*:\s*null\s*,')
# The same field anywhere, to tell whether an upstream writes it unasked.
_ANY_USAGE_NULL = re.compile(rb'"usage"\s*:\s*null')


@dataclass(frozen=True, slots=True)
class UsageHabit:
    """What an upstream sends on a stream whose request asked for no usage."""

    #: A usage count anyway (vLLM ``--enable-force-include-usage``, some hosted APIs).
    volunteers: bool
    #: ``"usage": null`` on its chunks anyway (servers that write every field).
    marks_null: bool
    #: Its events carry ``id:`` fields: an added usage chunk would take a
    #: number and shift every id after it, so the kind is never injected.
    numbers_events: bool = False
    #: It answered the option with a 400 naming it (old vLLM): left alone.
    refuses_option: bool = False


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


#: What a habit is learned for: the request target (path and query), the
#: ``Host``, the model, and a keyed digest of the credentials. A gateway
#: in front of the upstream may send any of them to another backend.
HabitKey = tuple[str, str, str, str]


class UsageHabits:
    """Per kind of request, what the upstream sends unasked, and so what injection may take back.

    Learning only ever goes towards leaving bytes alone: within the memory,
    a stream that shows more (a count, ``"usage": null``, ids) than what is
    known adds it, and one that shows less changes nothing, so no stream,
    a client's or a stale one, can make the sidecar take back what another
    stream's upstream sends by itself. Nothing learned is pushed out before
    its time: a full table learns no new kind.
    """

    def __init__(
        self,
        memory: float = HABIT_MEMORY,
        kinds: int = HABIT_KINDS,
        per_credential: int = HABIT_KINDS_PER_CREDENTIAL,
    ) -> None:
        self._memory = memory
        self._kinds = kinds
        self._per_credential = per_credential
        # In the order learned, so the expired ones are at the front.
        self._known: OrderedDict[HabitKey, tuple[UsageHabit, float]] = OrderedDict()
        # Kinds held per credentials' digest (a key's last part).
        self._held: Counter[str] = Counter()
        # Keys the credentials' digest: the table holds no credential, nor
        # anything that could be looked up in a list of known keys.
        self._secret = secrets.token_bytes(32)

    def key(
        self, target: str, host: str, model: str, credentials: Iterable[str]
    ) -> HabitKey | None:
        """The kind of a request, or ``None`` if it carries no credential (never injected).

        ``credentials``: the request's
        :func:`~streamwarden.core.headers.credential_parts`, whose quoting
        keeps two different sets of credentials from joining alike.
        """
        parts = list(credentials)
        if not parts:
            return None
        digest = self._digest()
        digest.update(b"\0".join(part.encode("utf-8", "surrogateescape") for part in parts))
        # The target and host as digests too: a query may hold a credential
        # (?key=), and an entry stays small whatever a client sends.
        kept = []
        for part in (target, host):
            hashed = self._digest()
            hashed.update(part.encode("utf-8", "surrogateescape"))
            kept.append(hashed.hexdigest())
        return (kept[0], kept[1], model, digest.hexdigest())

    def _digest(self) -> Any:
        return hashlib.blake2b(key=self._secret, digest_size=16)

    def role(self, key: HabitKey, now: float) -> UsageRole:
        """For a request the sidecar could inject: take back this, watch, or leave it.

        ``None`` (send unchanged, nothing to take back): the kind sends
        usage unasked, so the meter gets the count without the option,
        numbers its events, so no event can be added without changing ids,
        or refused the option; or the table is full and the kind unknown.
        """
        self._forget_expired(now)
        known = self._known.get(key)
        if known is None:
            return HabitWatch(self, key) if self._has_room(key) else None
        habit = known[0]
        if habit.volunteers or habit.numbers_events or habit.refuses_option:
            return None
        return TakeBack(chunk=True, nulls=not habit.marks_null)

    def learn(self, key: HabitKey, habit: UsageHabit, now: float) -> None:
        self._forget_expired(now)
        known = self._known
        held = known.get(key)
        if held is not None:
            old = held[0]
            habit = UsageHabit(
                old.volunteers or habit.volunteers,
                old.marks_null or habit.marks_null,
                old.numbers_events or habit.numbers_events,
                old.refuses_option or habit.refuses_option,
            )
            # Learned then: it is learned again from scratch in time.
            known[key] = (habit, held[1])
        elif self._has_room(key):
            known[key] = (habit, now)
            self._held[key[3]] += 1

    def refused(self, key: HabitKey, now: float) -> None:
        """The upstream refused the option for this kind: leave it alone for the memory.

        From now, whatever was learned of the kind before: a refusal near a
        habit's expiry must not be forgotten a moment later.
        """
        self._forget_expired(now)
        held = self._known.pop(key, None)
        if held is None:
            if not self._has_room(key):
                return  # a full table (or share): the kind is not injected anyway
            self._held[key[3]] += 1
        old = held[0] if held is not None else UsageHabit(False, False)
        refused = UsageHabit(old.volunteers, old.marks_null, old.numbers_events, True)
        self._known[key] = (refused, now)  # at the end: the newest

    def _has_room(self, key: HabitKey) -> bool:
        """A new kind may be learned: the table, and its credentials' share, have room."""
        return len(self._known) < self._kinds and self._held[key[3]] < self._per_credential

    def _forget_expired(self, now: float) -> None:
        known = self._known
        while known:
            first = next(iter(known.values()))
            if now - first[1] < self._memory:
                break
            key, _ = known.popitem(last=False)
            credential = key[3]
            self._held[credential] -= 1
            if not self._held[credential]:
                del self._held[credential]


@dataclass(frozen=True, slots=True)
class UsageRequest:
    """A request body that may ask for usage in the client's place."""

    #: The body with ``stream_options.include_usage`` added: the client's
    #: bytes and :data:`INCLUDE_USAGE` spliced in before the closing brace.
    injected: bytes
    #: The request's model.
    model: str


#: Longest model name a habit is kept for: a longer one is sent unchanged.
MAX_MODEL_NAME = 256


class _Uncertain(ValueError):
    """A body JSON parsers may read in more than one way: sent unchanged."""


def _members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Duplicate names are read as the first by some parsers and the last
    # by others: which "stream" would the upstream see?
    members = dict(pairs)
    if len(members) != len(pairs):
        raise _Uncertain("duplicate member name")
    return members


def _constant(name: str) -> Any:
    raise _Uncertain(f"{name} is not JSON")  # Python's json would take NaN, Infinity


#: Member names a server reads; some (Go's encoding/json, .NET) match names
#: without regard to case, and Go folds ``ſ`` to ``s`` and the Kelvin sign
#: to ``k``: the sidecar only changes a request whose every top-level name
#: is one of these exactly or none of them in any spelling.
_READ_NAMES = frozenset({"stream", "model", "stream_options"})


def _names_read_alike(request: dict[str, Any]) -> bool:
    folded = [name.casefold() for name in request]
    if len(set(folded)) != len(folded):
        return False  # "stream" and "Stream": which one does the upstream read?
    return all(
        name in _READ_NAMES or fold not in _READ_NAMES
        for name, fold in zip(request, folded, strict=True)
    )


def _names_the_option(value: Any) -> bool:
    """Whether any name or string in the request holds ``stream_options`` (decoded, any case)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "stream_options" in item.casefold():
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def usage_request(body: bytes) -> UsageRequest | None:
    """The body asking for ``include_usage``, or ``None`` if it is to be sent unchanged.

    Anything the sidecar cannot read with certainty goes unchanged: bytes
    that are not UTF-8 (a splice into UTF-16 would break it), not one JSON
    object, nested past the parser's depth, with duplicate names or
    ``NaN``; a request that does not stream, names a model past
    :data:`MAX_MODEL_NAME`, already carries ``stream_options`` in any
    shape, or mentions ``stream_options`` anywhere (an upstream's error
    that quotes it could not be told from a refusal of the option).
    """
    try:
        text = body.decode("utf-8")
        request: Any = json.loads(text, object_pairs_hook=_members, parse_constant=_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict) or request.get("stream") is not True:
        return None
    if not _names_read_alike(request):
        return None
    model = request.get("model", "")
    if not isinstance(model, str) or len(model) > MAX_MODEL_NAME:
        return None
    # The client's own stream_options, in whatever shape (the upstream reads
    # it its own way), or the name anywhere, maybe spelt with escapes.
    if ("stream_options" in text.casefold() or "\\" in text) and _names_the_option(request):
        return None
    # The object's closing brace: the last byte but JSON whitespace.
    end = len(body.rstrip(b" \t\r\n")) - 1
    return UsageRequest(body[:end] + INCLUDE_USAGE + body[end:], model)


def without_usage_null(raw: bytes) -> bytes:
    """An event block without the ``"usage": null`` field the injected option added."""
    if b'"usage"' not in raw:
        return raw
    return _USAGE_NULL.sub(b"", raw, count=1)


# The option as the sidecar added it, quoted back: as JSON (maybe inside a
# JSON string) or as Python's repr of it (pydantic's "input" in vLLM's 400s).
_QUOTED_OPTION = re.compile(
    rb"""\\?["']stream_options\\?["']\s*:\s*\{\s*\\?["']include_usage\\?["']\s*:\s*(?:true|True)\s*\}"""
)


def refuses_stream_options(status: int, body: bytes) -> bool:
    """The upstream's answer refuses the injected option: a 400 that names it.

    Named, not quoted: a validation error that echoes the request (vLLM
    writes pydantic's ``input``) holds the added member whatever its
    cause; only a mention of ``stream_options`` outside such a quote
    blames the option. The client's own body never names it (or the
    request would not have been changed).
    """
    if status != 400 or b"stream_options" not in body:
        return False
    return b"stream_options" in _QUOTED_OPTION.sub(b"", body)
