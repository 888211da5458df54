"""``python -m streamwarden.tools.mock``: run the simulated LLM upstream from the shell.

The flags and behaviour are those of ``streamwarden mock-upstream``; see
:mod:`streamwarden.tools.mock.cli`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from streamwarden.tools.mock.cli import run_mock_cli

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the mock with ``argv`` (default: the process arguments); return the exit code."""
    return run_mock_cli(argv, prog="python -m streamwarden.tools.mock")


if __name__ == "__main__":
    sys.exit(main())
