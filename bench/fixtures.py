"""The recorded-style test streams the core benchmarks feed (no streamwarden import).

Kept free of streamwarden's modules so a benchmark run with another build's
Python (``bench.relay_ab``, a build from before the package layout) can use it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def long_openai_stream(events: int) -> bytes:
    """``tests/fixtures/make_long_openai.py``'s deterministic OpenAI stream of ``events`` tokens."""
    spec = importlib.util.spec_from_file_location(
        "make_long_openai", FIXTURES / "make_long_openai.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_long_openai"] = module
    spec.loader.exec_module(module)
    stream: bytes = module.long_openai_stream(events)
    return stream
