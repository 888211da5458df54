"""The streams of the transparency suite, the upstreams that replay them, and the comparison.

Every case is a body an upstream answers, as a function of the request it
got (a server that honours ``stream_options.include_usage`` answers
differently when asked), with its path, media type and headers. The
sources are the recorded corpus (``fixtures/streams``), the habits of
OpenAI-compatible servers seen in the wild, and generic shapes of event
streams (ids, ``retry:``, comments, CRLF, a BOM, gzip, a JSON body where a
stream was asked for).

The same case is served by a real aiohttp server (:class:`ReplayUpstream`,
for the sidecar) and by a raw ASGI app (:func:`replay_app`, for the
middleware), both writing it in the same pieces: one event (or line) per
write, one event cut in two (between a CR and its LF where there is one,
else in its middle, which may be inside a UTF-8 character). Both are
deterministic, so a direct answer and a proxied one can be compared byte
for byte; :func:`assert_same_events` allows only the documented additions
(keep-alive comments at event boundaries).
"""

from __future__ import annotations

import difflib
import json
import re
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aiohttp import web

from streamwarden.core.sse import SSEDecoder

__all__ = [
    "BODIES_SENT_UNCHANGED",
    "BODIES_SPLICED",
    "BOM",
    "CASES",
    "CASE_HEADER",
    "CHAT_PATH",
    "HABITS",
    "KEEPALIVE",
    "Case",
    "ChatHabit",
    "Framing",
    "ReplayUpstream",
    "Variant",
    "assert_same_events",
    "replay_app",
    "request_body",
    "sse_events",
    "variants",
]

STREAMS = Path(__file__).parent / "fixtures" / "streams"
MANIFEST: dict[str, dict[str, Any]] = json.loads((STREAMS / "manifest.json").read_text())
#: The only bytes either face may add between two events with the default config.
KEEPALIVE = b": keep-alive\n\n"
#: The request header that tells the replay which case to answer (passed on unchanged).
CASE_HEADER = "x-replay-case"
CHAT_PATH = "/v1/chat/completions"
BOM = b"\xef\xbb\xbf"

Framing = Literal["sse", "lines", "whole"]
Request = Mapping[str, Any]
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Case:
    """One upstream answer: what it says for a request, and how it is served."""

    name: str
    #: The request path, with its query.
    path: str
    content_type: str
    #: The body for the request's JSON (``{}`` if it is not a JSON object).
    answer: Callable[[Request], bytes]
    headers: tuple[tuple[str, str], ...] = ()
    framing: Framing = "sse"
    #: The client's requests: without (``False``) and with ``include_usage``.
    asks_usage: tuple[bool, ...] = (False,)
    #: Served gzip-encoded, each piece flushed (``Z_SYNC_FLUSH``) as a server does per event.
    gzip: bool = False


@dataclass(frozen=True, slots=True)
class Variant:
    """A case and the request the client sends for it."""

    case: Case
    asks_usage: bool

    @property
    def id(self) -> str:
        return f"{self.case.name}/{'asks-usage' if self.asks_usage else 'plain'}"


def variants(cases: Iterable[Case]) -> list[Variant]:
    return [Variant(case, asks) for case in cases for asks in case.asks_usage]


def request_body(asks_usage: bool) -> bytes:
    """What a client sends: a streaming chat request, with ``include_usage`` or without."""
    body: dict[str, Any] = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": "Say hi — 日本語"}],
    }
    if asks_usage:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, ensure_ascii=False).encode()


def _chat(rest: bytes) -> bytes:
    return b'{"model":"m","stream":true' + rest + b"}"


