"""The tests mirror the package (tests/README.md): a folder a part, one name a file.

Test modules import the shared helpers of ``tests/`` by name, from any folder
(pyproject.toml, ``pythonpath``), and never each other: what two test files
share is a helper in ``tests/``, so ``tests/`` alone is on the path. A test
importing another test module would pass in a whole run (pytest puts each
collected file's folder on ``sys.path``) and fail run on its own. Without an
``__init__.py``, pytest imports each test file under its own name, so no two
may share one; and a test file in ``tests/`` itself has not been given its
folder yet.
"""

from __future__ import annotations

import ast
import tomllib
from collections import Counter
from pathlib import Path

from locations import REPO, TESTS


def _test_files() -> list[str]:
    return sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))


def _imported_modules(path: Path) -> set[str]:
    """The top-level names of the modules ``path`` imports (absolute imports, at any depth)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_test_sits_in_the_folder_of_the_part_it_tests() -> None:
    loose = [name for name in _test_files() if "/" not in name]
    assert not loose, f"give each a folder (tests/README.md says which): {loose}"


def test_no_test_module_is_imported_by_another_file_of_the_tests() -> None:
    test_modules = {name.rsplit("/", 1)[-1].removesuffix(".py") for name in _test_files()}
    readers = [p for p in TESTS.rglob("*.py") if "node_modules" not in p.parts]
    found = {
        p.relative_to(TESTS).as_posix(): sorted(_imported_modules(p) & test_modules)
        for p in readers
    }
    found = {path: modules for path, modules in found.items() if modules}
    assert not found, f"move what they share into a helper in tests/ (tests/README.md): {found}"


def test_only_tests_is_on_the_path_and_no_name_is_used_twice() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    path = pyproject["tool"]["pytest"]["ini_options"]["pythonpath"]
    assert path == ["tests"], "a test module imports only helpers of tests/ (tests/README.md)"
    names = Counter(name.rsplit("/", 1)[-1] for name in _test_files())
    assert not [n for n, count in names.items() if count > 1], names.most_common(3)
