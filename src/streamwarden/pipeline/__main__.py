"""``python -m streamwarden.pipeline``: the docs' parity table, from the plan's stages."""

from __future__ import annotations

from streamwarden.pipeline.parity import parity_table

print(parity_table())
