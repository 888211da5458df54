"""``streamwarden demo``: a simulated model with the sidecar in front, on loopback.

It starts the mock upstream on a free port and the sidecar on ``--port``
(8080 unless taken), with a short keep-alive interval and idle timeout so
that each of the five jobs shows within seconds, then prints one command
per job to try (what to run, what to look for) and runs until Ctrl-C or
SIGTERM (exit 0 either way).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from streamwarden.config import load_settings
from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock import MockSettings, start_mock

__all__ = ["run_demo"]

KEEPALIVE = "2s"
IDLE_TIMEOUT = "9s"
_BODY = '{"model":"demo","stream":true,"messages":[{"role":"user","content":"Hello!"}]}'


def _curl(url: str, fault: str | None = None, *, headers: bool = False, tokens: int = 0) -> str:
    extra = f" -H 'x-mock-fault: {fault}'" if fault else ""
    if tokens:
        extra += f" -H 'x-mock-tokens: {tokens}'"
    flags = "-N -i" if headers else "-N"
    return (
        f"curl {flags} {url}/v1/chat/completions -H 'content-type: application/json'{extra} "
        f"-d '{_BODY}'"
    )


def instructions(url: str, admin_url: str) -> str:
    """What the demo prints once it is up: one command per job, and what to look for."""
    return f"""\
streamwarden demo: a simulated model behind the sidecar at {url}
(metrics at {admin_url}/metrics; stop with Ctrl-C)

1. No buffering: the response headers forbid it (Cache-Control: no-cache,
   no-transform; X-Accel-Buffering: no; no Content-Length) and the tokens
   trickle in one by one, ending with data: [DONE]:

   {_curl(url, headers=True)}

2. Keep-alive: a model that stalls mid-answer gets ': keep-alive' written
   every {KEEPALIVE} so no load balancer cuts the connection, and after
   {IDLE_TIMEOUT} of silence an upstream_timeout error event ends it:

   {_curl(url, "stall")}

3. Honest endings: an upstream that stops without data: [DONE] gives the
   client an error event with code stream_truncated instead of a silently
   shorter answer (the openai SDK raises APIError on it):

   {_curl(url, "truncate")}

4. Cancellation: start a long answer and press Ctrl-C after a few tokens.
   The upstream is closed at once: this window's log line says
   end_state=client_cancelled and cancel_propagation_s (well under 1 ms):

   {_curl(url, tokens=400)}

5. Metering: every finished stream logged one line above, with
   tokens_generated, tokens_delivered and tokens_zombie (the ones made after
   the client left, as in 4). The totals, by dialect and count source:

   curl -s {admin_url}/metrics | grep -E 'streamwarden_(tokens|zombie|streams)_'
"""


async def _serve(port: int, duration: float) -> int:
    mock = await start_mock(settings=MockSettings(tokens_per_second=8.0, ttft=0.5, tokens=30))
    overrides = {
        "upstream": mock.url,
        "listen": f"127.0.0.1:{port}",
        "admin_listen": "127.0.0.1:0",
        "keepalive_interval": KEEPALIVE,
        "upstream_idle_timeout": IDLE_TIMEOUT,
        "drain_timeout": "2s",
        "log_format": "text",
    }
    sidecar = Sidecar(load_settings(environ={}, overrides=overrides))
    try:
        await sidecar.start()
    except OSError:
        if port == 0:
            raise
        # The default port is taken: any free port will do for a demo.
        sidecar = Sidecar(
            load_settings(environ={}, overrides={**overrides, "listen": "127.0.0.1:0"})
        )
        await sidecar.start()
    print(instructions(sidecar.proxy_url, sidecar.admin_url), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(duration if duration > 0 else None):
            await stop.wait()
    await sidecar.drain()
    await sidecar.close()
    await mock.close()
    return 0


def run_demo(port: int = 8080, duration: float = 0.0) -> int:
    """Run the demo until Ctrl-C (or for ``duration`` seconds, for tests)."""
    from streamwarden.observation.logs import configure_logging

    configure_logging(load_settings(environ={}, overrides={"log_format": "text"}))
    try:
        return asyncio.run(_serve(port, duration))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 0
