"""Header rules shared by both faces: hop-by-hop headers and streamed-response headers.

Pure functions over ``(name, value)`` pairs, so the aiohttp sidecar and the
ASGI middleware apply exactly the same rules.

- Hop-by-hop headers describe one connection, not the message: a proxy
  removes every header the ``Connection`` header names, then the fixed list
  (RFC 9110 section 7.6.1), on requests and on responses.
- A streamed response must not be buffered or transformed by anything
  between us and the client: ``Cache-Control`` gains ``no-cache`` and
  ``no-transform`` (keeping the app's other directives),
  ``X-Accel-Buffering: no`` turns off nginx's response buffering, and no
  ``Content-Length`` is sent since the length is not known.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import parse_qsl, quote

__all__ = [
    "CREDENTIAL_HEADERS",
    "CREDENTIAL_QUERY_PARAMETERS",
    "HOP_BY_HOP",
    "SECRET_HEADERS",
    "credential_parts",
    "drop_hop_by_hop",
    "merge_cache_control",
    "redact",
    "redact_url",
    "stream_response_headers",
]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "proxy-connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)

#: Headers whose values never reach a log line.
SECRET_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "api-key",
        "cookie",
        "set-cookie",
        "x-goog-api-key",
    }
)

#: Request headers that say who is asking, in every dialect's API. What a
#: request may be shown or changed by is decided per value of these: the
#: owner of a resumable stream, the kind of a request whose upstream habit
#: usage injection learns.
CREDENTIAL_HEADERS = (
    "authorization",  # OpenAI and its compatibles, Vertex AI, bearer tokens
    "proxy-authorization",  # a client's credential for a proxy on the way
    "x-api-key",  # Anthropic
    "api-key",  # Azure OpenAI
    "x-goog-api-key",  # Gemini (google-genai)
    "cookie",  # a browser's session
)
#: Query parameters that carry a credential: what a client may put in the URL.
CREDENTIAL_QUERY_PARAMETERS = (
    "key",  # Gemini (?key=, its REST examples and older SDKs)
    "access_token",  # Google's OAuth token in the query
    "api_key",
    "api-key",
)

Pairs = Iterable[tuple[str, str]]


def credential_parts(
    headers: Pairs,
    query_string: str,
    header_names: Iterable[str] = CREDENTIAL_HEADERS,
    query_names: Iterable[str] = CREDENTIAL_QUERY_PARAMETERS,
) -> list[str]:
    """A request's credentials, one canonical ``name=value`` string each, in a fixed order.

    Names lower-case, in any order and number; a query parameter's name
    starts with ``?`` (no header name does) and its value is decoded one
    character a byte (latin-1: UTF-8's replacement would make ``?key=%FF``
    and ``?key=%FE`` one) and quoted again, so that no byte of it (a decoded
    ``%00`` or ``=``) can pass for a separator when the parts are joined. A
    header value holds no NUL (HTTP forbids it). Both the owner of a
    resumable stream and the kind of a usage-injected request are digests
    of these parts.
    """
    wanted = frozenset(name.lower() for name in header_names)
    seen = sorted(
        (name.lower(), value.strip()) for name, value in headers if name.lower() in wanted
    )
    parts = [f"{n}={v}" for n, v in seen]
    if query_string:
        params = frozenset(name.lower() for name in query_names)
        parts += sorted(
            f"?{name.lower()}={quote(value, safe='', encoding='latin-1')}"
            for name, value in parse_qsl(query_string, keep_blank_values=True, encoding="latin-1")
            if name.lower() in params
        )
    return parts


def drop_hop_by_hop(headers: Pairs) -> list[tuple[str, str]]:
    """``headers`` without the ones named by ``Connection`` and the fixed hop-by-hop list."""
    pairs = list(headers)
    named = set(HOP_BY_HOP)
    for name, value in pairs:
        if name.lower() == "connection":
            named.update(token.strip().lower() for token in value.split(",") if token.strip())
    return [(name, value) for name, value in pairs if name.lower() not in named]


def merge_cache_control(value: str | None) -> str:
    """``value`` with ``no-cache`` and ``no-transform`` added, other directives kept."""
    directives = [d.strip() for d in (value or "").split(",") if d.strip()]
    present = {d.split("=", 1)[0].strip().lower() for d in directives}
    for required in ("no-cache", "no-transform"):
        if required not in present:
            directives.append(required)
    return ", ".join(directives)


def stream_response_headers(
    headers: Pairs, *, drop_encoding: bool = False
) -> list[tuple[str, str]]:
    """The headers a streamed response leaves with.

    ``drop_encoding`` removes ``Content-Encoding`` when the body is forwarded
    decoded.
    """
    removed = {"content-length", "cache-control", "x-accel-buffering"}
    if drop_encoding:
        removed.add("content-encoding")
    cache_control: str | None = None
    out: list[tuple[str, str]] = []
    for name, value in headers:
        lower = name.lower()
        if lower == "cache-control":
            cache_control = value if cache_control is None else f"{cache_control}, {value}"
        if lower not in removed:
            out.append((name, value))
    out.append(("Cache-Control", merge_cache_control(cache_control)))
    out.append(("X-Accel-Buffering", "no"))
    return out


def redact(headers: Pairs, extra: Iterable[str] = ()) -> dict[str, str]:
    """Headers for a log line, with secret values replaced."""
    secret = SECRET_HEADERS | {name.lower() for name in extra}
    return {name: ("[redacted]" if name.lower() in secret else value) for name, value in headers}


def redact_url(url: str) -> str:
    """``url`` for a log line: no userinfo (passwords), no query (``?key=`` API keys)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.split("?", 1)[0]
    authority, slash, path = rest.partition("/")
    host = authority.rpartition("@")[2]
    path = path.split("?", 1)[0].split("#", 1)[0]
    return f"{scheme}://{host}{slash}{path}"
