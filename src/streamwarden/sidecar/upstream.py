"""The sidecar's upstream client, by its old name: :mod:`streamwarden.upstream`.

The client moved out of the sidecar so that ``streamwarden probe`` can use
it without importing the face. Nothing in the project imports it from
here any more: this name stays for code outside that did, as a
deprecation path; new code imports :mod:`streamwarden.upstream`.
"""

from __future__ import annotations

from streamwarden.upstream import (
    BodySink,
    BodyTooLarge,
    ClientBodyBroken,
    Exchange,
    HeadTimeout,
    Origin,
    RequestBody,
    ResponseHead,
    UpstreamBroken,
    UpstreamConnection,
    UpstreamError,
    UpstreamPool,
    UpstreamUnreachable,
    open_exchange,
    request_head,
)

__all__ = [
    "BodySink",
    "BodyTooLarge",
    "ClientBodyBroken",
    "Exchange",
    "HeadTimeout",
    "Origin",
    "RequestBody",
    "ResponseHead",
    "UpstreamBroken",
    "UpstreamConnection",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamUnreachable",
    "open_exchange",
    "request_head",
]
