"""The Vercel AI SDK's UI message stream reader, run under Node (``tests/js``).

``read_ui_message_stream.mjs`` reads one chat answer as ``useChat`` does
and prints what the SDK assembled: the text, the tool parts, and the error
it raised, if any. Shared by the SDK error-event matrix and the tool-call
tests.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

JS = Path(__file__).parent / "js"


class VercelStreamError(Exception):
    """What the Vercel AI SDK raised in Node, carried back to Python."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


def node_and_ai_sdk() -> str | None:
    """Why the Vercel AI SDK cannot run here, or ``None`` if it can."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not (JS / "node_modules" / "ai" / "package.json").exists():
        return "the Vercel AI SDK is not installed (npm ci --prefix tests/js)"
    return None


def sdk_param(value: object, name: str) -> Any:
    """A ``pytest.param`` of one SDK's case, skipped for the Vercel AI SDK where it cannot run."""
    reason = node_and_ai_sdk() if name == "vercel-ai" else None
    return pytest.param(value, id=name, marks=[pytest.mark.skip(reason=reason)] if reason else [])


async def read_ui_stream(url: str, headers: dict[str, str]) -> dict[str, Any]:
    """The reader's result for one POST to ``url``: ``text``, ``tools`` (and the error's)."""
    process = await asyncio.create_subprocess_exec(
        "node",
        str(JS / "read_ui_message_stream.mjs"),
        url,
        json.dumps(headers),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await process.communicate()
    except asyncio.CancelledError:
        process.kill()
        await process.wait()
        raise
    if not out.strip():
        raise AssertionError(f"the Node reader failed: {err.decode(errors='replace')[-2000:]}")
    result: dict[str, Any] = json.loads(out)
    return result


def raise_if_failed(result: dict[str, Any]) -> None:
    if "error" in result:
        raise VercelStreamError(result["error"], result["message"])
