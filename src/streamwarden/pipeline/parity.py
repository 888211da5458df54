"""Face parity, as a table generated from the plan: which stages each face runs, and why not.

Every stage of :data:`streamwarden.pipeline.STAGES` runs in both faces
unless it names a ``middleware_gap``; the docs' table is this output
(``python -m streamwarden.pipeline``), and a test holds the two together.
"""

from __future__ import annotations

__all__ = ["parity_table"]


def parity_table() -> str:
    """The stages of the plan, in order, with what each face does with them (Markdown)."""
    from streamwarden import pipeline  # the plan as it is now (a test may extend it)

    rows = [
        "| stage | what it does | sidecar | middleware |",
        "|---|---|---|---|",
    ]
    for stage in pipeline.STAGES:
        gap = stage.middleware_gap
        middleware = f"no: {gap}" if gap else "yes"
        rows.append(f"| `{stage.name}` | {stage.summary} | yes | {middleware} |")
    return "\n".join(rows)
