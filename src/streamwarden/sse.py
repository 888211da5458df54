"""``streamwarden.sse``, the public name of the SSE decoder (a stable contract).

The decoder lives in :mod:`streamwarden.core.sse`; this module gives it its
public name, so that code and type checkers outside the project import
``from streamwarden.sse import SSEDecoder, Event`` as they always have.
"""

from streamwarden.core.sse import *  # noqa: F403  (the whole public surface, by design)
from streamwarden.core.sse import __all__ as __all__
