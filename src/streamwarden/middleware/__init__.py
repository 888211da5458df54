"""The middleware face: what the sidecar does, inside a FastAPI or Starlette app.

::

    from streamwarden.middleware import StreamWardenMiddleware

    app.add_middleware(StreamWardenMiddleware)

A pure ASGI middleware (never ``BaseHTTPMiddleware``, which hides client
disconnects and buffers) over the same core, config model and metrics as
the sidecar, importing neither aiohttp nor Starlette. Responses that are
streams (``text/event-stream``, NDJSON, the Vercel AI stream headers, or a
configured ``stream_media_types`` entry) get the five jobs; every other
response is passed on untouched after one look at its headers.

Where it diverges from the sidecar, and why:

- The app is the upstream. Closing the upstream means cancelling the app's
  task, so the app's generator runs its ``finally`` (and closes its own
  provider stream) the moment the client leaves, even while it awaits a
  silent provider and even if it never calls ``receive()``.
- An exception the app raises after its stream started is the upstream
  breaking: the dialect's ``upstream_error`` event and a clean end of
  body, the exception logged with its traceback rather than re-raised
  (re-raising would make the server cut the connection, which the client
  cannot tell from a network fault). Before the stream started,
  exceptions propagate as usual.
- A client that stops reading is noticed by the keep-alive timer rather
  than by the write itself (a timeout around every event would tax every
  event), so within ``keepalive_interval + client_write_timeout``.
- A gzip or deflate stream is inflated (a bounded step at a time) and
  relayed uncompressed, ``Content-Encoding`` dropped, as the sidecar does
  (:mod:`streamwarden.core.plan`); other codings (br, zstd) cannot be framed
  here and are passed on as they are. Never compress an event stream.
- Drain on shutdown is the server's: a request the server cancels gets the
  ``shutting_down`` error event if its client can still hear it.
- What runs beside the streams follows the app's lifespan: the engine
  watch (``engine_metrics_url``) starts at ``lifespan.startup`` (or at the
  first request, on a server that runs no lifespan), and
  ``await middleware.close()`` stops it, the resume store and the
  telemetry's exporters: ``lifespan.shutdown`` calls it, and a program that
  runs the app on a server without a lifespan calls it after the server.
  It reconciles the engine with this instance's streams only, so under
  several worker processes (several watches of one engine on the host) no
  watch claims unseen tokens (:mod:`streamwarden.features.engine.peers`).
- Logging is the app's: the middleware sets up a stderr handler (in
  ``log_format``, at ``log_level``) for the ``streamwarden`` loggers only if
  nothing in the process has set up Python logging, and it goes quiet once
  something does (:func:`streamwarden.observation.logs.log_unless_configured`).
- ``early_headers_after`` counts from the moment the request's body has
  been read (the app then awaits its provider), not from the moment it was
  forwarded: the app is the upstream (:mod:`~streamwarden.middleware.early`).
  Its answer is judged by the sidecar's rule
  (:func:`streamwarden.core.plan.early_refusal`); one that is refused is
  dropped and the app stopped, as the sidecar closes such an upstream.
- The sidecar's own settings (listeners, upstream connection, parser
  limits, drain, event loop) do nothing here; each
  one given as an option logs a warning
  (:data:`streamwarden.config.SIDECAR_ONLY`). ``max_concurrent_streams``
  works as in the sidecar: to look for ``"stream": true`` the middleware
  reads the first body message before the app runs, and hands it on.
"""

from streamwarden.middleware.face import (
    SCOPE_KEY,
    MetricsEndpoint,
    StreamWardenMiddleware,
    mount_metrics,
)

__all__ = ["SCOPE_KEY", "MetricsEndpoint", "StreamWardenMiddleware", "mount_metrics"]
