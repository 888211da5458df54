"""The request side of the proxy: what the one upstream gets of a client's request.

Requests pass through unchanged (method, path, query, body streamed), minus
hop-by-hop headers and the headers that describe this hop's framing or
expectation, which the sidecar rebuilds (``Host``, ``Content-Length``,
``Transfer-Encoding``) or answers itself (``Expect``:
:func:`answer_continue`), plus ``X-Forwarded-*``. Only a hop listed in
``trusted_proxies`` may say who the client is. The upstream is the
configured one, with its path prefix and, if its URL has them, its
credentials: a request can never choose it (no open proxy).
"""

from __future__ import annotations

import base64
import ipaddress
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from streamwarden.config import ResolvedRoute, Settings
from streamwarden.core.headers import drop_hop_by_hop
from streamwarden.core.refusals import RefusalKind
from streamwarden.net.upstream import Origin, RequestBody, request_head
from streamwarden.pipeline.request import IncomingRequest, RequestRefused, Rewrite

if TYPE_CHECKING:
    from streamwarden.observation.telemetry import RequestTrace

__all__ = [
    "TRACE",
    "ClientBody",
    "Forwarding",
    "answer_continue",
    "describe",
    "idempotent",
    "trace_of",
]

# Request headers that describe this hop's message framing or expectation,
# rebuilt (or answered) by the sidecar itself.
_REBUILT = frozenset({"host", "expect", "content-length", "transfer-encoding"})
# Methods whose requests may be sent twice (RFC 9110 section 9.2.2).
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
#: Where a request keeps its OpenTelemetry spans (a typed key where aiohttp
#: has them, 3.13 and later).
TRACE: Any = (
    web.RequestKey("streamwarden_trace", object)
    if hasattr(web, "RequestKey")
    else "streamwarden.trace"
)


def trace_of(request: web.BaseRequest) -> RequestTrace | None:
    """The request's OpenTelemetry spans, when telemetry is on."""
    trace: RequestTrace | None = request.get(TRACE)
    return trace


def idempotent(request: web.BaseRequest) -> bool:
    """Whether the request may be sent again (on a pooled connection that turned out dead)."""
    return request.method in _IDEMPOTENT or "Idempotency-Key" in request.headers


