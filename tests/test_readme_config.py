"""The README's configuration table against the settings model: every key, every default."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from streamwarden.config import Settings, parse_duration, parse_size

README = Path(__file__).resolve().parent.parent / "README.md"
ROW = re.compile(r"^\| `([a-z_]+)`(?: / `([a-z_]+)`)? \| ([^|]*) \|")


def table() -> dict[str, str]:
    text = README.read_text()
    section = text[text.index("## Configuration") : text.index("## Metrics")]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            defaults = [d.strip(" `") for d in match.group(3).split("/")]
            for key, default in zip((match.group(1), match.group(2)), defaults * 2, strict=False):
                if key:
                    rows[key] = default
    return rows


def test_the_table_lists_every_setting_and_no_other() -> None:
    assert set(table()) == set(Settings.model_fields)


def _as_value(shown: str, actual: Any) -> Any:
    """The table's default written the way the code holds it, where it can be read."""
    first = shown.split(" ")[0].strip("`")
    if isinstance(actual, bool):
        return first == "true"
    if isinstance(actual, float):
        return parse_duration(first)
    if isinstance(actual, int):
        return parse_size(first)
    if isinstance(actual, tuple):
        return () if first in ("[]",) else first
    if isinstance(actual, SecretStr):
        return SecretStr("") if first == "unset" else SecretStr(first)
    return first


def test_every_default_in_the_table_is_the_codes() -> None:
    defaults = Settings()
    for key, shown in table().items():
        actual = getattr(defaults, key)
        if actual is None or isinstance(actual, dict) or shown.startswith("("):
            continue  # "(required for run)", "none", "{}": said in words
        if shown in ("none", "system store"):
            continue
        assert _as_value(shown, actual) == actual, (key, shown, actual)
