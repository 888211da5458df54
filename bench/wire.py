"""The few HTTP/1.1 and SSE bytes the benchmark's upstream and load client share.

Both ends are deliberately hand-rolled and minimal (no aiohttp, no h11): the
harness measures a proxy by the delay it adds, so the code on either side of
it must be cheaper per event than the proxy, or the harness would measure
itself. Each token event carries the upstream's send time as 19 decimal
digits of ``time.monotonic_ns()`` in the chunk's last member,
``obfuscation``, where OpenAI's chunks carry a string that changes from
chunk to chunk (padding against length side channels); CLOCK_MONOTONIC is
one system-wide clock on Linux, so the client (another process) subtracts
it from its own receive time. The ``id`` stays the same through a stream,
as a real server's completion id does. (Until 2026-12-03 the stamp was the
``id``, which made every chunk's first bytes differ, as no server's do.)
"""

from __future__ import annotations

#: What precedes the send stamp in every stamped event.
STAMP_MARK = b'"obfuscation":"'
STAMP_DIGITS = 19

# An OpenAI Chat Completions chunk as OpenAI sends it (about 260 bytes), so
# the proxies parse and meter exactly what they would in production.
_TOKEN_EVENT = (
    b'data: {"id":"chatcmpl-BqA7wYk3Zt0eLm4NcR9sXv2HdPfGu","object":"chat.completion.chunk",'
    b'"created":1700000000,"model":"bench-model","system_fingerprint":"fp_bench",'
    b'"choices":[{"index":0,"delta":{"content":"%s"},"logprobs":null,"finish_reason":null}],'
    b'"usage":null,"obfuscation":"%019d"}\n\n'
)
_FINAL_EVENTS = (
    b'data: {"id":"chatcmpl-BqA7wYk3Zt0eLm4NcR9sXv2HdPfGu","object":"chat.completion.chunk",'
    b'"created":1700000000,"model":"bench-model","system_fingerprint":"fp_bench",'
    b'"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":12,"completion_tokens":%d,"total_tokens":%d},'
    b'"obfuscation":"%019d"}\n\n'
    b"data: [DONE]\n\n"
)
_COMPLETION = (
    b'{"id":"chatcmpl-BqA7wYk3Zt0eLm4NcR9sXv2HdPfGu","object":"chat.completion",'
    b'"created":1700000000,"model":"bench-model","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"%s"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":12,"completion_tokens":%d,"total_tokens":%d},'
    b'"obfuscation":"%019d"}'
)
TOKENS = (b" The", b" quick", b" brown", b" fox", b" jumps", b" over", b" the", b" lazy", b" dog")

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: text/event-stream; charset=utf-8\r\n"
    b"Cache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n"
    b"\r\n"
)
LAST_CHUNK = b"0\r\n\r\n"

REQUEST_BODY = (
    b'{"model":"bench-model","stream":true,"stream_options":{"include_usage":true},'
    b'"messages":[{"role":"user","content":"Say something."}]}'
)


def token_event(stamp_ns: int, index: int) -> bytes:
    return _TOKEN_EVENT % (TOKENS[index % len(TOKENS)], stamp_ns)


def final_events(stamp_ns: int, tokens: int) -> bytes:
    return _FINAL_EVENTS % (tokens, tokens + 12, stamp_ns)


def completion_body(stamp_ns: int, tokens: int) -> bytes:
    text = b"".join(TOKENS[i % len(TOKENS)] for i in range(tokens))
    return _COMPLETION % (text, tokens, tokens + 12, stamp_ns)


def chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk: the whole event in one chunk, as a streaming server writes it."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def json_response(body: bytes, status: str = "200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        status.encode(),
        len(body),
        body,
    )


def request(host: str, port: int, target: str, body: bytes = REQUEST_BODY) -> bytes:
    """A POST as the OpenAI SDKs send it (the body says ``"stream": true``)."""
    return (
        b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
        b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
        % (target.encode(), host.encode(), port, len(body), body)
    )


def get(host: str, port: int, target: str) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (target.encode(), host.encode(), port)


class Head:
    """A parsed request or response head: first line and lower-cased headers."""

    __slots__ = ("first", "headers")

    def __init__(self, raw: bytes) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        self.first = lines[0]
        self.headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()

    @property
    def status(self) -> int:
        parts = self.first.split(" ", 2)
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0

    @property
    def chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("content-length")
        return int(value) if value is not None and value.isdigit() else None


class ChunkedDecoder:
    """Incremental decoder of an HTTP/1.1 chunked body; ``done`` after the last chunk.

    Proxies re-chunk as they please (nginx by read, aiohttp by write), so the
    client has to undo the framing before it can look for events.
    """

    __slots__ = ("_buf", "_need", "done")

    def __init__(self) -> None:
        self._buf = bytearray()
        # >0: payload bytes still due in this chunk; 0: a size line is next;
        # -1: the CRLF after a chunk's payload is next; -2: trailers are next.
        self._need = 0
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buf = self._buf
        buf += data
        out: list[bytes] = []
        pos = 0
        n = len(buf)
        while not self.done:
            need = self._need
            if need > 0:
                take = min(need, n - pos)
                if take <= 0:
                    break
                out.append(bytes(buf[pos : pos + take]))
                pos += take
                self._need = need - take
                if self._need:
                    break
                self._need = -1
            elif need == -1:
                if n - pos < 2:
                    break
                pos += 2
                self._need = 0
            elif need == -2:
                if buf.startswith(b"\r\n", pos):
                    pos += 2
                    self.done = True
                    break
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                pos = end + 4
                self.done = True
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
                pos = eol + 2
                self._need = size if size else -2
        del buf[:pos]
        return out[0] if len(out) == 1 else b"".join(out)

    def leftover(self) -> bytes:
        """Bytes after the last chunk (the next request on a kept-alive connection)."""
        return bytes(self._buf) if self.done else b""
