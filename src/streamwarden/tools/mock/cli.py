"""The mock's command line: ``streamwarden mock-upstream``, ``python -m streamwarden.tools.mock``.

:func:`run_mock_cli` parses the flags, starts the server, prints one line
saying where it listens, and serves until SIGINT or SIGTERM. It returns an
exit code instead of exiting, so the main ``streamwarden`` CLI can delegate
to it. A bad flag yields exit code 2 and exactly one line on stderr (not
argparse's usage block), like every streamwarden command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from streamwarden.tools.mock.controls import MockSettings
from streamwarden.tools.mock.faults import Fault
from streamwarden.tools.mock.formats import DIALECT_ALIASES, WIRE_FORMATS
from streamwarden.tools.mock.server import start_mock

__all__ = ["parse_listen", "run_mock_cli"]

_EXIT_USAGE = 2
_EXIT_FAILURE = 1


class _UsageError(Exception):
    """A bad flag; the message is the one line to print."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def parse_listen(value: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) into host and port."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port {port} is out of range (0-65535)")
    return host, port


def _listen(value: str) -> tuple[str, int]:
    try:
        return parse_listen(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_CONTROLS_HELP = """\
per-request controls (a header x-mock-<name>, or a query parameter <name>,
which wins; they override the flags above for one request):
  tokens N          tokens in the answer
  tps N             tokens per second (0: unpaced)
  ttft SECONDS      time before the first token
  fault F           one of the faults below, or none
  fault-after N     tokens written before a cutting fault strikes
  delay SECONDS     how long stall-before-headers, slow-headers (and stall) last
  size BYTES        the giant-event event's size
  status CODE       error-status's HTTP status (a status >= 400 implies it)
  body 0|1          0: error-status answers with an empty body
  tool-call 0|1     1: a streamed tool call (every format but ollama and generic;
                    Gemini streams its arguments when the request's toolConfig
                    asks for streamFunctionCallArguments)
  stamp 0|1         1: each SSE block starts with ': streamwarden-sent <unix time>'
                    (streamwarden probe's per-event path delay)
  request-id ID     the id recorded and returned in x-mock-request-id

faults:
  truncate              end cleanly before the terminal event (and usage)
  truncate-mid          close in the middle of an event
  stall                 stop sending mid-answer (for delay, or forever)
  stall-before-headers  accept, then send nothing for delay
  slow-headers          send the headers after delay
  reset                 reset the connection mid-answer
  broken-chunked        break the chunked encoding
  giant-event           one event of size bytes
  garbage               bytes that are not the dialect
  error-status          answer status with the provider's error body
  keepalive-pings       send the dialect's own pings while thinking
  broken-tool-call      close the tool call after fault-after of its argument
                        fragments: a clean end, arguments that are not JSON

e.g. curl -N localhost:8000/v1/chat/completions -H 'x-mock-fault: truncate' \\
       -d '{"stream": true}'
     curl -N 'localhost:8000/v1/chat/completions?fault=stall&delay=5' -d '{"stream": true}'

GET /metrics serves engine counters (vLLM's names, or --engine sglang);
GET /_mock/stats the mock's record of every request.
"""


def _parser(prog: str) -> _Parser:
    defaults = MockSettings()
    parser = _Parser(
        prog=prog,
        description="Serve a simulated LLM upstream that streams like real providers "
        "and misbehaves on request.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_CONTROLS_HELP,
    )
    parser.add_argument(
        "--listen",
        type=_listen,
        default=("127.0.0.1", 8000),
        metavar="HOST:PORT",
        help="address to listen on (default 127.0.0.1:8000)",
    )
    parser.add_argument(
        "--dialect",
        choices=[*WIRE_FORMATS, *DIALECT_ALIASES],
        default=defaults.dialect,
        metavar="D",
        help="wire format for paths no provider owns (default %(default)s; one of: "
        + ", ".join([*WIRE_FORMATS, *DIALECT_ALIASES])
        + ")",
    )
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=defaults.tokens_per_second,
        metavar="N",
        help="generation pace, 0 for unpaced (default %(default)s)",
    )
    parser.add_argument(
        "--ttft",
        type=float,
        default=defaults.ttft,
        metavar="SECONDS",
        help="time to first token (default %(default)s)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=defaults.tokens,
        metavar="N",
        help="tokens per answer (default %(default)s)",
    )
    parser.add_argument(
        "--fault",
        choices=[fault.value for fault in Fault],
        default=None,
        metavar="F",
        help="fault for every request (one of: " + ", ".join(f.value for f in Fault) + ")",
    )
    parser.add_argument(
        "--no-abort",
        action="store_true",
        help="keep generating after a client leaves, as an engine that does not abort "
        "(the tokens show in GET /metrics, never on the wire)",
    )
    parser.add_argument(
        "--engine",
        choices=["vllm", "sglang"],
        default=defaults.engine,
        help="the format of GET /metrics, an inference engine's (default %(default)s)",
    )
    return parser


def run_mock_cli(
    argv: Sequence[str] | None = None, prog: str = "streamwarden mock-upstream"
) -> int:
    """Run the mock from command-line flags; return the process exit code."""
    parser = _parser(prog)
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        settings = MockSettings(
            dialect=args.dialect,
            tokens_per_second=args.tokens_per_second,
            ttft=args.ttft,
            tokens=args.tokens,
            fault=args.fault,
            abort_on_disconnect=not args.no_abort,
            engine=args.engine,
        )
    except _UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    host, port = args.listen
    try:
        asyncio.run(_serve(host, port, settings))
    except OSError as exc:
        print(
            f"{prog}: error: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr
        )
        return _EXIT_FAILURE
    except KeyboardInterrupt:
        pass
    return 0


async def _serve(host: str, port: int, settings: MockSettings) -> None:
    server = await start_mock(host, port, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        # Not available on every platform; Ctrl-C still ends asyncio.run there.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    pace = f"{settings.tokens_per_second:g} tokens/s" if settings.tokens_per_second else "unpaced"
    fault = f", fault {settings.fault}" if settings.fault else ""
    print(
        f"streamwarden mock upstream listening on {server.url} "
        f"(default dialect {settings.dialect}, {pace}{fault})",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await server.close()
