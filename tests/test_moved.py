"""The old flat module names still work, as the very modules of their new homes.

Code outside the project imported ``streamwarden.relay``, ``streamwarden.mock``
and the rest before the package took its subpackages; each old name must
give the same module object (a copy would hold classes of its own), its
submodules must follow it, and ``python -m`` must run it as before.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamwarden._moved import MOVED, new_name

SRC = Path(__file__).resolve().parents[1] / "src" / "streamwarden"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_is_the_module_of_its_new_one(old: str) -> None:
    new = importlib.import_module(f"streamwarden.{MOVED[old]}")
    assert importlib.import_module(f"streamwarden.{old}") is new
    # Its own spec stays: it still knows where it lives.
    assert new.__spec__ is not None and new.__spec__.name == new.__name__


def test_an_old_package_takes_its_submodules_along() -> None:
    from streamwarden.core.dialects import base
    from streamwarden.tools.mock import server

    assert importlib.import_module("streamwarden.dialects.base") is base
    assert importlib.import_module("streamwarden.mock.server") is server
    from streamwarden.dialects.base import Dialect  # the old spelling of an import
    from streamwarden.mock.server import MockServer

    assert Dialect is base.Dialect and MockServer is server.MockServer


def test_every_old_name_is_gone_from_the_top_of_the_tree() -> None:
    """No old module is left beside its alias (it would shadow the alias)."""
    for old in MOVED:
        path = SRC.joinpath(*old.split("."))
        assert not path.with_suffix(".py").exists(), old
        assert not (path / "__init__.py").exists(), old


def test_names_that_never_moved_are_not_aliased() -> None:
    assert new_name("streamwarden.sidecar.proxy") is None
    assert new_name("streamwarden.core.relay") is None
    assert new_name("streamwarden.relayx") is None
    assert new_name("other.relay") is None
    assert new_name("streamwarden.mock.formats.openai") == "streamwarden.tools.mock.formats.openai"


def test_the_public_sse_name_is_the_decoder() -> None:
    import streamwarden.core.sse as core
    import streamwarden.sse as public

    assert public.SSEDecoder is core.SSEDecoder and public.Event is core.Event
    events = public.SSEDecoder().feed(b"data: hi\n\n")
    assert [(event.event, event.data) for event in events] == [("message", "hi")]


def test_python_dash_m_runs_an_old_name() -> None:
    """``python -m streamwarden.metrics`` printed the README's table, and still does."""
    env = {**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"}
    old = subprocess.run(
        [sys.executable, "-m", "streamwarden.metrics"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    new = subprocess.run(
        [sys.executable, "-m", "streamwarden.observation.metrics"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert old.returncode == 0, old.stderr
    assert old.stdout == new.stdout and "streamwarden_streams_total" in old.stdout
