"""Where things are, for a test in any folder of ``tests/``.

The tests sit one folder down from here (``tests/core/``, ``tests/sidecar/``...),
so a test's own ``__file__`` says nothing about where the repository or the
shared data is: these names do.
"""

from __future__ import annotations

from pathlib import Path

#: ``tests/``: the shared helper modules and the data folders below.
TESTS = Path(__file__).resolve().parent
#: The repository's root: ``src/``, ``docs/``, ``configs/``, ``helm/``...
REPO = TESTS.parent
#: Recorded and hand-written streams, and the helper scripts beside them.
FIXTURES = TESTS / "fixtures"
#: The recorded corpus: one provider stream per file.
STREAMS = FIXTURES / "streams"
