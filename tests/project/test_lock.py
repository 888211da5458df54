"""The lock (requirements/) says what pyproject.toml says, and the tiers stay out of our namespace.

CI installs from the lock (``pip install --require-hashes -r
requirements/dev.txt``), so a range changed in pyproject.toml without
``bash requirements/lock`` would go untested: these checks fail first, with
no network, the way ``uv sync --locked`` does.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from locations import REPO
from streamwarden.config import ConfigError, environment_overrides

LOCK = REPO / "requirements"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]

#: Each lock file and what it is made from (requirements/lock): the project's
#: own dependencies with some extras, and whether the build's requirements.
FILES = {
    "build.txt": (None, True),
    "image.txt": (("fast", "redis"), False),
    "dev.txt": (("test", "docs"), True),
}

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)(?:\s*;\s*([^\\]+?))?\s*\\?$")


def pins(name: str) -> dict[str, list[tuple[Version, str | None]]]:
    """Each package of a lock file: its pinned versions, with the marker of each line."""
    found: dict[str, list[tuple[Version, str | None]]] = {}
    for line in (LOCK / name).read_text().splitlines():
        match = _PIN.match(line)
        if match:
            package, version, marker = match.groups()
            found.setdefault(canonicalize_name(package), []).append((Version(version), marker))
    return found


def asked(extras: tuple[str, ...] | None, build: bool) -> Iterator[Requirement]:
    if extras is not None:
        yield from map(Requirement, PROJECT["dependencies"])
        for extra in extras:
            yield from map(Requirement, PROJECT["optional-dependencies"][extra])
    if build:
        yield from map(Requirement, PYPROJECT["build-system"]["requires"])


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_requirement_of_pyproject_is_pinned_within_its_range(name: str) -> None:
    locked = pins(name)
    environment = {**default_environment(), "python_full_version": "3.11.0"}
    wrong = []
    for requirement in asked(*FILES[name]):
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue  # another platform's: the universal lock has it under a marker
        versions = [v for v, _ in locked.get(canonicalize_name(requirement.name), [])]
        if not versions:
            wrong.append(f"{requirement}: not in the lock")
        wrong += [
            f"{requirement}: locked {version}"
            for version in versions
            if not requirement.specifier.contains(version, prereleases=True)
        ]
    assert not wrong, f"requirements/{name} is behind pyproject.toml (bash requirements/lock)"


def test_every_locked_line_carries_a_hash() -> None:
    for name in (*FILES, "uv.txt"):
        text = (LOCK / name).read_text()
        blocks = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 2)[2])
        unhashed = [b.split()[0] for b in blocks if "==" in b and "--hash=sha256:" not in b]
        assert not unhashed, f"{name}: {unhashed}"


def test_the_build_requirements_are_pyprojects_own() -> None:
    lines = (LOCK / "build.in").read_text().splitlines()
    listed = [line for line in lines if line and not line.startswith("#")]
    requires = PYPROJECT["build-system"]["requires"]
    assert listed[: len(requires)] == requires, "bash requirements/lock writes build.in anew"


def test_aiohttp_is_bounded_to_the_minor_versions_the_sidecar_was_tested_on() -> None:
    """The sidecar reads private names of aiohttp's server (sidecar/http.py).

    So pyproject.toml admits aiohttp up to the minor version the lock holds,
    which CI ran, and no further: a new minor needs its bound raised and the
    lock updated together, and then this suite runs on it (the import check
    in sidecar/http.py fails the whole collection if a name is gone).
    """
    (spec,) = [Requirement(r) for r in PROJECT["dependencies"] if r.startswith("aiohttp")]
    uppers = [s.version for s in spec.specifier if s.operator == "<"]
    assert len(uppers) == 1, f"aiohttp needs an upper bound: {spec}"
    upper = Version(uppers[0])
    for name in FILES:
        for version, _ in pins(name).get("aiohttp", []):
            assert (version.major, version.minor + 1) == (upper.major, upper.minor), (
                f"requirements/{name} locks aiohttp {version}, pyproject admits <{upper}: "
                "the newest minor admitted must be the one tested"
            )
    assert SpecifierSet(str(spec.specifier)).contains(aiohttp.__version__, prereleases=True)


#: Where the tiers set environment variables: a name under STREAMWARDEN_ that
#: is not a setting makes the config loader refuse to start (as it should for
#: a user's typo), so a test helper's own variable would stop a tier dead.
TIERS = ["tests", "bench", ".ci", "examples", "fuzz", "helm", "docs", "README.md", "Dockerfile"]
#: The tests of that very refusal, which write wrong names on purpose.
ON_PURPOSE = {"tests/config/test_config.py"}


def tier_files() -> Iterator[Path]:
    for entry in TIERS:
        path = REPO / entry
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for file in files:
            relative = file.relative_to(REPO).as_posix()
            if "node_modules" in relative or relative in ON_PURPOSE or not file.is_file():
                continue
            if file.suffix in {".py", ".sh", ".md", ".yaml", ".yml", ".tpl", ""}:
                yield file


def test_no_tier_sets_a_streamwarden_variable_that_is_not_a_setting() -> None:
    collisions = set()
    for file in tier_files():
        text = file.read_text(errors="replace")
        for name in set(re.findall(r"\bSTREAMWARDEN_[A-Z0-9_]*[A-Z0-9]\b", text)):
            try:
                environment_overrides({name: "1"})
            except ConfigError as exc:
                if "unknown variable" in str(exc):
                    collisions.add(f"{file.relative_to(REPO)}: {name}")
    assert not collisions, sorted(collisions)
