"""The tests mirror the package (tests/README.md): a folder a part, one name a file.

Test modules import the shared helpers of ``tests/`` and a few of each other
by name, from any folder (pyproject.toml, ``pythonpath``); without an
``__init__.py``, pytest imports each test file under its own name. So every
folder that holds tests must be on that path, and no two test files may share
a name; and a test file in ``tests/`` itself has not been given its folder yet.
"""

from __future__ import annotations

import tomllib
from collections import Counter

from locations import REPO, TESTS


def _test_files() -> list[str]:
    return sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))


def test_every_test_sits_in_the_folder_of_the_part_it_tests() -> None:
    loose = [name for name in _test_files() if "/" not in name]
    assert not loose, f"give each a folder (tests/README.md says which): {loose}"


def test_every_folder_of_tests_is_on_the_path_and_no_name_is_used_twice() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    path = set(pyproject["tool"]["pytest"]["ini_options"]["pythonpath"])
    folders = {"tests/" + name.rsplit("/", 1)[0] for name in _test_files() if "/" in name}
    assert folders <= path, f"add to pythonpath in pyproject.toml: {sorted(folders - path)}"
    names = Counter(name.rsplit("/", 1)[-1] for name in _test_files())
    assert not [n for n, count in names.items() if count > 1], names.most_common(3)
