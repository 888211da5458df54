"""``streamwarden run --help`` against the config model: every option's default and variable.

The help is read from the real command (a subprocess); what it shows is fed
back through the variable, the flag and the model, and must give the
model's own default: a default written a second time somewhere, or shown
in a form the config does not take (``15.0``, ``8388608``), fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr

from streamwarden.cli import _parser, _settings_from
from streamwarden.config import Settings, load_settings

PREFIX = "STREAMWARDEN_"
#: What every option of run shows: its default (or that it has none) and its variable.
SHOWN = re.compile(r"\((required|default: (?P<default>[^;]+)); env (?P<variable>\S+?)\)")
#: A duration as a user writes it: 250ms, 15s, 30m, 2h, or 0.
DURATION = re.compile(r"^(0|\d+(ms|s|m|h))$")
#: A size as a user writes it: 8MiB, 4KiB, or a number of bytes.
SIZE = re.compile(r"^\d+(KiB|MiB|GiB)?$")


def run_help(columns: int = 200) -> str:
    # Wide, so that argparse does not fold a variable's name at a hyphen.
    result = subprocess.run(
        [sys.executable, "-m", "streamwarden.cli", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "COLUMNS": str(columns)},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def listed_options(text: str) -> dict[str, str]:
    """Each option line of the help (``--listen HOST:PORT``) and its help, on one line."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation, _, help_text = line.strip().partition("  ")
            current = entries.setdefault(invocation, [])
            current.append(help_text)
        elif current is not None and line.startswith("    "):
            current.append(line)
        else:
            current = None
    return {option: " ".join(" ".join(parts).split()) for option, parts in entries.items()}


def epilog_rows(text: str) -> dict[str, str]:
    """The epilog's table: each variable and the default shown for it."""
    rows = re.findall(rf"(?m)^  ({PREFIX}[A-Z_]+)  +(\S+)$", text)
    return dict(rows)


def key_of(variable: str) -> str:
    assert variable.startswith(PREFIX), variable
    key = variable[len(PREFIX) :].lower()
    assert key in Settings.model_fields, f"{variable} names no setting"
    return key


def assert_written_as_the_config_takes_it(key: str, shown: str) -> None:
    default = getattr(Settings(), key)
    if isinstance(default, float):  # every float setting is a duration
        assert DURATION.match(shown), (key, shown)
    elif isinstance(default, int) and not isinstance(default, bool) and key.endswith("_bytes"):
        assert SIZE.match(shown), (key, shown)


def test_every_option_run_lists_shows_its_default_and_its_variable() -> None:
    options = listed_options(run_help())
    assert "--listen HOST:PORT" in options and "--keepalive-interval DURATION" in options
    for option, help_text in options.items():
        if option == "-h, --help":
            continue
        assert f"env {PREFIX}" in help_text, (option, help_text)
        flag = option.split()[0]
        if flag in ("--uvloop", "--set", "--config"):
            continue  # not one key's flag: each is checked on its own below
        match = SHOWN.search(help_text)
        assert match, (option, help_text)
        key = key_of(match["variable"])
        default = getattr(Settings(), key)
        if match["default"] is None:  # "required"
            assert default is None, key
            continue
        shown = match["default"]
        assert_written_as_the_config_takes_it(key, shown)
        # The default shown is the model's, read back by the variable...
        from_variable = load_settings(environ={match["variable"]: shown})
        assert getattr(from_variable, key) == default, (option, shown)
        # ...and by this very flag (which sets that key and no other).
        from_flag = _settings_from(_parser().parse_args(["run", flag, shown]))
        assert getattr(from_flag, key) == default, (option, shown)


def test_the_required_upstream_says_so_and_names_its_variable() -> None:
    options = listed_options(run_help())
    assert "(required; env STREAMWARDEN_UPSTREAM)" in options["--upstream URL"]
    assert Settings().upstream is None
    given = load_settings(environ={"STREAMWARDEN_UPSTREAM": "http://127.0.0.1:8000"})
    assert given.upstream == "http://127.0.0.1:8000"


def test_the_options_that_are_not_one_key_name_their_variables(tmp_path: Path) -> None:
    options = listed_options(run_help())
    config = options["--config FILE"]
    assert "(default: none; env STREAMWARDEN_CONFIG)" in config
    file = tmp_path / "sw.yaml"
    file.write_text("keepalive_interval: 7s\n")
    assert load_settings(environ={"STREAMWARDEN_CONFIG": str(file)}).keepalive_interval == 7.0

    uvloop = options["--uvloop"]
    assert "env STREAMWARDEN_EVENT_LOOP=uvloop" in uvloop
    by_flag = _settings_from(_parser().parse_args(["run", "--uvloop"]))
    by_variable = load_settings(environ={"STREAMWARDEN_EVENT_LOOP": "uvloop"})
    assert by_flag.event_loop == by_variable.event_loop == "uvloop"

    assert "env STREAMWARDEN_<KEY>" in options["--set KEY=VALUE"]


def _from_shown(shown: str) -> Any:
    """A default as the help shows it, read the way the config file reads it."""
    return yaml.safe_load(f"value: {shown}")["value"]


def test_the_epilog_lists_every_other_key_with_its_variable_and_default() -> None:
    text = run_help()
    flagged = {
        key_of(match["variable"])
        for help_text in listed_options(text).values()
        if (match := SHOWN.search(help_text)) and match["variable"] != "STREAMWARDEN_CONFIG"
    }
    rows = epilog_rows(text)
    listed = {key_of(variable) for variable in rows}
    # Every STREAMWARDEN_* setting is in --help, once: as a flag or as a row.
    assert listed | flagged == set(Settings.model_fields)
    assert not listed & flagged, listed & flagged
    defaults = Settings()
    for variable, shown in rows.items():
        key = key_of(variable)
        default = getattr(defaults, key)
        if shown == "unset":
            assert default is None or default == SecretStr(""), (key, default)
            continue
        assert_written_as_the_config_takes_it(key, shown)
        from_file = Settings.model_validate({key: _from_shown(shown)})
        assert getattr(from_file, key) == default, (variable, shown)
        from_variable = load_settings(environ={variable: shown})
        assert getattr(from_variable, key) == default, (variable, shown)


def test_at_80_columns_the_prose_folds_and_the_table_stays_whole() -> None:
    narrow = run_help(80)
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert epilog_rows(narrow) == epilog_rows(run_help(200))


def test_a_bad_value_for_a_flag_is_still_one_line_and_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "streamwarden.cli", "run", "--log-level", "loud"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
