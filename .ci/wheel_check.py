"""Checks of a streamwarden wheel, for ``.ci/wheel`` and cibuildwheel's test-command.

``contents WHEEL [SRC]``
    The wheel is a platform wheel that holds the compiled per-event modules:
    the group's shared library, and an extension for every module its
    ``_compiled.json`` names, each built from the source that ships beside it
    (and that is in SRC, the tree it was built from). A wheel without them
    would install and run the plain sources, correct but slower, and nobody
    would notice.
``policy``
    Reads ``auditwheel show --json`` on stdin and prints the most compatible
    manylinux tag the wheel satisfies (what ``auditwheel repair --plat`` gets).
``installed``
    The interpreter running this script has streamwarden installed from a
    wheel: ``streamwarden --version`` says compiled, the per-event modules
    import from their extensions in site-packages, and a real sidecar, in
    front of the mock upstream, relays a stream and turns a truncated one
    into an error event, with its start-up log saying compiled too.

Standard library only: ``installed`` runs in a fresh virtualenv that holds the
wheel, its dependencies and nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.machinery
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

#: What ``streamwarden --version`` and the sidecar's start-up line say when
#: the compiled modules run (streamwarden._native.native_summary).
COMPILED = "per-event modules compiled"
#: The mock upstream answers at once, 12 tokens: 13 content chunks (the
#: role's first), then ``[DONE]``.
FAST = {"x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "12"}
BOUND = 30.0  # seconds: every wait below gives up after this


class CheckFailed(Exception):
    pass


def require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- contents ----------------------------------------------------------------


def _module_paths(module: str, names: set[str]) -> tuple[str, str]:
    """(source, extension stem) of a module, as paths inside the wheel."""
    path = module.replace(".", "/")
    if f"{path}/__init__.py" in names:
        return f"{path}/__init__.py", f"{path}/__init__"
    return f"{path}.py", path


def _extension(stem: str, names: set[str], abi: str) -> str | None:
    found = [n for n in names if n.startswith(stem + ".") and n.endswith(".so")]
    return next((n for n in found if abi in n), None)


def check_contents(wheel: Path, sources: Path | None) -> str:
    python_tag, abi_tag, platform_tag = wheel.name.removesuffix(".whl").split("-")[-3:]
    require(platform_tag != "any" and abi_tag != "none", f"{wheel.name}: not a platform wheel")
    # cp311 -> the extensions' cpython-311 suffix.
    abi = f"cpython-{python_tag.removeprefix('cp')}-"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        require("streamwarden/_compiled.json" in names, "no streamwarden/_compiled.json")
        manifest = json.loads(archive.read("streamwarden/_compiled.json"))
        group, modules = manifest["group"], manifest["modules"]
        require(bool(modules), "the build compiled no module")
        library = _extension(f"{group}__mypyc", names, abi)
        require(library is not None, f"no shared library of the group {group} for {abi}")
        for module, digest in modules.items():
            source, stem = _module_paths(module, names)
            require(_extension(stem, names, abi) is not None, f"{module}: no extension for {abi}")
            require(source in names, f"{module}: its source is not in the wheel")
            require(_sha256(archive.read(source)) == digest, f"{module}: built from other source")
            if sources is not None:
                here = (sources / source).read_bytes()
                require(_sha256(here) == digest, f"{module}: {sources / source} differs")
    against = f"the wheel's sources and {sources}" if sources else "the wheel's sources"
    return (
        f"{wheel.name}: {len(modules)} compiled modules and {PurePosixPath(str(library)).name};"
        f" every digest matches {against}"
    )


def manylinux_policy(show: str) -> str:
    report = json.loads(show)
    tag = str(report["overall_tag"])
    require(tag.startswith("manylinux"), f"no manylinux policy fits: {tag}")
    return tag


# -- installed -----------------------------------------------------------------


def _script(name: str) -> Path:
    return Path(sys.executable).parent / name


def check_imports() -> str:
    """The package and its compiled modules come from this interpreter's site-packages."""
    import streamwarden
    from streamwarden import _native

    site = Path(sysconfig.get_paths()["platlib"]).resolve()
    require(
        Path(streamwarden.__file__).resolve().is_relative_to(site),
        f"streamwarden is imported from {streamwarden.__file__}, not from {site}",
    )
    state = _native.state()
    require(state.compiled, f"the sources run: {state.reason}")
    for name in state.modules:
        file = importlib.import_module(name).__file__ or ""
        require(
            file.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)),
            f"{name} is imported from {file}, not its extension",
        )
    return f"{len(state.modules)} modules import from their extensions in {site}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + BOUND
    while True:
        require(process.poll() is None, f"{process.args!r} exited {process.returncode}")
        require(time.monotonic() < deadline, f"{url} never answered")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.05)  # polling the condition itself, bounded by the deadline


