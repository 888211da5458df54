"""One stream's tool calls, checked on the way out: part of an honest ending.

What a dialect reads of its tool calls is followed to each call's close
(:mod:`streamwarden.core.toolcalls` holds the calls themselves). A close
whose arguments are not a JSON object is replaced by ``tool_call_invalid``
(it is checked before it is written: nothing after it reaches the client),
and arguments held past ``max_tool_arguments_bytes``, or nested past
``max_tool_arguments_depth``, end the stream ``tool_call_too_large`` in
place of the event that went over. A stream that ends for any other reason
while a call is open says ``tool_call_truncated`` instead of its own code
(its end state stays its own), and names every call it broke.
"""

from __future__ import annotations

from streamwarden.core.dialects import Dialect, Observation
from streamwarden.core.endings import ErrorCode
from streamwarden.core.meter import StreamMeter
from streamwarden.core.toolcalls import (
    INVALID,
    LISTED,
    TOO_LARGE,
    ToolCall,
    ToolCalls,
    starts_calls,
)

__all__ = ["CallCheck"]


class CallCheck:
    """The tool calls of one stream, made at the first step of one."""

    __slots__ = ("_max_bytes", "_max_depth", "_meter", "calls")

    def __init__(self, meter: StreamMeter, max_bytes: int, max_depth: int) -> None:
        self._meter = meter
        self._max_bytes = max_bytes
        self._max_depth = max_depth
        #: The stream's tool calls (None: none yet).
        self.calls: ToolCalls | None = None

    def follow(self, seen: Observation) -> ToolCall | None:
        """What an event says of tool calls (a terminal closes them all); the call it broke."""
        tools = self.calls
        steps = seen.calls
        if tools is None:
            if steps is None or not starts_calls(steps):
                return None  # a text block's stop, a choice's finish: no call yet
            tools = self._new()
        if steps is not None:
            broken = tools.follow(steps)
            if broken is not None:
                return broken
        return tools.finish_all() if seen.terminal else None

    def _new(self) -> ToolCalls:
        tools = ToolCalls(self._max_bytes, self._max_depth)
        self.calls = self._meter.tool_calls = tools
        return tools

    def failure(self, call: ToolCall) -> tuple[ErrorCode, str]:
        """The ending in place of the event that broke ``call``: invalid, or too large."""
        if call.end_state == TOO_LARGE and call.nested:
            return ErrorCode.TOOL_CALL_TOO_LARGE, (
                f"the arguments of {call.describe()} nest deeper than {self._max_depth} levels"
                " (max_tool_arguments_depth)"
            )
        if call.end_state == TOO_LARGE:
            return ErrorCode.TOOL_CALL_TOO_LARGE, (
                f"the arguments held for the stream's open tool calls exceeded {self._max_bytes}"
                f" bytes (max_tool_arguments_bytes) at {call.describe()}"
            )
        assert call.end_state == INVALID
        return ErrorCode.TOOL_CALL_INVALID, (
            f"the upstream closed {call.describe()} with arguments that are not a whole JSON"
            f" object ({call.size} bytes)"
        )

    def inside(self, dialect: Dialect, held: bytes | None) -> str | None:
        """The tool calls a cut now breaks, as a message names them, if any.

        ``held``: the partial block or line the framer holds (``None``: none).
        """
        tools = self.calls
        calls = tools.cut_calls() if tools is not None else []
        if not calls and dialect.calls_arrive_whole and held:
            cut = dialect.call_in_cut(held)
            if cut is not None:
                calls = [(tools if tools is not None else self._new()).cut_whole(*cut)]
        if not calls:
            return None
        if len(calls) == 1:
            return f"inside {calls[0].describe()}, {_received(calls[0])}"
        # Each named (id, name, bytes), up to as many as a record lists.
        named = "; ".join(f"{call.describe()}, {_received(call)}" for call in calls[:LISTED])
        more = f"; and {len(calls) - LISTED} more" if len(calls) > LISTED else ""
        return f"inside {len(calls)} tool calls: {named}{more}"

    def open_calls(self) -> list[dict[str, object]]:
        """The first :data:`~streamwarden.core.toolcalls.LISTED` tool calls open now."""
        tools = self.calls
        if tools is None:
            return []
        return [
            {"id": c.call_id, "name": c.name, "arguments_bytes": c.size}
            for c in tools.first_open(LISTED)
        ]

    @property
    def open_count(self) -> int:
        tools = self.calls
        return 0 if tools is None else tools.open_count


def _received(call: ToolCall) -> str:
    return f"with {call.size} bytes of its arguments received"
