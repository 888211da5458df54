"""The ``streamwarden`` command: run, demo, mock-upstream, check-config.

Any bad flag or configuration value ends the process with exit code 2 and
one line on stderr that names the key, the value and what was expected.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from streamwarden import __version__
from streamwarden.config import ConfigError, Settings, load_settings

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="streamwarden",
        description="Keep LLM token streams alive and honest.",
    )
    parser.add_argument("--version", action="version", version=f"streamwarden {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="run the sidecar proxy")
    run.add_argument("--config", help="YAML config file")
    run.add_argument("--upstream", help="upstream URL (http://, https://, unix:/path.sock)")
    run.add_argument("--listen", help="proxy address HOST:PORT")
    run.add_argument("--admin-listen", dest="admin_listen", help="admin address HOST:PORT")
    run.add_argument("--dialect", help="stream dialect, or auto")
    run.add_argument("--keepalive-interval", dest="keepalive_interval", help="e.g. 15s")
    run.add_argument("--log-format", dest="log_format", help="json or text")
    run.add_argument("--log-level", dest="log_level", help="debug, info, warning, error")
    run.add_argument(
        "--event-loop", dest="event_loop", help="auto (uvloop when installed), asyncio, uvloop"
    )
    run.add_argument(
        "--uvloop",
        dest="event_loop",
        action="store_const",
        const="uvloop",
        help="same as --event-loop uvloop",
    )

    demo = commands.add_parser("demo", help="start a simulated model and the sidecar in front")
    demo.add_argument("--port", type=int, default=8080, help="sidecar port (0: any free port)")
    demo.add_argument("--for", dest="duration", type=float, default=0.0, help=argparse.SUPPRESS)

    mock = commands.add_parser(
        "mock-upstream", help="run the simulated LLM upstream", add_help=False
    )
    mock.add_argument("args", nargs=argparse.REMAINDER)

    check = commands.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("file")
    return parser


def _settings_from(args: argparse.Namespace) -> Settings:
    keys = (
        "upstream",
        "listen",
        "admin_listen",
        "dialect",
        "keepalive_interval",
        "log_format",
        "log_level",
        "event_loop",
    )
    overrides: dict[str, Any] = {key: getattr(args, key) for key in keys}
    return load_settings(args.config, overrides=overrides)


def _run(args: argparse.Namespace) -> int:
    settings = _settings_from(args)
    if settings.upstream is None:
        raise ConfigError("upstream: required (set --upstream, STREAMWARDEN_UPSTREAM or the file)")
    from streamwarden.logs import configure_logging
    from streamwarden.sidecar import run_sidecar

    configure_logging(settings)
    if settings.event_loop == "asyncio":
        return asyncio.run(run_sidecar(settings))
    try:
        import uvloop
    except ImportError:
        if settings.event_loop == "uvloop":
            raise ConfigError(
                'event_loop: "uvloop" is not installed (pip install "streamwarden[fast]")'
            ) from None
        return asyncio.run(run_sidecar(settings))
    return uvloop.run(run_sidecar(settings))


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["mock-upstream"]:
        # The mock has its own flags (argparse would not pass "--x" through).
        from streamwarden.mock import run_mock_cli

        return run_mock_cli(arguments[1:])
    args = _parser().parse_args(arguments)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "check-config":
            load_settings(args.file)
            print(f"{args.file}: ok")
            return 0
        if args.command == "demo":
            from streamwarden.demo import run_demo

            return run_demo(port=args.port, duration=args.duration)
    except ConfigError as exc:
        print(f"streamwarden: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"streamwarden: error: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
