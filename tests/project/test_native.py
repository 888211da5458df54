"""The per-event modules run compiled when the build compiled them, and from source otherwise.

``setup.py`` compiles them with mypyc; ``streamwarden._native`` decides at
import time which code runs. The dangerous case is a compiled module older
than its source (an editable install, edited afterwards): Python prefers
the extension, so without the check the old code would run.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import streamwarden
from streamwarden import _native

PACKAGE = Path(streamwarden.__file__).parent
STATE = _native.state()
#: The environment of the subprocesses: the tree under test, nothing asked for.
_BASE_ENV = {
    k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STREAMWARDEN_PURE_PYTHON")
}


def _is_extension(path: str | None) -> bool:
    return path is not None and path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def _group_library() -> Path | None:
    spec = importlib.util.find_spec("streamwarden_native__mypyc")
    return None if spec is None or spec.origin is None else Path(spec.origin)


def _files_in(root: Path, env: dict[str, str]) -> tuple[str, str]:
    """``__file__`` of each per-event module, imported from the tree at ``root``, and stderr."""
    script = (
        "import json, streamwarden, streamwarden._native as n\n"
        "import importlib\n"
        "state = n.state()\n"
        "files = {m: importlib.import_module(m).__file__ for m in state.modules}\n"
        "print(json.dumps([n.native_summary(), files]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", script],
        env={**_BASE_ENV, **env, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout, done.stderr


@pytest.fixture
def built_tree(tmp_path: Path) -> Path:
    """A copy of this install's compiled package, to edit without touching the real one."""
    group = _group_library()
    if not STATE.modules or group is None:
        pytest.skip("this install compiled nothing (pip install -e . with a C compiler does)")
    shutil.copytree(
        PACKAGE, tmp_path / "streamwarden", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy2(group, tmp_path / group.name)
    return tmp_path


def test_what_runs_is_what_the_state_says() -> None:
    files = {module: importlib.import_module(module).__file__ for module in STATE.modules}
    if STATE.compiled:
        assert all(_is_extension(path) for path in files.values()), files
        assert not os.environ.get("STREAMWARDEN_PURE_PYTHON")
    else:
        assert all(path is not None and path.endswith(".py") for path in files.values()), files
        assert STATE.reason


def test_a_source_edited_after_the_build_runs_as_source_with_a_warning(built_tree: Path) -> None:
    out, err = _files_in(built_tree, {})
    summary, files = json.loads(out)
    assert "compiled" in summary and all(_is_extension(path) for path in files.values()), out

    # One module edited: all of them run from source (all or none), and it is said.
    meter = built_tree / "streamwarden" / "core" / "meter.py"
    meter.write_text(meter.read_text() + "\n# edited after the build\n")
    out, err = _files_in(built_tree, {})
    summary, files = json.loads(out)
    assert "streamwarden.core.meter changed after the build" in summary
    assert all(path.endswith(".py") for path in files.values()), files
    assert "RuntimeWarning" in err and "changed after the build" in err


def test_pure_python_is_asked_for_with_an_environment_variable(built_tree: Path) -> None:
    out, err = _files_in(built_tree, {"STREAMWARDEN_PURE_PYTHON": "1"})
    summary, files = json.loads(out)
    assert "STREAMWARDEN_PURE_PYTHON is set" in summary
    assert all(path.endswith(".py") for path in files.values()), files
    assert "RuntimeWarning" not in err  # asked for: nothing to warn about


def test_a_missing_shared_library_runs_every_module_from_source(built_tree: Path) -> None:
    for library in built_tree.glob("streamwarden_native__mypyc*"):
        library.unlink()
    out, _ = _files_in(built_tree, {})
    summary, files = json.loads(out)
    assert "compiled nothing" in summary
    assert all(path.endswith(".py") for path in files.values()), files
