"""The ``streamwarden`` command: run, demo, mock-upstream, check-config, top, inject, webhook,
probe.

Any bad flag or configuration value ends the process with exit code 2 and
one line on stderr that names the key, the value and what was expected.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from streamwarden import __version__
from streamwarden._native import native_summary
from streamwarden.config import (
    CONFIG_FILE_VARIABLE,
    ENV_PREFIX,
    ConfigError,
    Settings,
    env_variable,
    key_choices,
    load_settings,
    parse_duration,
    parse_size,
    written_default,
)
from streamwarden.core.dialects import DIALECT_NAMES

if TYPE_CHECKING:
    from streamwarden.tools.inject import InjectOptions

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
    parser.add_argument(
        "--version", action="version", version=f"streamwarden {__version__} ({native_summary()})"
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _run_parser(commands)

    demo = commands.add_parser("demo", help="start a simulated model and the sidecar in front")
    demo.add_argument("--port", type=int, default=8080, help="sidecar port (0: any free port)")
    demo.add_argument("--for", dest="duration", type=float, default=0.0, help=argparse.SUPPRESS)

    mock = commands.add_parser(
        "mock-upstream", help="run the simulated LLM upstream", add_help=False
    )
    mock.add_argument("args", nargs=argparse.REMAINDER)

    check = commands.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("file")

    _top_parser(commands)
    _kubernetes_parsers(commands)
    _probe_parser(commands)
    return parser


def _run_parser(commands: Any) -> None:
    run = commands.add_parser(
        "run",
        help="run the sidecar proxy",
        description="Run the sidecar: a reverse proxy in front of one upstream that keeps "
        "its streams alive and honest. Every setting comes, lowest to highest, from its "
        "default, the config file, the STREAMWARDEN_<KEY> environment variable, then these "
        "flags; --set KEY=VALUE reaches any key.",
        formatter_class=_HelpFormatter,
    )
    where = run.add_argument_group("where")
    where.add_argument(
        "--config",
        metavar="FILE",
        help=f"YAML config file (default: none; env {CONFIG_FILE_VARIABLE})",
    )
    _flag(where, "--upstream", "upstream", "URL", "http://, https:// or unix:/path.sock")
    _flag(where, "--listen", "listen", "HOST:PORT", "proxy address; :PORT for every interface")
    _flag(where, "--admin-listen", "admin_listen", "HOST:PORT", "/metrics, /healthz, /readyz")
    streams = run.add_argument_group("streams")
    _flag(streams, "--dialect", "dialect", "D", "stream wire format")
    _flag(
        streams,
        "--keepalive-interval",
        "keepalive_interval",
        "DURATION",
        "quiet time before ': keep-alive'",
    )
    process = run.add_argument_group("process")
    _flag(process, "--log-format", "log_format", "F", "")
    _flag(process, "--log-level", "log_level", "L", "")
    _flag(process, "--event-loop", "event_loop", "LOOP", "auto: uvloop when installed")
    process.add_argument(
        "--uvloop",
        dest="event_loop",
        action="store_const",
        const="uvloop",
        help=f"same as --event-loop uvloop (env {env_variable('event_loop')}=uvloop)",
    )
    process.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config key (repeatable), e.g. --set max_concurrent_streams=500 "
        "--set on_client_gone=detach; YAML values (--set 'stream_media_types=[a/b]') "
        f"(default: none; env {ENV_PREFIX}<KEY>, each listed below)",
    )
    run.epilog = _other_keys(run)


def _top_parser(commands: Any) -> None:
    top = commands.add_parser(
        "top",
        help="show a sidecar's open streams, live",
        description="The open streams of a running sidecar (its admin port's /streams), "
        "refreshed every --interval: what to look at first when streams hang.",
    )
    top.add_argument(
        "--admin",
        default="http://127.0.0.1:9090",
        metavar="URL",
        help="the sidecar's admin address (default %(default)s)",
    )
    top.add_argument("--interval", type=float, default=1.0, metavar="SECONDS")
    top.add_argument("--once", action="store_true", help="print one screen and exit")


def _kubernetes_parsers(commands: Any) -> None:
    """``inject`` and ``webhook``: the two ways to add the sidecar to pods."""
    inject = commands.add_parser(
        "inject",
        help="add the sidecar to Kubernetes manifests",
        description="Read Kubernetes manifests (multi-document YAML, Lists) and write them to "
        "stdout with the streamwarden sidecar added to every pod template annotated "
        "streamwarden.io/inject: enabled (or all, with --all). One line per pod template "
        "on stderr says what was done, or why not.",
    )
    inject.add_argument("file", nargs="?", default="-", help="FILE, or - for stdin (default)")
    _inject_flags(inject)

    webhook = commands.add_parser(
        "webhook",
        help="run the mutating admission webhook that injects the sidecar",
        description="Serve AdmissionReview v1 over HTTPS: pods being created get the same "
        "sidecar as `streamwarden inject` adds, as a JSON patch. It never denies.",
    )
    webhook.add_argument(
        "--listen", default="0.0.0.0:8443", metavar="HOST:PORT", help="default %(default)s"
    )
    webhook.add_argument("--tls-cert", required=True, metavar="FILE", help="PEM certificate")
    webhook.add_argument("--tls-key", required=True, metavar="FILE", help="PEM private key")
    webhook.add_argument(
        "--max-body-bytes",
        default="4MiB",
        metavar="SIZE",
        help="largest AdmissionReview accepted (default %(default)s)",
    )
    webhook.add_argument(
        "--log-format", default="json", choices=("json", "text"), help="default %(default)s"
    )
    _inject_flags(webhook)


def _inject_flags(parser: argparse.ArgumentParser) -> None:
    """The rewrite's flags, the same for ``inject`` and ``webhook``."""
    from streamwarden.tools.inject import DEFAULT_IMAGE

    group = parser.add_argument_group("injection")
    group.add_argument(
        "--all",
        dest="all_pods",
        action="store_true",
        help="inject every pod template not annotated streamwarden.io/inject: disabled",
    )
    group.add_argument(
        "--no-native",
        dest="native",
        action="store_false",
        help="a regular container instead of a native sidecar (Kubernetes < 1.29)",
    )
    group.add_argument(
        "--image", default=DEFAULT_IMAGE, metavar="IMAGE", help="default %(default)s"
    )
    group.add_argument(
        "--base-url-env",
        default="OPENAI_BASE_URL=/v1,ANTHROPIC_BASE_URL",
        metavar="NAME[=/PATH],...",
        help="egress mode: the app variables pointed at the sidecar (default %(default)s)",
    )


