"""Streams for the output-filter tests: one writer per dialect, and a relay to run them through.

Every stream is built from text pieces by one writer per dialect, the way its
provider writes it (compact JSON), so the expected output of a filtered
stream can be built by the same writer from pieces redacted by hand. The
core's filter tests (tests/core/test_filters*.py) and the faces' ones
(tests/faces/test_filters_faces.py, the Responses WebSocket's in
tests/sidecar/) share them, and the two readers at the end.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import httpx
import openai

from streamwarden.core.filters import REDACTED, FilterRule, compile_filters
from streamwarden.core.relay import Limits, Relay
from streamwarden.core.usage import UsageRole
from streamwarden.pipeline.transforms import with_transforms

SECRET = "sk-proj-Q7eXg9TzK2mLw4RbN8vYc1HdJ"  # the shape of an OpenAI key, not a key
LIMITS = Limits(15.0, 60.0, 1800.0, 1 << 20)

REDACT = (FilterRule("builtin", "secrets", "redact", "secrets"),)
BLOCK = (FilterRule("builtin", "secrets", "block", "secrets"),)


def compact_json(value: Any) -> str:
    """JSON as the providers write it: no spaces, non-ASCII as it is."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# -- one writer per dialect: (path, content type, headers, events, closing) -------------


def openai_chat(pieces: list[str]) -> bytes:
    out = [
        "data: "
        + compact_json({"id": "c1", "choices": [{"index": 0, "delta": {"content": p}}]})
        + "\n\n"
        for p in pieces
    ]
    return ("".join(out) + "data: [DONE]\n\n").encode()


def anthropic(pieces: list[str]) -> bytes:
    def block(kind: str, data: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {compact_json({'type': kind, **data})}\n\n"

    out = [block("message_start", {"message": {"id": "m1", "usage": {"output_tokens": 1}}})]
    out.append(block("content_block_start", {"index": 0}))
    out += [
        block("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": p}})
        for p in pieces
    ]
    out.append(block("content_block_stop", {"index": 0}))
    out.append(block("message_stop", {}))
    return "".join(out).encode()


def cohere(pieces: list[str]) -> bytes:
    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {compact_json({'type': kind, **data})}\n\n"

    out = [event("message-start", id="m1", delta={"message": {"role": "assistant"}})]
    out.append(event("content-start", index=0, delta={"message": {"content": {"text": ""}}}))
    out += [
        event("content-delta", index=0, delta={"message": {"content": {"text": p}}}) for p in pieces
    ]
    out.append(event("content-end", index=0))
    usage = {"tokens": {"output_tokens": 3}}
    out.append(event("message-end", delta={"finish_reason": "COMPLETE", "usage": usage}))
    return "".join(out).encode()


def responses(pieces: list[str]) -> bytes:
    """As the Responses API writes it: the deltas, then the whole text again, four times."""

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {compact_json({'type': kind, **data})}\n\n"

    text = "".join(pieces)
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "annotations": [], "text": text}
    item = {"id": "msg_1", "type": "message", "status": "completed", "content": [part]}
    out = [event("response.created", response={"id": "r1", "status": "in_progress", "output": []})]
    added = {**item, "status": "in_progress", "content": [], "role": "assistant"}
    out.append(event("response.output_item.added", output_index=0, item=added))
    out.append(event("response.content_part.added", **where, part={**part, "text": ""}))
    out += [event("response.output_text.delta", **where, delta=p) for p in pieces]
    out.append(event("response.output_text.done", **where, text=text))
    out.append(event("response.content_part.done", **where, part=part))
    out.append(
        event("response.output_item.done", output_index=0, item={**item, "role": "assistant"})
    )
    done = {"id": "r1", "status": "completed", "output": [item], "usage": {"output_tokens": 3}}
    out.append(event("response.completed", response=done))
    return "".join(out).encode()


def gemini(pieces: list[str]) -> bytes:
    def chunk(text: str, finish: bool) -> str:
        candidate: dict[str, Any] = {"content": {"parts": [{"text": text}], "role": "model"}}
        if finish:
            candidate["finishReason"] = "STOP"
        return "data: " + compact_json({"candidates": [candidate]}) + "\r\n\r\n"

    return "".join(chunk(p, i == len(pieces) - 1) for i, p in enumerate(pieces)).encode()


def ollama(pieces: list[str]) -> bytes:
    out = [
        compact_json({"model": "m", "message": {"role": "assistant", "content": p}, "done": False})
        + "\n"
        for p in pieces
    ]
    out.append(compact_json({"model": "m", "done": True, "eval_count": 3}) + "\n")
    return "".join(out).encode()


def vercel(pieces: list[str]) -> bytes:
    out = [f"0:{compact_json(p)}\n" for p in pieces]
    out.append('d:{"finishReason":"stop","usage":{"completionTokens":3}}\n')
    return "".join(out).encode()


