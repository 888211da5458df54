"""The build: the modules on the path of every event, compiled with mypyc.

Everything else about the package is in ``pyproject.toml``. The modules
below run once per upstream read and per event (framing, the dialects, the
meter, the relay, the upstream client and the sidecar's stream driver); mypyc
compiles their typed Python to C extensions, which is what brings the
sidecar's CPU per event under twice nginx's (``bench/README.md``). The same
sources stay importable as plain Python: :mod:`streamwarden._native`
decides at import time which of the two runs.

The compiled modules are built when mypyc is importable (it ships inside
mypy, a build requirement) and ``STREAMWARDEN_PURE_PYTHON`` is not set in
the build's environment. A build whose C compiler is missing or fails
installs the plain sources only: every extension is optional.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from setuptools import Extension, setup

SRC = Path(__file__).parent / "src"

#: The per-event modules, as paths under src/. Only typed, self-contained
#: modules belong here: mypyc compiles no subclass of a builtin type
#: (``dialects/raw.py`` stays plain for that), and callers' calls into these
#: modules are bound at build time, so nothing may patch them at runtime.
COMPILED = [
    "streamwarden/core/sse.py",
    "streamwarden/core/meter.py",
    "streamwarden/core/inflate.py",
    "streamwarden/core/relay.py",
    "streamwarden/core/timers.py",
    "streamwarden/core/lifecycle.py",
    "streamwarden/core/transform.py",
    "streamwarden/core/endings.py",
    "streamwarden/core/calls.py",
    "streamwarden/core/toolcalls.py",
    "streamwarden/core/dialects/__init__.py",
    "streamwarden/core/dialects/base.py",
    "streamwarden/core/dialects/anthropic.py",
    "streamwarden/core/dialects/cohere.py",
    "streamwarden/core/dialects/gemini.py",
    "streamwarden/core/dialects/generic.py",
    "streamwarden/core/dialects/ndjson.py",
    "streamwarden/core/dialects/openai_chat.py",
    "streamwarden/core/dialects/openai_responses.py",
    "streamwarden/core/dialects/tgi.py",
    "streamwarden/core/dialects/vercel_ai.py",
    "streamwarden/net/upstream.py",
    # The stages' transforms: the path of every event of a stream that has them.
    "streamwarden/pipeline/holdback.py",
    "streamwarden/pipeline/takeback.py",
    "streamwarden/pipeline/stamping.py",
    "streamwarden/sidecar/channel.py",
    "streamwarden/sidecar/driver.py",
]

#: The shared library of the compiled group (mypyc puts the code of every
#: module in it; each module's own extension is a small shim).
GROUP = "streamwarden_native"

#: What the build compiled, and from which sources: read at import time, so
#: a source edited after the build runs as Python instead of the stale C.
MANIFEST = SRC / "streamwarden" / "_compiled.json"


def _module(path: str) -> str:
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def _forget_stale_extensions() -> None:
    """Remove the in-place extension of a module no longer compiled (moved, say).

    An editable build leaves each module's extension beside its source, and
    Python prefers an extension to a source of the same name: left there, a
    moved module's old extension would shadow its new source.
    """
    kept = {str(SRC / path.removesuffix(".py")) for path in COMPILED}
    for built in (SRC / "streamwarden").rglob("*.so"):
        if str(built.parent / built.name.split(".", 1)[0]) not in kept:
            built.unlink()


def _compiled_extensions() -> list[Extension]:
    MANIFEST.unlink(missing_ok=True)
    _forget_stale_extensions()
    if os.environ.get("STREAMWARDEN_PURE_PYTHON"):  # streamwarden._native.PURE_PYTHON
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        return []
    # The build runs where the runtime dependencies may be missing (pip's
    # isolated build environment): what they type is Any to mypyc, and the
    # project's own mypy run (strict, with them installed) checks the rest.
    flags = [
        "--ignore-missing-imports",
        "--follow-imports=silent",
        "--no-warn-unused-ignores",
        "--no-warn-return-any",
        "--allow-subclassing-any",
        "--allow-untyped-calls",
    ]
    try:
        # mypyc names each module by its path below the first directory
        # without an __init__.py: src/streamwarden/core/relay.py is streamwarden.core.relay.
        extensions = mypycify(
            [*flags, *(f"src/{path}" for path in COMPILED)], opt_level="3", group_name=GROUP
        )
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error
        print(f"warning: the per-event modules are not compiled ({exc!r})", file=sys.stderr)
        return []
    for extension in extensions:
        # A failed compile leaves the plain sources, which run as they are.
        extension.optional = True
    sources = {
        _module(path): hashlib.sha256((SRC / path).read_bytes()).hexdigest() for path in COMPILED
    }
    MANIFEST.write_text(json.dumps({"group": GROUP, "modules": sources}, indent=1) + "\n")
    return extensions


setup(ext_modules=_compiled_extensions())
