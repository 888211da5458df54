"""The shape of the code (issue #26): functions a reader can hold, faces a reader can find.

No function in ``src/streamwarden`` runs over :data:`MAX_FUNCTION_LINES`,
counted from its ``def`` line to its last line (docstring included,
decorators not), except the declarative tables in :data:`TABLES`: a
parser's flags or a family of metrics reads as a list, and splitting it
would scatter one list over several functions. The faces' two central
classes stay under :data:`MAX_FACE_CLASS_LINES`: what does not fit there
belongs to a class or module with a name of its own.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from locations import REPO

SRC = REPO / "src" / "streamwarden"

MAX_FUNCTION_LINES = 60
MAX_FACE_CLASS_LINES = 300
#: The relay (issue #37): what is not the path of a frame or an input's
#: answer has a core module of its own (timers, lifecycle, transforms).
MAX_RELAY_LINES = 350

#: Declarative tables, by module (relative to src/streamwarden) and qualified
#: name, with why each is one: nothing else may run over the limit.
TABLES: dict[tuple[str, str], str] = {
    ("cli.py", "_probe_parser"): "argparse: the probe's flags, as --help lists them",
    ("tools/mock/cli.py", "_parser"): "argparse: the mock upstream's flags, as --help lists them",
    (
        "observation/metrics.py",
        "StreamMetrics.__init__",
    ): "the metric families, one definition each",
}

#: The faces' central classes, by module and name.
FACE_CLASSES = [
    ("sidecar/proxy.py", "Proxy"),
    ("middleware/responder.py", "StreamResponder"),
]

_Function = ast.FunctionDef | ast.AsyncFunctionDef


def _lines(node: ast.stmt) -> int:
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def _functions(tree: ast.Module) -> Iterator[tuple[str, _Function]]:
    """Every function and method in a module, with its qualified name."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, _Function]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _Function):
                name = prefix + child.name
                yield name, child
                yield from walk(child, name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    return walk(tree, "")


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC).as_posix(), ast.parse(path.read_text(), str(path))


def _long_functions() -> dict[tuple[str, str], int]:
    return {
        (module, name): _lines(function)
        for module, tree in _modules()
        for name, function in _functions(tree)
        if _lines(function) > MAX_FUNCTION_LINES
    }


def test_no_function_runs_over_sixty_lines_but_a_declarative_table() -> None:
    offenders = {key: length for key, length in _long_functions().items() if key not in TABLES}
    listed = "\n".join(
        f"  {module}: {name} ({length} lines)"
        for (module, name), length in sorted(offenders.items())
    )
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n{listed}"


def test_every_allowed_table_is_still_long_and_still_there() -> None:
    # An entry that no longer needs its exemption would let the next long
    # function in under its name.
    long = _long_functions()
    stale = sorted(key for key in TABLES if key not in long)
    assert not stale, f"allow-list entries no longer over the limit (remove them): {stale}"


def _class(trees: dict[str, ast.Module], module: str, name: str) -> ast.ClassDef:
    (cls,) = (
        node for node in trees[module].body if isinstance(node, ast.ClassDef) and node.name == name
    )
    return cls


def test_the_faces_central_classes_stay_under_three_hundred_lines() -> None:
    trees = dict(_modules())
    sizes = {
        f"{module}: {name}": _lines(_class(trees, module, name)) for module, name in FACE_CLASSES
    }
    over = {name: size for name, size in sizes.items() if size >= MAX_FACE_CLASS_LINES}
    assert not over, f"classes at or over {MAX_FACE_CLASS_LINES} lines: {over}"


def test_the_relay_has_one_forward_path_and_at_most_350_lines() -> None:
    relay = _class(dict(_modules()), "core/relay.py", "Relay")
    forwards = [
        node.name
        for node in relay.body
        if isinstance(node, _Function) and node.name.startswith("_forward")
    ]
    assert forwards == ["_forward"], f"one path for every frame, not {forwards}"
    assert _lines(relay) <= MAX_RELAY_LINES, f"Relay is {_lines(relay)} lines"


def test_the_checker_sees_a_long_function_and_a_nested_one() -> None:
    # A checker that can't fail is a bug: it must find a long method inside
    # a class and a long function nested in another.
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"class A:\n  def m(self):\n{body}\n\ndef outer():\n  def inner():\n{body}\n"
    found = {name: _lines(f) for name, f in _functions(ast.parse(source))}
    assert found["A.m"] == MAX_FUNCTION_LINES + 1
    assert found["outer.<locals>.inner"] == MAX_FUNCTION_LINES + 1
    assert found["outer"] == MAX_FUNCTION_LINES + 2
