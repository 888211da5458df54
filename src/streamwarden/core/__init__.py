"""The core: what every stream goes through, with no I/O and no face.

Framing (:mod:`~streamwarden.core.sse`, :mod:`~streamwarden.core.inflate`),
the wire formats (:mod:`~streamwarden.core.dialects`), the stream plan
(:mod:`~streamwarden.core.plan`), the per-stream state machine
(:mod:`~streamwarden.core.relay`) with its accounting
(:mod:`~streamwarden.core.meter`) and journal
(:mod:`~streamwarden.core.journal`), the header rules and the refusals both
faces answer with. The two transforms the relay applies inside an event's
own pass, for speed (:mod:`~streamwarden.core.filters`' hold-back and
:mod:`~streamwarden.core.usage`'s take-back), live here too; their stages
in :mod:`streamwarden.pipeline` decide when they run.

Bytes and a clock go in, bytes and actions come out: nothing here imports
a face, a feature, an event loop or a web framework (``pyproject.toml``'s
import contracts hold that).
"""