def _probe_parser(commands: Any) -> None:
    probe = commands.add_parser(
        "probe",
        help="find the hop that buffers, compresses or cuts a stream",
        description="Send one streaming request along the real path (by default an "
        "OpenAI-style chat completion with stream: true) and report how its events "
        "arrived, with a verdict per symptom: buffered, compressed, no keep-alives, cut by "
        "an idle timeout, truncated, missing no-buffering headers. When the far end is "
        "streamwarden mock-upstream (or a sidecar in front of it), each event carries its "
        "send time and the delay in the path is exact.",
        epilog="Exit code 0: clean; 1: a symptom was found (or no answer); 2: bad usage.",
    )
    probe.add_argument("url", metavar="URL", help="a URL without a path gets /v1/chat/completions")
    probe.add_argument("--method", "-X", default="POST", help="default %(default)s")
    probe.add_argument(
        "-H",
        "--header",
        dest="headers",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="a request header (repeatable); Authorization and keys are never printed",
    )
    probe.add_argument(
        "--data", "-d", metavar="BODY", help="the request body, or @FILE (default: a chat request)"
    )
    probe.add_argument(
        "--dialect", default="auto", choices=DIALECT_NAMES, help="default %(default)s"
    )
    probe.add_argument(
        "--stall",
        metavar="DURATION",
        help="ask the far end (streamwarden mock-upstream) for a silence this long "
        "mid-stream, to find the path's idle timeout (e.g. 75s)",
    )
    probe.add_argument(
        "--max-time", metavar="DURATION", help="stop reading after this long (default 300s)"
    )
    probe.add_argument(
        "--max-bytes",
        metavar="SIZE",
        default="16MiB",
        help="stop reading past this much body, compressed or inflated (default %(default)s)",
    )
    probe.add_argument(
        "--max-events",
        metavar="N",
        default="100000",
        help="stop reading past this many events (default %(default)s)",
    )
    probe.add_argument(
        "--connect-timeout", metavar="DURATION", default="10s", help="default %(default)s"
    )
    probe.add_argument("--cacert", metavar="FILE", help="CA bundle for an https:// URL")
    probe.add_argument(
        "--no-stamp",
        dest="stamp",
        action="store_false",
        help="do not send x-mock-stamp: 1 (the mock's send-time control)",
    )
    probe.add_argument("--json", action="store_true", help="print the report as JSON")
    probe.add_argument("--plot", metavar="FILE.png", help="draw send time against arrival time")


