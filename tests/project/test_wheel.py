"""The wheel's checks (``.ci/wheel``, ``.ci/wheel_check.py``) catch what they are for.

The wheel itself is built, repaired and installed without a compiler by
``.ci/wheel`` (a stage of ``.ci/run``; about a minute and a half), and the
image's install of it is rehearsed in test_container.py. Here, in
milliseconds: the contents check refuses a wheel that would silently
install the plain sources (no platform tag, an extension missing, compiled
from other source); ``without-compiler`` really leaves no compiler; and the
cibuildwheel matrix is the one the README promises.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from locations import REPO

SCRIPT = REPO / ".ci" / "wheel"
SOURCE = b"def feed(data: bytes) -> int:\n    return len(data)\n"
ABI = "cpython-311-x86_64-linux-gnu"


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("wheel_check", REPO / ".ci" / "wheel_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wheel_check = _checker()


def make_wheel(
    directory: Path,
    *,
    tag: str = "cp311-cp311-manylinux_2_17_x86_64",
    source: bytes = SOURCE,
    extensions: bool = True,
) -> Path:
    """A wheel laid out as the build lays out one module of the compiled group."""
    path = directory / f"streamwarden-0.1.0-{tag}.whl"
    manifest = {"group": "g", "modules": {"streamwarden.sse": hashlib.sha256(SOURCE).hexdigest()}}
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("streamwarden/_compiled.json", json.dumps(manifest))
        archive.writestr("streamwarden/sse.py", source)
        archive.writestr(f"g__mypyc.{ABI}.so", b"\x7fELF")
        if extensions:
            archive.writestr(f"streamwarden/sse.{ABI}.so", b"\x7fELF")
    return path


def test_a_wheel_with_every_module_compiled_from_its_source_passes(tmp_path: Path) -> None:
    tree = tmp_path / "src" / "streamwarden"
    tree.mkdir(parents=True)
    (tree / "sse.py").write_bytes(SOURCE)
    summary = wheel_check.check_contents(make_wheel(tmp_path), tmp_path / "src")
    assert "1 compiled modules" in summary and f"g__mypyc.{ABI}.so" in summary


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ({"tag": "py3-none-any"}, "not a platform wheel"),
        ({"extensions": False}, "no extension"),
        ({"source": SOURCE + b"# edited after the build\n"}, "built from other source"),
        ({"tag": "cp312-cp312-manylinux_2_17_x86_64"}, "for cpython-312"),
    ],
)
def test_a_wheel_that_would_run_from_source_fails(
    tmp_path: Path, kind: dict[str, object], message: str
) -> None:
    with pytest.raises(wheel_check.CheckFailed, match=message):
        wheel_check.check_contents(make_wheel(tmp_path, **kind), None)  # type: ignore[arg-type]


def test_a_tree_changed_since_the_build_fails(tmp_path: Path) -> None:
    tree = tmp_path / "src" / "streamwarden"
    tree.mkdir(parents=True)
    (tree / "sse.py").write_bytes(SOURCE + b"# changed\n")
    with pytest.raises(wheel_check.CheckFailed, match="differs"):
        wheel_check.check_contents(make_wheel(tmp_path), tmp_path / "src")


def test_the_repair_takes_the_policy_auditwheel_found() -> None:
    show = {"overall_tag": "manylinux_2_17_x86_64", "sym_tag": "manylinux_2_17_x86_64"}
    assert wheel_check.manylinux_policy(json.dumps(show)) == "manylinux_2_17_x86_64"
    with pytest.raises(wheel_check.CheckFailed, match="no manylinux policy"):
        wheel_check.manylinux_policy(json.dumps({"overall_tag": "linux_x86_64"}))


def _without_compiler(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), "without-compiler", *command],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHON": sys.executable},
    )


def test_without_compiler_leaves_no_compiler_and_no_python_headers() -> None:
    outside = subprocess.run(["cc", "--version"], capture_output=True, timeout=30)
    if outside.returncode != 0:
        pytest.skip("no C compiler on this machine: nothing to hide")
    if _without_compiler("true").returncode != 0:
        pytest.skip("no mount namespace can be made here (unshare)")
    include = subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    assert (Path(include) / "Python.h").exists()  # outside, it is there
    for probe in (["cc", "--version"], ["gcc", "--version"], ["test", "-e", f"{include}/Python.h"]):
        inside = _without_compiler(*probe)
        assert inside.returncode != 0, (probe, inside.stdout, inside.stderr)
        assert "no C compiler here" in inside.stdout
    # Only the compiler: everything else runs as usual.
    assert _without_compiler(sys.executable, "-c", "print('ran')").stdout.endswith("ran\n")


def test_cibuildwheel_builds_the_promised_matrix_and_tests_with_the_same_script() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["cibuildwheel"]
    assert config["build"].split() == ["cp311-*", "cp312-*", "cp313-*"]
    assert config["skip"] == "*-musllinux_*"
    assert config["linux"]["archs"] == ["x86_64", "aarch64"]
    assert config["test-command"] == "bash {project}/.ci/wheel test {wheel}"
    # The namespace .ci/wheel hides the compiler in needs these in a container.
    assert "--cap-add=SYS_ADMIN" in config["container-engine"]["create-args"]