#: Streaming chat bodies that an upstream takes and that clients do send
#: (name, bytes), for usage injection's request side: those the sidecar
#: cannot read exactly as any JSON parser would, or that carry their own
#: ``stream_options`` in a shape servers read differently, reach the
#: upstream byte for byte as sent...
BODIES_SENT_UNCHANGED = [
    ("stream-options-empty", _chat(b',"stream_options":{}')),  # vLLM: asks for usage
    ("stream-options-one", _chat(b',"stream_options":{"include_usage":1}')),
    ("stream-options-string", _chat(b',"stream_options":{"include_usage":"true"}')),
    ("stream-options-false", _chat(b',"stream_options":{"include_usage":false}')),
    ("stream-options-null", _chat(b',"stream_options":null')),
    ("stream-options-odd", _chat(b',"stream_options":"odd"')),
    ("duplicate-stream", b'{"model":"m","stream":false,"stream":true}'),
    ("nan", _chat(b',"temperature":NaN')),
    ("deep", _chat(b',"x":' + b"[" * 3000 + b"]" * 3000)),
    ("names-the-option", _chat(b',"messages":[{"role":"user","content":"stream_options?"}]')),
    ("names-it-escaped", _chat(b',"messages":[{"role":"user","content":"stream\\u005foptions"}]')),
    ("utf-16", '{"model":"m","stream":true}'.encode("utf-16")),
    ("bom", b"\xef\xbb\xbf" + _chat(b"")),
    # Names some parsers match without regard to case (Go, .NET), or with
    # Go's folding of the long s: which member would the upstream read?
    ("case-stream-options", _chat(b',"Stream_Options":{"include_usage":true}')),
    ("case-stream", b'{"model":"m","stream":true,"STREAM":false}'),
    ("long-s-stream-options", _chat(b',"\\u017ftream_options":{"include_usage":true}')),
    ("not-json", b'not json at all, but asking for a stream: "stream": true'),
    ("not-an-object", b'[{"model":"m","stream":true}]'),
]
#: ... and the others get exactly the added member's bytes, spliced in before
#: the closing brace: no number, escape or space of the client's re-written.
BODIES_SPLICED = [
    # What a JavaScript client writes when it cuts a string inside an emoji.
    ("lone-surrogate", _chat(b',"messages":[{"role":"user","content":"cut \\ud83d"}]')),
    ("huge-exponent", _chat(b',"temperature":1e400')),
    ("upper-exponent", _chat(b',"temperature":1E0,"top_p":-0.0')),
    ("nested", _chat(b',"x":' + b"[" * 100 + b"]" * 100)),
    ("raw-unicode", _chat(',"messages":[{"content":"日本語 🙂"}]'.encode())),
    ("spaced", b'{ "model" : "m" ,\n "stream" : true }'),
]


def asks_for_usage(request: Request) -> bool:
    options = request.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _parsed(body: bytes) -> Request:
    try:
        request = json.loads(body)
    except ValueError:
        return {}
    return request if isinstance(request, dict) else {}


# -- OpenAI chat streams and the habits of the servers that write them --------------------

PIECES = ("Hel", "lo", " —", " 日本語", " 😀")
PROMPT_TOKENS = 9


