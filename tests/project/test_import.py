"""``import streamwarden`` changes nothing global in the process that imports it.

The middleware is imported into a host application's process: importing it
must leave that process's import system, logging and signal handlers as
they were. The one exception is ``_native``'s, and only when the compiled
per-event modules are stale or refused: then a finder loads their sources.
"""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import logging, signal, sys, warnings
def snapshot():
    return (
        list(sys.meta_path),
        list(sys.path_hooks),
        list(logging.root.handlers),
        logging.root.level,
        [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)],
        sys.excepthook,
        sys.displayhook,
    )
before = snapshot()
import streamwarden, streamwarden.sse, streamwarden.middleware, streamwarden.sidecar
from streamwarden._native import state
after = snapshot()
added = [f for f in after[0] if f not in before[0]]
# The build compiled some and they are not what runs: their sources load.
expected = ["_SourceFinder"] if state().modules and not state().compiled else []
assert [type(f).__name__ for f in added] == expected, added
assert [f for f in before[0] if f not in after[0]] == []
assert after[1:] == before[1:], (before[1:], after[1:])
# The old flat names of 0.1's first layout are gone, not aliased.
import importlib.util
assert importlib.util.find_spec("streamwarden.relay") is None
print("unchanged")
"""


def test_importing_streamwarden_changes_nothing_global() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_")}
    for pure in ("", "1"):
        if pure:
            env["STREAMWARDEN_PURE_PYTHON"] = pure
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", PROBE],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == 0 and done.stdout.strip() == "unchanged", done.stderr