class Forwarding:
    """How this sidecar forwards requests: the upstream's address, its credentials, trusted hops."""

    __slots__ = (
        "_authorization",
        "_body_limit",
        "_prefix",
        "_preserve_host",
        "_trusted_networks",
        "_ws_base",
        "origin",
    )

    def __init__(self, settings: Settings) -> None:
        upstream = settings.upstream
        if upstream is None:
            raise ValueError("an upstream is required")
        self._authorization: str | None = None
        if upstream.startswith("unix:"):
            #: Where the upstream's connections go.
            self.origin = Origin("http", "localhost", 80, upstream[len("unix:") :])
            self._prefix = ""
            self._ws_base = "http://localhost"
        else:
            url = URL(upstream)
            assert url.host is not None and url.port is not None
            self.origin = Origin(url.scheme, url.host, url.port)
            self._prefix = url.raw_path.rstrip("/")
            self._ws_base = str(url.with_user(None).with_password(None)).rstrip("/")
            if url.user is not None:
                # Credentials in the configured upstream URL are the
                # operator's: they are sent on every request, in place of
                # any Authorization the client sent (documented in README).
                token = f"{url.user}:{url.password or ''}".encode()
                self._authorization = "Basic " + base64.b64encode(token).decode()
        self._preserve_host = settings.preserve_host
        self._body_limit = settings.max_request_body_bytes
        self._trusted_networks = tuple(ipaddress.ip_network(n) for n in settings.trusted_proxies)

    def websocket_url(self, request: web.BaseRequest) -> URL:
        """The upstream URL of a WebSocket upgrade."""
        return URL(self._ws_base + request.raw_path, encoded=True)

    def headers(self, request: web.BaseRequest) -> CIMultiDict[str]:
        """The request's headers as the upstream gets them."""
        headers: CIMultiDict[str] = CIMultiDict(drop_hop_by_hop(request.headers.items()))
        for name in _REBUILT:
            headers.popall(name, None)
        headers["Host"] = (
            request.headers.get("Host", self.origin.host_header)
            if self._preserve_host
            else self.origin.host_header
        )
        remote = request.remote or ""
        forwarded_for = request.headers.get("X-Forwarded-For")
        trusted = self._trusted(remote)
        if forwarded_for and trusted:
            headers["X-Forwarded-For"] = f"{forwarded_for}, {remote}"
        else:
            headers["X-Forwarded-For"] = remote
        if not trusted:
            # Only a trusted hop may say who the client is: from anyone else
            # these would let a client lie to an upstream that believes them.
            headers.popall("Forwarded", None)
            headers["X-Real-IP"] = remote
        headers["X-Forwarded-Proto"] = request.scheme
        headers["X-Forwarded-Host"] = request.host
        trace = trace_of(request)
        if trace is not None:
            # The upstream call's own context, so the server's spans join the trace.
            headers.popall("traceparent", None)
            headers.popall("tracestate", None)
            headers.update(trace.upstream_headers())
        if self._authorization is not None:
            headers["Authorization"] = self._authorization
        return headers

    def _trusted(self, peer: str) -> bool:
        if not self._trusted_networks or not peer:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False  # a unix-socket peer, say
        return any(address in network for network in self._trusted_networks)

    def body(
        self, request: web.BaseRequest, start: bytes, rewritten: Rewrite | None = None
    ) -> RequestBody | None:
        """The request's body, from its first bytes (``start``) on, or the rewritten one."""
        if not request.body_exists:
            return None
        if rewritten is not None:
            return self.whole_body(rewritten.body)
        content = request.content
        rest = None if content.at_eof() else content.iter_any()
        return RequestBody(
            start=start, rest=rest, chunked=request.content_length is None, limit=self._body_limit
        )

    def whole_body(self, body: bytes) -> RequestBody:
        """A body the sidecar holds whole (rewritten, or the client's own sent again)."""
        return RequestBody(start=body, rest=None, chunked=False, limit=self._body_limit)

    def head(
        self,
        request: web.BaseRequest,
        body: RequestBody | None,
        rewritten: Rewrite | None = None,
        length: int | None = None,
    ) -> bytes:
        """The request's head as the upstream gets it, framed for ``body``."""
        headers = self.headers(request)
        if rewritten is not None:
            length = len(rewritten.body)
        if body is not None and body.chunked:
            headers["Transfer-Encoding"] = "chunked"
        elif length is not None:
            headers["Content-Length"] = str(length)
        elif request.content_length is not None:
            headers["Content-Length"] = str(request.content_length)
        return request_head(request.method, self._prefix + request.raw_path, headers.items())


async def answer_continue(request: web.BaseRequest) -> bool:
    """Answer ``Expect: 100-continue`` before the body is read; ``False`` for any other.

    The sidecar answers it itself and never forwards ``Expect``: an upstream
    that ignores the header would hold the body (and the client) forever.
    """
    if request.headers["Expect"].strip().lower() != "100-continue":
        return False
    if request.version >= aiohttp.HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response itself has not started
    return True


class ClientBody:
    """A client's request body, as the pipeline's request step reads it (a RequestBody)."""

    __slots__ = ("_request", "_start")

    #: The sidecar forwards the body itself: its first bytes are always read.
    lazy = False

    def __init__(self, request: web.BaseRequest) -> None:
        self._request = request
        self._start: bytes | None = None

    async def start(self) -> bytes:
        """Enough of the body to see ``"stream": true``; it is sent on unchanged."""
        if self._start is None:
            request = self._request
            if "Expect" in request.headers and not await answer_continue(request):
                raise RequestRefused(RefusalKind.EXPECTATION_FAILED)
            self._start = await request.content.readany()
        return self._start

    async def read_on(self, start: bytes, limit: int) -> tuple[bytes, bool]:
        """The body read on from ``start``, up to ``limit``: (bytes, whole)."""
        parts = [start]
        size = len(start)
        content = self._request.content
        while not content.at_eof() and size <= limit:
            chunk = await content.readany()
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        whole = content.at_eof() and size <= limit
        self._start = joined = b"".join(parts)
        return joined, whole


def describe(request: web.BaseRequest, route: ResolvedRoute) -> IncomingRequest:
    """The request as the pipeline's request step sees it."""
    return IncomingRequest(
        request.method,
        request.path,
        request.raw_path,
        request.rel_url.raw_query_string,
        request.headers.items(),
        route,
        request.host,
        request.content_length,
        ClientBody(request) if request.body_exists else None,
    )