def chat_stream(
    *, choices: int = 1, usage: bool = False, nulls: bool = False, spaced: bool = False
) -> bytes:
    """A chat completion stream: role chunk, one chunk per piece, finish, usage, ``[DONE]``.

    ``nulls``: every chunk but the usage chunk carries ``"usage": null``.
    ``usage``: a last chunk with ``"choices": []`` and the count. With
    ``choices`` > 1 (a request with ``n``) every step has one chunk per
    choice, in index order. ``spaced`` writes JSON as Python's ``json.dumps``
    does by default (``", "`` and ``": "``), as a Python app relaying a
    stream may.
    """
    separators = (", ", ": ") if spaced else (",", ":")

    def event(data: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(data, ensure_ascii=False, separators=separators).encode()

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        data: dict[str, Any] = {
            "id": "chatcmpl-Tr4nsp4r3ncyCh3ck",
            "object": "chat.completion.chunk",
            "created": 1757435012,
            "model": "m",
            "choices": [
                {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            ],
        }
        if nulls:
            data["usage"] = None
        return event(data)

    events: list[bytes] = []
    for index in range(choices):
        events.append(chunk(index, {"role": "assistant", "content": ""}))
    for piece in PIECES:
        for index in range(choices):
            events.append(chunk(index, {"content": piece}))
    for index in range(choices):
        events.append(chunk(index, {}, "stop"))
    if usage:
        completion = len(PIECES) * choices
        count = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": completion,
            "total_tokens": PROMPT_TOKENS + completion,
        }
        events.append(
            event(
                {
                    "id": "chatcmpl-Tr4nsp4r3ncyCh3ck",
                    "object": "chat.completion.chunk",
                    "created": 1757435012,
                    "model": "m",
                    "choices": [],
                    "usage": count,
                }
            )
        )
    events.append(b"data: [DONE]")
    return b"".join(e + b"\n\n" for e in events)


When = Literal["always", "asked", "never"]


@dataclass(frozen=True, slots=True)
class ChatHabit:
    """How an OpenAI-compatible server answers ``include_usage``, asked or not."""

    name: str
    #: When the usage chunk (``"choices": []``) is sent.
    usage: When
    #: When every other chunk carries ``"usage": null``.
    nulls: When
    choices: int = 1
    spaced: bool = False

    def answer(self, request: Request) -> bytes:
        asked = asks_for_usage(request)
        return chat_stream(
            choices=self.choices,
            usage=self.usage == "always" or (self.usage == "asked" and asked),
            nulls=self.nulls == "always" or (self.nulls == "asked" and asked),
            spaced=self.spaced,
        )


HABITS = {
    habit.name: habit
    for habit in (
        # vLLM with --enable-force-include-usage: the count whatever the request.
        ChatHabit("force-usage", usage="always", nulls="never"),
        # Hosted APIs that always count: "usage": null on each chunk, then the count.
        ChatHabit("force-usage-with-nulls", usage="always", nulls="always"),
        # Servers that ignore stream_options: never a count, even when asked.
        ChatHabit("usage-never", usage="never", nulls="never"),
        # SGLang-like: "usage": null on every chunk, the count only when asked.
        ChatHabit("nulls-always-usage-when-asked", usage="asked", nulls="always"),
        # OpenAI itself: both only when asked.
        ChatHabit("like-openai", usage="asked", nulls="asked"),
        # vLLM without the flag: the count when asked, no nulls.
        ChatHabit("like-vllm", usage="asked", nulls="never"),
        # n = 2: two choices interleaved, OpenAI's way.
        ChatHabit("two-choices", usage="asked", nulls="asked", choices=2),
        # A Python app relaying with json.dumps: ", " and ": ".
        ChatHabit("like-openai-spaced-json", usage="asked", nulls="asked", spaced=True),
    )
}


# -- generic shapes, over the stream of a server that honours the option like OpenAI ----------


def _event_blocks(body: bytes) -> list[bytes]:
    return [block + b"\n\n" for block in body.split(b"\n\n") if block]


def with_ids(body: bytes) -> bytes:
    return b"".join(b"id: %d\n" % n + block for n, block in enumerate(_event_blocks(body), 1))


def with_retry(body: bytes) -> bytes:
    blocks = _event_blocks(body)
    blocks[2] = b"retry: 2500\n" + blocks[2]
    return b"retry: 3000\n\n" + b"".join(blocks)


def with_comments(body: bytes) -> bytes:
    # OpenRouter's own comment while the model is queued, and one inside an event.
    blocks = _event_blocks(body)
    blocks[3] = b": inside an event\n" + blocks[3]
    return b": OPENROUTER PROCESSING\n\n" * 2 + b"".join(blocks)


def chat_shape(name: str, shape: Callable[[bytes], bytes], **options: Any) -> Case:
    like_openai = HABITS["like-openai"]
    return Case(
        f"shape/{name}",
        CHAT_PATH,
        "text/event-stream; charset=utf-8",
        lambda request: shape(like_openai.answer(request)),
        **options,
    )


def _json_reply(request: Request) -> bytes:
    """A whole chat completion, as OpenAI indents it, answered to ``stream: true``."""
    reply = {
        "id": "chatcmpl-Tr4nsp4r3ncyCh3ck",
        "object": "chat.completion",
        "created": 1757435012,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(PIECES), "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 5, "total_tokens": 14},
    }
    return (json.dumps(reply, ensure_ascii=False, indent=2) + "\n").encode()


SHAPES = [
    chat_shape("upstream-ids", with_ids),
    chat_shape("retry-fields", with_retry),
    chat_shape("upstream-comments", with_comments),
    chat_shape("crlf", lambda body: body.replace(b"\n", b"\r\n")),
    chat_shape("cr", lambda body: body.replace(b"\n", b"\r")),
    chat_shape("bom", lambda body: BOM + body),
    chat_shape("gzip", lambda body: body, gzip=True),
    Case(
        "shape/bom-generic",
        "/events",
        "text/event-stream",
        lambda request: BOM + (STREAMS / "generic.sse").read_bytes(),
    ),
    Case("shape/json-body", CHAT_PATH, "application/json", _json_reply, framing="whole"),
]


# -- the recorded corpus ---------------------------------------------------------------


def _corpus_case(name: str, entry: Mapping[str, Any]) -> Case:
    body = (STREAMS / name).read_bytes()
    query = entry.get("request_query")
    return Case(
        f"corpus/{name}",
        entry["request_path"] + (f"?{query}" if query else ""),
        entry["content_type"],
        lambda request: body,
        headers=tuple(entry["headers"].items()),
        framing=entry["framing"],
        # The chat recordings answer a request with include_usage (they end in the
        # usage chunk): replayed, they answer that request.
        asks_usage=(entry["dialect"] == "openai-chat",),
    )


CORPUS = [_corpus_case(name, entry) for name, entry in MANIFEST.items()]
HABIT_CASES = [
    Case(
        f"habit/{habit.name}",
        CHAT_PATH,
        "text/event-stream; charset=utf-8",
        habit.answer,
        asks_usage=(False, True),
    )
    for habit in HABITS.values()
]
CASES = [*CORPUS, *HABIT_CASES, *SHAPES]


# -- serving a case in pieces --------------------------------------------------------------

_BLANK_LINE = re.compile(rb"(?:\r\n|\r|\n)(?:\r\n|\r|\n)")
_NEWLINE = re.compile(rb"\n")


def blocks(body: bytes, framing: Framing) -> list[bytes]:
    """``body`` cut after each event block (SSE) or line; whatever remains is the last."""
    if framing == "whole":
        third = max(1, len(body) // 3)
        return [p for p in (body[:third], body[third : 2 * third], body[2 * third :]) if p]
    pattern = _BLANK_LINE if framing == "sse" else _NEWLINE
    out: list[bytes] = []
    start = 0
    for match in pattern.finditer(body):
        out.append(body[start : match.end()])
        start = match.end()
    if start < len(body):
        out.append(body[start:])
    return out


def pieces(case: Case, body: bytes) -> list[bytes]:
    """The writes of ``body``: one per block, the middle block cut in two."""
    parts = blocks(body, case.framing)
    middle = len(parts) // 2
    block = parts[middle]
    cut = block.find(b"\r\n") + 1 if b"\r\n" in block else len(block) // 2
    parts[middle : middle + 1] = [p for p in (block[:cut], block[cut:]) if p]
    if not case.gzip:
        return parts
    deflate = zlib.compressobj(wbits=31)  # gzip
    out = [deflate.compress(p) + deflate.flush(zlib.Z_SYNC_FLUSH) for p in parts]
    out.append(deflate.flush())
    return out


def response_head(case: Case, body: bytes) -> list[tuple[str, str]]:
    head = [("Content-Type", case.content_type), *case.headers]
    if case.gzip:
        head.append(("Content-Encoding", "gzip"))
    elif case.framing == "whole":
        head.append(("Content-Length", str(len(body))))
    return head


class ReplayUpstream:
    """An aiohttp upstream answering each request with its case (named in ``CASE_HEADER``)."""

    def __init__(self, cases: Iterable[Case]) -> None:
        self.cases = {case.name: case for case in cases}
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.answer)

    async def answer(self, request: web.Request) -> web.StreamResponse:
        case = self.cases[request.headers[CASE_HEADER]]
        body = case.answer(_parsed(await request.read()))
        response = web.StreamResponse()
        for name, value in response_head(case, body):
            response.headers[name] = value
        await response.prepare(request)
        for piece in pieces(case, body):
            await response.write(piece)
        await response.write_eof()
        return response


def replay_app(cases: Iterable[Case]) -> ASGIApp:
    """The same answers as a raw ASGI app: one ``http.response.body`` message per piece."""
    by_name = {case.name: case for case in cases}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        parts: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        case = by_name[headers[CASE_HEADER]]
        body = case.answer(_parsed(b"".join(parts)))
        head = [(k.lower().encode(), v.encode()) for k, v in response_head(case, body)]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        for piece in pieces(case, body):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


# -- the comparison ---------------------------------------------------------------------------


def without_additions(direct: bytes, through: bytes, framing: Framing) -> bytes:
    """``through`` without the keep-alive frames it has at event boundaries beyond ``direct``'s.

    Walks both block by block: a block of ``through`` that is the next one of
    ``direct`` is kept; a keep-alive block that is not is an addition and
    is dropped; anything else is kept, so that the comparison fails. Only
    SSE streams may get keep-alives (line-framed ones and whole bodies get
    none, so nothing is dropped from them).
    """
    if framing != "sse":
        return through
    want = blocks(direct, "sse")
    kept: list[bytes] = []
    matched = 0
    for block in blocks(through, "sse"):
        if matched < len(want) and block == want[matched]:
            kept.append(block)
            matched += 1
        elif block != KEEPALIVE:
            kept.append(block)
    return b"".join(kept)


def sse_events(body: bytes) -> list[tuple[str, str, str | None]]:
    decoder = SSEDecoder()
    events = [*decoder.feed(body), *decoder.close()]
    return [(e.event, e.data, e.id) for e in events]


def as_forwarded(direct: bytes, framing: Framing) -> bytes:
    """``direct`` as both faces are documented to forward it: a leading BOM stripped.

    The framer strips a single leading UTF-8 BOM from the raw bytes (see
    :mod:`streamwarden.core.sse`: a keep-alive written before the first event
    would otherwise move it off the start of the stream); a doubled one is kept.
    """
    if framing == "sse" and direct.startswith(BOM) and not direct.startswith(BOM * 2):
        return direct[len(BOM) :]
    return direct


def assert_same_events(direct: bytes, through: bytes, framing: Framing, what: str) -> None:
    """``through`` is ``direct`` byte for byte, but for the documented additions.

    On a mismatch the message is a diff of the two, block by block (the raw
    bytes, ``repr``-ed), and of their decoded SSE events.
    """
    for expected in (direct, as_forwarded(direct, framing)):
        if without_additions(expected, through, framing) == expected:
            return
    raw = difflib.unified_diff(
        [repr(b) for b in blocks(direct, framing)],
        [repr(b) for b in blocks(through, framing)],
        "direct",
        what,
        lineterm="",
        n=1,
    )
    lines = [f"{what}: {len(through)} bytes, not the direct {len(direct)}", *list(raw)[:40]]
    if framing == "sse":
        mine, theirs = sse_events(direct), sse_events(through)
        lines.append(f"decoded: {len(theirs)} events, {len(mine)} directly")
        lines.extend(
            list(
                difflib.unified_diff(
                    [repr(e) for e in mine],
                    [repr(e) for e in theirs],
                    "direct events",
                    f"{what} events",
                    lineterm="",
                    n=0,
                )
            )[:20]
        )
    raise AssertionError("\n".join(lines))
