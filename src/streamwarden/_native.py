"""Which code runs: the per-event modules compiled by the build, or their sources.

``setup.py`` compiles the modules on the path of every event with mypyc and
writes ``_compiled.json``: the group's shared library and a digest of each
compiled module's source. Python's import system prefers an extension
module to the source beside it, so a compiled module whose source changed
afterwards (an editable install, edited or checked out anew) would run the
old code. This module, imported by the package before anything else, runs
the compiled modules only when every one of them is there and built from
the sources as they are now; otherwise, or when ``STREAMWARDEN_PURE_PYTHON``
is set, it puts a finder first on ``sys.meta_path`` that loads all of them
from their sources. All or none: the compiled modules call each other
inside their shared library, so half of them compiled would meet classes of
the other half that are not the ones they were built against.

Kept out of the compiled set itself, and free of any import of the package.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["PURE_PYTHON", "NativeState", "choose", "native_summary", "state"]

#: Set (to anything), at build or at run time: the per-event modules run from source.
PURE_PYTHON = "STREAMWARDEN_PURE_PYTHON"

_PACKAGE = Path(__file__).parent
_MANIFEST = _PACKAGE / "_compiled.json"


class NativeState:
    """What the build compiled and what runs (for ``--version``, the log and the tests)."""

    __slots__ = ("compiled", "modules", "reason")

    def __init__(self, compiled: bool, modules: tuple[str, ...], reason: str) -> None:
        #: The compiled modules run (else every module runs from its source).
        self.compiled = compiled
        #: The modules the build compiled (empty: it compiled none).
        self.modules = modules
        #: Why the sources run, or "" when the compiled modules do.
        self.reason = reason


_state = NativeState(False, (), "not decided yet")


def state() -> NativeState:
    return _state


def native_summary() -> str:
    """One phrase for the start-up log line and ``--version``."""
    if _state.compiled:
        return f"{len(_state.modules)} per-event modules compiled"
    return f"per-event modules from source ({_state.reason})"


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Loads the named modules from their ``.py`` files, never their extensions."""

    def __init__(self, modules: dict[str, Path]) -> None:
        self._modules = modules

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        source = self._modules.get(fullname)
        if source is None:
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def _source_of(module: str) -> Path:
    parts = module.split(".")[1:]
    package = _PACKAGE.joinpath(*parts)
    return package / "__init__.py" if package.is_dir() else package.with_suffix(".py")


def _extension_of(source: Path) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = source.with_name(source.stem + suffix)
        if candidate.exists():
            return candidate
    return None


def _why_not(group: str, modules: dict[str, str]) -> str:
    """Why the compiled modules must not run, or "" if they may."""
    if os.environ.get(PURE_PYTHON):
        return f"{PURE_PYTHON} is set"
    # Beside the package, where the build put it: one found elsewhere on
    # sys.path would be another build's.
    if _extension_of(_PACKAGE.parent / f"{group}__mypyc.py") is None:
        return "the build compiled nothing (no C compiler, or it failed)"
    for module, digest in modules.items():
        source = _source_of(module)
        if _extension_of(source) is None:
            return f"{module} was not compiled"
        if not source.exists() or hashlib.sha256(source.read_bytes()).hexdigest() != digest:
            return f"{module} changed after the build (reinstall to compile it again)"
    return ""


def choose() -> NativeState:
    """Decide once, before any compiled module is imported, which code runs."""
    global _state
    try:
        manifest = json.loads(_MANIFEST.read_text())
        group: str = manifest["group"]
        modules: dict[str, str] = manifest["modules"]
    except (OSError, ValueError, KeyError, TypeError):
        _state = NativeState(False, (), "the build compiled nothing")
        return _state
    reason = _why_not(group, modules)
    if reason:
        sources = {module: _source_of(module) for module in modules}
        sys.meta_path.insert(0, _SourceFinder(sources))
        if _extension_of(_source_of(next(iter(modules)))) is not None and not os.environ.get(
            PURE_PYTHON
        ):
            # Compiled code older than its source: correct to run the source,
            # only slower. Say so, since nobody asked for it.
            warnings.warn(
                f"streamwarden runs its per-event modules from source: {reason}",
                RuntimeWarning,
                stacklevel=3,
            )
    _state = NativeState(not reason, tuple(modules), reason)
    return _state
