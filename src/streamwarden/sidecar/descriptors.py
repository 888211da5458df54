"""The sidecar's file descriptors: its open-files limit, and how many clients fit in it.

systemd starts a service with a soft ``RLIMIT_NOFILE`` of 1024 and a hard
one far above it (512Ki since systemd 240; a container runtime gives its
own). A proxy that keeps 1024 runs out at about a thousand idle clients,
and then nothing that needs a descriptor works: the admin port cannot
accept (``/healthz`` fails, the pod is restarted), an upstream cannot be
opened, clients already connected are reset. So at start the process
raises its soft limit to the hard one (what nginx's ``worker_rlimit_nofile``
lets an operator do), and the proxy port holds at most
``max_client_connections`` clients: by default what the limit leaves after
a reserve, counted so that every client can have its upstream open at once.
A stream read on after its client left (drain, detach) keeps its upstream
open without a client: it holds one of those places until it ends
(:class:`~streamwarden.sidecar.http.ClientConnections`), so the streams read
on are inside the budget too, however often clients leave and come back.
"""

from __future__ import annotations

import logging
import resource

__all__ = [
    "PROXY_BACKLOG",
    "client_connection_budget",
    "open_files_limit",
    "raise_open_files_limit",
]

log = logging.getLogger("streamwarden.sidecar")

#: The proxy port's listen backlog. An event loop accepts up to this many
#: connections in one go before any of them runs ``connection_made``, where
#: it is counted (and refused past the limit): the reserve covers them.
PROXY_BACKLOG = 128
#: Descriptors besides clients, their upstreams and the accept burst: stdio,
#: the two listeners, the event loop's own (epoll, its wake-up pipe), admin
#: connections (probes, scrapes, ``streamwarden top``), the resume store,
#: the engine's scrape, the OpenTelemetry exporter, a certificate read.
_FIXED_RESERVE = 64
#: What an unlimited hard limit is taken as: Linux's ``fs.nr_open`` default,
#: above which ``setrlimit`` fails anyway.
_UNLIMITED_AS = 1 << 20


def open_files_limit() -> int:
    """The process's soft ``RLIMIT_NOFILE``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _UNLIMITED_AS if soft == resource.RLIM_INFINITY else soft


def raise_open_files_limit() -> int:
    """Raise the soft open-files limit to the hard one; the soft limit after, logged if changed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _UNLIMITED_AS if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning(
                "open-files limit left at %d: raising it to %d failed: %s", soft, target, exc
            )
        else:
            log.info("open-files limit raised from %d to %d (the hard limit)", soft, target)
    return open_files_limit()


def client_connection_budget(open_files: int, upstream_pool_size: int) -> int:
    """How many client connections fit in ``open_files`` descriptors, the reserve kept.

    Each client may have a stream or a WebSocket open, each with its own
    upstream connection: two descriptors a client (a stream read on after
    its client left holds a place too, with one). The upstream pool keeps
    up to ``upstream_pool_size`` idle connections besides. At least one.
    """
    spare = open_files - _FIXED_RESERVE - PROXY_BACKLOG - upstream_pool_size
    return max(spare // 2, 1)