#: The settings ``run`` cannot do without (``_run`` refuses to start without them).
_REQUIRED_FOR_RUN = frozenset({"upstream"})


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, but an indented paragraph (a table) is kept as it is written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.split("\n\n"):
            if paragraph.startswith(" "):
                paragraphs.append("\n".join(indent + line for line in paragraph.splitlines()))
            else:
                paragraphs.append(super()._fill_text(paragraph, width, indent))
        return "\n\n".join(paragraphs)


def _flag(group: argparse._ArgumentGroup, flag: str, key: str, metavar: str, what: str) -> None:
    """One flag for a config key: its help shows the model's default, choices and variable."""
    choices = key_choices(key)
    parts = [what] if what else []
    if choices is not None:
        parts.append(f"one of {', '.join(choices)}")
    shown = "required" if key in _REQUIRED_FOR_RUN else f"default: {written_default(key)}"
    text = "; ".join(parts)
    group.add_argument(
        flag,
        dest=key,
        metavar=metavar,
        choices=choices,
        help=f"{text} ({shown}; env {env_variable(key)})".lstrip(),
    )


def _other_keys(parser: argparse.ArgumentParser) -> str:
    """The epilog: every key without a flag of its own, its variable and its default."""
    flagged = {action.dest for action in parser._actions}
    rows = [
        (env_variable(key), written_default(key))
        for key in Settings.model_fields
        if key not in flagged
    ]
    width = max(len(variable) for variable, _ in rows)
    table = "\n".join(f"  {variable:<{width}}  {default}" for variable, default in rows)
    return (
        "Every other key, by its variable, with its default. In the config file and in "
        f"--set KEY=VALUE, a key is its variable's name without {ENV_PREFIX}, in lower case; "
        "durations are written 250ms, 15s, 2m, sizes 64KiB, 8MiB. The configuration reference "
        f"(docs/reference/configuration.md) says what each does.\n\n{table}\n\n"
        "Check a file with: streamwarden check-config FILE"
    )


