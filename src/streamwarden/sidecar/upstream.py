"""The sidecar's upstream client, by its old name: :mod:`streamwarden.upstream`.

The client moved out of the sidecar so that ``streamwarden probe`` can use
it without importing the face. Some of the sidecar's modules still import
it from here, until the package is laid out anew (issue #26); new code
imports :mod:`streamwarden.upstream`.
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
