"""The root of an event whose data is its text, not JSON.

Kept in a module of its own, which the build leaves uncompiled: mypyc
compiles no subclass of a builtin type, and the filters need the root to be
a list they can write back into (``root[0] = text``).
"""


class RawText(list[str]):
    """The root of an event whose whole data is its text (not JSON): ``[data]``."""

    __slots__ = ()