def _assignments(pairs: Sequence[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs as config keys (values parsed as YAML scalars or lists)."""
    import yaml

    found: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE")
        try:
            parsed = yaml.safe_load(value) if value.strip() else value
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}: {value!r} is not a valid value") from None
        found[key.strip()] = value if isinstance(parsed, int | float | bool) else parsed
    return found


def _settings_from(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = _assignments(getattr(args, "assignments", []))
    # A flag's destination is its key (see _flag): every flag given, none listed twice.
    overrides.update(
        {
            key: value
            for key, value in vars(args).items()
            if key in Settings.model_fields and value is not None
        }
    )
    return load_settings(args.config, overrides=overrides)


def _run(args: argparse.Namespace) -> int:
    settings = _settings_from(args)
    for key in sorted(_REQUIRED_FOR_RUN):
        if getattr(settings, key) is None:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"{key}: required (set {flag}, {env_variable(key)} or the file)")
    from streamwarden.observation.logs import configure_logging
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


def _check_config(path: str) -> int:
    """Every problem of a config file, one line each (exit 2), or ok (exit 0)."""
    from streamwarden.config import config_problems, read_config_file

    problems = config_problems(read_config_file(path))
    for problem in problems:
        print(f"streamwarden: error: {problem}", file=sys.stderr)
    if problems:
        return 2
    settings = load_settings(path, environ={})
    if settings.upstream is None:
        print(
            f"{path}: ok, but streamwarden run also needs upstream "
            "(--upstream, STREAMWARDEN_UPSTREAM or the file)"
        )
        return 0
    print(f"{path}: ok")
    return 0


def _inject_options(args: argparse.Namespace) -> InjectOptions:
    from streamwarden.tools.inject import InjectOptions, parse_base_url_env

    try:
        base_url_env = parse_base_url_env(args.base_url_env)
    except ValueError as exc:
        raise ConfigError(f"--base-url-env: {exc}") from None
    if not args.image.strip():
        raise ConfigError("--image: empty")
    return InjectOptions(
        all_pods=args.all_pods, native=args.native, image=args.image, base_url_env=base_url_env
    )


def _inject(args: argparse.Namespace) -> int:
    """Manifests in (a file or stdin), manifests out (stdout), one line per pod on stderr."""
    import yaml

    from streamwarden.tools.inject import ManifestError, inject_documents

    options = _inject_options(args)
    name = "stdin" if args.file == "-" else args.file
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{name}: not YAML: {problem}{where}") from None
    try:
        results, outcomes = inject_documents(documents, options)
    except ManifestError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    # Key order as read; wide lines so that long strings are not folded.
    sys.stdout.write(
        yaml.safe_dump_all(
            results, sort_keys=False, explicit_start=True, allow_unicode=True, width=1 << 16
        )
    )
    for outcome in outcomes:
        print(f"streamwarden inject: {outcome.line()}", file=sys.stderr)
    return 0


def _webhook(args: argparse.Namespace) -> int:
    from streamwarden.config import parse_size
    from streamwarden.observation.logs import configure_logging
    from streamwarden.tools.webhook import CertificateFiles, run_webhook

    options = _inject_options(args)
    try:
        max_body_bytes = parse_size(args.max_body_bytes)
    except ValueError:
        raise ConfigError(f"--max-body-bytes: {args.max_body_bytes!r} is not a size") from None
    if not re.match(r"^(\[[0-9a-fA-F:.]+\]|[^:\s]*):[0-9]{1,5}$", args.listen):
        raise ConfigError(f"--listen: {args.listen!r} is not HOST:PORT")
    try:
        certificates = CertificateFiles(args.tls_cert, args.tls_key)
    except ssl.SSLError as exc:
        raise ConfigError(f"--tls-cert/--tls-key: {exc.reason or exc}") from None
    except OSError as exc:
        raise ConfigError(f"--tls-cert/--tls-key: {exc.filename}: {exc.strerror}") from None
    configure_logging(Settings(log_format=args.log_format))
    return asyncio.run(run_webhook(args.listen, certificates, options, max_body_bytes))


def _count(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError("count")
    return number


def _option(parse: Any, flag: str, value: str | None, default: Any) -> Any:
    if value is None:
        return default
    try:
        return parse(value)
    except ValueError:
        kinds = {parse_size: "a size such as 16MiB", _count: "a whole number"}
        kind = kinds.get(parse, "a duration such as 75s")
        raise ConfigError(f"{flag} {value!r}: expected {kind}") from None


def _probe(args: argparse.Namespace) -> int:
    """``streamwarden probe``: 0 clean, 1 a symptom (or no answer), 2 bad usage."""
    import json
    from pathlib import Path

    from streamwarden.tools.probe.client import ProbeError, UsageError, capture, prepare
    from streamwarden.tools.probe.measure import analyse, render_text, report_json

    stall = _option(parse_duration, "--stall", args.stall, None)
    if stall is not None and stall <= 0:
        raise ConfigError(f"--stall {args.stall!r}: expected a duration above 0")
    default_time = 300.0 if stall is None else max(300.0, stall + 60.0)
    data: bytes | None = None
    if args.data is not None:
        given: str = args.data
        data = Path(given[1:]).read_bytes() if given.startswith("@") else given.encode()
    try:
        request = prepare(
            args.url,
            method=args.method,
            headers=args.headers,
            data=data,
            stall=stall,
            stamp=args.stamp,
            max_time=_option(parse_duration, "--max-time", args.max_time, default_time),
            max_bytes=_option(parse_size, "--max-bytes", args.max_bytes, 0),
            max_events=_option(_count, "--max-events", args.max_events, 0),
            connect_timeout=_option(parse_duration, "--connect-timeout", args.connect_timeout, 0),
            ca_bundle=args.cacert,
        )
    except UsageError as exc:
        raise ConfigError(str(exc)) from None
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError('--plot needs matplotlib: pip install "streamwarden[plot]"') from None
    try:
        captured = asyncio.run(capture(request, dialect=args.dialect))
    except ProbeError as exc:
        print(f"streamwarden probe: {exc}", file=sys.stderr)
        return 1
    report = analyse(captured)
    line = f"{request.method} {request.shown_url}"
    if args.json:
        print(json.dumps(report_json(report, line, request.shown_headers()), indent=2))
    else:
        sys.stdout.write(render_text(report, line, request.shown_headers()))
    if args.plot is not None:
        from streamwarden.tools.probe.plot import plot

        plot(report, args.plot, line)
    return 1 if report.fails else 0


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["mock-upstream"]:
        # The mock has its own flags (argparse would not pass "--x" through).
        from streamwarden.tools.mock import run_mock_cli

        return run_mock_cli(arguments[1:])
    if not arguments:
        # A bare command: what it can do, one line each.
        _parser().print_help(sys.stderr)
        return 2
    args = _parser().parse_args(arguments)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "check-config":
            return _check_config(args.file)
        if args.command == "top":
            from streamwarden.observation.top import run_top

            return run_top(args.admin, args.interval, args.once)
        if args.command == "inject":
            return _inject(args)
        if args.command == "webhook":
            return _webhook(args)
        if args.command == "probe":
            return _probe(args)
        if args.command == "demo":
            from streamwarden.tools.demo import run_demo

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
