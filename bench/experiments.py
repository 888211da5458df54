"""Proposed hot-path changes, applied at run time, so they can be measured before src/ changes.

``python -m bench.experiments PATCHES run ...`` applies the named patches
(``+``-separated) to the installed package and then runs ``streamwarden``
with the remaining arguments. The harness starts these as paths named
``sidecar+PATCHES`` (``python -m bench experiment``) and loads them in the
same interleaved windows as the unpatched sidecar. A patch here is evidence
for a change, never the change itself: the product code stays as it is.

- ``no-gap-metrics``: no Prometheus histogram observation per content
  event (the inter-token gap); shows what that observation costs.
- ``gc-off``: no cyclic garbage collection: what its pauses cost in p99.
- ``noop``: no change; the control for the runner itself, and for every
  other patch: experiments run the modules from source, never compiled.
- ``no-digit-scan``: orjson for every event, without the scan for
  19-digit runs first; an upper bound of what a cheaper guard would win.
- ``no-batch``: the stream driver writes each HTTP chunk's events at once
  instead of one write per upstream read; shows what batching is worth.

Four earlier patches proved their worth and are now the sidecar's own code
(bench/README.md tells what each gained): ``lazy-deadline`` (one deadline
timer per stream), ``direct-feed`` (the relay in the upstream's data
callback, now ``streamwarden.sidecar.driver``), ``fast-cancel`` (the
upstream shut down in the callback that hears the client leave) and
``orjson``. ``body-bytes`` (a small request body sent whole, not as a
chunked upload: −2%, within noise) is gone with aiohttp's client: the
sidecar's own client sends a body it has read whole with its length.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["PATCHES", "apply"]


def _no_gap_metrics() -> None:
    from streamwarden.sidecar.proxy import Proxy

    original = Proxy.__init__

    def without_gaps(self: Proxy, *args: object, **kwargs: object) -> None:
        kwargs["gap_observer"] = None
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    Proxy.__init__ = without_gaps  # type: ignore[method-assign]


def _no_batch() -> None:
    from streamwarden.sidecar import driver

    def gather(self: Any, out: bytes) -> None:
        if out:
            self._pending.append(out)
            self.flush()  # at once, as each chunk is parsed, not once per read

    driver._Conduit._gather = gather  # type: ignore[method-assign]


def _gc_relaxed() -> None:
    """The collector's first generation every 50,000 allocations instead of 700.

    A relayed event allocates a handful of tracked objects (its frame,
    event, observation, lists), so the default threshold runs a young
    collection every hundred-odd events.
    """
    import gc

    gc.set_threshold(50_000, 20, 100)


def _gc_off() -> None:
    """No cyclic garbage collection at all: an upper bound of what its pauses cost in p99."""
    import gc

    gc.disable()


def _noop() -> None:
    """Nothing: the control, the sidecar started through this runner unpatched."""


PATCHES: dict[str, Callable[[], None]] = {
    "no-batch": _no_batch,
    "no-gap-metrics": _no_gap_metrics,
    "gc-relaxed": _gc_relaxed,
    "gc-off": _gc_off,
    "noop": _noop,
}


def apply(names: list[str]) -> None:
    # A compiled class cannot be patched, and compiled callers would not see
    # a patched function: an experiment runs the sources, so compare it with
    # ``sidecar+noop`` (the sources unpatched), not with the compiled sidecar.
    os.environ["STREAMWARDEN_PURE_PYTHON"] = "1"
    import streamwarden.core.dialects  # noqa: F401 - every dialect module loaded before patching

    for name in names:
        PATCHES[name]()


def main() -> int:
    patches = [p for p in sys.argv[1].split("+") if p]
    unknown = [p for p in patches if p not in PATCHES]
    if unknown:
        print(f"unknown patch(es) {unknown}; known: {sorted(PATCHES)}", file=sys.stderr)
        return 2
    apply(patches)
    from streamwarden.cli import main as streamwarden_main

    return streamwarden_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
