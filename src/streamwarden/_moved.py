"""The old, flat module names, kept working after the package took its subpackages.

Until 0.1 every module sat at the top of the package (``streamwarden.relay``,
``streamwarden.mock``, ...). Code outside the project imports them by those
names, so each old name stays an alias of the module's new home: the same
module object, not a copy (a copy would hold its own classes, and an
``isinstance`` across the two would fail). A package's submodules follow
it (``streamwarden.dialects.base`` is ``streamwarden.core.dialects.base``),
and ``python -m`` runs an old name as it did.

New code imports the new names; :data:`MOVED` is the table of both.
``streamwarden.sse``, a public contract, is a real module besides, so that
type checkers see it (``streamwarden/sse.py``).

Kept free of any import of the package, like :mod:`streamwarden._native`:
the finder is in place before any other module is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import CodeType, ModuleType

__all__ = ["MOVED", "install", "new_name"]

#: Each old name below ``streamwarden.``, and where its module lives now.
MOVED: dict[str, str] = {
    "dialects": "core.dialects",
    "filters": "core.filters",
    "headers": "core.headers",
    "inflate": "core.inflate",
    "journal": "core.journal",
    "meter": "core.meter",
    "plan": "core.plan",
    "refusals": "core.refusals",
    "relay": "core.relay",
    "usage": "core.usage",
    "upstream": "net.upstream",
    "sidecar.upstream": "net.upstream",
    "resume": "features.resume.model",
    "resume_store": "features.resume.store",
    "resume_redis": "features.resume.redis_store",
    "resume_service": "features.resume.service",
    "engine": "features.engine.counters",
    "engine_watch": "features.engine.watch",
    "live": "observation.live",
    "logs": "observation.logs",
    "metrics": "observation.metrics",
    "register": "observation.register",
    "telemetry": "observation.telemetry",
    "top": "observation.top",
    "demo": "tools.demo",
    "inject": "tools.inject",
    "mock": "tools.mock",
    "probe": "tools.probe.measure",
    "probe_client": "tools.probe.client",
    "probe_plot": "tools.probe.plot",
    "webhook": "tools.webhook",
}

_ROOT = "streamwarden."


def new_name(fullname: str) -> str | None:
    """The module's name now, if ``fullname`` is an old one (or below an old package)."""
    if not fullname.startswith(_ROOT):
        return None
    rest = fullname[len(_ROOT) :]
    moved = MOVED.get(rest)
    if moved is not None:
        return _ROOT + moved
    head, dot, _ = rest.rpartition(".")
    while dot:
        moved = MOVED.get(head)
        if moved is not None:
            return f"{_ROOT}{moved}.{rest[len(head) + 1 :]}"
        head, dot, _ = head.rpartition(".")
    return None


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module of its new one (and runs it for ``python -m``)."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._own: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._target)
        self._own = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing runs: the module ran when it was imported under its new name.

        The import system has just given it the old name's spec, though;
        its own goes back, so that it still knows where it lives.
        """
        module.__spec__ = self._own

    def get_code(self, fullname: str) -> CodeType | None:
        # runpy (``python -m streamwarden.mock``) runs a module's code afresh as __main__.
        spec = importlib.util.find_spec(self._target)
        loader = spec.loader if spec is not None else None
        get_code = getattr(loader, "get_code", None)
        return get_code(self._target) if get_code is not None else None


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        moved = new_name(fullname)
        if moved is None:
            return None
        real = importlib.util.find_spec(moved)
        if real is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _Alias(moved), origin=real.origin)
        spec.submodule_search_locations = real.submodule_search_locations
        return spec


_FINDER = _AliasFinder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
