"""``streamwarden top``: the open streams of a sidecar, live in the terminal.

It reads the admin port's ``GET /streams`` every ``--interval`` and shows
one row per open stream, oldest first (id, route, dialect, age, time to
first token, events and tokens so far, time since the last write to the
client, the client's state), and how the streams of the last minute
ended. A stream whose last write is long ago, or whose client is
``paused``, is the one that "hangs".
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

__all__ = ["render", "run_top"]


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"


def render(view: dict[str, Any], source: str) -> Group:
    """The screen for one ``/streams`` answer."""
    streams = view.get("streams", [])
    table = Table(title=f"streamwarden top: {len(streams)} open streams at {source}", expand=True)
    for column in (
        "id",
        "route",
        "dialect",
        "age",
        "ttft",
        "events",
        "tokens",
        "last write",
        "client",
    ):
        # The names an operator greps for never shrink to an ellipsis.
        table.add_column(
            column,
            justify="right" if column in ("events", "tokens") else "left",
            no_wrap=column in ("dialect", "client"),
            min_width=16 if column == "dialect" else 9 if column == "client" else None,
        )
    for stream in streams:
        quiet = stream.get("since_last_write_s") or 0.0
        client = stream.get("client", "")
        style = "bold red" if client == "paused" or quiet > 30 else None
        table.add_row(
            str(stream.get("id")),
            str(stream.get("route")),
            str(stream.get("dialect")),
            _seconds(stream.get("age_s")),
            _seconds(stream.get("ttft_s")),
            str(stream.get("events")),
            str(stream.get("tokens")),
            _seconds(quiet),
            client,
            style=style,
        )
    recent = view.get("recent", {})
    endings = ", ".join(f"{state} {count}" for state, count in sorted(recent.items())) or "none"
    footer = Text(f"last minute's endings: {endings}")
    if view.get("draining"):
        footer.append("   (draining)", style="yellow")
    return Group(table, footer)


async def _fetch(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url) as response:
        response.raise_for_status()
        loaded: dict[str, Any] = json.loads(await response.read())
        return loaded


async def _top(admin: str, interval: float, once: bool) -> int:
    url = admin.rstrip("/") + "/streams"
    console = Console()
    timeout = aiohttp.ClientTimeout(total=max(2.0, interval))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if once:
            console.print(render(await _fetch(session, url), admin))
            return 0
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                try:
                    shown: Any = render(await _fetch(session, url), admin)
                except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                    shown = Text(f"streamwarden top: {url}: {type(exc).__name__}: {exc}")
                live.update(shown, refresh=True)
                await asyncio.sleep(interval)  # the refresh interval


def run_top(admin: str, interval: float = 1.0, once: bool = False) -> int:
    """Run until Ctrl-C; ``once`` prints one screen and exits."""
    try:
        return asyncio.run(_top(admin, interval, once))
    except KeyboardInterrupt:
        return 0
