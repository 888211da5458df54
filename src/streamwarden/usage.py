"""Usage injection, with no I/O: ask an OpenAI-style upstream for exact usage, invisibly.

OpenAI's Chat Completions API (and vLLM, SGLang, llama.cpp's server...)
streams a token count only when the request asks for it with
``"stream_options": {"include_usage": true}``; otherwise the sidecar can
only estimate. With ``usage_injection: auto`` the sidecar adds that option
to a streaming request that did not ask for it (:func:`inject_usage`),
then takes back from the response what the option added
(:func:`without_usage_null`, and the relay drops the usage-only chunk),
so that the client receives exactly the bytes it would have received
without it, while the meter gets the provider's own count.

What the option adds, per the API: every chunk carries ``"usage": null``,
and one last chunk before ``[DONE]`` has ``"choices": []`` and the usage.

Bodies that are not a JSON object, do not stream, already ask for usage,
or are larger than the configured bound are sent unchanged. An upstream
that refuses the option (old vLLM answers 400 naming ``stream_options``:
:func:`refuses_stream_options`) gets the request again as the client sent
it, and the face stops injecting there for a while.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["inject_usage", "refuses_stream_options", "without_usage_null"]

# "usage": null with the comma that joined it to its neighbour (either
# side), whatever the spacing; only in chunks of a stream whose request the
# sidecar changed.
_USAGE_NULL = re.compile(rb',\s*"usage"\s*:\s*null(?=\s*[,}])|"usage"\s*:\s*null\s*,')


def inject_usage(body: bytes) -> bytes | None:
    """The body asking for ``include_usage``, or ``None`` if it is to be sent unchanged."""
    try:
        request: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict) or request.get("stream") is not True:
        return None
    options = request.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        return None  # the client's own odd value: not ours to fix
    if options.get("include_usage") is True:
        return None  # asked for by the client: it gets it, nothing to take back
    request["stream_options"] = {**options, "include_usage": True}
    return json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode()


def without_usage_null(raw: bytes) -> bytes:
    """An event block without the ``"usage": null`` field the injected option added."""
    if b'"usage"' not in raw:
        return raw
    return _USAGE_NULL.sub(b"", raw, count=1)


def refuses_stream_options(status: int, body: bytes) -> bool:
    """The upstream's answer refuses the injected option (a 400 that names it)."""
    return status == 400 and b"stream_options" in body
