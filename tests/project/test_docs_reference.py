"""The docs' reference tables are the code's own, never kept by hand.

Each table of ``docs/`` that describes the code (settings, metrics, the log
line, error codes and end states, what the SDKs raise, the faces' parity,
the span attributes) sits between two comments and is made by one function
(``streamwarden.tools.reference.TABLES``). A change to the code without
``python -m streamwarden.tools.reference --write`` fails here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from locations import REPO
from streamwarden.config import Settings, parse_duration, parse_size, written_default
from streamwarden.core.meter import EndState
from streamwarden.tools.reference import END_STATES, TABLES, Table, main

DOCS = REPO / "docs"
_OTEL = {"span attributes", "genai metrics"}


@pytest.mark.parametrize("table", TABLES, ids=lambda t: f"{t.page}:{t.end[12:-4]}")
def test_the_page_holds_the_table_the_code_makes(table: Table) -> None:
    if table.end[12:-4] in _OTEL:
        pytest.importorskip("opentelemetry.sdk")
    assert table.published(DOCS) == table.make(), (
        "run: python -m streamwarden.tools.reference --write"
    )


def test_a_table_that_differs_from_the_code_is_named_and_written_again(tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.sdk")
    docs = tmp_path / "docs"
    for table in TABLES:
        (docs / table.page).parent.mkdir(parents=True, exist_ok=True)
        if not (docs / table.page).exists():
            (docs / table.page).write_text((DOCS / table.page).read_text())
    page = docs / "reference/configuration.md"
    page.write_text(page.read_text().replace("| `15s` |", "| `20s` |", 1))  # kept by hand
    assert main(["--docs", str(docs)]) == 1
    assert main(["--docs", str(docs), "--write"]) == 0
    assert main(["--docs", str(docs)]) == 0
    assert page.read_text() == (DOCS / "reference/configuration.md").read_text()


def _config_rows() -> dict[str, list[str]]:
    text = (DOCS / "reference/configuration.md").read_text()
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `") and "STREAMWARDEN_" in line:
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells
    return rows


def test_the_configuration_page_lists_every_setting_with_its_variable_and_no_other() -> None:
    rows = _config_rows()
    assert set(rows) == set(Settings.model_fields)
    for key, cells in rows.items():
        assert cells[1] == f"`STREAMWARDEN_{key.upper()}`"
        assert cells[4], f"{key}: no doc comment in Settings says what it does"


def _as_value(shown: str, actual: Any) -> Any:
    """A default as the page shows it, read back the way the code holds it."""
    if isinstance(actual, bool):
        return shown == "true"
    if isinstance(actual, float):
        return parse_duration(shown)
    if isinstance(actual, int):
        return parse_size(shown)
    if isinstance(actual, tuple):
        return () if shown == "[]" else shown
    if isinstance(actual, SecretStr):
        return SecretStr("") if shown == "unset" else SecretStr(shown)
    return shown


def test_every_default_on_the_page_reads_back_as_the_codes() -> None:
    defaults = Settings()
    for key, cells in _config_rows().items():
        shown = cells[2].strip("`")
        assert shown == written_default(key)
        actual = getattr(defaults, key)
        if actual is None or isinstance(actual, dict):
            continue  # "unset", "{}"
        assert _as_value(shown, actual) == actual, (key, shown, actual)


def test_every_end_state_is_explained() -> None:
    assert set(END_STATES) == set(EndState)


def test_the_log_fields_are_the_stream_lines() -> None:
    from streamwarden.core.meter import StreamMeter, StreamRecord
    from streamwarden.observation.logs import FIELD_DOCS, stream_fields

    record = StreamRecord("1", "/", "POST", "/v1/x", 200, "openai-chat", StreamMeter(0.0))
    assert list(FIELD_DOCS) == list(stream_fields(record))