def _stream(proxy: str, headers: dict[str, str]) -> bytes:
    request = urllib.request.Request(
        proxy + "/v1/chat/completions",
        data=b'{"stream": true}',
        headers={"content-type": "application/json", **headers},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=BOUND) as response:
        require(response.status == 200, f"status {response.status}")
        return bytes(response.read())


@contextlib.contextmanager
def _started(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as output:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=output)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(BOUND)


def check_sidecar(work: Path) -> str:
    """The installed sidecar in front of the installed mock: a stream, a cut one, a drain."""
    upstream, proxy, admin = (f"127.0.0.1:{_free_port()}" for _ in range(3))
    sidecar_log = work / "sidecar.log"
    mock_argv = [str(_script("streamwarden")), "mock-upstream", "--listen", upstream]
    sidecar_argv = [str(_script("streamwarden")), "run", "--upstream", f"http://{upstream}"]
    sidecar_argv += ["--listen", proxy, "--admin-listen", admin, "--log-format", "text"]
    sidecar_argv += ["--set", "drain_timeout=1s"]
    with (
        _started(mock_argv, work / "mock.log") as mock,
        _started(sidecar_argv, sidecar_log) as sidecar,
    ):
        _wait_healthy(f"http://{upstream}/metrics", mock)
        _wait_healthy(f"http://{admin}/healthz", sidecar)
        body = _stream(f"http://{proxy}", FAST)
        require(body.count(b'"content":"') == 13, f"not the whole stream: {body[-300:]!r}")
        require(body.endswith(b"data: [DONE]\n\n"), f"no [DONE]: {body[-300:]!r}")
        cut = _stream(f"http://{proxy}", {**FAST, "x-mock-fault": "truncate"})
        require(b"stream_truncated" in cut, f"a cut stream ended silently: {cut[-300:]!r}")
        sidecar.send_signal(signal.SIGTERM)
        require(sidecar.wait(BOUND) == 0, f"the sidecar exited {sidecar.returncode}")
    log = sidecar_log.read_text(errors="replace")
    require(COMPILED in log, f"the sidecar's log does not say compiled:\n{log}")
    return "the sidecar relayed a stream, ended a cut one with stream_truncated, drained, exit 0"


def check_installed() -> list[str]:
    version = subprocess.run(
        [str(_script("streamwarden")), "--version"],
        capture_output=True,
        text=True,
        timeout=BOUND,
        check=True,
    ).stdout.strip()
    require(COMPILED in version, f"streamwarden --version: {version}")
    with tempfile.TemporaryDirectory(prefix="streamwarden-smoke-") as work:
        return [f"streamwarden --version: {version}", check_imports(), check_sidecar(Path(work))]


def main(argv: list[str]) -> int:
    command, *args = argv or ["help"]
    try:
        if command == "contents" and len(args) in (1, 2):
            print(check_contents(Path(args[0]), Path(args[1]) if len(args) == 2 else None))
        elif command == "policy" and not args:
            print(manylinux_policy(sys.stdin.read()))
        elif command == "installed" and not args:
            # Left set, it would make this a test of the sources, not of the wheel.
            os.environ.pop("STREAMWARDEN_PURE_PYTHON", None)
            for line in check_installed():
                print(line)
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except CheckFailed as failure:
        print(f"wheel check failed: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