def tgi(pieces: list[str]) -> bytes:
    """TGI's /generate_stream: a token an event, the last one with the whole text again."""

    def event(index: int, text: str) -> str:
        last = index == len(pieces) - 1
        token = {"id": index, "text": text, "logprob": -0.25, "special": False}
        details = {"finish_reason": "length", "generated_tokens": len(pieces), "seed": None}
        data = {
            "index": index + 1,
            "token": token,
            "generated_text": "".join(pieces) if last else None,
            "details": details if last else None,
        }
        # (TGI writes "data:" with no space; a rewritten event gets one, as
        # every writer here has it: the same event to any SSE reader.)
        return f"data: {compact_json(data)}\n\n"

    return "".join(event(i, p) for i, p in enumerate(pieces)).encode()


def generic(pieces: list[str]) -> bytes:
    return "".join(f"data: {p}\n\n" for p in pieces).encode()


def text_lines(pieces: list[str]) -> bytes:
    """NDJSON not in Ollama's shape, each line its own text (any line without ``done``)."""
    return "".join(f"{p}\n" for p in pieces).encode()


def json_lines(pieces: list[str]) -> bytes:
    """NDJSON objects not in Ollama's shape: the filters read each line whole, as inspect does."""
    return "".join(compact_json({"text": p}) + "\n" for p in pieces).encode()


Writer = Callable[[list[str]], bytes]
DIALECTS: dict[str, tuple[Writer, str, str, dict[str, str]]] = {
    "openai-chat": (openai_chat, "/v1/chat/completions", "text/event-stream", {}),
    "anthropic": (anthropic, "/v1/messages", "text/event-stream", {}),
    "openai-responses": (responses, "/v1/responses", "text/event-stream", {}),
    "gemini": (gemini, "/v1beta/models/g:streamGenerateContent", "text/event-stream", {}),
    "cohere": (cohere, "/v2/chat", "text/event-stream", {}),
    "ndjson": (ollama, "/api/chat", "application/x-ndjson", {}),
    "vercel-ai": (vercel, "/api/chat", "text/plain", {"x-vercel-ai-data-stream": "v1"}),
    "generic": (generic, "/events", "text/event-stream", {}),
    "tgi": (tgi, "/generate_stream", "text/event-stream", {}),
    "ndjson-text": (text_lines, "/stream", "application/x-ndjson", {}),
}
LINES = ("ndjson", "vercel-ai", "ndjson-text")


def relay(
    dialect: str,
    rules: tuple[FilterRule, ...] = (),
    tools: bool = False,
    *,
    usage: UsageRole = None,
) -> Relay:
    _, path, content_type, headers = DIALECTS[dialect]
    return with_transforms(
        Relay(
            LIMITS,
            started_at=0.0,
            now=0.0,
            path=path,
            content_type=content_type,
            headers=headers,
        ),
        filters=compile_filters(rules, tools),
        usage=usage,
    )


def run(r: Relay, reads: list[bytes]) -> bytes:
    out = b"".join(r.feed(read, float(i)) for i, read in enumerate(reads))
    return out + r.upstream_eof(float(len(reads)))


def split_secret(text: str, secret: str, events: int) -> list[str]:
    """``text`` cut into pieces so that ``secret`` (inside it) spans ``events`` of them."""
    start = text.index(secret)
    cuts = [start + round(i * len(secret) / events) for i in range(1, events)]
    bounds = [0, start - 4, start + 1, *cuts, start + len(secret) - 1, len(text)]
    bounds = sorted(set(bounds))
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def redacted_pieces(pieces: list[str], secret: str) -> list[str]:
    """The pieces as a client must see them: ``[redacted]`` where the secret begins."""
    text = "".join(pieces)
    start = text.index(secret)
    end = start + len(secret)
    out: list[str] = []
    offset = 0
    for piece in pieces:
        lo, hi = offset, offset + len(piece)
        keep = piece[: max(0, min(hi, start) - lo)] + (REDACTED if lo <= start < hi else "")
        keep += piece[max(0, end - lo) :] if hi > end else ""
        out.append(keep)
        offset = hi
    return out


TEXT = f"Your key is {SECRET} and nothing else, keep it safe."


def events_of(stream: bytes, dialect: str) -> list[str]:
    text = stream.decode()
    if dialect in LINES:
        return text.splitlines(keepends=True)
    sep = "\r\n\r\n" if dialect == "gemini" else "\n\n"
    return [part + sep for part in text.split(sep)[:-1]]


# -- readers through a face ---------------------------------------------------------

ASK: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "key?"}]}


async def responses_answer(base: str) -> tuple[str, str, str]:
    """The Responses API's answer as the SDK gives it: the deltas, and the final response's
    ``output_text`` both from ``responses.create(stream=True)`` and ``responses.stream``."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k")
    async with client:
        stream = await client.responses.create(model="m", input="key?", stream=True)
        deltas = final = ""
        async for event in stream:
            if event.type == "response.output_text.delta":
                deltas += event.delta
            elif event.type == "response.completed":
                final = event.response.output_text
        async with client.responses.stream(model="m", input="key?") as helper:
            async for _ in helper:
                pass
            accumulated = (await helper.get_final_response()).output_text
        return deltas, final, accumulated


async def raw(base: str, path: str = "/v1/chat/completions") -> bytes:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.post(base + path, json=ASK)).content
