"""``streamwarden webhook``: the injection rewrite as a mutating admission webhook.

The Kubernetes API server sends an ``AdmissionReview`` (admission.k8s.io/v1)
for every pod being created; the answer allows it, always, with the JSON
patch that :func:`streamwarden.tools.inject.pod_patch` computes (the same rewrite
as ``streamwarden inject``). A pod it will not touch is allowed unpatched,
or patched with only its ``streamwarden.io/inject-skipped`` reason, and the
reason is in ``status.message`` (and in ``warnings`` when the pod asked for
the sidecar). It never denies: a broken webhook must not block a deploy
(the chart also sets ``failurePolicy: Ignore`` and a timeout).

TLS comes from mounted files (a Secret from cert-manager or the chart); they
are checked at every handshake and reloaded when they changed, so a renewed
certificate is served without a restart. A half-written pair (a new
certificate with the old key) fails to load and the previous pair stays.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import signal
import ssl
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from streamwarden.tools.inject import InjectOptions, ManifestError, Outcome, pod_patch

__all__ = ["ADMISSION_API", "CertificateFiles", "review", "run_webhook", "webhook_app"]

log = logging.getLogger("streamwarden.webhook")

ADMISSION_API = "admission.k8s.io/v1"
#: The path the MutatingWebhookConfiguration calls.
MUTATE_PATH = "/mutate"
#: A Pod object is a few KiB; etcd refuses objects over 1.5 MiB.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class ReviewError(ValueError):
    """A body that is not an AdmissionReview request (answered 400: there is no uid)."""


def review(body: Any, options: InjectOptions) -> tuple[dict[str, Any], Outcome | None]:
    """The AdmissionReview response to a request, and what happened to its pod."""
    if not isinstance(body, dict) or body.get("kind") != "AdmissionReview":
        raise ReviewError("not an AdmissionReview")
    if body.get("apiVersion") != ADMISSION_API:
        raise ReviewError(f"apiVersion {body.get('apiVersion')!r}: only {ADMISSION_API} is served")
    request = body.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
        raise ReviewError("an AdmissionReview without request.uid")
    response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    outcome: Outcome | None = None
    reason = _not_a_pod_creation(request)
    if reason is None:
        try:
            patch, outcome = pod_patch(request.get("object"), options)
        except ManifestError as exc:
            reason = f"malformed pod: {exc}"
        else:
            if patch:
                encoded = json.dumps(patch, separators=(",", ":")).encode()
                response["patchType"] = "JSONPatch"
                response["patch"] = base64.b64encode(encoded).decode("ascii")
            reason = outcome.reason or None
            if outcome.status == "skipped":
                response["warnings"] = [f"streamwarden: not injected: {outcome.reason}"]
    if reason:
        response["status"] = {"message": f"streamwarden: not injected: {reason}"}
    return {"apiVersion": ADMISSION_API, "kind": "AdmissionReview", "response": response}, outcome


def _not_a_pod_creation(request: Mapping[str, Any]) -> str | None:
    kind = request.get("kind")
    if not isinstance(kind, dict) or kind.get("kind") != "Pod" or request.get("subResource"):
        what = kind.get("kind") if isinstance(kind, dict) else kind
        return f"a {what!s} is not a Pod"
    if request.get("operation") != "CREATE":
        return f"operation {request.get('operation')}: only pods being created are injected"
    return None


class CertificateFiles:
    """A server TLS context from a certificate and key file, reloaded when they change."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self._stamp = self._files_stamp()
        self._current = self._load()
        #: The context the listener is given: it only answers the ClientHello,
        #: then hands the handshake to the newest loaded context.
        self.context = self._new_context()
        self.context.load_cert_chain(cert_file, key_file)
        self.context.sni_callback = self._on_client_hello
        #: How many times new files were loaded (for tests and the log).
        self.reloads = 0

    def _files_stamp(self) -> tuple[tuple[int, int, int], ...]:
        # os.stat follows the symlinks a mounted Secret swaps on update.
        stats = (os.stat(self.cert_file), os.stat(self.key_file))
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)

    @staticmethod
    def _new_context() -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context

    def _load(self) -> ssl.SSLContext:
        context = self._new_context()
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def current(self) -> ssl.SSLContext:
        """The context for a new handshake: the files' newest pair that loads."""
        try:
            stamp = self._files_stamp()
        except OSError as exc:
            log.warning("tls files unreadable, keeping the loaded pair: %s", exc.strerror)
            return self._current
        if stamp != self._stamp:
            try:
                self._current = self._load()
            except (OSError, ssl.SSLError, ValueError) as exc:
                # Mid-update (new certificate, old key): the next handshake retries.
                log.warning("tls files changed but do not load yet, keeping the old pair: %s", exc)
                return self._current
            self._stamp = stamp
            self.reloads += 1
            log.info("tls certificate reloaded from %s", self.cert_file)
        return self._current

    def _on_client_hello(
        self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext
    ) -> None:
        connection.context = self.current()


async def _mutate(request: web.Request) -> web.StreamResponse:
    options: InjectOptions = request.app[_OPTIONS]
    try:
        body = json.loads(await request.read())
        answer, outcome = review(body, options)
    except web.HTTPRequestEntityTooLarge:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        return web.json_response({"error": str(exc)}, status=400)
    except RecursionError:
        # json's C decoder refuses nesting deeper than the interpreter's stack.
        return web.json_response({"error": "JSON nested too deep"}, status=400)
    result = answer["response"]
    log.info(
        "admission review %s: %s%s",
        result["uid"],
        outcome.line() if outcome else "not a pod creation",
        "" if outcome else f" ({result.get('status', {}).get('message', '')})",
    )
    return web.json_response(answer)


async def _healthz(request: web.Request) -> web.StreamResponse:
    return web.Response(text="ok\n")


_OPTIONS = web.AppKey("options", InjectOptions)


def webhook_app(
    options: InjectOptions, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> web.Application:
    """The webhook's aiohttp app: ``POST /mutate``, ``GET /healthz``."""
    app = web.Application(client_max_size=max_body_bytes)
    app[_OPTIONS] = options
    app.router.add_post(MUTATE_PATH, _mutate)
    app.router.add_get("/healthz", _healthz)
    return app


async def run_webhook(
    listen: str,
    certificates: CertificateFiles,
    options: InjectOptions,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> int:
    """Serve until SIGTERM or SIGINT; the exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host, _, port = listen.rpartition(":")
    runner = web.AppRunner(webhook_app(options, max_body_bytes), access_log=None)
    await runner.setup()
    site = web.TCPSite(
        runner, host.strip("[]") or None, int(port), ssl_context=certificates.context
    )
    await site.start()
    bound = next((a for a in runner.addresses if isinstance(a, tuple)), (host, port))
    log.info("streamwarden webhook listening on %s:%s (https)", bound[0], bound[1])
    await stop.wait()
    await runner.cleanup()
    return 0
